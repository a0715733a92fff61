"""The client's side of the GPU data path: describing a worker's KV tensors, the registered handle, what a
save reports, and the RegisterDeviceMemory request.

A registration (``DeviceRegistration``: the GPU's UUID, one CUDA IPC handle per KV tensor and the
segments that say where each block's bytes lie; ``pegaflow.common.wire.device_registration``) is
built on the worker with ``export_torch_kv``, which needs torch (imported when called, so the client
itself never needs it), and sent with ``PegaClient.register_device_memory``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from pegaflow.client.doorbell import DoorbellClient
from pegaflow.common.wire.device_registration import (
    DeviceRegistration,
    ExportedTensor,
    LayoutError,
    normalize_uuid,
    raw_ipc_handle,
    segments_from_strides,
)
from pegaflow.proto import pegaflow_pb2 as pb

__all__ = [
    "DeviceHandle",
    "DeviceRegistration",
    "DeviceSave",
    "ExportedTensor",
    "LayoutError",
    "export_torch_kv",
    "registration_request",
]


# ---------------------------------------------------------------- describing torch tensors


def torch_device_uuid(device) -> str:
    """The UUID of a torch CUDA device, as the wire spells it."""
    import torch

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
        ipc_handle=raw_ipc_handle(handle),
        offset=storage_offset + start,
        size=storage_bytes - start,
    )


def export_torch_kv(tensors: Sequence, block_dims: Sequence[int], num_blocks: int) -> DeviceRegistration:
    """A registration for KV tensors whose dimension ``block_dims[i]`` indexes the blocks.

    The stored block is the concatenation of the tensors' segments in the order given (layer order
    for per-layer tensors). Raises ValueError (LayoutError for a layout that cannot be described).
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


# ---------------------------------------------------------------- on the wire


def registration_request(
    registration: DeviceRegistration, instance_id: str
) -> pb.RegisterDeviceMemoryRequest:
    """The RegisterDeviceMemoryRequest for a DeviceRegistration (the client fills in the session)."""
    return pb.RegisterDeviceMemoryRequest(
        instance_id=instance_id,
        device_uuid=registration.device_uuid,
        tensors=[
            pb.DeviceTensor(ipc_handle=t.ipc_handle, offset=t.offset, size=t.size)
            for t in registration.tensors
        ],
        segments=[
            pb.DeviceSegment(tensor=s.tensor, offset=s.offset, stride=s.stride, nbytes=s.nbytes)
            for s in registration.segments
        ],
        num_blocks=registration.num_blocks,
    )


class DeviceHandle:
    """A client's registration of GPU memory; stays valid across reconnects (the client re-registers it)."""

    def __init__(self, instance, registration: DeviceRegistration):
        self.instance = instance  # the client's InstanceHandle the blocks belong to
        self.registration = registration
        self._lock = threading.Lock()
        self._registration_id = ""
        self.doorbell: DoorbellClient | None = None  # the server's local fast path, when it offers one

    @property
    def registration_id(self) -> str:
        """The server's id, or "" while not registered (server unreachable)."""
        return self._registration_id

    @property
    def registered(self) -> bool:
        return bool(self._registration_id)

    def _set(self, registration_id: str, doorbell_path: str = "", epoch: str = "") -> None:
        """``doorbell_path``: the server's doorbell; ``epoch``: the pool epoch it must greet with."""
        bell = DoorbellClient(doorbell_path, epoch) if doorbell_path else None
        with self._lock:
            self._registration_id = registration_id
            old, self.doorbell = self.doorbell, bell
        if old is not None:
            old.close()

    def __repr__(self) -> str:
        return f"DeviceHandle({self._registration_id or '<unregistered>'}, {self.registration.device_uuid})"


@dataclasses.dataclass(frozen=True)
class DeviceSave:
    """What SaveFromDevice did: per-hash statuses (AllocStatus numbers) and how many blocks it wrote."""

    statuses: list[int]
    written: int
