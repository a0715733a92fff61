"""The free-slot reserve (store/free_reserve.py): evictions made ahead of saves, in the policy's order,
never of a pinned block, so that a save into a full pool finds its slots free."""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import AllocStatus, KVEngine
from pegaflow.server.main import build_parser, config_from_args
from pegaflow.server.store.free_reserve import (
    IDLE_S,
    SOLE_SAVER_STREAK,
    FreeSlotReserve,
    default_reserve_bytes,
)
from pegaflow.server.store.namespace import KvLayout

BLOCK = 256 * 1024
POOL = 64 * MIB  # 16 slabs of 4 MiB: 256 blocks
RESERVE = 2 * MIB  # 8 blocks (POOL / 32 caps it at 2 MiB too)


def layout() -> KvLayout:
    return KvLayout(model_id="m", block_bytes=BLOCK, dtype="bf16", tp_size=1, tp_rank=0)


def hashes(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def make(reserve_bytes: int) -> tuple[KVEngine, str, str]:
    eng = KVEngine(
        ServerConfig(
            pool_size_bytes=POOL, http_addr=None, slab_bytes=4 * MIB, free_reserve_bytes=reserve_bytes
        )
    )
    sid = eng.open_session("t").session_id
    return eng, sid, eng.register_instance(sid, layout()).instance_id


def save(eng: KVEngine, sid: str, iid: str, hs: list[bytes]) -> list[AllocStatus]:
    statuses = []
    for lo in range(0, len(hs), 64):
        res = eng.allocate_blocks(sid, iid, hs[lo : lo + 64])
        if res.save_id:
            eng.seal_blocks(sid, res.save_id)
        statuses += res.statuses
    return statuses


def fill_with_other_namespace(eng: KVEngine, sid: str):
    """Fills the pool with namespace "other"'s blocks, every byte 0xAB; returns the pool's view."""
    other_layout = KvLayout(model_id="other", block_bytes=BLOCK, dtype="bf16")
    other = eng.register_instance(sid, other_layout).instance_id
    view = eng.pool_view()
    for lo in range(0, 256, 64):
        res = eng.allocate_blocks(sid, other, hashes(256, "x")[lo : lo + 64])
        for loc in res.locations:
            view[loc.offset : loc.offset + loc.length] = 0xAB
        eng.seal_blocks(sid, res.save_id)
    return view


def wait_reserve_evictions(eng: KVEngine, count: int, timeout_s: float = 5.0) -> int:
    until = time.monotonic() + timeout_s
    while (got := eng.stats().reserve_evictions) < count and time.monotonic() < until:
        time.sleep(0.01)
    return got


def on_allocation_evictions(eng: KVEngine) -> int:
    stats = eng.stats()
    return stats.evictions + stats.dram_drops_kept_on_ssd - stats.reserve_evictions


@pytest.mark.parametrize("reserve_bytes", [RESERVE, 0], ids=["reserve", "off"])
def test_a_save_into_a_full_pool_finds_its_slots_freed_ahead_in_the_policys_order(reserve_bytes):
    eng, sid, iid = make(reserve_bytes)
    try:
        assert save(eng, sid, iid, hashes(256, "a")) == [AllocStatus.GRANTED] * 256  # the pool is full
        time.sleep(0.05)
        # A pool that merely filled up keeps all it holds: nothing needed room yet.
        assert eng.stats().reserve_evictions == 0
        assert eng.query_prefix(sid, iid, hashes(256, "a")).num_hits == 256
        save(eng, sid, iid, hashes(8, "b"))  # evicts 8 for itself: saves now meet a full pool
        assert on_allocation_evictions(eng) == 8
        if reserve_bytes:
            assert wait_reserve_evictions(eng, 8) == 8
            time.sleep(0.05)
            assert eng.stats().reserve_evictions == 8  # it keeps its reserve, no more
            # The policy's next 8 went. The query above touched the whole chain tail first (a prefix
            # loses its tail first): "b" took a-248..255, the reserve a-240..247.
            assert eng.query_prefix(sid, iid, hashes(256, "a")).num_hits == 240
        before = on_allocation_evictions(eng)
        assert save(eng, sid, iid, hashes(8, "c")) == [AllocStatus.GRANTED] * 8
        # With the reserve the save evicted nothing itself; without it, its own 8 victims.
        assert on_allocation_evictions(eng) - before == (0 if reserve_bytes else 8)
        if reserve_bytes:
            assert wait_reserve_evictions(eng, 16) == 16  # and the reserve is refilled
    finally:
        eng.close()


def test_the_reserve_never_evicts_a_pinned_block_and_stops_when_nothing_is_evictable():
    eng, sid, iid = make(RESERVE)
    try:
        eng._reserver = None  # driven by hand: no allocation wakes the thread, so no race with the leases
        other = eng.open_session("u").session_id
        other_iid = eng.register_instance(other, layout()).instance_id
        # The whole pool, leased (a session may pin half of it): nothing is evictable.
        save(eng, sid, iid, hashes(128, "a"))
        lease_a = eng.query_prefix(sid, iid, hashes(128, "a"), lease=True)
        save(eng, other, other_iid, hashes(128, "b"))
        lease_b = eng.query_prefix(other, other_iid, hashes(128, "b"), lease=True)
        assert lease_a.num_hits == lease_b.num_hits == 128
        eng._store.free_reserve.used(BLOCK, 0, "", evicted=True)  # as a save that had to evict
        with eng._locked(None):
            assert eng._store.refill_reserve(32) is False  # nothing evictable: no busy loop
        assert eng.stats().reserve_evictions == 0
        assert eng.query_prefix(sid, iid, hashes(128, "a") + hashes(128, "b")).num_hits == 256
        eng.release_lease(other, lease_b.lease_id)
        eng._store.free_reserve.used(BLOCK, 0, "", evicted=True)  # as a save that had to evict
        with eng._locked(None):
            assert eng._store.refill_reserve(32) is False  # its 8 freed, from the unpinned chain only
        assert eng.stats().reserve_evictions == 8
        assert eng.query_prefix(sid, iid, hashes(128, "a")).num_hits == 128
        assert eng.query_prefix(sid, iid, hashes(128, "b")).num_hits == 120
    finally:
        eng.close()


def test_the_reserve_evicts_in_slices_and_reports_more_to_do():
    eng, sid, iid = make(RESERVE)
    try:
        eng._reserver = None  # drive it by hand (the thread stays parked: nothing wakes it)
        eng._reserve_wanted.clear()
        save(eng, sid, iid, hashes(256, "a"))
        eng._store.free_reserve.used(BLOCK, 0, "", evicted=True)  # as a save that had to evict
        with eng._locked(None):
            assert eng._store.refill_reserve(3) is True  # 3 of 8: more to do
            assert eng._store.refill_reserve(3) is True
            assert eng._store.refill_reserve(3) is False  # 8 free: done
            assert eng._store.refill_reserve(3) is False
        assert eng.stats().reserve_evictions == 8
    finally:
        eng.close()


def test_sizes_are_forgotten_when_idle_and_the_reserve_is_capped_by_the_part():
    now = [0.0]
    reserve = FreeSlotReserve(64 * MIB, clock=lambda: now[0])
    reserve.used(BLOCK, 0, "", evicted=False)
    assert reserve.sizes() == []  # no save had to evict yet: no reserve
    reserve.used(BLOCK, 0, "", evicted=True)
    reserve.used(2 * MIB, 1, "team-a", evicted=True)
    reserve.used(BLOCK, 0, "", evicted=False)  # under pressure it stays, evicting or not
    assert sorted(reserve.sizes()) == [(BLOCK, 0, ""), (2 * MIB, 1, "team-a")]
    assert reserve.slots(BLOCK, 1 << 40) == 256  # 64 MiB of 256 KiB blocks
    assert reserve.slots(BLOCK, 256 * MIB) == 32  # a 256 MiB part reserves at most 1/32 of itself
    assert reserve.slots(4 * MIB, 8 * MIB) == 1  # never less than one slot
    now[0] = IDLE_S + 1
    reserve.used(BLOCK, 0, "", evicted=False)
    assert reserve.sizes() == [(BLOCK, 0, "")]
    with pytest.raises(ValueError):
        FreeSlotReserve(-1)


def test_slots_are_zeroed_ahead_only_for_a_namespace_that_saves_alone():
    reserve = FreeSlotReserve(64 * MIB)
    for _ in range(SOLE_SAVER_STREAK - 1):
        reserve.used(BLOCK, 0, "", True, ns_index=1)
    assert reserve.sole_saver(BLOCK, 0) == -1
    reserve.used(BLOCK, 0, "", False, ns_index=1)
    assert reserve.sole_saver(BLOCK, 0) == 1
    reserve.used(BLOCK, 0, "", False, ns_index=2)  # two models interleave: the next saver is a guess
    assert reserve.sole_saver(BLOCK, 0) == -1


def test_the_cli_default_is_a_64th_of_the_pool_at_most_512mb_and_bad_sizes_are_refused():
    def reserve_of(*args: str) -> int:
        return config_from_args(build_parser().parse_args(list(args))).free_reserve_bytes

    assert reserve_of("--pool-size", "1gb") == 16 * MIB == default_reserve_bytes(1 << 30)
    assert reserve_of("--pool-size", "64gb") == 512 * MIB
    assert reserve_of("--pool-size", "1gb", "--free-reserve", "0") == 0
    with pytest.raises(ValueError, match="--free-reserve"):
        reserve_of("--pool-size", "1gb", "--free-reserve", "512mb")  # over a quarter of the pool


def test_slots_another_namespace_held_are_zeroed_ahead_so_the_save_that_gets_them_zeroes_nothing():
    eng, sid, iid = make(RESERVE)
    try:
        view = fill_with_other_namespace(eng, sid)
        on_request_thread: list = []  # slots zeroed by the calls of this (the request) thread
        zero, me = eng.dram.zero, threading.current_thread()

        def recording_zero(slots, deadline=None):
            if threading.current_thread() is me:
                on_request_thread.extend(slots)
            return zero(slots, deadline)

        eng.dram.zero = recording_zero
        save(eng, sid, iid, hashes(8, "a"))  # evicts for itself: its 8 slots zeroed on this thread
        assert len(on_request_thread) == 8
        time.sleep(0.05)
        # One save is no streak: nothing zeroed ahead for a namespace that may not save next.
        assert eng.stats().reserve_zeroed_blocks == 0
        for n in range(1, SOLE_SAVER_STREAK):  # "m" keeps saving: the sole saver of that size
            save(eng, sid, iid, hashes(8, f"a{n}"))
        until = time.monotonic() + 5
        while eng.stats().reserve_zeroed_blocks < 8 and time.monotonic() < until:
            time.sleep(0.01)
        assert eng.stats().reserve_zeroed_blocks == 8  # the reserve's 8 slots, zeroed for "m" ahead
        on_request_thread.clear()
        res = eng.allocate_blocks(sid, iid, hashes(8, "b"))
        assert on_request_thread == []  # nothing left to zero on the request path
        for loc in res.locations:  # and nothing of the other namespace's is exposed
            assert not view[loc.offset : loc.offset + loc.length].any()
        eng.seal_blocks(sid, res.save_id)
    finally:
        eng.close()


def test_whole_write_saves_zero_nothing_on_their_path_and_get_nothing_zeroed_ahead():
    """A GPU save (whole_write: its copy overwrites every byte) needs no zeroed slots: none are zeroed
    for it, on its path or by the reserve thread ahead of it, however long its streak of saves."""
    eng, sid, iid = make(RESERVE)
    try:
        view = fill_with_other_namespace(eng, sid)
        zeroed: list = []
        zero = eng.dram.zero

        def recording_zero(slots, deadline=None):
            zeroed.extend(slots)
            return zero(slots, deadline)

        eng.dram.zero = recording_zero
        for n in range(SOLE_SAVER_STREAK + 2):
            res = eng.allocate_blocks(sid, iid, hashes(8, f"g{n}"), whole_write=True)
            assert res.statuses == [AllocStatus.GRANTED] * 8
            for loc in res.locations:  # the copy
                view[loc.offset : loc.offset + loc.length] = n + 1
            eng.seal_blocks(sid, res.save_id)
            time.sleep(0.02)  # the reserve thread's turn
        wait_reserve_evictions(eng, 8)
        time.sleep(0.1)
        assert eng._store.free_reserve.sole_saver(BLOCK, 0) == -1
        assert zeroed == [] and eng.stats().reserve_zeroed_blocks == 0
        # A plain save of the same namespace after them still gets its foreign slots zeroed.
        res = eng.allocate_blocks(sid, iid, hashes(8, "plain"))
        assert len(zeroed) == 8
        for loc in res.locations:
            assert not view[loc.offset : loc.offset + loc.length].any()
        eng.seal_blocks(sid, res.save_id)
    finally:
        eng.close()


def test_a_reserve_found_clean_is_not_taken_out_again_until_another_namespaces_slot_is_freed():
    eng, sid, iid = make(RESERVE)
    try:
        store = eng._store
        other = eng.register_instance(
            sid, KvLayout(model_id="other", block_bytes=BLOCK, dtype="bf16")
        ).instance_id
        save(eng, sid, other, hashes(4, "o"))
        lease = eng.query_prefix(sid, other, hashes(4, "o"), lease=True)  # pinned: never evicted
        assert lease.num_hits == 4
        # "m" fills the pool and goes on saving under pressure: the sole saver of this size, whose
        # reserve the background thread refills with "m"'s own slots (nothing to zero).
        save(eng, sid, iid, hashes(256, "m"))
        for n in range(SOLE_SAVER_STREAK + 2):
            save(eng, sid, iid, hashes(8, f"m{n}"))
        assert store.free_reserve.sole_saver(BLOCK, 0) >= 0
        until = time.monotonic() + 5
        while (store.reserve_low() or eng.stats().reserve_zeroed_blocks) and time.monotonic() < until:
            time.sleep(0.01)
        taken_out: list[int] = []
        allocate_many = store.allocator.allocate_many

        def counting(block_bytes, count, hold=False, part=0):
            got = allocate_many(block_bytes, count, hold, part)
            taken_out.extend(got)
            return got

        with eng._lock:
            store.allocator.allocate_many = counting
            try:
                assert store.take_unzeroed_reserve() == []  # the pass that finds it clean, if not done yet
                taken_out.clear()
                assert store.take_unzeroed_reserve() == []
                assert taken_out == []  # found clean: not taken out and put back again
            finally:
                store.allocator.allocate_many = allocate_many
        eng.release_lease(sid, lease.lease_id)
        with eng._lock:
            (entry,) = [e for e in (store.index.get((ns, b"o-0")) for ns in range(4)) if e is not None]
            slot = entry.dram
            store._evict_dram(entry)  # a slot of "other" is free now: foreign to "m"
            slots = store.take_unzeroed_reserve()
            assert [s[0] for s in slots] == [slot]
            store.return_zeroed(slots)
            assert store.take_unzeroed_reserve() == []
    finally:
        eng.close()
