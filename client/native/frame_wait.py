"""A local socket's answer waited for and read outside the interpreter lock (frame_wait.c says why).

``recv_frame`` is ``spin_until_readable`` + ``frames.read_frame`` in one call with the lock released
once: same arguments, same results and errors. It is native once ``start()`` has built the module
and proven it in a child process (common/native/extension.py), which happens on a thread of its own
so that no client waits for a compiler: until then, or when the module cannot be built or proven
(no compiler, a crash in the child), or with ``PEGAFLOW_NATIVE_CLIENT=0``, it is the Python one.
Natively, ``held_s`` keeps the lock for the first part of the wait and ``send_now`` sends without
releasing it: for a caller the whole process waits for (FrameLink.call says when).
"""

from __future__ import annotations

import errno
import logging
import os

from pegaflow.common.native.extension import NativeExtension
from pegaflow.common.native.optional import OptionalNative
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
a, b = socket.socketpair()
a.setblocking(False)
t0 = time.monotonic()
assert mod.recv_frame(a.fileno(), 64, 0.0, True, t0 + 0.05, 0.01) == (2, None)  # held, then not
assert time.monotonic() - t0 >= 0.05
assert mod.send_now(b.fileno(), struct.pack("<I", 2) + b"hi") == 6
assert mod.recv_frame(a.fileno(), 64, 0.0, True, far(), 0.01) == (0, b"hi")
b.close()
assert mod.send_now(a.fileno(), b"x") < 0
"""

EXTENSION = NativeExtension(SOURCE, "_pegaflow_frame_wait", _CHILD, "the client's native frame wait")

NATIVE = OptionalNative(EXTENSION, "recv_frame", ENV_SWITCH, "the client waits for answers in Python", log)
start = NATIVE.start
wait_until_ready = NATIVE.wait_until_ready
is_native = NATIVE.is_native
use = NATIVE.use


def recv_frame(
    sock, poller, limit: int, spin_s: float, yield_cpu: bool, deadline: float, held_s: float = 0.0
) -> bytes | None:
    """One frame's body (b"" for GOODBYE), or None when the peer closed between frames, after spinning
    up to ``spin_s`` (``poller``: ``sock`` registered for POLLIN, used by the Python wait). ``held_s``:
    natively, the first part of the wait keeps the interpreter lock (frame_wait.c). Raises
    TimeoutError, FrameTooLarge, ConnectionError (EOF inside a frame), OSError."""
    native = NATIVE.get()
    if native is None:
        frames.spin_until_readable(poller, spin_s, yield_cpu)
        return frames.read_frame(sock, limit, deadline)
    code, value = native(sock.fileno(), limit, spin_s, yield_cpu, deadline, held_s)
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


def send_now(sock, data: bytes) -> int | None:
    """What one non-blocking send took of ``data`` with the interpreter lock kept (0 when nothing
    fitted); None when the native module is not in use (send it the usual way). Raises OSError."""
    module = NATIVE.module()
    if module is None:
        return None
    sent = module.send_now(sock.fileno(), data)
    if sent == -errno.EAGAIN:
        return 0
    if sent < 0:
        raise OSError(-sent, os.strerror(-sent))
    return sent
