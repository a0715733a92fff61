"""Where pegaflow's natively built modules are cached, how one is put there, and how it is loaded.

A build goes into the first writable cache folder, keyed by a hash of everything that shapes the
binary (its source, the compiler flags, the Python version), so pytest from the tree, ``pip
install -e .``, a wheel and Bazel's sandboxed tests (no network; HOME private) each build once and
reuse it. Concurrent builders (two test processes) each build in a private temporary folder and
``rename`` the result into place: the last rename wins and both are identical.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable


def cache_dirs() -> list[str]:
    """Candidate cache folders, best first."""
    dirs = []
    if os.environ.get("PEGAFLOW_CACHE_DIR"):
        dirs.append(os.environ["PEGAFLOW_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(os.path.join(os.environ["XDG_CACHE_HOME"], "pegaflow"))
    if os.environ.get("HOME"):
        dirs.append(os.path.join(os.environ["HOME"], ".cache", "pegaflow"))
    dirs.append(os.path.join(tempfile.gettempdir(), f"pegaflow-cache-{os.getuid()}"))
    return dirs


def cached_build(filename: str, build: Callable[[str, str], None]) -> str:
    """The path of ``filename`` in a cache folder, calling ``build(work_dir, target)`` to make it when
    no folder holds it yet (``build`` writes ``target`` inside ``work_dir``). Raises RuntimeError with
    every folder's failure when none could build it."""
    errors = []
    for cache in cache_dirs():
        target = os.path.join(cache, filename)
        if os.path.exists(target):
            return target
        try:
            os.makedirs(cache, exist_ok=True)
            work = tempfile.mkdtemp(prefix=f".{filename}-", dir=cache)
            try:
                built = os.path.join(work, filename)
                build(work, built)
                os.replace(built, target)  # atomic: a concurrent builder's identical file may be replaced
            finally:
                shutil.rmtree(work, ignore_errors=True)
        except Exception as e:  # unwritable folder, no compiler, ...: try the next folder
            errors.append(f"{cache}: {e}")
            continue
        return target
    raise RuntimeError("; ".join(errors))


def load_built(path: str):
    """The extension module at ``path`` (imported once per process; its name is the file's stem).
    Raises ImportError when it cannot be loaded."""
    name = os.path.basename(path).split(".")[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod
