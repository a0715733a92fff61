"""The client's side of the GPU data path: a registered GPU memory handle, what a save reports, and the
RegisterDeviceMemory request.

A registration itself (``DeviceRegistration``: the GPU's UUID, one CUDA IPC handle per KV tensor and
the segments that say where each block's bytes lie) is built on the worker with
``pegaflow.server.gpu.registration.export_torch_kv``, which needs torch; the client only reads its
fields to put them on the wire, so it never imports server code.
"""

from __future__ import annotations

import dataclasses
import threading

from pegaflow.client.doorbell import DoorbellClient
from pegaflow.proto import pegaflow_pb2 as pb


def registration_request(registration, instance_id: str) -> pb.RegisterDeviceMemoryRequest:
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

    def __init__(self, instance, registration):
        self.instance = instance  # the client's InstanceHandle the blocks belong to
        self.registration = registration  # a pegaflow.server.gpu.registration.DeviceRegistration
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

    def _set(self, registration_id: str, doorbell_path: str = "") -> None:
        with self._lock:
            self._registration_id = registration_id
            old, self.doorbell = self.doorbell, DoorbellClient(doorbell_path) if doorbell_path else None
        if old is not None:
            old.close()

    def __repr__(self) -> str:
        return f"DeviceHandle({self._registration_id or '<unregistered>'}, {self.registration.device_uuid})"


@dataclasses.dataclass(frozen=True)
class DeviceSave:
    """What SaveFromDevice did: per-hash statuses (AllocStatus numbers) and how many blocks it wrote."""

    statuses: list[int]
    written: int
