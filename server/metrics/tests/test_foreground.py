"""The metrics feeder yields to engine calls in flight (server/metrics/foreground.py)."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest

from pegaflow.client import KvLayout, PegaClient
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.metrics import registry
from pegaflow.server.metrics.foreground import ForegroundActivity
from pegaflow.server.runtime import start_server


def test_wait_quiet_waits_for_every_call_in_flight():
    activity = ForegroundActivity()
    assert activity.wait_quiet(0.0) and not activity.busy
    entered, leave = threading.Event(), threading.Event()

    def call():
        with activity:
            entered.set()
            leave.wait(5)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    assert entered.wait(5)
    while activity.calls < 2:
        time.sleep(0.001)
    assert activity.busy and not activity.wait_quiet(0.05)
    started = time.monotonic()
    threading.Timer(0.1, leave.set).start()
    assert activity.wait_quiet(5)
    assert time.monotonic() - started >= 0.09 and activity.calls == 0
    for t in threads:
        t.join()


@pytest.fixture
def server(tmp_path):
    srv = start_server(
        ServerConfig(
            pool_size_bytes=16 * MIB,
            addr="127.0.0.1:0",
            http_addr=None,
            fd_socket_path=str(tmp_path / "pool.sock"),
        )
    )
    yield srv
    srv.stop()


def _drain_s(metrics, within_s: float = 10.0) -> float:
    start = time.monotonic()
    while metrics._pending:
        assert time.monotonic() - start < within_s, "the feeder did not drain its queue"
        time.sleep(0.001)
    return time.monotonic() - start


def _lookups(client, inst, tag: bytes, n: int) -> None:
    # Through the engine (read_lane=False clients): the feeder yields to calls in the handler frame.
    for i in range(n):
        client.query_prefix(inst, [tag + b"%03d-%03d" % (i, j) for j in range(256)])


def test_the_feeder_waits_while_a_call_is_in_flight_then_feeds(server):
    metrics = server.metrics
    metrics.max_feed_defer_s = 30.0  # no forced feeding within this test
    with PegaClient(server.address, name="feeder-test", read_lane=False) as client:
        inst = client.register_instance(KvLayout(model_id="m", block_bytes=4096))
        _lookups(client, inst, b"idle", 1)
        assert _drain_s(metrics) < 5.0  # nothing in flight: fed within a feed interval or so
        with metrics.foreground:  # as the handler frame holds it around every engine call
            _lookups(client, inst, b"busy", 1)
            time.sleep(0.5)  # five feed intervals
            assert len(metrics._pending) == 1, "the feeder ran while a call was in flight"
        assert _drain_s(metrics) < 5.0


def test_under_calls_without_a_pause_the_feeder_still_feeds_in_paced_slices(server, monkeypatch):
    metrics = server.metrics
    metrics.max_feed_defer_s = 0.05
    monkeypatch.setattr(registry, "BUSY_PAUSE_S", 0.005)  # pauses that dominate the feeding itself
    with PegaClient(server.address, name="feeder-test", read_lane=False) as client:
        inst = client.register_instance(KvLayout(model_id="m", block_bytes=4096))
        with metrics.foreground:
            _lookups(client, inst, b"busy", 8)  # 2048 keys
            busy_s = _drain_s(metrics)
        _lookups(client, inst, b"idle", 8)
        idle_s = _drain_s(metrics)
        with metrics._state_lock:
            fed = metrics.hit_rate.rates()
    # The deferral, then 2048 keys in slices of FEED_SLICE_KEYS, each followed by BUSY_PAUSE_S.
    paced = (2048 // registry.FEED_SLICE_KEYS) * registry.BUSY_PAUSE_S
    assert busy_s >= metrics.max_feed_defer_s + 0.9 * paced
    assert idle_s < busy_s
    assert any(rate is not None for rate in fed.values())


def test_a_lookup_split_across_slices_keeps_its_hits_and_order(server):
    metrics = server.metrics
    metrics.close()  # its feeder thread stopped: this test feeds by hand
    seen: list[tuple[int, int]] = []
    add = metrics.hit_rate.add
    metrics.hit_rate.add = lambda hits, requests: (seen.append((hits, requests)), add(hits, requests))
    hashes = [b"h%03d" % i for i in range(40)]
    metrics._pending.append((0, hashes, 25))
    metrics._feed_some(16)
    metrics._feed_some(16)
    metrics._feed_some(16)
    # Tail first: hashes 24-39 hold one of the 25 leading hits, 8-23 sixteen, 0-7 eight.
    assert seen == [(1, 16), (16, 16), (8, 8)]
    assert sum(h for h, _ in seen) == 25 and sum(r for _, r in seen) == 40
    assert not metrics._pending


def test_the_queue_never_looks_empty_while_a_split_lookup_has_keys_left(server):
    # A drain check (a scrape's, this file's _drain_s) must not see an empty queue between taking a
    # lookup's tail and leaving its head: CI once saw a drained queue with a head still to feed.
    metrics = server.metrics
    metrics.close()
    lengths: list[int] = []

    class Watched(deque):
        def popleft(self):
            item = super().popleft()
            lengths.append(len(self))
            return item

    metrics._pending = Watched([(0, [b"h%03d" % i for i in range(40)], 25)])
    for _ in range(2):
        metrics._feed_some(16)
        assert 0 not in lengths and len(metrics._pending) == 1
    metrics._feed_some(16)
    assert lengths == [0] and not metrics._pending


def test_every_engine_call_runs_inside_the_foreground_activity(server):
    seen: list[int] = []

    class Recording(ForegroundActivity):
        def __enter__(self):
            out = super().__enter__()
            seen.append(self.calls)
            return out

    server.metrics.foreground = Recording()
    with PegaClient(server.address, name="feeder-test", read_lane=False) as client:
        inst = client.register_instance(KvLayout(model_id="m", block_bytes=4096))
        client.query_prefix(inst, [b"e" * 32])
    assert len(seen) >= 3 and all(n >= 1 for n in seen)  # OpenSession, RegisterInstance, QueryPrefix
    assert server.metrics.foreground.calls == 0
