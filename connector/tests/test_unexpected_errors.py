"""The engine never fails because the cache did: an unexpected error below a hook vLLM calls (a bug
of ours, the OS out of file descriptors, a CUDA error) is logged and costs the cache, not the call.
Each test drives the real scheduler lookup or worker with a stand-in below it that raises."""

from __future__ import annotations

import pytest

from pegaflow.connector.metadata import BlockTransfer
from pegaflow.connector.scheduler import ServerPrefixLookup
from pegaflow.connector.tests.support import LAYER_NAMES, NUM_BLOCKS, StandInLink, config, hashes, layout
from pegaflow.connector.worker import WorkerConnector

pytestmark = pytest.mark.timeout(60)


class RaisingClient:
    """Every call fails the way no client error is expected to: the OS out of descriptors."""

    def query_prefix(self, *args, **kwargs):
        raise OSError(24, "Too many open files")

    def release(self, *args, **kwargs):
        raise OSError(24, "Too many open files")


def test_a_lookup_that_fails_unexpectedly_finds_nothing_and_marks_the_server_unwell():
    link = StandInLink(RaisingClient())
    lookup = ServerPrefixLookup(link, timeout_s=1.0)
    assert lookup(hashes("a", 4)) is None  # vLLM schedules the request without external hits
    assert link.failures == ["prefix lookup"]  # skipped until a probe answers, not retried every step
    assert lookup(hashes("a", 4)) is None


def _worker(name: str) -> WorkerConnector:
    return WorkerConnector(
        config("unused:0"), layout(), num_blocks=NUM_BLOCKS, layer_names=LAYER_NAMES, instance_name=name
    )


def test_a_lease_release_that_fails_unexpectedly_is_a_lost_lease_not_an_error():
    w = _worker("release")
    w.link = StandInLink(RaisingClient())
    try:
        # The blocks read under it are then reported failed and recomputed (worker._finish_load).
        assert w._release_verified(["lease-1", "lease-2"], loaded_bytes=4096) is False
        assert w.stats["load_leases_lost"] == 1
    finally:
        w.shutdown()


class FailingCudaMarks:
    """GpuKvTransfer's surface where a save starts: the forward's end cannot be marked."""

    block_bytes = 4096

    def record_ready(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_save_whose_forward_cannot_be_marked_is_dropped_and_holds_no_request():
    w = _worker("cuda-marks")
    w.link = StandInLink(RaisingClient())
    w.gpu = FailingCudaMarks()
    try:
        w.submit_saves([BlockTransfer("r", [1, 2], hashes("r", 2))])
        assert w.stats["save_blocks_dropped_error"] == 2
        assert w.finished_sending({"r"}) == {"r"}  # its blocks are vLLM's to free at once
    finally:
        w.gpu = None
        w.shutdown()


def test_shutdown_runs_every_step_when_one_fails():
    w = _worker("shutdown")
    link = w.link = StandInLink(RaisingClient())

    def broken_finish():
        raise RuntimeError("a bug in the load job's end")

    w._finish_load = broken_finish
    w.shutdown()  # does not raise
    assert link.closed  # the later steps ran
    assert w._save_thread._shutdown and w._housekeeping._shutdown


def test_a_mistyped_log_level_is_ignored_not_a_failed_import():
    """The connector module is imported by every vLLM process; PEGAFLOW_LOG_LEVEL=verbose used to
    raise there (ValueError from setLevel) and stop vLLM."""
    # The module imports vLLM's connector base. On the GPU host there is no vLLM, only the marker
    # classes test_gpu_worker_server.py puts in sys.modules when it runs first (no __file__).
    vllm = pytest.importorskip("vllm")
    if getattr(vllm, "__file__", None) is None:
        pytest.skip("vLLM is not installed here: only stand-in marker classes")
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import pegaflow.connector.connector"],
        env={
            **os.environ,
            "PEGAFLOW_LOG_LEVEL": "verbose",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "is not a log level; ignored" in done.stderr


def test_an_unexpected_error_while_attaching_is_retried_not_the_end_of_the_link(tmp_path, monkeypatch):
    """The link's thread attaches in the background; an error no client call is expected to raise
    (here the first client cannot be made: no file descriptor left) used to end that thread, leaving
    the cache off for the life of the process."""
    import pegaflow.client as client_module
    from pegaflow.connector.server_link import ServerLink
    from pegaflow.connector.tests.support import wait_for
    from pegaflow.server.testing import ServerProcess

    real, made = client_module.PegaClient, []

    def first_fails(*args, **kwargs):
        made.append(1)
        if len(made) == 1:
            raise OSError(24, "Too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(client_module, "PegaClient", first_fails)
    with ServerProcess(tmp_path / "server", pool_size="32mb") as srv:
        link = ServerLink(
            srv.addr, [layout()], client_name="t", instance_name="t", rpc_timeout_s=5.0, retry_interval_s=0.2
        )
        link.start()
        try:
            wait_for(lambda: link.usable() is not None, timeout_s=30)
            assert len(made) == 2
        finally:
            link.close()
