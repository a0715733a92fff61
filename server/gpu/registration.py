"""What a GPU worker hands the server so the server can copy its KV blocks itself.

The worker side (the connector, the bench's emulated worker) builds a
``DeviceRegistration`` from its torch tensors with ``export_torch_kv``; the
client sends it (``pegaflow.client.device``); the server rebuilds it with
``registration_from_proto`` and opens it with ``ipc.IpcMappings``. Only this module's torch helpers
import torch, and only when called, so the server never needs torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pegaflow.server.gpu.copy_plan import BlockLayout, Segment, segments_from_strides
from pegaflow.server.gpu.ipc import CUDA_IPC_HANDLE_BYTES, cuda_ipc_handle_from_torch

# Limits that keep a registration's planning arrays and RPC message small and sane.
MAX_TENSORS = 4096
MAX_SEGMENTS = 16384


@dataclasses.dataclass(frozen=True)
class ExportedTensor:
    """One KV tensor: the cudaMalloc block that holds it and where in that block it starts."""

    ipc_handle: bytes  # raw cudaIpcMemHandle (64 bytes)
    offset: int  # bytes from the block's base to the tensor's first byte
    size: int  # bytes usable from the tensor's first byte (to the end of its storage)


@dataclasses.dataclass(frozen=True)
class DeviceRegistration:
    """All KV tensors of one worker rank on one GPU, and how a block spreads over them."""

    device_uuid: str
    tensors: tuple[ExportedTensor, ...]
    segments: tuple[Segment, ...]
    num_blocks: int

    def validate(self) -> BlockLayout:
        """Checks the description and returns its layout; raises ValueError on anything malformed."""
        if not self.tensors or len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"a registration needs 1..{MAX_TENSORS} tensors, got {len(self.tensors)}")
        if len(self.segments) > MAX_SEGMENTS:
            raise ValueError(
                f"a registration may have at most {MAX_SEGMENTS} segments, got {len(self.segments)}"
            )
        for i, t in enumerate(self.tensors):
            if len(t.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
                raise ValueError(f"tensor {i}: an IPC handle has {CUDA_IPC_HANDLE_BYTES} bytes")
            if t.offset < 0 or t.size <= 0:
                raise ValueError(f"tensor {i}: offset must be >= 0 and size > 0")
        return BlockLayout(self.segments, [t.size for t in self.tensors], self.num_blocks)


# ---------------------------------------------------------------- on the wire

# (The client builds the request: pegaflow.client.device.registration_request.)


def registration_from_proto(req) -> DeviceRegistration:
    """The registration a RegisterDeviceMemoryRequest describes; InvalidArgument if malformed.

    Only the counts and handle sizes are checked here; ``validate`` checks the layout against the tensors.
    """
    from pegaflow.server.errors import InvalidArgument

    if not 0 < len(req.tensors) <= MAX_TENSORS:
        raise InvalidArgument(f"tensors: 1..{MAX_TENSORS} expected, got {len(req.tensors)}")
    if not 0 < len(req.segments) <= MAX_SEGMENTS:
        raise InvalidArgument(f"segments: 1..{MAX_SEGMENTS} expected, got {len(req.segments)}")
    for i, t in enumerate(req.tensors):
        if len(t.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
            raise InvalidArgument(f"tensors[{i}].ipc_handle must be {CUDA_IPC_HANDLE_BYTES} bytes")
    if len(req.device_uuid) > 64:
        raise InvalidArgument("device_uuid is longer than 64 characters")
    return DeviceRegistration(
        device_uuid=req.device_uuid,
        tensors=tuple(ExportedTensor(t.ipc_handle, t.offset, t.size) for t in req.tensors),
        segments=tuple(Segment(s.tensor, s.offset, s.stride, s.nbytes) for s in req.segments),
        num_blocks=req.num_blocks,
    )


# ---------------------------------------------------------------- worker side


def torch_device_uuid(device) -> str:
    """The UUID of a torch CUDA device, as the server spells it."""
    import torch

    from pegaflow.server.gpu.cuda_runtime import normalize_uuid

    return normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))


def export_torch_tensor(tensor) -> ExportedTensor:
    """The IPC description of one CUDA tensor (its storage must stay alive while registered)."""
    if not tensor.is_cuda:
        raise ValueError("only CUDA tensors can be registered for the GPU data path")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    # (device, handle, storage size, storage offset in its cudaMalloc block, ref counter..., event...)
    handle, storage_bytes, storage_offset = shared[1], int(shared[2]), int(shared[3])
    start = tensor.storage_offset() * tensor.element_size()
    return ExportedTensor(
        ipc_handle=cuda_ipc_handle_from_torch(handle),
        offset=storage_offset + start,
        size=storage_bytes - start,
    )


def export_torch_kv(tensors: Sequence, block_dims: Sequence[int], num_blocks: int) -> DeviceRegistration:
    """A registration for KV tensors whose dimension ``block_dims[i]`` indexes the blocks.

    The stored block is the concatenation of the tensors' segments in the
    order given (layer order for per-layer tensors).
    """
    if len(tensors) != len(block_dims):
        raise ValueError(f"{len(tensors)} tensors but {len(block_dims)} block dimensions")
    if not tensors:
        raise ValueError("no KV tensors to register")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"KV tensors of one registration must share a GPU, got {sorted(map(str, devices))}")
    exported, segments = [], []
    for i, (t, dim) in enumerate(zip(tensors, block_dims, strict=True)):
        if t.shape[dim] != num_blocks:
            raise ValueError(
                f"tensor {i} has {t.shape[dim]} blocks in dimension {dim}, expected {num_blocks}"
            )
        exported.append(export_torch_tensor(t))
        segments += segments_from_strides(i, tuple(t.shape), tuple(t.stride()), t.element_size(), dim)
    reg = DeviceRegistration(
        device_uuid=torch_device_uuid(tensors[0].device),
        tensors=tuple(exported),
        segments=tuple(segments),
        num_blocks=num_blocks,
    )
    reg.validate()
    return reg
