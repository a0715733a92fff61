"""A GPU worker's registration as the server receives it: from the request, checked, as a BlockLayout.

The registration's value types and their checks are shared with the worker side
(``pegaflow.common.wire.device_registration``); the worker builds one from its torch tensors with
``pegaflow.client.device.export_torch_kv`` and the client sends it. The server rebuilds it here
with ``registration_from_proto``, turns it into the copy planner's ``BlockLayout`` with
``layout_of`` and opens its tensors with ``ipc.IpcMappings``. Nothing here needs torch or CUDA.
"""

from __future__ import annotations

from pegaflow.common.wire.device_registration import (
    CUDA_IPC_HANDLE_BYTES,
    MAX_SEGMENTS,
    MAX_TENSORS,
    MAX_UUID_CHARS,
    DeviceRegistration,
    ExportedTensor,
    Segment,
)
from pegaflow.server.errors import InvalidArgument
from pegaflow.server.gpu.copy_plan import BlockLayout

__all__ = ["DeviceRegistration", "ExportedTensor", "layout_of", "registration_from_proto"]


def layout_of(reg: DeviceRegistration) -> BlockLayout:
    """The copy planner's layout of a registration; ValueError (LayoutError) if it is malformed."""
    reg.validate()
    return BlockLayout(reg.segments, [t.size for t in reg.tensors], reg.num_blocks)


def registration_from_proto(req) -> DeviceRegistration:
    """The registration a RegisterDeviceMemoryRequest describes; InvalidArgument if malformed.

    Only the counts and handle sizes are checked here; ``layout_of`` checks the layout against the tensors.
    """
    if not 0 < len(req.tensors) <= MAX_TENSORS:
        raise InvalidArgument(f"tensors: 1..{MAX_TENSORS} expected, got {len(req.tensors)}")
    if not 0 < len(req.segments) <= MAX_SEGMENTS:
        raise InvalidArgument(f"segments: 1..{MAX_SEGMENTS} expected, got {len(req.segments)}")
    for i, t in enumerate(req.tensors):
        if len(t.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
            raise InvalidArgument(f"tensors[{i}].ipc_handle must be {CUDA_IPC_HANDLE_BYTES} bytes")
    if len(req.device_uuid) > MAX_UUID_CHARS:
        raise InvalidArgument(f"device_uuid is longer than {MAX_UUID_CHARS} characters")
    return DeviceRegistration(
        device_uuid=req.device_uuid,
        tensors=tuple(ExportedTensor(t.ipc_handle, t.offset, t.size) for t in req.tensors),
        segments=tuple(Segment(s.tensor, s.offset, s.stride, s.nbytes) for s in req.segments),
        num_blocks=req.num_blocks,
    )
