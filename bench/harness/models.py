"""The models the experiments serve, their KV geometry, and pool capacities in blocks.

Experiments run tiny random-weight models built offline (pegaflow.tools.vllm_cpu.tiny_model):
what matters for a KV cache is the KV bytes per token and the prefill cost per token, not the
weights. `BENCH_MODEL` is shaped so that prefill dominates serving cost the way it does for real
LLMs at long prompts (recipes/ttft-anchors.md: a 10K-token prompt takes ~3 s to prefill on one
core, ~33 ms when its KV is already in memory) and so that one 128-token block is exactly 1 MiB.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

from pegaflow.server.tiers.dram.allocator import default_slab_bytes, slot_stride
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec, ensure_tiny_model

# Llama, 4 layers, 8 KV heads x 64 dims: 8 KiB of bf16 KV per token, 1 MiB per 128-token block.
BENCH_MODEL = TinyModelSpec(
    arch="llama",
    layers=4,
    hidden=512,
    heads=8,
    kv_heads=8,
    head_dim=64,
    intermediate=1536,
    max_pos=16384,
    vocab=4096,
)
# vLLM's KV block size on the CPU backend (its default there).
CPU_BLOCK_TOKENS = 128
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """K and V of every layer for one token, as vLLM's CPU attention backend stores them."""
    if spec.arch == "deepseek_v3":
        raise ValueError("MLA models store a latent, not K and V: compute their geometry separately")
    return 2 * spec.kv_heads * spec.head_dim * _DTYPE_BYTES[spec.dtype] * spec.layers


def block_bytes(spec: TinyModelSpec, block_tokens: int = CPU_BLOCK_TOKENS) -> int:
    return kv_bytes_per_token(spec) * block_tokens


def pool_capacity_blocks(pool_bytes: int, block_bytes_: int) -> int:
    """How many blocks of one size a pool of pool_bytes holds under the server's slab allocator
    (whole slabs of equal slots; a slab's tail smaller than a slot is unused)."""
    slab = default_slab_bytes(pool_bytes)
    if pool_bytes < slab or block_bytes_ > slab:
        return 0
    return (pool_bytes // slab) * (slab // slot_stride(block_bytes_))


def smallest_pool_for_blocks(blocks: int, block_bytes_: int) -> int:
    """The smallest pool size, in whole MiB, whose capacity is at least `blocks` blocks."""
    mib = 1 << 20
    size = max(mib, -(-blocks * block_bytes_ // mib) * mib)
    while pool_capacity_blocks(size, block_bytes_) < blocks:
        size += mib
    return size


def default_model_cache() -> pathlib.Path:
    """$PEGAFLOW_BENCH_MODEL_CACHE, else under $TEST_TMPDIR (Bazel) or the system temp dir."""
    base = os.environ.get("PEGAFLOW_BENCH_MODEL_CACHE")
    if base:
        return pathlib.Path(base)
    return pathlib.Path(os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()) / "pegaflow-bench-models"


def ensure_model(spec: TinyModelSpec = BENCH_MODEL, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The model directory for spec, built on first use (deterministic, ~5 s) and reused after."""
    return ensure_tiny_model(cache_dir or default_model_cache(), spec)
