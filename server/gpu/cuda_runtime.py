"""The one place that imports CuPy: lazily, so CPU-only machines import the GPU path and skip it.

The server drives CUDA through CuPy's thin runtime bindings (streams, events,
async copies, host registration, IPC) and compiles its copy kernels with
NVRTC through ``cupy.RawKernel``. Nothing here touches the GPU at import time.
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
