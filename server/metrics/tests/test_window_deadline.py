"""GetStats and scrapes read the windows within their deadline: with the sketches in this process
(the embedded server's default), feeding a backlog of lookups is the slow part, and a flush with a
deadline stops at it instead of after a whole batch of 65,536 keys (0.2-0.3 s on the 2-vCPU VM)."""

from __future__ import annotations

import time

from pegaflow.server.metrics.lookup_sketches import LookupSketches
from pegaflow.server.metrics.registry import MAX_KEYS_PER_ADD, ServerMetrics

KEYS_PER_LOOKUP = 64


def backlogged_metrics(lookups: int) -> ServerMetrics:
    """ServerMetrics with in-process sketches and ``lookups`` lookups waiting to be fed (its feeder
    thread is not started: nothing feeds them but the flush under test)."""
    metrics = ServerMetrics({"15m": 900.0}, sketches="thread")
    metrics.insights.block_bytes = lambda _ns: 4096
    metrics.sketches = LookupSketches(metrics.windows, 1 << 30)
    for i in range(lookups):
        metrics.on_lookup(0, [f"k{i % 997}-{j}".encode() for j in range(KEYS_PER_LOOKUP)], 8)
    return metrics


def test_a_flush_with_a_deadline_stops_at_it_not_after_a_whole_batch():
    metrics = backlogged_metrics(4 * MAX_KEYS_PER_ADD // KEYS_PER_LOOKUP)
    try:
        before = len(metrics._pending)
        metrics.window_rates(deadline=time.monotonic() + 0.02)
        fed = before - len(metrics._pending)
        assert 0 < fed < MAX_KEYS_PER_ADD // KEYS_PER_LOOKUP  # less than one batch of the old flush
    finally:
        metrics.close()


def test_a_flush_without_a_deadline_still_feeds_its_four_batches():
    metrics = backlogged_metrics(5 * MAX_KEYS_PER_ADD // KEYS_PER_LOOKUP)
    try:
        measured, ceiling = metrics.window_rates()
        assert len(metrics._pending) == MAX_KEYS_PER_ADD // KEYS_PER_LOOKUP
        assert ceiling["15m"] is not None and measured["15m"] is not None
    finally:
        metrics.close()
