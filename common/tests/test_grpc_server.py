"""The daemons' gRPC thread pool is started whole: its thread count never climbs under load."""

from __future__ import annotations

import threading
from concurrent import futures

from pegaflow.common.grpc_server import started_thread_pool


def _named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_every_worker_runs_before_the_first_task():
    pool = started_thread_pool(6, "pf-test-started")
    try:
        assert _named("pf-test-started") == 6
    finally:
        pool.shutdown(wait=True)


def test_the_thread_count_stays_put_under_concurrent_peaks():
    pool = started_thread_pool(4, "pf-test-peaks")
    try:
        before = _named("pf-test-peaks")
        for width in (1, 3, 4, 2, 4):
            gate = threading.Barrier(width + 1)
            done = [pool.submit(gate.wait, 10.0) for _ in range(width)]
            gate.wait(10.0)
            futures.wait(done, timeout=10.0)
            assert _named("pf-test-peaks") == before == 4
    finally:
        pool.shutdown(wait=True)
