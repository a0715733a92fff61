"""The block store's tiering through the engine: spill to a lower tier, promote on a hit, pins,
failures, bounds, FIFO reclaim and recovery (a slow test tier, see tiering_support.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.common.wire.types import Tier
from pegaflow.server.clients.tenants import Tenant
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import AllocStatus, KVEngine, QueryPurpose
from pegaflow.server.store.namespace import KvLayout
from pegaflow.server.store.tests.tiering_support import SlowTier

BLOCK = 256 * 1024
POOL = 8 * MIB  # 2 slabs of 4 MiB: 32 blocks


def layout(**kw) -> KvLayout:
    base = dict(
        model_id="m", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
        block_bytes=BLOCK, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
    )  # fmt: skip
    base.update(kw)
    return KvLayout(**base)


def hashes(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def pattern(h: bytes) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(abs(hash(h)) % 2**32).bytes(BLOCK), np.uint8)


def make(ssd: SlowTier, foreground=None, **kw) -> KVEngine:
    cfg = dict(pool_size_bytes=POOL, http_addr=None, slab_bytes=4 * MIB, reaper_interval_s=3600)
    cfg.update(kw)
    return KVEngine(ServerConfig(**cfg), ssd=ssd, foreground=foreground)


def save(eng: KVEngine, sid: str, iid: str, hs: list[bytes]) -> list[AllocStatus]:
    res = eng.allocate_blocks(sid, iid, hs)
    view = eng.pool_view()
    for h, loc in zip(hs, res.locations, strict=True):
        if loc is not None:
            view[loc.offset : loc.offset + BLOCK] = pattern(h)
    if res.save_id:
        eng.seal_blocks(sid, res.save_id)
    return res.statuses


def settle(eng: KVEngine, ssd: SlowTier) -> None:
    ssd.settle()
    with eng._lock:  # completions run on the tier's threads; take the lock once so they are recorded
        pass


def fill_dram(eng, sid, iid, tag: str, n: int = 32) -> None:
    """Saves n other blocks, pushing what was there out of DRAM."""
    for i in range(0, n, 8):
        save(eng, sid, iid, hashes(8, f"{tag}{i}"))


@pytest.fixture
def ssd():
    return SlowTier(capacity_blocks=256)


def test_write_through_spills_and_a_prefix_hit_promotes_byte_identical(ssd):
    eng = make(ssd, ssd_write_policy="on-seal")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        chain = hashes(6, "keep")
        save(eng, sid, iid, chain)
        settle(eng, ssd)
        assert eng.stats().ssd_blocks == 6  # written at seal
        fill_dram(eng, sid, iid, "other", 32)
        settle(eng, ssd)
        stats = eng.stats()
        assert stats.dram_drops_kept_on_ssd >= 6
        first = eng.query_prefix(sid, iid, chain, lease=True)
        assert first.num_hits == 0 and first.pending == 6
        assert first.sources == (Tier.SSD,) * 6
        loaded = eng.load_blocks(sid, iid, first.lease_id)
        assert loaded.num_hits == 6 and loaded.pending == 0
        view = eng.pool_view()
        for h, off in zip(chain, loaded.offsets, strict=True):
            assert np.array_equal(view[off : off + BLOCK], pattern(h))
        eng.release_lease(sid, first.lease_id)
        again = eng.query_prefix(sid, iid, chain)
        assert again.num_hits == 6 and again.sources == (Tier.DRAM,) * 6
        stats = eng.stats()
        assert (stats.ssd_hits, stats.promoted_blocks) == (6, 6)
    finally:
        eng.close()


def test_second_sighting_writes_only_reused_blocks(ssd):
    eng = make(ssd, ssd_write_policy="on-reuse")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        save(eng, sid, iid, hashes(4, "reused"))
        save(eng, sid, iid, hashes(4, "once"))
        settle(eng, ssd)
        assert eng.stats().demotions_started == 0  # nothing written at seal
        assert eng.query_prefix(sid, iid, hashes(4, "reused")).num_hits == 4  # its first reuse
        settle(eng, ssd)
        assert eng.stats().ssd_blocks == 4
        fill_dram(eng, sid, iid, "other", 32)
        settle(eng, ssd)
        assert eng.query_prefix(sid, iid, hashes(4, "once")).pending == 0  # a one-off: gone
        hit = eng.query_prefix(sid, iid, hashes(4, "reused"), lease=True)
        assert hit.pending == 4
        assert eng.load_blocks(sid, iid, hit.lease_id).num_hits == 4
    finally:
        eng.close()


def test_second_sighting_writes_a_block_lost_before_its_reuse_when_it_is_saved_again(ssd):
    eng = make(ssd, ssd_write_policy="on-reuse")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        lost, one_off = hashes(4, "lost"), hashes(4, "one-off")
        for chain in (lost, one_off):
            assert eng.query_prefix(sid, iid, chain).num_hits == 0  # its own request's lookup
            save(eng, sid, iid, chain)
        fill_dram(eng, sid, iid, "other", 32)  # both leave DRAM before any reuse
        settle(eng, ssd)
        assert eng.stats().demotions_started == 0
        again = eng.query_prefix(sid, iid, lost)  # asked for a second time: a miss, recomputed
        assert (again.num_hits, again.pending) == (0, 0)
        save(eng, sid, iid, lost)
        settle(eng, ssd)
        assert eng.stats().ssd_blocks == 4  # written at this seal; the one-off and the fillers not
        fill_dram(eng, sid, iid, "more", 32)
        settle(eng, ssd)
        hit = eng.query_prefix(sid, iid, lost, lease=True)
        assert hit.pending == 4 and hit.sources == (Tier.SSD,) * 4
        loaded = eng.load_blocks(sid, iid, hit.lease_id)
        view = eng.pool_view()
        for h, off in zip(lost, loaded.offsets, strict=True):
            assert np.array_equal(view[off : off + BLOCK], pattern(h))
        assert eng.query_prefix(sid, iid, one_off).pending == 0
    finally:
        eng.close()


def test_a_corrupt_copy_is_a_miss_and_is_dropped_never_served(ssd):
    eng = make(ssd, ssd_write_policy="on-seal")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        chain = hashes(4, "c")
        save(eng, sid, iid, chain)
        settle(eng, ssd)
        fill_dram(eng, sid, iid, "other", 32)
        settle(eng, ssd)
        ssd.corrupt = set(ssd.records)  # every record fails its checksum now
        hit = eng.query_prefix(sid, iid, chain, lease=True)
        assert hit.pending == 4
        loaded = eng.load_blocks(sid, iid, hit.lease_id)
        assert loaded.num_hits == 0 and loaded.pending == 0
        stats = eng.stats()
        assert stats.corrupt_blocks == 4 and stats.promotion_failures == 4
        eng.release_lease(sid, hit.lease_id)
        assert eng.query_prefix(sid, iid, chain).pending == 0  # dropped from the index
        assert save(eng, sid, iid, chain[:1]) == [AllocStatus.GRANTED]  # and can be saved again
    finally:
        eng.close()


def test_promotions_in_flight_are_bounded_and_the_rest_is_a_miss(ssd):
    eng = make(ssd, ssd_write_policy="on-seal", promote_inflight_bytes=3 * BLOCK)
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        chain = hashes(8, "b")
        save(eng, sid, iid, chain)
        settle(eng, ssd)
        fill_dram(eng, sid, iid, "other", 32)
        settle(eng, ssd)
        ssd.gate.clear()  # hold the reads in flight
        hit = eng.query_prefix(sid, iid, chain)
        assert hit.pending == 3
        assert eng.stats().promotions_dropped >= 1
        again = eng.query_prefix(sid, iid, chain, purpose=QueryPurpose.LOAD)
        assert again.pending == 3  # the same three still arriving; no new ones within the bound
        ssd.gate.set()
        settle(eng, ssd)
        assert eng.query_prefix(sid, iid, chain, purpose=QueryPurpose.LOAD).num_hits == 3
    finally:
        ssd.gate.set()
        eng.close()


def test_pending_blocks_are_never_evicted_and_a_lease_pins_them(ssd):
    eng = make(ssd, ssd_write_policy="on-seal")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        chain = hashes(4, "p")
        save(eng, sid, iid, chain)
        settle(eng, ssd)
        fill_dram(eng, sid, iid, "other", 32)
        settle(eng, ssd)
        ssd.gate.clear()
        hit = eng.query_prefix(sid, iid, chain, lease=True)
        assert hit.pending == 4
        fill_dram(eng, sid, iid, "more", 40)  # pressure while the promotion is in flight
        ssd.gate.set()
        loaded = eng.load_blocks(sid, iid, hit.lease_id)
        assert loaded.num_hits == 4
        fill_dram(eng, sid, iid, "yet", 40)  # leased: still not evicted
        view = eng.pool_view()
        for h, off in zip(chain, loaded.offsets, strict=True):
            assert np.array_equal(view[off : off + BLOCK], pattern(h))
    finally:
        ssd.gate.set()
        eng.close()


def test_a_full_lower_tier_reclaims_its_oldest_copies_first():
    ssd = SlowTier(capacity_blocks=8)
    eng = make(ssd, ssd_write_policy="on-seal")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        for i in range(4):
            save(eng, sid, iid, hashes(4, f"g{i}"))
            settle(eng, ssd)
        assert len(ssd.allocated) == 8  # never past its capacity
        stats = eng.stats()
        assert stats.ssd_reclaimed_blocks == 8 and stats.ssd_blocks == 8
        held = {tag.rpartition(b"\0")[2] for tag, _ in ssd.records.values()}
        assert held == set(hashes(4, "g2") + hashes(4, "g3"))  # the newest; the oldest went first
        # the reclaimed blocks keep their DRAM copies: still hits
        assert eng.query_prefix(sid, iid, hashes(4, "g0")).num_hits == 4
    finally:
        eng.close()


@pytest.mark.parametrize("tenant", [None, Tenant("team-a", "a" * 32)], ids=["no-tenant", "tenant"])
def test_a_restart_recovers_what_the_lower_tier_holds(ssd, tmp_path, tenant):
    """A tenant's namespace is persisted with its tenant, so its records map back to it."""
    cfg = dict(ssd_write_policy="on-seal", ssd_cache_paths=(str(tmp_path),), ssd_cache_capacity_bytes=1 << 30)
    eng = make(ssd, **cfg)
    sid = eng.open_session("t", tenant=tenant).session_id
    iid = eng.register_instance(sid, layout()).instance_id
    save(eng, sid, iid, hashes(5, "r"))
    settle(eng, ssd)
    eng.close()
    restarted = SlowTier(capacity_blocks=256)
    restarted.records = dict(ssd.records)
    restarted.allocated = set(ssd.records)
    restarted._next = ssd._next
    eng = make(restarted, **cfg)
    try:
        assert eng.stats().recovered_blocks == 5
        sid = eng.open_session("t", tenant=tenant).session_id
        iid = eng.register_instance(sid, layout()).instance_id  # same layout: same namespace
        hit = eng.query_prefix(sid, iid, hashes(5, "r"), lease=True)
        assert hit.pending == 5
        loaded = eng.load_blocks(sid, iid, hit.lease_id)
        view = eng.pool_view()
        for h, off in zip(hashes(5, "r"), loaded.offsets, strict=True):
            assert np.array_equal(view[off : off + BLOCK], pattern(h))
    finally:
        eng.close()


