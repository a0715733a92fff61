"""bench/tail_latency.py on CPU: the baselines' index (leases pin, LRU eviction skips pinned slots),
the anchor's percentile rule, and one real baseline server answering the real client."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

from pegaflow.bench import tail_latency as tl


def test_percentiles_follow_the_anchor_rule():
    xs = [i / 1e6 for i in range(1, 3001)]  # 1..3000 us
    assert tl.pct(xs, 0.5) == 1501.0 and tl.pct(xs, 0.99) == 2971.0 and tl.pct(xs, 0.999) == 2998.0
    assert tl.pct([], 0.5) is None


def test_baseline_store_leases_pin_and_eviction_takes_the_least_recent_unpinned():
    store = tl.BaselineStore(4 * tl.BLOCK_BYTES)  # 4 slots
    a, b = [b"a%031d" % i for i in range(2)], [b"b%031d" % i for i in range(2)]
    for hs in (a, b):
        slots, _ = store.allocate(2)
        store.seal(hs, slots)
    hits, lease, offsets = store.query(a, lease=True)  # a: most recent and pinned
    assert hits == 2 and lease and len(offsets) == 2
    slots, _ = store.allocate(2)  # must evict b (least recent), not the pinned a
    store.seal([b"c%031d" % i for i in range(2)], slots)
    assert store.query(b, lease=False)[0] == 0 and store.query(a, lease=False)[0] == 2
    store.release(lease)
    assert not store.pins
    assert store.query([b"missing" * 4] + a, lease=True)[:2] == (0, 0)  # a prefix stops at a miss


@pytest.mark.timeout(60)
def test_an_asyncio_baseline_answers_queries_and_saves():
    path = tempfile.mkdtemp() + "/b.sock"
    proc = subprocess.Popen(
        [sys.executable, tl.__file__, "--baseline-server", "asyncio", path, str(1 << 30), "0"],
        stdout=subprocess.PIPE,
    )
    try:
        assert b"ready" in proc.stdout.readline()
        client = tl.FrameClient(path)
        hashes = tl.new_hashes(tl.NQ)
        assert client.save(hashes) == tl.NQ
        hits, release = client.query(hashes)
        assert hits == tl.NQ
        release()
        stats = tl.measure(lambda: client.query(hashes), 50, 30)
        assert stats["n"] == 50 and stats["full_hits"] == 50 and stats["errors"] == 0
    finally:
        proc.kill()
        proc.wait()


def test_merged_runs_give_each_cell_its_median_and_worst_run():
    def run(p99_local: float, p99_asyncio: float) -> dict:
        cell = lambda p99: {"p50_us": p99 / 4, "p99_us": p99, "p999_us": p99 * 2}  # noqa: E731
        return {
            "systems": {
                "ours-sketch-thread": {"local": {"idle": cell(p99_local)}},
                "asyncio": {"idle": cell(p99_asyncio)},
            }
        }

    merged = tl.merge([run(500, 90), run(1300, 80), run(550, 100)])
    local = merged["systems"]["ours-sketch-thread"]["local"]["idle"]
    assert (local["p99_us"], local["p99_us_worst"], local["p99_us_runs"]) == (550, 1300, [500, 1300, 550])
    assert merged["systems"]["asyncio"]["idle"]["p99_us"] == 90 and merged["merged_runs"] == 3
    assert [label for label, _, _ in tl.rows_of(merged)] == ["ours-sketch-thread-local", "asyncio"]
