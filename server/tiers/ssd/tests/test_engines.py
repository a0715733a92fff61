"""The io_uring binding: built from source into a cache (concurrent builders included), probed in
a child process, and a probe that dies (SIGILL, as PyPI liburing does on AMD EPYC) falls back to
the thread pool with one log line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pegaflow.server.tiers.ssd.engines import AUTO_PREFERENCE, open_engine, uring_binding
from pegaflow.server.tiers.ssd.engines.threads import ThreadEngine


def test_the_probe_runs_in_a_child_and_passes_here(tmp_path):
    why = uring_binding.probe(str(tmp_path))
    if why is not None and "could not build" in why:
        pytest.skip(f"no io_uring binding on this machine: {why}")
    assert why is None
    assert not [p for p in os.listdir(tmp_path) if "probe" in p]  # the probe cleans up


def test_a_probe_that_dies_falls_back_to_threads_with_one_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(uring_binding, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    monkeypatch.setattr(uring_binding, "_probe_cache", {})
    with caplog.at_level(logging.WARNING):
        engine = open_engine("io_uring", 4, str(tmp_path))
    try:
        assert isinstance(engine, ThreadEngine)
        lines = [r.getMessage() for r in caplog.records if "io_uring is unavailable" in r.getMessage()]
        assert len(lines) == 1 and "signal 4" in lines[0]
    finally:
        engine.close()


def test_a_probe_that_hangs_is_given_up(tmp_path, monkeypatch):
    monkeypatch.setattr(uring_binding, "_CHILD", "import time; time.sleep(60)")
    monkeypatch.setattr(uring_binding, "_probe_cache", {})
    why = uring_binding.probe(str(tmp_path), timeout_s=0.5)
    assert why is not None and "did not finish" in why


@pytest.mark.parametrize("kind", ["threads", "auto"])  # auto = threads: measured faster here
def test_the_thread_pool_needs_no_probe(tmp_path, monkeypatch, kind):
    if kind == "auto" and AUTO_PREFERENCE != "threads":
        pytest.skip("auto prefers io_uring")
    monkeypatch.setattr(uring_binding, "probe", lambda *a, **k: pytest.fail("probed"))
    engine = open_engine(kind, 2, str(tmp_path))
    assert engine.name == "threads"
    engine.close()


def test_concurrent_first_builds_share_one_cached_module(tmp_path):
    """Two processes building into an empty cache at once (parallel test runs) both get a module."""
    code = (
        "from pegaflow.server.tiers.ssd.engines import uring_binding as u; "
        "ffi, lib = u.load(); print(u.module_path())"
    )
    env = {**os.environ, "PEGAFLOW_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    if any(p.returncode for p in procs) and b"could not build" in b"".join(e for _, e in outs):
        pytest.skip("no compiler / liburing headers here")
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {o.decode().strip() for o, _ in outs}
    assert len(paths) == 1 and os.path.exists(paths.pop())
    built = [f for f in os.listdir(tmp_path / "cache") if f.endswith(".so")]
    assert len(built) == 1 and not [f for f in os.listdir(tmp_path / "cache") if f.startswith(".")]
