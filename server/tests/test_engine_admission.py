"""W-TinyLFU vs LRU through the real KVEngine (real pool, allocator, leases, eviction path).

Every request looks up one block; a miss saves it (allocate, seal), evicting as
the engine does. Traces are seeded, so hit rates are deterministic; the margins
asserted are well inside the measured gaps (printed with -s).
"""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.server.config import KIB, MIB, ServerConfig
from pegaflow.server.engine import AllocStatus, KVEngine
from pegaflow.server.store.namespace import KvLayout

BLOCK = 64 * KIB
POOL = 32 * MIB  # 512 blocks of 64 KiB
TRACE_LEN = 40_000


def scan_heavy_trace(seed: int) -> list[int]:
    """Zipf reuse of a hot set 1.5x the pool, alternating with runs of one-off blocks (scans)."""
    rng = np.random.default_rng(seed)
    hot = 768
    weights = np.arange(1, hot + 1) ** -0.9
    weights /= weights.sum()
    trace: list[int] = []
    scan_id = 10**9
    while len(trace) < TRACE_LEN:
        trace.extend(rng.choice(hot, size=600, p=weights).tolist())
        trace.extend(range(scan_id, scan_id + 600))
        scan_id += 600
    return trace[:TRACE_LEN]


def recency_trace(seed: int) -> list[int]:
    """A working set that fits in the pool and slides by one block every 10 requests."""
    rng = np.random.default_rng(seed)
    base = np.arange(TRACE_LEN) // 10
    return (base + rng.integers(0, 300, size=TRACE_LEN)).tolist()


def replay(trace: list[int], lfu: bool) -> float:
    engine = KVEngine(
        ServerConfig(pool_size_bytes=POOL, http_addr=None, slab_bytes=4 * MIB, enable_lfu_admission=lfu)
    )
    try:
        sid = engine.open_session("trace", expires=False).session_id
        iid = engine.register_instance(sid, KvLayout(model_id="m", block_bytes=BLOCK)).instance_id
        for block in trace:
            h = block.to_bytes(8, "little")
            if engine.query_prefix(sid, iid, [h]).num_hits:
                continue
            res = engine.allocate_blocks(sid, iid, [h])
            assert res.statuses == [AllocStatus.GRANTED]
            engine.seal_blocks(sid, res.save_id)
        stats = engine.stats()
        assert stats.pool_used_bytes <= POOL and stats.evictions > 0
        if lfu:
            assert stats.admission_rejections > 0
        return stats.hits / (stats.hits + stats.misses)
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_tinylfu_beats_lru_on_a_scan_heavy_trace():
    trace = scan_heavy_trace(11)
    lru, lfu = replay(trace, lfu=False), replay(trace, lfu=True)
    print(f"scan-heavy: LRU {lru:.3f}, W-TinyLFU {lfu:.3f}")
    assert lfu >= lru + 0.05


@pytest.mark.timeout(300)
def test_tinylfu_costs_little_on_a_recency_friendly_trace():
    trace = recency_trace(12)
    lru, lfu = replay(trace, lfu=False), replay(trace, lfu=True)
    print(f"recency: LRU {lru:.3f}, W-TinyLFU {lfu:.3f}")
    assert lru > 0.8
    assert lfu >= lru - 0.03
