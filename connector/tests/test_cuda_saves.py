"""The CUDA path's save jobs on CPU: two run at a time (worker._CUDA_SAVES_IN_FLIGHT), they share one
device registration, and their counts add up. The GPU copy is a stand-in that records when each
save runs; the worker, its jobs, threads and locks are the real ones (the copy itself is tested on a
GPU in test_gpu_worker_server.py)."""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.connector import worker as worker_module
from pegaflow.connector.metadata import BlockTransfer
from pegaflow.connector.tests.support import (
    LAYER_NAMES,
    NUM_BLOCKS,
    StandInLink,
    config,
    hashes,
    layout,
    wait_for,
)
from pegaflow.connector.worker import WorkerConnector

pytestmark = pytest.mark.timeout(60)


class StandInTransfer:
    """GpuKvTransfer's surface as the save path uses it; ``save`` waits at ``meet`` (if set) so a
    test can tell whether two saves were running at once."""

    block_bytes = 4096

    def __init__(
        self,
        meet: threading.Barrier | None = None,
        register_s: float = 0.0,
        gate: threading.Event | None = None,
    ):
        self.meet = meet
        self.gate = gate  # set: saves may finish
        self.register_s = register_s
        self.registrations = 0
        self.running = self.most_running = 0
        self._lock = threading.Lock()

    def record_ready(self):
        return None

    def register(self, client, inst, timeout_s):
        self.registrations += 1
        time.sleep(self.register_s)
        return "device-handle"

    def save(self, client, handle, chunk, ids, timeout_s, ready=None):
        assert handle == "device-handle"
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if self.meet is not None:
                self.meet.wait()  # BrokenBarrierError after its timeout: one save at a time
            if self.gate is not None:
                self.gate.wait(10)
            return (None, len(chunk))
        finally:
            with self._lock:
                self.running -= 1


def cuda_worker(transfer: StandInTransfer) -> WorkerConnector:
    """A worker as register_kv_caches leaves it for CUDA KV, with stand-ins below it."""
    w = WorkerConnector(
        config("unused:0"), layout(), num_blocks=NUM_BLOCKS, layer_names=LAYER_NAMES, instance_name="cuda"
    )
    w.gpu = transfer
    w._start_save_threads(worker_module._CUDA_SAVES_IN_FLIGHT)  # what _register_cuda does
    w.link = StandInLink()
    return w


def test_two_save_jobs_copy_at_once_and_every_count_adds_up():
    transfer = StandInTransfer(meet=threading.Barrier(2, timeout=10))
    w = cuda_worker(transfer)
    try:
        for req in ("a", "b", "c", "d"):  # four steps' saves: two pairs that meet
            w.submit_saves([BlockTransfer(req, [1, 2, 3], hashes(req, 3))])
        wait_for(lambda: not w._pending_saves, timeout_s=30)
        assert transfer.most_running == 2
        assert w.stats["saved_blocks"] == 12 and w.stats["save_jobs_failed"] == 0
        assert w.finished_sending({"a", "b", "c", "d"}) == {"a", "b", "c", "d"}
    finally:
        w.shutdown()


def test_concurrent_saves_register_the_device_memory_once():
    transfer = StandInTransfer(
        register_s=0.3
    )  # the first registration is still out when the second save starts
    w = cuda_worker(transfer)
    try:
        for req in ("a", "b"):
            w.submit_saves([BlockTransfer(req, [1], hashes(req, 1))])
        wait_for(lambda: not w._pending_saves, timeout_s=30)
        assert transfer.registrations == 1
        assert w.stats["saved_blocks"] == 2
    finally:
        w.shutdown()


def test_a_preempted_request_loses_only_its_own_queued_save():
    gate = threading.Event()
    transfer = StandInTransfer(gate=gate)
    w = cuda_worker(transfer)
    try:
        for req in ("a", "b", "c"):  # a and b copy (held at the gate), c waits for a thread
            w.submit_saves([BlockTransfer(req, [1, 2], hashes(req, 2))])
        wait_for(lambda: transfer.running == 2, timeout_s=10)
        w.handle_preemptions({"c"})  # c is not copying: nothing to wait for
        gate.set()
        wait_for(lambda: not w._pending_saves, timeout_s=30)
        assert w.stats["save_jobs_preempted"] == 1
        assert w.stats["saved_blocks"] == 4  # a's and b's; c was never copied
        assert transfer.most_running == 2
    finally:
        gate.set()
        w.shutdown()


def test_a_registration_that_fails_unexpectedly_leaves_vllm_serving_without_the_cache(monkeypatch):
    """An error of ours while describing the KV tensors (an AttributeError shipped in the CUDA path
    once) disables the connector for this worker instead of failing vLLM's start."""
    from pegaflow.connector import gpu_worker
    from pegaflow.connector.tests.support import kv_caches

    def broken(*_args):
        raise AttributeError("'int' object has no attribute 'block_bytes'")

    monkeypatch.setattr(gpu_worker, "GpuKvTransfer", broken)
    monkeypatch.setattr(worker_module.WorkerConnector, "_register_host", lambda self, kv: broken())
    w = WorkerConnector(
        config("unused:0"), layout(), num_blocks=NUM_BLOCKS, layer_names=LAYER_NAMES, instance_name="broken"
    )
    try:
        w.register_kv_caches(kv_caches(0))
        assert not w.active and w.pages is None and w.gpu is None
        assert "AttributeError" in w.disabled_reason
    finally:
        w.shutdown()
