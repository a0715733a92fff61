"""A CPython extension written in C that pegaflow compiles on first use, proves in a child, then loads.

The module is compiled with the system's C compiler (``$CC`` or ``gcc``; generic x86-64 code: no
``-march``, so it runs on any CPU of the kind) against this interpreter's headers, and cached
(cache.py) under a name keyed by the source, the flags, the compiler and the Python version. The
source names its module with the ``MODULE_NAME`` / ``MODULE_SYMBOL`` macros given on the command line.

Before a process trusts native code, ``probe()`` loads it in a child process that runs the source's
own self-test: a crash there (a CPU without an instruction the compiler chose, a bug) costs only the
child, and the caller goes on without the native part, with the reason ``probe()`` returns. Proven
once per process.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import subprocess
import sys
import sysconfig
import threading
from functools import partial

from pegaflow.common.native.cache import cached_build, load_built

CFLAGS = ("-O2", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-fvisibility=hidden", "-Wall")
PROBE_TIMEOUT_S = 20.0


class NativeUnavailable(RuntimeError):
    """The module could not be built, loaded or proven."""


class NativeExtension:
    """One C source built as a CPython extension. ``prefix``: the module's name before the build key;
    ``self_test``: Python run in the child as ``python -S -c self_test NAME PATH`` (it loads the module
    from PATH and exits 0 once it works); ``what`` names it in errors."""

    def __init__(self, source: str, prefix: str, self_test: str, what: str, cflags=CFLAGS):
        self.source = source
        self.prefix = prefix
        self.self_test = self_test
        self.what = what
        self.cflags = tuple(cflags)
        self._lock = threading.Lock()
        self._probed: str | None | bool = False  # False: not probed yet; None: works; str: why not
        self._module = None

    def module_path(self) -> str:
        """Path of the built module (building it on first use). Raises NativeUnavailable."""
        try:
            with open(self.source, "rb") as f:
                text = f.read()
        except OSError as e:
            raise NativeUnavailable(f"{self.what}: source missing: {e}") from e
        name = f"{self.prefix}_{self._build_key(text)}"
        try:
            return cached_build(
                name + importlib.machinery.EXTENSION_SUFFIXES[0], partial(self._compile, name)
            )
        except RuntimeError as e:
            raise NativeUnavailable(f"could not build {self.what}: {e}") from e

    def probe(self) -> str | None:
        """None when the module builds and its self-test passes in a child, else why not."""
        with self._lock:
            if self._probed is False:
                self._probed = self._run_probe()
            return self._probed

    def load(self):
        """The module, proven by ``probe()``. Raises NativeUnavailable."""
        why = self.probe()
        if why is not None:
            raise NativeUnavailable(why)
        with self._lock:
            if self._module is None:
                path = self.module_path()
                try:
                    self._module = load_built(path)
                except ImportError as e:
                    raise NativeUnavailable(f"cannot load {path}: {e}") from e
            return self._module

    # ------------------------------------------------------------------ build and probe

    @staticmethod
    def _compiler() -> str:
        return os.environ.get("CC") or "gcc"

    def _build_key(self, text: bytes) -> str:
        h = hashlib.sha256(text)
        for part in (
            " ".join(self.cflags),
            self._compiler(),
            sys.version,
            sysconfig.get_platform(),
            sys.abiflags,
        ):
            h.update(part.encode())
        return h.hexdigest()[:16]

    def _compile(self, name: str, work: str, target: str) -> None:
        include = sysconfig.get_paths()["include"]
        cmd = [
            self._compiler(),
            *self.cflags,
            f"-I{include}",
            f'-DMODULE_NAME="{name}"',
            f"-DMODULE_SYMBOL={name}",
            self.source,
            "-o",
            target,
        ]
        done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {done.stderr.strip()[-2000:]}")

    def _run_probe(self) -> str | None:
        try:
            path = self.module_path()
        except NativeUnavailable as e:
            return str(e)
        name = os.path.basename(path).split(".")[0]
        try:
            child = subprocess.run(
                [sys.executable, "-S", "-c", self.self_test, name, path],
                capture_output=True,
                timeout=PROBE_TIMEOUT_S,
                env={**os.environ, "PYTHONPATH": ""},
            )
        except subprocess.TimeoutExpired:
            return f"{self.what}'s probe did not finish within {PROBE_TIMEOUT_S:.0f} s"
        except OSError as e:
            return f"{self.what}'s probe could not start: {e}"
        if child.returncode == 0:
            return None
        if child.returncode < 0:
            return f"{self.what}'s probe process died with signal {-child.returncode}"
        detail = (child.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
        return f"{self.what}'s probe failed: {detail}"
