"""Builds and loads the read lane's native module (read_lane.c), proven in a child first.

The module is a plain CPython extension, compiled on first use with the system's C compiler and cached
(common/native/extension.py). Why a CPython extension rather than cffi (the SSD tier's binding): its
serving thread must never take the interpreter lock, and the calls the block store makes on every
seal and eviction must not release and re-take it (cffi releases the lock around every call, so each
call could wait up to the switch interval to get it back while the engine lock is held).

Before the server trusts it, ``probe()`` loads the module in a child process and runs a query
through a real socket there: a crash costs only the child, and the server runs without the lane
(every query goes to the engine), with one log line.
"""

from __future__ import annotations

import os

from pegaflow.common.native.extension import NativeExtension, NativeUnavailable

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_lane.c")

ReadLaneUnavailable = NativeUnavailable

# The child's self-test: a session, an instance, a published block, one leased query and its
# release over a real socket pair, answered by the serving thread.
_CHILD = r"""
import importlib.util, socket, struct, sys, time
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
lane = mod.Lane()
lane.add_session("s", 0, 1 << 30, 16, True)
lane.add_instance("i", "s", 1, 4096)
lane.publish(1, [b"k"], [8192], 4096, [7])
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0pegaflow-read-lane-probe-%d" % time.monotonic_ns())
srv.listen(4)
lane.serve(srv.fileno(), b"PGRD\x01\x01x", 4, 5.0, 1 << 16, 5.0, 1 << 20)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.settimeout(5)
c.connect(srv.getsockname())
assert c.recv(7) == b"PGRD\x01\x01x"
body = b"PGR1" + struct.pack("<BBHI", 1, 1, 1, 1000) + b"\x01s\x01i"
body += struct.pack("<IQQ", 0, 42, 0) + b"\x01k"
c.sendall(struct.pack("<I", len(body)) + body)
size = struct.unpack("<I", c.recv(4))[0]
answer = b""
while len(answer) < size:
    answer += c.recv(size - len(answer))
assert answer[8] == 0 and struct.unpack_from("<H", answer, 6)[0] == 1, answer
assert struct.unpack_from("<QQ", answer, 15) == (8192, 7), answer
assert lane.pins(1, b"k") == 1 and lane.unpublish(1, b"k") is False
assert lane.release("s", 42, 4096) is not None and lane.unpublish(1, b"k") is True
lane.stop()
"""

EXTENSION = NativeExtension(SOURCE, "_pegaflow_read_lane", _CHILD, "the read lane")


def probe() -> str | None:
    """None when the module builds and works (proven once per process, in a child), else why not."""
    return EXTENSION.probe()


def load():
    """The native module, proven by ``probe()``. Raises ReadLaneUnavailable."""
    return EXTENSION.load()
