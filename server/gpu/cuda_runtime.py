"""The one place that imports CuPy: lazily, so CPU-only machines import the GPU path and skip it.

The server drives CUDA through CuPy's thin runtime bindings (streams, events,
host registration, IPC, waiting) and compiles its copy kernels with NVRTC
through ``cupy.RawKernel``. Nothing here touches the GPU at import time.

The calls a request makes to *enqueue* its copies (``StreamCalls``: kernel
launches, async copies, event records and waits between streams, event
queries) go straight to the driver through ``ctypes.PyDLL``, which keeps the
GIL for the call. Why: CuPy's bindings release and re-take the GIL around each
call; a request path makes 10-60 of them, and whenever another thread runs
Python meanwhile, each re-take waits until that thread gives the GIL back (up
to ``sys.getswitchinterval()``, 5 ms). These calls never block (pinned memory,
asynchronous streams) and last a few microseconds, so holding the GIL through
them is the cheaper rule. Blocking waits (``eventSynchronize``) still release it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os

log = logging.getLogger(__name__)

# cudaMemcpyKind / flags, from the CUDA runtime headers.
MEMCPY_DEFAULT = 4
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
EVENT_DISABLE_TIMING = 2
EVENT_INTERPROCESS = 4
STREAM_NON_BLOCKING = 1
IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

# Set to "0" to keep the server off the GPU even when one is present.
ENV_DISABLE = "PEGAFLOW_DISABLE_GPU"


class CudaUnavailable(RuntimeError):
    """CuPy or a CUDA device is missing: the GPU data path is off."""


@functools.lru_cache(maxsize=1)
def _load():
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        raise CudaUnavailable(f"GPU data path disabled by {ENV_DISABLE}")
    try:
        cupy = importlib.import_module("cupy")
        runtime = importlib.import_module("cupy_backends.cuda.api.runtime")
    except ImportError as exc:
        raise CudaUnavailable(
            f"CuPy is not installed ({exc}); the GPU data path needs cupy-cuda12x/13x"
        ) from exc
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver
        raise CudaUnavailable(f"no usable CUDA driver: {exc}") from exc
    if count <= 0:
        raise CudaUnavailable("no CUDA device is visible")
    return cupy, runtime


def cupy_module():
    """The ``cupy`` module; raises CudaUnavailable without CuPy or a GPU."""
    return _load()[0]


def runtime():
    """CuPy's CUDA runtime bindings; raises CudaUnavailable without CuPy or a GPU."""
    return _load()[1]


def available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    try:
        _load()
    except CudaUnavailable as exc:
        log.debug("GPU data path unavailable: %s", exc)
        return False
    return True


def normalize_uuid(value: str | bytes | list[int]) -> str:
    """A GPU UUID as 32 lowercase hex digits, whatever the source's spelling.

    torch prints ``"GPU-xxxxxxxx-xxxx-..."`` or plain dashed hex, CUDA's
    device properties give 16 raw bytes, nvidia-smi prints ``GPU-...``.
    """
    if isinstance(value, list | tuple):  # some bindings hand back the 16 bytes as ints
        value = bytes(b & 0xFF for b in value)
    if isinstance(value, bytes | bytearray):
        if len(value) != 16:
            raise ValueError(f"a raw GPU UUID has 16 bytes, got {len(value)}")
        return bytes(value).hex()
    text = value.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    digits = text.replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"not a GPU UUID: {value!r}")
    return digits


@functools.lru_cache(maxsize=1)
def device_uuids() -> dict[str, int]:
    """UUID -> this process's device ordinal, for every visible GPU.

    Workers name GPUs by UUID so that differing CUDA_VISIBLE_DEVICES between a
    worker and the server never make them disagree on which GPU is meant.
    """
    rt = runtime()
    out = {}
    for ordinal in range(rt.getDeviceCount()):
        out[normalize_uuid(_driver_device_uuid(ordinal))] = ordinal
    return out


def _driver_device_uuid(ordinal: int) -> bytes:
    """The 16 UUID bytes of runtime device ``ordinal``, straight from the driver.

    CuPy's device properties carry the UUID as a C string, cut at its first
    zero byte, so they cannot be trusted for this.
    """
    runtime().getDeviceCount()  # the runtime has initialised the driver (cuInit) by now
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaUnavailable(f"cannot load the CUDA driver library: {exc}") from exc
    device = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(device), ctypes.c_int(ordinal))
    if rc != 0:
        raise CudaUnavailable(f"cuDeviceGet({ordinal}) failed with CUresult {rc}")
    buf = ctypes.create_string_buffer(16)
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    rc = get_uuid(buf, device)
    if rc != 0:
        raise CudaUnavailable(f"cuDeviceGetUuid({ordinal}) failed with CUresult {rc}")
    return buf.raw[:16]


