"""The eviction batch's one-pass path (BlockStore._evict_dram_many) against the one-victim-at-a-time
path it stands in for: the same saves, queries and leases into a full pool leave both engines in the
same state, block for block. The one-by-one path is the reference (every victim through _evict_dram)."""

from __future__ import annotations

import random

import pytest

from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.store.namespace import KvLayout

SMALL, LARGE = 256 * 1024, 1 * MIB


def _engine(one_by_one: bool, counted: list[tuple[int, ...]], lfu: bool) -> KVEngine:
    eng = KVEngine(
        ServerConfig(pool_size_bytes=32 * MIB, http_addr=None, slab_bytes=4 * MIB, enable_lfu_admission=lfu)
    )
    store = eng._store
    if one_by_one:
        store._evictable_batch = lambda _batch: None  # every batch takes the victims one by one
    else:
        batched = store._evict_dram_many

        def counting(entries):
            counted.append(tuple(entry.length for entry in entries))
            return batched(entries)

        store._evict_dram_many = counting
    return eng


def _state(eng: KVEngine) -> dict:
    store = eng._store
    index = store.index
    blocks = {key: (e.state, e.dram, e.dram_ready, e.pins) for key, e in index._blocks.items()}
    stats = eng.stats()
    return {
        "blocks": blocks,
        "by_slot": sorted(index._by_slot),
        "counts": (index.sealed, index.writing, index.pinned, index.dram_ready, index.ssd_ready),
        "per_ns": (dict(index._entries_per_ns), dict(index._sealed_per_ns)),
        "victim_order": _victim_order(eng.policy),
        "used": eng.allocator.used_bytes,
        "free_slabs": eng.allocator.free_slabs,
        "alloc": eng.allocator.stats(),
        "evictions": stats.evictions,
        "resident": stats.resident_blocks,
    }


def _victim_order(policy) -> list:
    """Every key the policy tracks, in the order it would offer them as victims (the skipped ones
    move the same way in both engines)."""
    seen: set = set()
    order: list = []
    while got := policy.next_victims(64, lambda key: key in seen):
        seen.update(got)
        order += got
    return order


def _script(eng: KVEngine) -> list:
    """Two models (two block sizes) saving into a 32 MiB pool many times over, with a lease held across
    saves (its blocks must survive), queries refreshing old blocks, and the answers of every call."""
    sid = eng.open_session("t").session_id
    small = eng.register_instance(sid, KvLayout(model_id="s", block_bytes=SMALL, dtype="bf16")).instance_id
    large = eng.register_instance(sid, KvLayout(model_id="l", block_bytes=LARGE, dtype="bf16")).instance_id
    out = []

    def save(iid, tag, n):
        hashes = [f"{tag}-{i}".encode() for i in range(n)]
        res = eng.allocate_blocks(sid, iid, hashes)
        out.append(list(res.statuses))
        if res.save_id:
            out.append(eng.seal_blocks(sid, res.save_id))
        return hashes

    first = save(small, "s0", 32)
    lease = eng.query_prefix(sid, small, first[:8], lease=True)
    out.append(lease.num_hits)
    for round_ in range(1, 14):
        save(small, f"s{round_}", 48)
        if round_ % 4 == 0:
            save(large, f"l{round_}", 6)  # another size: victims of both sizes, slabs moving
        out.append(eng.query_prefix(sid, small, [f"s{round_ - 1}-{i}".encode() for i in range(16)]).num_hits)
    out.append(eng.query_prefix(sid, small, first[:8]).num_hits)  # the leased blocks stayed
    eng.release_lease(sid, lease.lease_id)
    for round_ in range(14, 20):
        save(small, f"s{round_}", 64)
    # The other size takes over the pool, then the first one takes it back: every victim of the other
    # size, slabs emptying part way through a batch and moving between the sizes.
    for round_ in range(6):
        save(large, f"L{round_}", 8)
    for round_ in range(6):
        save(small, f"S{round_}", 40)
    return out


@pytest.mark.parametrize("lfu", [False, True])
def test_batched_eviction_leaves_the_engine_as_one_by_one_eviction_does(lfu):
    counted: list[int] = []
    engines = []
    for one_by_one in (True, False):
        engines.append(_engine(one_by_one, counted, lfu))
    try:
        answers = [_script(eng) for eng in engines]
        assert answers[0] == answers[1]
        assert answers[0][2] == 8  # the lease's hits
        reference, batched = (_state(eng) for eng in engines)
        assert batched == reference
        assert len(reference["victim_order"]) == reference["resident"]  # the policy tracks every block
        assert reference["evictions"] > 200  # the pool turned over many times
        assert sum(map(len, counted)) > 100  # and the batches mostly took the one-pass path,
        assert any(LARGE in lengths and SMALL in lengths for lengths in counted) or any(
            set(lengths) == {LARGE} for lengths in counted
        )  # victims of the other size among them
    finally:
        for eng in engines:
            eng.close()


def _random_script(eng: KVEngine, seed: int) -> list:
    """Saves of three block sizes in random order and sizes, leases taken and let go at random."""
    rng = random.Random(seed)
    sid = eng.open_session("t").session_id
    sizes = (SMALL, 640 * 1024, LARGE)
    instances = [
        eng.register_instance(sid, KvLayout(model_id=f"m{size}", block_bytes=size, dtype="bf16")).instance_id
        for size in sizes
    ]
    out, leases, saved = [], [], []
    for step in range(120):
        which = rng.randrange(3)
        hashes = [f"{step}-{i}".encode() for i in range(rng.randrange(1, 40))]
        res = eng.allocate_blocks(sid, instances[which], hashes)
        out.append(list(res.statuses))
        if res.save_id:
            out.append(eng.seal_blocks(sid, res.save_id))
        saved.append((which, hashes))
        if rng.random() < 0.2:
            which, old = rng.choice(saved)
            hit = eng.query_prefix(sid, instances[which], old, lease=rng.random() < 0.5)
            out.append(hit.num_hits)
            if hit.lease_id:
                leases.append(hit.lease_id)
        if leases and rng.random() < 0.3:
            eng.release_lease(sid, leases.pop(rng.randrange(len(leases))))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_batched_eviction_matches_one_by_one_under_random_mixed_sizes(seed):
    counted: list[tuple[int, ...]] = []
    engines = [_engine(one_by_one, counted, False) for one_by_one in (True, False)]
    try:
        answers = [_random_script(eng, seed) for eng in engines]
        assert answers[0] == answers[1]
        assert _state(engines[1]) == _state(engines[0])
        assert counted  # the one-pass path ran
    finally:
        for eng in engines:
            eng.close()
