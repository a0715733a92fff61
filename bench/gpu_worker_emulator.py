"""KV tensors of an emulated vLLM GPU worker, in vLLM's layouts, for the GPU benchmarks.

vLLM itself cannot run on the benchmark machine, so a worker is emulated by
what the data path sees of it: torch CUDA tensors shaped and strided exactly as
vLLM allocates them, filled with random bf16.

* ``per_layer``: FlashAttention's ``[2, num_blocks, block_tokens, kv_heads, head_dim]`` per layer
  (K and V separate, so two 32 KiB chunks per block and layer for Qwen3-8B);
* ``cross_layer``: ``[num_blocks, layers, 2, block_tokens, kv_heads, head_dim]``, one tensor
  (all layers of a block contiguous: 2.25 MiB per block for Qwen3-8B);
* ``mla``: ``[num_blocks, block_tokens, latent]`` per layer (DeepSeek-V3: 61 layers, 576 wide).

``stored_blocks`` computes, by plain torch indexing (independent of the copy
planner), the bytes a stored block must hold, to verify copies.
"""

from __future__ import annotations

import dataclasses

QWEN3_8B = dict(layers=36, kv_heads=8, head_dim=128, block_tokens=16)
DEEPSEEK_V3_MLA = dict(layers=61, latent=576, block_tokens=16)


@dataclasses.dataclass(frozen=True)
class KvShape:
    layout: str  # per_layer | cross_layer | mla
    layers: int
    num_blocks: int
    block_tokens: int
    kv_heads: int = 0
    head_dim: int = 0
    latent: int = 0

    @property
    def block_bytes(self) -> int:
        if self.layout == "mla":
            return self.layers * self.block_tokens * self.latent * 2
        return self.layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * 2


def qwen3_8b(layout: str, num_blocks: int) -> KvShape:
    return KvShape(layout=layout, num_blocks=num_blocks, **QWEN3_8B)


def deepseek_mla(num_blocks: int) -> KvShape:
    return KvShape(layout="mla", num_blocks=num_blocks, **DEEPSEEK_V3_MLA)


def build_kv(shape: KvShape, device: str = "cuda", seed: int = 0):
    """(tensors, block_dims) as vLLM would allocate them, filled with random bf16."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*dims):
        return torch.randn(*dims, dtype=torch.bfloat16, device=device, generator=g)

    s = shape
    if s.layout == "per_layer":
        dims = (2, s.num_blocks, s.block_tokens, s.kv_heads, s.head_dim)
        return [rand(*dims) for _ in range(s.layers)], [1] * s.layers
    if s.layout == "cross_layer":
        return [rand(s.num_blocks, s.layers, 2, s.block_tokens, s.kv_heads, s.head_dim)], [0]
    if s.layout == "mla":
        return [rand(s.num_blocks, s.block_tokens, s.latent) for _ in range(s.layers)], [0] * s.layers
    raise ValueError(f"unknown layout {s.layout!r}")


def gather_blocks(shape: KvShape, tensors, ids):
    """A (n, block_bytes) uint8 CUDA tensor: the stored bytes of blocks ``ids``, by plain indexing."""
    import torch

    idx = torch.as_tensor(ids, device=tensors[0].device, dtype=torch.long)
    if shape.layout == "per_layer":
        out = torch.stack([t.index_select(1, idx) for t in tensors]).movedim(2, 0)  # (n, L, 2, ...)
    elif shape.layout == "cross_layer":
        out = tensors[0].index_select(0, idx)
    else:
        out = torch.stack([t.index_select(0, idx) for t in tensors]).movedim(1, 0)  # (n, L, ...)
    return out.contiguous().view(torch.uint8).reshape(len(ids), shape.block_bytes)


def zero_blocks(shape: KvShape, tensors, block_dims, ids) -> None:
    import torch

    idx = torch.as_tensor(ids, device=tensors[0].device, dtype=torch.long)
    for t, dim in zip(tensors, block_dims, strict=True):
        t.index_fill_(dim, idx, 0)