class NotedHits:
    """Stands in for ForegroundPriority: records which queries the engine called served now."""

    def __init__(self) -> None:
        self.ready_hits = 0

    def ready_hit(self) -> None:
        self.ready_hits += 1


def test_only_queries_served_wholly_from_dram_make_the_disk_yield(ssd):
    noted = NotedHits()
    eng = make(ssd, foreground=noted, ssd_write_policy="on-seal")
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        chain = hashes(6, "keep")
        save(eng, sid, iid, chain)
        settle(eng, ssd)
        assert eng.query_prefix(sid, iid, chain).num_hits == 6
        assert noted.ready_hits == 1  # all six in DRAM: served now
        assert eng.query_prefix(sid, iid, hashes(3, "absent")).num_hits == 0
        assert noted.ready_hits == 1  # a miss serves nothing
        fill_dram(eng, sid, iid, "other", 32)
        settle(eng, ssd)
        first = eng.query_prefix(sid, iid, chain, lease=True)
        assert first.pending == 6
        assert noted.ready_hits == 1  # waits for the disk itself: no yield for it
        eng.load_blocks(sid, iid, first.lease_id)
        eng.release_lease(sid, first.lease_id)
        assert eng.query_prefix(sid, iid, chain).num_hits == 6
        assert noted.ready_hits == 2
    finally:
        eng.close()


