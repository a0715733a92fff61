"""The connector worker's CUDA path: pegaflow-server copies KV blocks to and from the GPU itself.

When vLLM runs on CUDA, the worker does not copy bytes at all. At start it
registers its KV tensors with the server (CUDA IPC handles, the GPU's UUID and
where each block's bytes live, see ``pegaflow.common.wire.device_registration``);
afterwards a save is one ``SaveFromDevice`` RPC (the server allocates, copies
GPU -> pool with one batched launch, seals) and a load one ``LoadToDevice`` RPC
(lease, copy pool -> GPU, release; when it returns the bytes are in GPU memory).
The worker spends no CPU on copies and needs no pinned buffers.

vLLM's GPU layouts, all handled by ``segments_from_strides`` (common/wire/device_registration.py):

* FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer (block dim 1);
* FlashInfer and others: ``[num_blocks, 2, block_size, kv_heads, head_dim]`` per layer,
  possibly a permuted view (HND); cross-layer KV is the same with a larger block stride
  (every layer's view into one allocation);
* MLA: ``[num_blocks, block_size, latent]`` per layer.

Saves must not read a block before the forward pass that writes it has run:
``record_ready`` (called on the forward thread, in ``wait_for_save``) records a
CUDA event on the current stream, and ``save`` waits on it (on the save
thread) before asking the server to copy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pegaflow.client.device import DeviceRegistration, LayoutError, export_torch_kv

log = logging.getLogger("vllm.pegaflow.connector.gpu_worker")


class GpuLayoutError(ValueError):
    """The KV tensors are not in a layout the GPU path can describe."""


def is_cuda_kv(kv_caches: Mapping[str, Any]) -> bool:
    """True when vLLM's KV tensors live on a CUDA device (then this path is used)."""
    return bool(kv_caches) and all(getattr(t, "is_cuda", False) for t in kv_caches.values())


def block_dim_of(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension that indexes KV blocks in one of vLLM's layouts."""
    shape = list(shape)
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        return 1  # [2, blocks, ...]: K and V separate
    if shape and shape[0] == num_blocks:
        return 0  # blocks first (FlashInfer, MLA, cross-layer views)
    raise GpuLayoutError(
        f"no block dimension of size {num_blocks} where vLLM puts it in shape {tuple(shape)}"
    )


class GpuKvTransfer:
    """One worker rank's KV tensors, described once for the server; saves and loads as single RPCs."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int, layer_names: Sequence[str]):
        missing = [name for name in layer_names if name not in kv_caches]
        if missing:
            raise GpuLayoutError(f"no KV tensor for layers {missing}")
        self.layer_names = list(layer_names)
        self.num_blocks = num_blocks
        tensors = [kv_caches[name] for name in self.layer_names]
        dims = [block_dim_of(t.shape, num_blocks) for t in tensors]
        try:
            self.registration: DeviceRegistration = export_torch_kv(tensors, dims, num_blocks)
        except (ValueError, LayoutError) as exc:
            raise GpuLayoutError(str(exc)) from exc
        self.block_bytes = self.registration.validate()
        self.num_layers = len(tensors)
        self.layout_tag = _layout_tag(tensors, dims)
        self._tensors = tensors  # the registration is only valid while they live

    # -------------------------------------------------------------- forward thread

    def record_ready(self):
        """A CUDA event after everything the forward pass has queued so far (the blocks to save)."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._tensors[0].device))
        return event

    # -------------------------------------------------------------- transfer threads

    def register(self, client: Any, inst: Any, timeout_s: float) -> Any:
        """RegisterDeviceMemory for instance ``inst``; returns the handle saves and loads use.

        The client re-registers the handle by itself after every reconnect (a new server epoch).
        """
        return client.register_device_memory(inst, self.registration, timeout_s=timeout_s)

    def save(
        self,
        client: Any,
        handle: Any,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        timeout_s: float,
        ready: Any = None,
    ) -> Any:
        """Stores ``block_ids`` under ``hashes``; returns the server's per-block statuses and count written.

        ``ready``: the event ``record_ready`` gave when these blocks were queued; waited on first.
        """
        if ready is not None:
            ready.synchronize()
        return client.save_from_device(handle, list(hashes), list(block_ids), timeout_s=timeout_s)

    def load(
        self, client: Any, handle: Any, hashes: Sequence[bytes], block_ids: Sequence[int], timeout_s: float
    ) -> int:
        """Loads the leading stored blocks of ``hashes`` into ``block_ids``; returns how many landed.

        A LOAD query: the scheduler's lookup already counted these blocks as requested."""
        from pegaflow.client import QueryPurpose

        return int(
            client.load_to_device(
                handle, list(hashes), list(block_ids), timeout_s=timeout_s, purpose=QueryPurpose.LOAD
            )
        )


def _layout_tag(tensors: Sequence[Any], dims: Sequence[int]) -> str:
    """Names the stored bytes' order, for the namespace: workers share blocks only if their tags are equal.

    A stored block is, layer after layer, the tensor's per-block bytes in
    physical order: the dimensions outside the block dimension (K/V of
    ``[2, blocks, ...]``) first, then the inner ones from the largest stride
    down. KV-first, blocks-first and cross-layer tensors of one model store the
    same bytes and get the same tag; a permuted physical order (HND instead of
    NHD) or another dtype gets another.
    """
    descs = set()
    for t, dim in zip(tensors, dims, strict=True):
        others = [d for d in range(t.dim()) if d != dim and t.shape[d] > 1]
        outer = [d for d in others if t.stride(d) > t.stride(dim)]
        inner = sorted((d for d in others if t.stride(d) <= t.stride(dim)), key=lambda d: -t.stride(d))
        descs.add((str(t.dtype).removeprefix("torch."), "x".join(str(t.shape[d]) for d in outer + inner)))
    if len(descs) != 1:
        raise GpuLayoutError(f"layers differ in dtype or shape: {sorted(descs)}")
    ((dtype, desc),) = descs
    return f"cuda:{dtype}:{len(tensors)}x{desc}"
