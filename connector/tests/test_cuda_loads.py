"""The CUDA path's loads on CPU: a step that loads several requests keeps two of their RPCs in flight
(``WorkerConnector._load_cuda`` and its load helper), and what lands is reported exactly: the blocks
a request's load did not bring are recomputed, and a load still running past the step's deadline fails
the step's loads whole. The GPU copy is a stand-in; the worker, its job, threads and locks are the
real ones (the copy itself is tested on a GPU in test_gpu_worker_server.py)."""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.connector import worker as worker_module
from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata
from pegaflow.connector.tests.support import LAYER_NAMES, NUM_BLOCKS, StandInLink, config, hashes, layout
from pegaflow.connector.worker import WorkerConnector

pytestmark = pytest.mark.timeout(60)


class StandInLoads:
    """GpuKvTransfer's surface as the load path uses it. ``load`` meets the other loads at ``meet`` (if
    set: a test can tell whether two ran at once), lands ``hits[req]`` blocks (default: all) and sleeps
    ``stall_s[req]`` first (a load still running at the step's deadline)."""

    block_bytes = 4096

    def __init__(self, meet=None, hits=None, stall_s=None):
        self.meet = meet
        self.hits = hits or {}
        self.stall_s = stall_s or {}
        self.running = self.most_running = 0
        self.loaded: list[str] = []
        self._lock = threading.Lock()

    def record_ready(self):
        return None

    def register(self, client, inst, timeout_s):
        return "device-handle"

    def load(self, client, handle, block_hashes, block_ids, timeout_s):
        assert handle == "device-handle"
        req = next(r for r, n in REQUESTS.items() if hashes(r, n) == list(block_hashes))
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if self.meet is not None:
                self.meet.wait()  # BrokenBarrierError after its timeout: one load at a time
            time.sleep(self.stall_s.get(req, 0.0))
            with self._lock:
                self.loaded.append(req)
            return self.hits.get(req, len(block_ids))
        finally:
            with self._lock:
                self.running -= 1


REQUESTS = {"a": 3, "b": 4, "c": 2, "d": 5}  # request -> blocks to load


def step(reqs) -> PegaConnectorMetadata:
    ids = iter(range(NUM_BLOCKS))
    loads = [BlockTransfer(r, [next(ids) for _ in range(REQUESTS[r])], hashes(r, REQUESTS[r])) for r in reqs]
    return PegaConnectorMetadata(loads=loads)


def cuda_worker(transfer: StandInLoads, **cfg) -> WorkerConnector:
    """A worker as register_kv_caches leaves it for CUDA KV, with stand-ins below it."""
    w = WorkerConnector(
        config("unused:0", **cfg),
        layout(),
        num_blocks=NUM_BLOCKS,
        layer_names=LAYER_NAMES,
        instance_name="cuda",
    )
    w.gpu = transfer
    w._start_save_threads(worker_module._CUDA_SAVES_IN_FLIGHT)  # what _register_cuda does
    w._start_load_helper()
    w.link = StandInLink()
    return w


def test_a_steps_device_loads_run_two_at_once_and_every_block_lands():
    transfer = StandInLoads(meet=threading.Barrier(2, timeout=10))
    w = cuda_worker(transfer, load_timeout_s=20.0)
    try:
        w.start_load(step(["a", "b", "c", "d"]))  # two pairs that meet
        assert w.take_load_errors() == set()
        assert transfer.most_running == 2 and sorted(transfer.loaded) == ["a", "b", "c", "d"]
        assert w.stats["loaded_blocks"] == 14 and w.stats["load_failed_blocks"] == 0
    finally:
        w.shutdown()


def test_the_blocks_a_request_did_not_get_are_reported_on_whichever_thread_loaded_it():
    transfer = StandInLoads(hits={"b": 1, "c": 0})
    w = cuda_worker(transfer)
    try:
        meta = step(["a", "b", "c"])
        w.start_load(meta)
        b, c = meta.loads[1], meta.loads[2]
        assert w.take_load_errors() == set(b.block_ids[1:]) | set(c.block_ids)
        assert w.stats["loaded_blocks"] == 3 + 1 and w.stats["load_failed_blocks"] == 3 + 2
    finally:
        w.shutdown()


def test_a_load_still_running_past_the_deadline_fails_the_steps_loads_by_that_deadline():
    transfer = StandInLoads(stall_s={"b": 3.0})
    w = cuda_worker(transfer, load_timeout_s=0.5)
    try:
        meta = step(["a", "b"])
        start = time.monotonic()
        w.start_load(meta)
        failed = w.take_load_errors()
        assert time.monotonic() - start < 2.0  # not held by b's load
        assert failed == {i for t in meta.loads for i in t.block_ids}  # a's landed, but the step is one job
    finally:
        w.shutdown()


def test_a_single_requests_load_stays_on_the_load_thread():
    transfer = StandInLoads()
    w = cuda_worker(transfer)
    try:
        seen: list[str] = []
        real = transfer.load

        def load(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return real(*args, **kwargs)

        transfer.load = load
        w.start_load(step(["d"]))
        assert w.take_load_errors() == set()
        assert len(seen) == 1 and seen[0].startswith("pegaflow-load_")
    finally:
        w.shutdown()
