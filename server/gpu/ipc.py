"""Opening workers' KV tensors in the server by CUDA IPC, and pinning the host pool for DMA.

A worker exports each KV tensor as (GPU UUID, cudaIpcMemHandle of the
cudaMalloc block that holds it, byte offset of the tensor in that block, bytes
usable from there). The server maps the UUID to its own device ordinal (so
CUDA_VISIBLE_DEVICES may differ between the two processes) and opens each
handle once: several tensors of one worker often live in one cudaMalloc block,
and CUDA refuses to open a handle twice in one process, so mappings are shared
and reference-counted by handle.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

from pegaflow.server.errors import DeadlineExceeded
from pegaflow.server.gpu import cuda_runtime

log = logging.getLogger(__name__)

CUDA_IPC_HANDLE_BYTES = 64
# torch's shareable-handle header: a version byte, then a type byte ('c' = cudaMalloc block).
_TORCH_TYPE_CUDA_MALLOC = ord("c")
_TORCH_TYPE_EXPANDABLE = ord("e")


class IpcError(RuntimeError):
    """A worker's handle could not be opened (wrong GPU, stale handle, unsupported allocator)."""


def cuda_ipc_handle_from_torch(handle: bytes) -> bytes:
    """The raw 64-byte cudaIpcMemHandle inside the handle ``storage._share_cuda_()`` returns.

    torch <= 2.0 returned the raw handle; later versions prefix a version byte
    and a type byte. Tensors from torch's expandable segments carry a different
    kind of handle, which this path does not open.
    """
    handle = bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1] == _TORCH_TYPE_CUDA_MALLOC:
        return handle[2:]
    if len(handle) >= 2 and handle[1] == _TORCH_TYPE_EXPANDABLE:
        raise IpcError(
            "KV tensors allocated with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot be "
            "shared with pegaflow-server; run the worker with expandable_segments:False"
        )
    raise IpcError(f"unrecognised CUDA IPC handle ({len(handle)} bytes)")


@dataclasses.dataclass
class _Mapping:
    ordinal: int
    base: int
    refs: int


class IpcMappings:
    """This process's open CUDA IPC mappings, shared and reference-counted by handle.

    The driver call that maps a handle runs outside the table's lock: a registration never waits
    for another one's ``cudaIpcOpenMemHandle`` (which takes no timeout) unless both open the same
    handle, and then only until its own deadline.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[bytes, _Mapping] = {}
        self._opening: dict[bytes, concurrent.futures.Future] = {}  # handle -> its opener's outcome

    def device_ordinal(self, device_uuid: str) -> int:
        """The server's ordinal for the GPU a worker named by UUID."""
        uuid = cuda_runtime.normalize_uuid(device_uuid)
        ordinals = cuda_runtime.device_uuids()
        if uuid not in ordinals:
            raise IpcError(
                f"GPU {device_uuid} is not visible to pegaflow-server (it sees {sorted(ordinals)}); "
                "start the server with every GPU its workers use visible"
            )
        return ordinals[uuid]

    def open(self, ordinal: int, handle: bytes, deadline: float | None = None) -> int:
        """Base device address of the block ``handle`` names, mapped into this process.

        IpcError if it cannot be mapped; DeadlineExceeded if another caller was mapping the same
        handle and had not finished by ``deadline`` (time.monotonic; None: no limit)."""
        if len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise IpcError(f"a CUDA IPC handle has {CUDA_IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        while True:
            with self._lock:
                existing = self._open.get(handle)
                if existing is not None:
                    if existing.ordinal != ordinal:
                        raise IpcError(
                            f"handle already open on GPU {existing.ordinal}, asked for GPU {ordinal}"
                        )
                    existing.refs += 1
                    return existing.base
                opening = self._opening.get(handle)
                if opening is None:  # this caller maps it
                    opening = self._opening[handle] = concurrent.futures.Future()
                    break
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                opening.result(left)  # IpcError: that open failed, and this one would too
            except concurrent.futures.TimeoutError:
                raise DeadlineExceeded(
                    "another registration was still opening the same CUDA IPC handle at the deadline"
                ) from None
            # mapped now (or already closed again: then this caller maps it)
        try:
            base = self._map(ordinal, handle)
        except BaseException as exc:
            with self._lock:
                del self._opening[handle]
            opening.set_exception(
                exc if isinstance(exc, IpcError) else IpcError(f"opening the handle failed: {exc}")
            )
            raise
        with self._lock:
            self._open[handle] = _Mapping(ordinal, base, 1)
            del self._opening[handle]
        opening.set_result(None)
        return base

    @staticmethod
    def _map(ordinal: int, handle: bytes) -> int:
        cupy = cuda_runtime.cupy_module()
        rt = cuda_runtime.runtime()
        try:
            with cupy.cuda.Device(ordinal):
                return int(rt.ipcOpenMemHandle(handle, cuda_runtime.IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        except Exception as exc:  # CUDARuntimeError: stale handle, dead exporter, wrong device
            raise IpcError(f"cudaIpcOpenMemHandle failed on GPU {ordinal}: {exc}") from exc

    def close(self, handle: bytes) -> None:
        """Drops one reference; unmaps when the last one goes. Only call once no copy uses it."""
        with self._lock:
            mapping = self._open.get(handle)
            if mapping is None:
                return
            mapping.refs -= 1
            if mapping.refs > 0:
                return
            del self._open[handle]
        cupy = cuda_runtime.cupy_module()
        try:
            with cupy.cuda.Device(mapping.ordinal):
                cuda_runtime.runtime().ipcCloseMemHandle(mapping.base)
        except Exception:  # the exporter may be gone; the mapping is dropped either way
            log.exception("cudaIpcCloseMemHandle failed on GPU %d", mapping.ordinal)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


class PinnedHostRegion:
    """The host pool registered with CUDA once (cudaHostRegister, portable to every GPU).

    Registration makes the pool reachable by DMA and by kernels through UVA at
    the full host-link rate; pageable memory moves at an eighth of it.
    """

    def __init__(self, addr: int, size: int):
        if size <= 0:
            raise ValueError("cannot register an empty region")
        rt = cuda_runtime.runtime()
        cupy = cuda_runtime.cupy_module()
        self.host_addr = int(addr)
        self.size = int(size)
        with cupy.cuda.Device(0):
            rt.hostRegister(
                self.host_addr,
                self.size,
                cuda_runtime.HOST_REGISTER_PORTABLE | cuda_runtime.HOST_REGISTER_MAPPED,
            )
            try:
                # With UVA this is normally the host address itself; ask rather than assume.
                self.device_addr = int(rt.pointerGetAttributes(self.host_addr).devicePointer)
            except Exception:
                rt.hostUnregister(self.host_addr)
                raise
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            cupy = cuda_runtime.cupy_module()
            with cupy.cuda.Device(0):
                cuda_runtime.runtime().hostUnregister(self.host_addr)
