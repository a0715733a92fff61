"""Builds and loads the read lane's native module (read_lane.c), and proves it in a child first.

The module is a plain CPython extension, compiled on first use with the system's C compiler
(``gcc``, generic x86-64 code: no ``-march``, so it runs on any CPU of the kind) against this
interpreter's headers, and cached (server/native/cache.py) under a name keyed by the source, the
flags and the Python version. Why a CPython extension rather than cffi (the SSD tier's binding):
its serving thread must never take the interpreter lock, and the calls the block store makes on
every seal and eviction must not release and re-take it (cffi releases the lock around every call,
so each call could wait up to the switch interval to get it back while the engine lock is held).

Before the server trusts it, ``probe()`` loads the module in a child process and runs a query
through a real socket there: a crash costs only the child, and the server runs without the lane
(every query goes to the engine), with one log line.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import threading
from functools import partial

from pegaflow.server.native.cache import cached_build, load_built

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_lane.c")
CFLAGS = ["-O2", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-fvisibility=hidden", "-Wall"]
PROBE_TIMEOUT_S = 20.0

_lock = threading.Lock()
_loaded = None
_probed: str | None | bool = False  # False: not probed yet; None: works; str: why not


class ReadLaneUnavailable(RuntimeError):
    """The native module could not be built, loaded or proven."""


def _compiler() -> str:
    return os.environ.get("CC") or "gcc"


def _build_key(source: bytes) -> str:
    h = hashlib.sha256(source)
    for part in (" ".join(CFLAGS), _compiler(), sys.version, sysconfig.get_platform(), sys.abiflags):
        h.update(part.encode())
    return h.hexdigest()[:16]


def module_path() -> str:
    """Path of the built module (building it on first use). Raises ReadLaneUnavailable."""
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
    except OSError as e:
        raise ReadLaneUnavailable(f"read lane source missing: {e}") from e
    name = f"_pegaflow_read_lane_{_build_key(source)}"
    try:
        return cached_build(name + importlib.machinery.EXTENSION_SUFFIXES[0], partial(_compile, name))
    except RuntimeError as e:
        raise ReadLaneUnavailable(f"could not build the read lane: {e}") from e


def _compile(name: str, work: str, target: str) -> None:
    include = sysconfig.get_paths()["include"]
    cmd = [
        _compiler(),
        *CFLAGS,
        f"-I{include}",
        f'-DMODULE_NAME="{name}"',
        f"-DMODULE_SYMBOL={name}",
        SOURCE,
        "-o",
        target,
    ]
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:1])} failed: {done.stderr.strip()[-2000:]}")


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


def probe() -> str | None:
    """None when the module builds and works (proven once per process, in a child), else why not."""
    global _probed
    with _lock:
        if _probed is not False:
            return _probed
        try:
            path = module_path()
        except ReadLaneUnavailable as e:
            _probed = str(e)
            return _probed
        name = os.path.basename(path).split(".")[0]
        try:
            child = subprocess.run(
                [sys.executable, "-S", "-c", _CHILD, name, path],
                capture_output=True,
                timeout=PROBE_TIMEOUT_S,
                env={**os.environ, "PYTHONPATH": ""},
            )
            if child.returncode == 0:
                _probed = None
            elif child.returncode < 0:
                _probed = f"the read lane's probe process died with signal {-child.returncode}"
            else:
                detail = (child.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
                _probed = f"the read lane's probe failed: {detail}"
        except subprocess.TimeoutExpired:
            _probed = f"the read lane's probe did not finish within {PROBE_TIMEOUT_S:.0f} s"
        return _probed


def load():
    """The native module, proven by ``probe()``. Raises ReadLaneUnavailable."""
    global _loaded
    why = probe()
    if why is not None:
        raise ReadLaneUnavailable(why)
    with _lock:
        if _loaded is None:
            path = module_path()
            try:
                _loaded = load_built(path)
            except ImportError as e:
                raise ReadLaneUnavailable(f"cannot load {path}: {e}") from e
        return _loaded