def test_a_region_tenants_blocks_spill_and_promote_back_into_its_region(ssd):
    """A tenant with memory of its own (region=SIZE): its evicted blocks go to the lower tier like any,
    and a hit promotes them into its region again (offsets relative to it), not into the pool."""
    cfg = ServerConfig(
        pool_size_bytes=POOL,
        http_addr=None,
        slab_bytes=4 * MIB,
        reaper_interval_s=3600,
        ssd_write_policy="on-seal",
    )
    eng = KVEngine(cfg, ssd=ssd, tenant_regions={"r": 4 * MIB})  # 16 blocks of its own
    try:
        part = eng.region.part("r")
        sid = eng.open_session("t", tenant=Tenant("r", "r" * 32, region_bytes=4 * MIB)).session_id
        iid = eng.register_instance(sid, layout()).instance_id
        view = eng.pool_view()

        def save_in_region(hs: list[bytes]) -> None:
            res = eng.allocate_blocks(sid, iid, hs)
            for h, off in zip(hs, res.offsets, strict=True):
                assert 0 <= off < part.size_bytes
                view[part.base + off : part.base + off + BLOCK] = pattern(h)
            eng.seal_blocks(sid, res.save_id)

        chain = hashes(6, "keep")
        save_in_region(chain)
        settle(eng, ssd)
        for i in range(0, 16, 8):  # fill its region: the chain leaves DRAM, kept on the SSD
            save_in_region(hashes(8, f"other{i}"))
        settle(eng, ssd)
        first = eng.query_prefix(sid, iid, chain, lease=True)
        assert first.num_hits == 0 and first.pending == 6
        loaded = eng.load_blocks(sid, iid, first.lease_id)
        assert loaded.num_hits == 6
        for h, off in zip(chain, loaded.offsets, strict=True):
            assert 0 <= off < part.size_bytes
            assert np.array_equal(view[part.base + off : part.base + off + BLOCK], pattern(h))
        eng.release_lease(sid, first.lease_id)
        assert eng.allocator.available(BLOCK) == POOL // BLOCK  # the shared pool holds none of it
    finally:
        eng.close()