class CudaCallFailed(RuntimeError):
    """A driver call returned an error (CUresult ``code``)."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} failed with CUresult {code}")
        self.code = code


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA refusing a call (a driver CUresult, or CuPy's CUDARuntimeError)."""
    return isinstance(exc, CudaCallFailed) or type(exc).__name__ in ("CUDARuntimeError", "CUDADriverError")


class StreamCalls:
    """The enqueueing calls of the copy path, on the driver API, holding the GIL (module docstring).

    Handles are the runtime's: CuPy stream pointers are CUstreams, runtime events are CUevents
    and device pointers CUdeviceptrs; the caller's thread has the device's primary context
    current (``runtime().setDevice``). Every call raises CudaCallFailed on an error.
    """

    def __init__(self, lib=None):
        lib = lib if lib is not None else ctypes.PyDLL("libcuda.so.1")
        u64, vp, uint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
        self._launch = lib.cuLaunchKernel
        self._launch.argtypes = [vp, uint, uint, uint, uint, uint, uint, uint, vp, vp, vp]
        self._launch.restype = ctypes.c_int
        self._memcpy = lib.cuMemcpyAsync
        self._memcpy.argtypes = [u64, u64, ctypes.c_size_t, vp]
        self._memcpy.restype = ctypes.c_int
        self._record = lib.cuEventRecord
        self._record.argtypes = [vp, vp]
        self._record.restype = ctypes.c_int
        self._query = lib.cuEventQuery
        self._query.argtypes = [vp]
        self._query.restype = ctypes.c_int
        self._wait = lib.cuStreamWaitEvent
        self._wait.argtypes = [vp, vp, uint]
        self._wait.restype = ctypes.c_int

    def launch(self, kernel, grid: int, threads: int, stream: int, params) -> None:
        """Launches ``kernel`` (a compiled ``cupy`` Function: ``.ptr`` is its CUfunction) with
        ``params``, numpy scalars in the kernel's order and types."""
        held = [_CTYPES[p.dtype.char](p) for p in params]
        args = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h in held])
        rc = self._launch(kernel.ptr, grid, 1, 1, threads, 1, 1, 0, stream, args, None)
        if rc:
            raise CudaCallFailed("cuLaunchKernel", rc)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """An asynchronous copy between any two addresses (unified addressing infers the direction)."""
        rc = self._memcpy(dst, src, nbytes, stream)
        if rc:
            raise CudaCallFailed("cuMemcpyAsync", rc)

    def record(self, event: int, stream: int) -> None:
        rc = self._record(event, stream)
        if rc:
            raise CudaCallFailed("cuEventRecord", rc)

    def wait_event(self, stream: int, event: int) -> None:
        """``stream`` waits (on the GPU) for ``event``'s work."""
        rc = self._wait(stream, event, 0)
        if rc:
            raise CudaCallFailed("cuStreamWaitEvent", rc)

    def done(self, event: int) -> bool:
        """True once the event's work completed, False while it runs; raises for a failed copy."""
        rc = self._query(event)
        if rc == CUDA_SUCCESS:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise CudaCallFailed("cuEventQuery", rc)


class RuntimeStreamCalls:
    """The same calls through CuPy's bindings (they release the GIL around each call): the fallback
    when the driver library cannot be bound, and the baseline the copier benchmark compares with."""

    def __init__(self):
        self._rt = runtime()

    def launch(self, kernel, grid: int, threads: int, stream: int, params) -> None:
        kernel((grid,), (threads,), tuple(params), stream=cupy_module().cuda.ExternalStream(stream))

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._rt.memcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream)

    def record(self, event: int, stream: int) -> None:
        self._rt.eventRecord(event, stream)

    def wait_event(self, stream: int, event: int) -> None:
        self._rt.streamWaitEvent(stream, event, 0)

    def done(self, event: int) -> bool:
        rc = self._rt.eventQuery(event)
        if rc == CUDA_SUCCESS:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise CudaCallFailed("cudaEventQuery", rc)


# numpy scalar type code -> the ctypes type a kernel parameter of that type is passed as.
_CTYPES = {
    "Q": ctypes.c_uint64,
    "L": ctypes.c_uint64,
    "q": ctypes.c_int64,
    "l": ctypes.c_int64,
    "I": ctypes.c_uint32,
    "i": ctypes.c_int32,
}


@functools.lru_cache(maxsize=1)
def _driver_stream_calls():
    return StreamCalls()


def stream_calls(prefer_driver: bool = True):
    """The enqueueing calls: on the driver holding the GIL (StreamCalls), or CuPy's (RuntimeStreamCalls)
    when ``prefer_driver`` is False or the driver library cannot be bound (logged once)."""
    if prefer_driver:
        try:
            return _driver_stream_calls()
        except (OSError, AttributeError) as exc:
            _warn_driver_unbound(exc)
    return RuntimeStreamCalls()


@functools.lru_cache(maxsize=1)
def _warn_driver_unbound(exc) -> None:
    log.warning("gpu: cannot bind the CUDA driver's stream calls (%s); using CuPy's runtime calls", exc)
