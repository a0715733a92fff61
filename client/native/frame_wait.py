"""A local socket's answer waited for and read outside the interpreter lock (frame_wait.c says why).

``recv_frame`` is ``spin_until_readable`` + ``frames.read_frame`` in one call with the lock released
once: same arguments, same results and errors. It is native once ``start()`` has built the module
and proven it in a child process (common/native/extension.py), which happens on a thread of its own
so that no client waits for a compiler: until then, or when the module cannot be built or proven
(no compiler, a crash in the child), or with ``PEGAFLOW_NATIVE_CLIENT=0``, it is the Python one.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from pegaflow.common.native.extension import NativeExtension
from pegaflow.common.wire import frames

log = logging.getLogger("pegaflow.client")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frame_wait.c")
ENV_SWITCH = "PEGAFLOW_NATIVE_CLIENT"

# The child's self-test: a timeout, a frame, a GOODBYE, an oversized frame, a frame cut off, EOF.
_CHILD = r"""
import importlib.util, socket, struct, sys, time
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
a, b = socket.socketpair()
a.setblocking(False)
far = lambda: time.monotonic() + 5
assert mod.recv_frame(a.fileno(), 64, 0.0, True, time.monotonic() + 0.02) == (2, None)
b.sendall(struct.pack("<I", 5) + b"hello" + struct.pack("<I", 0))
assert mod.recv_frame(a.fileno(), 64, 0.001, True, far()) == (0, b"hello")
assert mod.recv_frame(a.fileno(), 64, 0.001, False, far()) == (0, b"")
b.sendall(struct.pack("<I", 100))
assert mod.recv_frame(a.fileno(), 64, 0.0, True, far()) == (5, 100)
b.sendall(struct.pack("<I", 9) + b"cut")
b.close()
assert mod.recv_frame(a.fileno(), 200, 0.0, True, far()) == (4, None)
assert mod.recv_frame(a.fileno(), 200, 0.0, True, far()) == (1, None)
"""

EXTENSION = NativeExtension(SOURCE, "_pegaflow_frame_wait", _CHILD, "the client's native frame wait")

_native = None  # the module's recv_frame once proven
_started = False
_python_only = False  # use(False): a load still running must not switch to native
_start_lock = threading.Lock()


def start() -> None:
    """Builds and proves the native module on a thread of its own (once per process)."""
    global _started
    with _start_lock:
        if _started or os.environ.get(ENV_SWITCH, "1") == "0":
            return
        _started = True
    threading.Thread(target=_load, name="pegaflow-native-client", daemon=True).start()


def _load() -> None:
    global _native
    why = EXTENSION.probe()
    if why is not None:
        log.info("pegaflow: the client waits for answers in Python (%s)", why)
        return
    try:
        loaded = EXTENSION.load().recv_frame
        if not _python_only:
            _native = loaded
    except Exception as exc:  # noqa: BLE001 - the Python wait stays
        log.info("pegaflow: the client waits for answers in Python (%s)", exc)


def wait_until_ready(timeout_s: float) -> bool:
    """True once the native wait is in use (start() first)."""
    end = time.monotonic() + timeout_s
    while _native is None and time.monotonic() < end:
        time.sleep(0.01)
    return _native is not None


def is_native() -> bool:
    return _native is not None


def use(native: bool, timeout_s: float = 60.0) -> bool:
    """Tests and benchmarks (A/B): every client of this process waits natively from now on (the
    module built and proven first, within ``timeout_s``; False if it cannot be), or in Python."""
    global _native, _started, _python_only
    with _start_lock:
        _started = True  # no client's start() changes it behind the caller's back
    _python_only = not native
    if not native:
        _native = None
        return True
    if _native is None:
        _load()
    return wait_until_ready(timeout_s)


def recv_frame(sock, poller, limit: int, spin_s: float, yield_cpu: bool, deadline: float) -> bytes | None:
    """One frame's body (b"" for GOODBYE), or None when the peer closed between frames, after spinning
    up to ``spin_s`` (``poller``: ``sock`` registered for POLLIN, used by the Python wait). Raises
    TimeoutError, FrameTooLarge, ConnectionError (EOF inside a frame), OSError."""
    native = _native
    if native is None:
        frames.spin_until_readable(poller, spin_s, yield_cpu)
        return frames.read_frame(sock, limit, deadline)
    code, value = native(sock.fileno(), limit, spin_s, yield_cpu, deadline)
    if code == 0:
        return value
    if code == 1:
        return None
    if code == 2:
        raise TimeoutError("deadline passed")
    if code == 3:
        raise OSError(value, os.strerror(value))
    if code == 4:
        raise ConnectionError("the peer closed the connection inside a frame")
    if code == 5:
        raise frames.FrameTooLarge(f"frame of {value} bytes exceeds the limit of {limit} bytes")
    raise AssertionError(f"recv_frame: unknown code {code}")
