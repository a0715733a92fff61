"""KVEngine in-process (real memfd pool, real policy): visibility, dedup, leases, eviction, reclaim."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import numpy as np
import pytest

from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import AllocStatus, KVEngine, QueryPurpose
from pegaflow.server.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from pegaflow.server.store.namespace import KvLayout
from pegaflow.server.testing import held_elsewhere, wait_for

BLOCK = 256 * 1024


def layout(**kw) -> KvLayout:
    base = dict(model_id="m", block_bytes=BLOCK, dtype="bf16", tp_size=1, tp_rank=0)
    base.update(kw)
    return KvLayout(**base)


@pytest.fixture
def engine():
    eng = KVEngine(ServerConfig(pool_size_bytes=32 * MIB, http_addr=None, slab_bytes=4 * MIB))
    yield eng
    eng.close()


def hashes(n: int, tag: str = "h") -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def save(eng: KVEngine, sid: str, iid: str, hs: list[bytes], fill: int | None = None) -> list[int]:
    """Saves in batches of 64 (a session may hold at most half the pool unsealed: see the quota test)."""
    statuses = []
    for lo in range(0, len(hs), 64):
        res = eng.allocate_blocks(sid, iid, hs[lo : lo + 64])
        view = eng.pool_view()
        for i, loc in enumerate(res.locations, start=lo):
            if loc is not None:
                view[loc.offset : loc.offset + loc.length] = (fill if fill is not None else i) % 251
        if res.save_id:
            eng.seal_blocks(sid, res.save_id)
        statuses += res.statuses
    return statuses


def test_unsealed_blocks_are_invisible_and_sealed_ones_are_hits(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    res = engine.allocate_blocks(sid, iid, hashes(4))
    assert res.statuses == [AllocStatus.GRANTED] * 4
    assert engine.query_prefix(sid, iid, hashes(4)).num_hits == 0
    assert engine.seal_blocks(sid, res.save_id, hashes(4)[:2]) == 2
    assert engine.query_prefix(sid, iid, hashes(4)).num_hits == 2
    engine.seal_blocks(sid, res.save_id)
    hit = engine.query_prefix(sid, iid, hashes(4) + [b"absent"] + hashes(1))
    assert hit.num_hits == 4 and hit.lease_id == ""


def test_duplicate_saves_dedupe(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    first = engine.allocate_blocks(sid, iid, hashes(3))
    second = engine.allocate_blocks(sid, iid, hashes(3) + [b"new", b"new"])
    assert second.statuses == [AllocStatus.IN_PROGRESS] * 3 + [AllocStatus.GRANTED, AllocStatus.IN_PROGRESS]
    engine.seal_blocks(sid, first.save_id)
    third = engine.allocate_blocks(sid, iid, hashes(3))
    assert third.statuses == [AllocStatus.EXISTS] * 3 and third.save_id == ""


def test_abort_frees_everything_and_leaves_nothing_visible(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    res = engine.allocate_blocks(sid, iid, hashes(20))
    assert engine.stats().pool_used_bytes == 20 * BLOCK
    assert engine.abort_blocks(sid, res.save_id) == 20
    stats = engine.stats()
    assert stats.pool_used_bytes == 0 and stats.writing_blocks == 0 and stats.free_slabs == stats.total_slabs
    assert engine.query_prefix(sid, iid, hashes(20)).num_hits == 0
    with pytest.raises(NotFound):
        engine.seal_blocks(sid, res.save_id)


def test_namespaces_isolate_and_mla_shares_across_ranks(engine):
    sid = engine.open_session("t").session_id
    rank0 = engine.register_instance(sid, layout(tp_size=2, tp_rank=0))
    rank1 = engine.register_instance(sid, layout(tp_size=2, tp_rank=1))
    other_model = engine.register_instance(sid, layout(tp_size=2, tp_rank=0, model_id="other"))
    same_as_rank0 = engine.register_instance(sid, layout(tp_size=2, tp_rank=0))
    assert rank0.namespace_id != rank1.namespace_id != other_model.namespace_id
    assert same_as_rank0.namespace_id == rank0.namespace_id
    save(engine, sid, rank0.instance_id, hashes(5))
    assert engine.query_prefix(sid, same_as_rank0.instance_id, hashes(5)).num_hits == 5
    assert engine.query_prefix(sid, rank1.instance_id, hashes(5)).num_hits == 0
    assert engine.query_prefix(sid, other_model.instance_id, hashes(5)).num_hits == 0

    mla0 = engine.register_instance(sid, layout(tp_size=2, tp_rank=0, mla=True))
    mla1 = engine.register_instance(sid, layout(tp_size=2, tp_rank=1, mla=True))
    assert mla0.namespace_id == mla1.namespace_id
    save(engine, sid, mla0.instance_id, hashes(5, "mla"))
    assert engine.query_prefix(sid, mla1.instance_id, hashes(5, "mla")).num_hits == 5
    statuses = engine.allocate_blocks(sid, mla1.instance_id, hashes(5, "mla")).statuses
    assert statuses == [AllocStatus.EXISTS] * 5  # stored once for both ranks


def test_eviction_under_pressure_never_touches_leased_blocks(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    capacity_blocks = engine.allocator.total_slabs * (engine.allocator.slab_bytes // BLOCK)
    save(engine, sid, iid, hashes(16, "pinned"), fill=7)
    hit = engine.query_prefix(sid, iid, hashes(16, "pinned"), lease=True)
    assert hit.num_hits == 16 and hit.lease_id
    for round_ in range(4):  # write 4x the pool through it
        save(engine, sid, iid, hashes(capacity_blocks, f"churn{round_}"))
    stats = engine.stats()
    assert stats.evictions > 0 and stats.pinned_blocks == 16
    assert engine.query_prefix(sid, iid, hashes(16, "pinned")).num_hits == 16
    view = engine.pool_view()
    for loc in hit.locations:
        assert np.all(view[loc.offset : loc.offset + loc.length] == 7)
    engine.release_lease(sid, hit.lease_id)
    save(engine, sid, iid, hashes(capacity_blocks, "final"))
    assert engine.query_prefix(sid, iid, hashes(16, "pinned")).num_hits == 0


def test_pool_full_of_pinned_blocks_answers_no_space(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    other = engine.open_session("other").session_id  # one session may pin only half of the pool
    other_iid = engine.register_instance(other, layout()).instance_id
    capacity_blocks = engine.allocator.total_slabs * (engine.allocator.slab_bytes // BLOCK)
    half = capacity_blocks // 2
    save(engine, sid, iid, hashes(capacity_blocks))
    engine.query_prefix(sid, iid, hashes(capacity_blocks)[:half], lease=True)
    engine.query_prefix(other, other_iid, hashes(capacity_blocks)[half:], lease=True)
    res = engine.allocate_blocks(sid, iid, hashes(3, "more"))
    assert res.statuses == [AllocStatus.NO_SPACE] * 3 and res.save_id == ""


def test_one_size_cannot_starve_another(engine):
    sid = engine.open_session("t").session_id
    small = engine.register_instance(sid, layout(block_bytes=256 * 1024)).instance_id
    big_ns = engine.register_instance(sid, layout(block_bytes=2 * MIB, model_id="big"))
    total_small = engine.allocator.total_slabs * 16
    save(engine, sid, small, hashes(total_small, "s"))  # fills the whole pool with 256 KiB slabs
    assert engine.stats().free_slabs == 0
    statuses = save(engine, sid, big_ns.instance_id, hashes(8, "b"))
    assert statuses == [AllocStatus.GRANTED] * 8
    assert engine.query_prefix(sid, big_ns.instance_id, hashes(8, "b")).num_hits == 8
    stats = engine.stats()
    by_ns = {ns.namespace_id: ns.resident_blocks for ns in stats.namespaces}
    assert by_ns[big_ns.namespace_id] == 8
    assert stats.pool_used_bytes == stats.pool_capacity_bytes  # 8 x 2 MiB took exactly 64 small blocks' room
    # and back: the small size gets room again once big blocks are the coldest
    statuses = save(engine, sid, small, hashes(total_small, "s2"))
    assert statuses == [AllocStatus.GRANTED] * total_small


def test_slab_moves_when_the_coldest_blocks_are_spread_over_slabs(engine):
    sid = engine.open_session("t").session_id
    small = engine.register_instance(sid, layout(block_bytes=256 * 1024)).instance_id
    big = engine.register_instance(sid, layout(block_bytes=2 * MIB, model_id="big")).instance_id
    hs = hashes(engine.allocator.total_slabs * 16, "s")  # slab k holds hs[16k : 16k+16]
    save(engine, sid, small, hs)
    for i, h in enumerate(hs):
        if i % 16 >= 2:
            engine.query_prefix(sid, small, [h])  # a hit: recently used
    # The 16 coldest blocks are 2 in every slab: evicting them frees no slab, so a whole slab must move.
    assert save(engine, sid, big, hashes(1, "b")) == [AllocStatus.GRANTED]
    stats = engine.stats()
    assert stats.slab_moves == 1
    assert stats.evictions == 16 + 14  # the 16 coldest, then the 14 left in the slab that moved
    assert (
        stats.stranded_bytes == 7 * 2 * 256 * 1024 + 2 * MIB
    )  # 2 free slots in 7 small slabs + 1 in the big slab


def test_session_end_reclaims_leases_and_unsealed_blocks_but_keeps_sealed(engine):
    a = engine.open_session("a").session_id
    b = engine.open_session("b").session_id
    iid_a = engine.register_instance(a, layout()).instance_id
    iid_b = engine.register_instance(b, layout()).instance_id  # the same namespace
    save(engine, a, iid_a, hashes(4, "sealed"))
    engine.query_prefix(a, iid_a, hashes(4, "sealed"), lease=True)
    engine.allocate_blocks(a, iid_a, hashes(6, "half"))
    assert engine.stats().pinned_blocks == 4 and engine.stats().writing_blocks == 6
    engine.close_session(a)
    stats = engine.stats()
    assert stats.pinned_blocks == 0 and stats.writing_blocks == 0 and stats.live_leases == 0
    assert stats.pool_used_bytes == 4 * BLOCK
    assert engine.query_prefix(b, iid_b, hashes(4, "sealed")).num_hits == 4
    with pytest.raises(NotFound) as info:
        engine.query_prefix(a, iid_a, hashes(1))
    assert info.value.kind == "session"


def test_ids_work_only_from_the_session_that_created_them(engine):
    """Review finding F9: another session's instance, lease or save is NOT_FOUND, as if unknown."""
    owner = engine.open_session("owner").session_id
    other = engine.open_session("other").session_id
    iid = engine.register_instance(owner, layout()).instance_id
    save(engine, owner, iid, hashes(2, "x"))
    lease = engine.query_prefix(owner, iid, hashes(2, "x"), lease=True).lease_id
    pending = engine.allocate_blocks(owner, iid, hashes(2, "y")).save_id
    for call, kind in (
        (lambda: engine.query_prefix(other, iid, hashes(1, "x")), "instance"),
        (lambda: engine.allocate_blocks(other, iid, hashes(1, "z")), "instance"),
        (lambda: engine.unregister_instance(other, iid), "instance"),
        (lambda: engine.release_lease(other, lease), "lease"),
        (lambda: engine.seal_blocks(other, pending), "save"),
        (lambda: engine.abort_blocks(other, pending), "save"),
    ):
        with pytest.raises(NotFound) as info:
            call()
        assert info.value.kind == kind
    # nothing happened to the owner's state: its lease, save and instance still work
    assert engine.stats().live_leases == 1 and engine.stats().writing_blocks == 2
    engine.release_lease(owner, lease)
    assert engine.seal_blocks(owner, pending) == 2
    assert engine.query_prefix(owner, iid, hashes(2, "y")).num_hits == 2


def test_a_trusted_in_process_session_acts_on_other_sessions_instances(engine):
    """The server's own GPU data path saves and loads for a worker's instance."""
    worker = engine.open_session("worker").session_id
    datapath = engine.open_session("datapath", expires=False, trusted=True).session_id
    iid = engine.register_instance(worker, layout()).instance_id
    save(engine, datapath, iid, hashes(3, "g"))
    assert engine.query_prefix(worker, iid, hashes(3, "g")).num_hits == 3


def test_silent_session_expires_and_lease_and_write_timeouts_apply():
    eng = KVEngine(
        ServerConfig(
            pool_size_bytes=16 * MIB,
            http_addr=None,
            session_ttl_s=5.0,
            write_timeout_s=10.0,
            reaper_interval_s=3600,
        )
    )
    try:
        keep = eng.open_session("keep", expires=False).session_id
        quiet = eng.open_session("quiet").session_id
        iid = eng.register_instance(keep, layout()).instance_id
        quiet_iid = eng.register_instance(quiet, layout()).instance_id
        save(eng, keep, iid, hashes(2))
        lease = eng.query_prefix(keep, iid, hashes(2), lease=True, lease_ttl_s=1.0).lease_id
        pending = eng.allocate_blocks(keep, iid, hashes(3, "w")).save_id
        eng.query_prefix(quiet, quiet_iid, hashes(2), lease=True)
        now = time.monotonic()
        eng.reap(now + 2.0)  # lease ttl passed
        with pytest.raises(NotFound):
            eng.release_lease(keep, lease)
        assert eng.stats().live_sessions == 2
        eng.reap(now + 6.0)  # quiet session silent past its ttl; keep does not expire
        assert eng.stats().live_sessions == 1 and eng.stats().pinned_blocks == 0
        eng.reap(now + 11.0)  # write timeout
        with pytest.raises(NotFound):
            eng.seal_blocks(keep, pending)
        assert eng.stats().writing_blocks == 0
        assert eng.counters.expired_leases == 1 and eng.counters.timed_out_saves == 1
    finally:
        eng.close()


def test_bad_inputs_raise_typed_errors(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    with pytest.raises(InvalidArgument):
        engine.register_instance(sid, layout(block_bytes=engine.allocator.max_block_bytes + 1))
    with pytest.raises(InvalidArgument):
        engine.register_instance(sid, layout(tp_size=2, tp_rank=2))
    with pytest.raises(InvalidArgument):
        engine.query_prefix(sid, iid, [b"x" * 65])
    with pytest.raises(InvalidArgument):
        engine.allocate_blocks(sid, iid, [b"x"] * (engine.config.max_batch_blocks + 1))
    with pytest.raises(NotFound):
        engine.query_prefix(sid, "i-unknown", [b"x"])
    with pytest.raises(NotFound):
        engine.release_lease(sid, "l-unknown")
    res = engine.allocate_blocks(sid, iid, [b"a"])
    with pytest.raises(InvalidArgument):
        engine.seal_blocks(sid, res.save_id, [b"not-granted"])


def test_calls_honour_their_deadline_when_the_engine_is_busy(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    held = threading.Event()
    release = threading.Event()

    def hog():
        with engine._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hog)
    t.start()
    try:
        held.wait(5)
        # The lock is held until release is set: only honouring the deadline can end this call.
        with pytest.raises(DeadlineExceeded):
            engine.query_prefix(sid, iid, [b"x"], deadline=time.monotonic() + 0.2)
        assert not release.is_set()
    finally:
        release.set()
        t.join()


def test_session_listeners_hear_every_end_outside_the_lock(engine):
    heard: list[tuple[str, int]] = []
    # Re-entering the engine from a listener only works outside its lock (else: DeadlineExceeded).
    engine.add_session_listener(
        lambda sid: heard.append((sid, engine.stats(deadline=time.monotonic() + 5).live_sessions))
    )
    closed = engine.open_session("closed").session_id
    dropped = engine.open_session("dropped").session_id
    silent = engine.open_session("silent").session_id
    engine.close_session(closed)
    engine.attach_session(dropped)
    engine.detach_session(dropped)  # its pool connection closed
    engine.reap(time.monotonic() + engine.config.session_ttl_s + 1)
    assert heard == [(closed, 2), (dropped, 1), (silent, 0)]


class LockPassedOn:
    """A lock that another thread takes, and holds for ``seconds``, the moment ``thread`` lets go of
    it: a caller that was waiting for the engine lock (a reserve slice, a transfer's completion)."""

    def __init__(self, lock, thread: threading.Thread, seconds: float):
        self.lock, self.thread, self.seconds = lock, thread, seconds
        self.holder: threading.Thread | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()
        if self.holder is None and threading.current_thread() is self.thread:
            taken = threading.Event()

            def hold() -> None:
                with self.lock:
                    taken.set()
                    time.sleep(self.seconds)

            self.holder = threading.Thread(target=hold, name="passed-on")
            self.holder.start()
            assert taken.wait(5)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def test_close_session_tells_the_listeners_without_waiting_for_the_lock_again(engine):
    """CloseSession takes the engine lock once, by its deadline: the sessions it ended are taken for
    the listeners in that same hold, not by waiting for the lock again (with no deadline) after it."""
    heard: list[str] = []
    engine.add_session_listener(heard.append)  # as the runtime adds the GPU data path's
    sid = engine.open_session("t").session_id
    real = engine._lock
    engine._lock = passed_on = LockPassedOn(real, threading.current_thread(), 2.0)
    try:
        started = time.monotonic()
        engine.close_session(sid, deadline=started + 0.5)
        assert time.monotonic() - started < 0.5  # not the other holder's 2 s
        assert heard == [sid]
    finally:
        engine._lock = real
        if passed_on.holder is not None:
            passed_on.holder.join()


def test_a_close_that_cannot_take_the_lock_by_its_deadline_is_finished_by_the_reaper():
    """CloseSession waits for the engine lock until its deadline only, and the close is not lost: the
    reaper ends the session once the lock is free (leases released, unsealed blocks freed, listeners
    told), exactly once: a retry finds it ended, another pass of the reaper does nothing."""
    # A TTL no wait here comes near: only the close can end the session.
    config = ServerConfig(pool_size_bytes=32 * MIB, http_addr=None, slab_bytes=4 * MIB, session_ttl_s=60)
    with contextlib.closing(KVEngine(config)) as engine:
        heard: list[str] = []
        engine.add_session_listener(heard.append)
        sid = engine.open_session("t").session_id
        iid = engine.register_instance(sid, layout()).instance_id
        save(engine, sid, iid, hashes(2))
        assert engine.query_prefix(sid, iid, hashes(2), lease=True).num_hits == 2
        assert engine.allocate_blocks(sid, iid, hashes(3, "unsealed")).save_id
        assert engine.stats().pinned_blocks == 2 and engine.stats().open_saves == 1
        with held_elsewhere(engine._lock, 1.0):  # a slow holder: a starved thread
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                engine.close_session(sid, deadline=started + 0.2)
            assert time.monotonic() - started < 0.8
        wait_for(lambda: heard == [sid], 5, what="the reaper ending the session")
        with pytest.raises(NotFound):  # the client's retry finds it ended
            engine.close_session(sid, deadline=time.monotonic() + 5)
        engine.reap()  # another pass: nothing is done twice
        with pytest.raises(NotFound):
            engine.heartbeat(sid)
        stats = engine.stats()
        assert heard == [sid] and stats.sessions_closed == 1 and stats.live_sessions == 0
        assert stats.pinned_blocks == 0 and stats.open_saves == 0 and stats.pool_used_bytes == 2 * BLOCK


def test_a_save_or_lease_given_up_before_it_was_served_is_refused(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    # The client timed out and aborted before the server got to its AllocateBlocks.
    with pytest.raises(NotFound):
        engine.abort_blocks(sid, "w-late")
    with pytest.raises(DeadlineExceeded):
        engine.allocate_blocks(sid, iid, hashes(2), save_id="w-late")
    assert engine.stats().writing_blocks == 0
    res = engine.allocate_blocks(sid, iid, hashes(2), save_id="w-mine")
    assert res.save_id == "w-mine"
    with pytest.raises(FailedPrecondition):
        engine.allocate_blocks(sid, iid, hashes(2, "x"), save_id="w-mine")
    engine.seal_blocks(sid, "w-mine")
    with pytest.raises(NotFound):
        engine.release_lease(sid, "l-late")
    with pytest.raises(DeadlineExceeded):
        engine.query_prefix(sid, iid, hashes(2), lease=True, lease_id="l-late")
    assert engine.stats().pinned_blocks == 0
    assert engine.query_prefix(sid, iid, hashes(2), lease=True, lease_id="l-mine").lease_id == "l-mine"


def test_tombstones_expire_and_are_bounded():
    from pegaflow.server.clients.tombstones import Tombstones

    t = Tombstones(ttl_s=10.0, capacity=3)
    for i, ident in enumerate("abcd"):
        t.add(ident, now=float(i))
    assert "a" not in t and {"b", "c", "d"} <= {x for x in "abcd" if x in t}
    t.prune(now=12.5)  # b was added at 1.0, c at 2.0: both past 10 s
    assert "b" not in t and "c" not in t and "d" in t and len(t) == 1


def test_one_session_cannot_pile_up_instances_or_leases_without_bound():
    from pegaflow.server.errors import ResourceExhausted

    eng = KVEngine(
        ServerConfig(
            pool_size_bytes=16 * MIB, http_addr=None, max_instances_per_session=2, max_leases_per_session=2
        )
    )
    try:
        sid = eng.open_session("greedy").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        eng.register_instance(sid, layout())
        with pytest.raises(ResourceExhausted):
            eng.register_instance(sid, layout())
        save(eng, sid, iid, hashes(1))
        for _ in range(2):
            eng.query_prefix(sid, iid, hashes(1), lease=True)
        with pytest.raises(ResourceExhausted):
            eng.query_prefix(sid, iid, hashes(1), lease=True)
        assert eng.query_prefix(sid, iid, hashes(1)).num_hits == 1  # plain queries still work
        assert eng.stats().pinned_blocks == 1
    finally:
        eng.close()


# ------------------------------------------------------------ requests vs loads


def test_a_lookup_then_loads_by_every_rank_count_each_block_once():
    eng = KVEngine(
        ServerConfig(pool_size_bytes=32 * MIB, http_addr=None, slab_bytes=4 * MIB, enable_lfu_admission=True)
    )
    try:
        sid = eng.open_session("t").session_id
        iid = eng.register_instance(sid, layout()).instance_id
        ns = eng._registry.instances[iid].namespace.index
        stored = hashes(6)
        save(eng, sid, iid, stored)
        # The scheduler asks once for the whole prompt; then two worker ranks lease what it found.
        assert eng.query_prefix(sid, iid, stored + [b"absent"]).num_hits == 6
        for _ in range(2):
            hit = eng.query_prefix(sid, iid, stored, lease=True, purpose=QueryPurpose.LOAD)
            assert hit.num_hits == 6
            eng.release_lease(sid, hit.lease_id)
        stats = eng.stats()
        assert (stats.hits, stats.misses) == (6, 1)
        c = eng.counters
        assert (c.lookup_queries, c.load_queries, c.load_missed_blocks) == (1, 2, 0)
        assert [eng.policy.frequency((ns, h)) for h in stored] == [1] * 6  # the lookup alone
        # A block gone between the lookup and the load is a load miss, not a request miss.
        assert eng.query_prefix(sid, iid, stored + [b"absent"], purpose=QueryPurpose.LOAD).num_hits == 6
        assert eng.counters.load_missed_blocks == 1 and eng.stats().misses == 1
        eng.query_prefix(sid, iid, stored)  # a second request is a second use
        assert [eng.policy.frequency((ns, h)) for h in stored] == [2] * 6
    finally:
        eng.close()


def test_a_chain_queried_in_parts_is_accounted_as_one_query(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    save(engine, sid, iid, hashes(5))
    chain = hashes(8)
    for lo, hi in ((0, 2), (2, 8)):  # as the GPU data path queries in chunks
        engine.query_prefix(sid, iid, chain[lo:hi], account=False)
    assert engine.stats().hits == 0 and engine.counters.lookup_queries == 0
    engine.account_query(sid, iid, chain, 5, QueryPurpose.LOOKUP)
    stats = engine.stats()
    assert (stats.hits, stats.misses, engine.counters.lookup_queries) == (5, 3, 1)
    with pytest.raises(InvalidArgument):
        engine.account_query(sid, iid, chain, 9, QueryPurpose.LOOKUP)


# ------------------------------------------------------------ chain-aware recency


def capacity_of(eng: KVEngine) -> int:
    return eng.allocator.total_slabs * (eng.allocator.slab_bytes // BLOCK)


@pytest.mark.parametrize("resend_head", [True, False])
def test_a_full_pool_evicts_a_continuation_before_the_shared_head_it_extends(engine, resend_head):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    capacity = capacity_of(engine)
    head, continuation = hashes(8, "system-prompt"), hashes(8, "turn")
    save(engine, sid, iid, head)  # an earlier request stored the shared head
    save(engine, sid, iid, hashes(capacity - 8, "filler"))  # the pool is full
    # A request finds the head (lookup, then its worker leases and loads it) ...
    assert engine.query_prefix(sid, iid, head + continuation).num_hits == 8
    hit = engine.query_prefix(sid, iid, head, lease=True, purpose=QueryPurpose.LOAD)
    engine.release_lease(sid, hit.lease_id)
    # ... computes its continuation and saves it: with the loaded head (EXISTS), or without.
    statuses = save(engine, sid, iid, (head if resend_head else []) + continuation)
    assert statuses == [AllocStatus.EXISTS] * (8 if resend_head else 0) + [AllocStatus.GRANTED] * 8
    # Pressure: every filler goes, then 4 blocks of the chain.
    save(engine, sid, iid, hashes(capacity - 16 + 4, "pressure"))
    stored = engine.query_prefix(sid, iid, head + continuation).num_hits
    if resend_head:
        assert stored == 12  # the continuation lost its tail; the head it depends on is intact
    else:
        assert stored == 4  # the head, touched before its continuation was inserted, went first


def test_a_save_with_nothing_to_write_still_restates_its_chain(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    capacity = capacity_of(engine)
    chain = hashes(8, "chain")
    save(engine, sid, iid, chain)
    save(engine, sid, iid, hashes(capacity - 8, "filler"))  # the chain is now the coldest
    res = engine.allocate_blocks(sid, iid, chain)  # e.g. a request that found all of it stored
    assert res.statuses == [AllocStatus.EXISTS] * 8 and res.save_id == ""
    save(engine, sid, iid, hashes(8, "pressure"))
    assert engine.query_prefix(sid, iid, chain).num_hits == 8  # fillers went instead


def test_a_chain_saved_in_parts_is_restated_head_first(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    capacity = capacity_of(engine)
    chain = hashes(12, "chain")
    save(engine, sid, iid, hashes(capacity - 12, "filler"))
    save(engine, sid, iid, chain[:4])  # as the GPU data path saves in chunks, head first ...
    save(engine, sid, iid, chain[4:])  # ... leaving the tail more recent than the head
    engine.refresh_chain(sid, iid, chain)
    save(engine, sid, iid, hashes(capacity - 12 + 3, "pressure"))
    assert engine.query_prefix(sid, iid, chain).num_hits == 9


def test_a_seal_tells_the_policy_its_chain_tail_first_in_one_order(engine):
    # Stored head refreshed, new tail inserted, a hash named twice: inserted where first met from the
    # tail, refreshed where met again (after new-1, before new-0). The eviction order (coldest first)
    # shows what the policy heard, in one order: the inserts and refreshes interleaved as met.
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    head, other = hashes(3, "head"), hashes(2, "other")
    save(engine, sid, iid, head)
    save(engine, sid, iid, other)
    chain = [*head, b"new-0", b"twice", b"new-1", b"twice"]
    res = engine.allocate_blocks(sid, iid, chain)
    assert res.statuses == [AllocStatus.EXISTS] * 3 + [AllocStatus.GRANTED] * 3 + [AllocStatus.IN_PROGRESS]
    engine.seal_blocks(sid, res.save_id)
    order = [key[1] for key in engine._store.policy.next_victims(100, lambda _key: False)]
    assert order == [*reversed(other), b"new-1", b"twice", b"new-0", *reversed(head)]


def test_a_save_never_evicts_its_own_stored_head_to_make_room_for_its_tail(engine):
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    capacity = capacity_of(engine)
    head, continuation = hashes(8, "head"), hashes(8, "tail")
    save(engine, sid, iid, head)
    save(engine, sid, iid, hashes(capacity - 8, "filler"))  # the head is now the coldest
    statuses = save(engine, sid, iid, head + continuation)
    assert statuses == [AllocStatus.EXISTS] * 8 + [AllocStatus.GRANTED] * 8
    assert engine.query_prefix(sid, iid, head + continuation).num_hits == 16  # fillers made the room


def test_idle_namespaces_are_released_and_their_series_go_with_them():
    """Review finding F7: register/unregister cycles with fresh layouts must not grow state forever."""
    eng = KVEngine(
        ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, reaper_interval_s=3600, namespace_idle_s=5.0)
    )
    try:
        sid = eng.open_session("cycler", expires=False).session_id
        for i in range(200):
            iid = eng.register_instance(sid, layout(model_id=f"m{i}")).instance_id
            eng.unregister_instance(sid, iid)
        kept = eng.register_instance(sid, layout(model_id="kept")).instance_id
        stored = eng.register_instance(sid, layout(model_id="stored")).instance_id
        save(eng, sid, stored, hashes(2, "s"))
        eng.unregister_instance(sid, stored)  # no instance, but it holds blocks: kept
        assert len(eng.stats().namespaces) == 202
        now = time.monotonic()
        eng.reap(now)
        eng.reap(now + 6.0)
        assert {ns.model_id for ns in eng.stats().namespaces} == {"kept", "stored"}
        # a released layout registers again as a new namespace, under the same id
        again = eng.register_instance(sid, layout(model_id="m7"))
        assert again.namespace_id.startswith("ns-") and eng.query_prefix(sid, kept, hashes(1)).num_hits == 0
    finally:
        eng.close()


def test_the_number_of_namespaces_is_bounded():
    eng = KVEngine(ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, max_namespaces=8))
    try:
        sid = eng.open_session("t", expires=False).session_id
        for i in range(8):
            eng.register_instance(sid, layout(model_id=f"m{i}"))
        with pytest.raises(ResourceExhausted):
            eng.register_instance(sid, layout(model_id="one-too-many"))
        eng.register_instance(sid, layout(model_id="m3"))  # an existing namespace is fine
    finally:
        eng.close()


def test_a_reported_load_is_never_more_than_the_lease_holds(engine):
    """Review finding F6: an absurd loaded_bytes cannot overflow a counter or break GetStats."""
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    save(engine, sid, iid, hashes(2, "l"))
    for _ in range(2):
        lease = engine.query_prefix(sid, iid, hashes(2, "l"), lease=True).lease_id
        engine.release_lease(sid, lease, loaded_bytes=2**64 - 1)
    assert engine.stats().load_bytes == 2 * 2 * BLOCK


def test_one_session_cannot_pin_or_reserve_the_whole_pool(engine):
    """Review finding F8: a hog's leases are cut at its quota and its unsealed reservations beyond it
    are REJECTED; another session still gets room."""
    hog = engine.open_session("hog").session_id
    honest = engine.open_session("honest").session_id
    hog_iid = engine.register_instance(hog, layout()).instance_id
    honest_iid = engine.register_instance(honest, layout()).instance_id
    capacity_blocks = engine.allocator.total_slabs * (engine.allocator.slab_bytes // BLOCK)
    half = capacity_blocks // 2
    grabbed = engine.allocate_blocks(hog, hog_iid, hashes(capacity_blocks, "grab"))
    assert grabbed.statuses.count(AllocStatus.GRANTED) == half
    assert grabbed.statuses.count(AllocStatus.REJECTED) == capacity_blocks - half
    assert save(engine, honest, honest_iid, hashes(half // 2, "mine")).count(AllocStatus.GRANTED) == half // 2
    engine.abort_blocks(hog, grabbed.save_id)
    save(engine, hog, hog_iid, hashes(capacity_blocks - half // 2, "stored"))
    lease = engine.query_prefix(hog, hog_iid, hashes(capacity_blocks, "stored"), lease=True)
    assert lease.num_hits == half  # cut at the quota
    with pytest.raises(ResourceExhausted):
        engine.query_prefix(hog, hog_iid, hashes(4, "mine"), lease=True)
    assert engine.stats().quota_refusals >= 3
    # the pool's other half is still evictable: the honest session saves and finds its blocks
    assert save(engine, honest, honest_iid, hashes(half // 2, "more")).count(AllocStatus.GRANTED) == half // 2
    engine.release_lease(hog, lease.lease_id)
    assert engine.query_prefix(hog, hog_iid, hashes(4, "stored"), lease=True).num_hits == 4


def engine_full_of_victim_bytes(model_id: str) -> tuple[KVEngine, str, str, str]:
    """An 8 MiB pool full of namespace "victim"'s blocks, every byte 0xAB: (engine, session, the
    victim's instance, an instance of ``model_id``)."""
    eng = KVEngine(ServerConfig(pool_size_bytes=8 * MIB, http_addr=None, slab_bytes=4 * MIB))
    sid = eng.open_session("t").session_id
    victim = eng.register_instance(sid, layout(model_id="victim")).instance_id
    other = eng.register_instance(sid, layout(model_id=model_id)).instance_id
    capacity = eng.allocator.total_slabs * (eng.allocator.slab_bytes // BLOCK)
    secret = hashes(capacity, "secret")
    for lo in range(0, capacity, 8):  # a session holds at most half the pool unsealed at once
        assert save(eng, sid, victim, secret[lo : lo + 8], fill=0xAB) == [AllocStatus.GRANTED] * 8
    return eng, sid, victim, other


def test_a_slot_another_namespace_held_is_zeroed_before_it_is_granted():
    """Review finding F2: a writer that seals without writing must never expose another namespace's
    old bytes; its own namespace's slots are reused as they are (no cost in the common case)."""
    eng, sid, victim, other = engine_full_of_victim_bytes("other")
    try:
        res = eng.allocate_blocks(sid, other, hashes(8, "lazy"))  # evicts the victim's blocks
        view = eng.pool_view()
        for loc in res.locations:
            assert not view[loc.offset : loc.offset + loc.length].any()
        eng.seal_blocks(sid, res.save_id)  # sealed without writing: zeros, not the victim's bytes
        hit = eng.query_prefix(sid, other, hashes(8, "lazy"))
        assert hit.num_hits == 8 and not any(view[o : o + BLOCK].any() for o in hit.offsets)
    finally:
        eng.close()


def test_a_whole_write_grant_skips_the_memset_and_an_aborted_one_is_zeroed_for_whoever_comes_next():
    """The server's GPU copy overwrites every byte of a granted block before it seals (whole_write):
    a slot another namespace held is granted as it is (no memset on the copy's path). Sealed after
    the overwrite, it is the new namespace's; aborted (a copy that failed part-way may leave old
    bytes), it is foreign to every namespace, the old owner's included, and zeroed before its next
    grant."""
    eng, sid, victim, gpu = engine_full_of_victim_bytes("gpu")
    try:
        view = eng.pool_view()
        res = eng.allocate_blocks(sid, gpu, hashes(8, "copied"), whole_write=True)  # evicts the victim's
        assert res.statuses == [AllocStatus.GRANTED] * 8
        assert all((view[loc.offset : loc.offset + loc.length] == 0xAB).all() for loc in res.locations)
        for loc in res.locations:  # the copy: every byte
            view[loc.offset : loc.offset + loc.length] = 0x11
        eng.seal_blocks(sid, res.save_id)
        assert eng.query_prefix(sid, gpu, hashes(8, "copied")).num_hits == 8

        aborted = eng.allocate_blocks(sid, gpu, hashes(8, "failed"), whole_write=True)
        slots = {loc.offset for loc in aborted.locations}
        assert all((view[o : o + BLOCK] == 0xAB).all() for o in slots)  # the victim's, unzeroed
        for o in slots:  # a copy that failed half-way: the first half written
            view[o : o + BLOCK // 2] = 0x22
        eng.abort_blocks(sid, aborted.save_id)
        for owner in (gpu, victim):  # nobody gets those bytes back, not even the namespaces they held
            again = eng.allocate_blocks(sid, owner, hashes(16, f"lazy-{owner}"))
            for loc in again.locations:
                if loc is not None and loc.offset in slots:
                    assert not view[loc.offset : loc.offset + loc.length].any()
            assert slots & {loc.offset for loc in again.locations if loc is not None}
            eng.abort_blocks(sid, again.save_id)
            slots = {loc.offset for loc in again.locations if loc is not None} & slots
            for o in slots:  # back to "foreign to all" for the second owner's turn
                view[o : o + BLOCK] = 0x33
    finally:
        eng.close()


def test_zeroing_stops_at_the_deadline_and_no_slot_it_left_is_ever_granted_unzeroed(monkeypatch):
    """AllocateBlocks zeroes the slots another namespace held only until its deadline: then it grants
    nothing (DEADLINE_EXCEEDED, every slot of the call freed), and a slot it did not zero is foreign
    to every namespace, the allocating one included, so that its next grant zeroes it (F2)."""
    eng, sid, victim, other = engine_full_of_victim_bytes("other")
    try:
        memset = ctypes.memset

        def slow_memset(dst, c, n):  # a starved process: 0.1 s per 256 KiB slot
            time.sleep(0.1)
            return memset(dst, c, n)

        monkeypatch.setattr(ctypes, "memset", slow_memset)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            eng.allocate_blocks(sid, other, hashes(8, "lazy"), deadline=started + 0.25)
        assert time.monotonic() - started < 0.6  # not the 0.8 s of zeroing all 8
        monkeypatch.undo()
        assert eng.stats().open_saves == 0
        view = eng.pool_view()
        before = view.copy()
        again = eng.allocate_blocks(sid, other, hashes(8, "lazy"))
        assert again.statuses == [AllocStatus.GRANTED] * 8  # the first grant is gone, not IN_PROGRESS
        left = [
            loc for loc in again.locations if (before[loc.offset : loc.offset + loc.length] == 0xAB).all()
        ]
        assert left  # slots the first call granted and did not zero, granted again: zeroed this time
        for loc in again.locations:
            assert not view[loc.offset : loc.offset + loc.length].any()
    finally:
        eng.close()


@pytest.mark.parametrize("given_up_by", ["abort", "close"])
def test_a_save_being_zeroed_cannot_be_sealed_and_is_freed_by_its_own_call_once_given_up(
    monkeypatch, given_up_by
):
    """While AllocateBlocks zeroes its slots off the lock, the save (its id chosen by the client) is
    that call's: sealing it is refused (it would publish the other namespace's bytes), and an abort
    or the session's end leaves the slots to that call, which frees them once its memset is done, so
    no slot is freed under a memset still writing it, nor freed twice."""
    eng, sid, victim, other = engine_full_of_victim_bytes("other")
    zeroing, go_on = threading.Event(), threading.Event()
    memset = ctypes.memset

    def gated_memset(dst, c, n):
        zeroing.set()
        assert go_on.wait(10)
        return memset(dst, c, n)

    outcome: dict = {}

    def allocate() -> None:
        try:
            outcome["result"] = eng.allocate_blocks(sid, other, hashes(8, "lazy"), save_id="w-named")
        except Exception as exc:
            outcome["error"] = exc

    monkeypatch.setattr(ctypes, "memset", gated_memset)
    allocating = threading.Thread(target=allocate)
    allocating.start()
    try:
        assert zeroing.wait(5)
        with pytest.raises(FailedPrecondition):
            eng.seal_blocks(sid, "w-named")
        used = eng.stats().pool_used_bytes
        if given_up_by == "abort":
            assert eng.abort_blocks(sid, "w-named") == 8
        else:
            eng.close_session(sid)
        assert eng.stats().pool_used_bytes == used  # still the zeroing call's: nobody else gets them
        go_on.set()
        allocating.join(10)
        expected = DeadlineExceeded if given_up_by == "abort" else NotFound
        assert isinstance(outcome.get("error"), expected), outcome
        stats = eng.stats()
        assert stats.pool_used_bytes == used - 8 * BLOCK and stats.open_saves == 0
        assert stats.aborted_blocks == 8
    finally:
        go_on.set()
        allocating.join(10)
        eng.close()


def test_a_grant_whose_zeroing_ends_with_the_lock_busy_is_freed_by_the_reaper(monkeypatch):
    """Zeroed, the grant still needs the lock (to become the client's): busy past the deadline, the
    call answers DEADLINE_EXCEEDED at its deadline and hands the save to the reaper, which frees it."""
    eng, sid, victim, other = engine_full_of_victim_bytes("other")
    memset = ctypes.memset
    holders: list[threading.Thread] = []

    def memset_then_lock_taken(dst, c, n):
        out = memset(dst, c, n)
        if not holders:
            taken = threading.Event()

            def hold() -> None:
                with eng._lock:
                    taken.set()
                    time.sleep(1.0)

            holders.append(threading.Thread(target=hold))
            holders[0].start()
            assert taken.wait(5)
        return out

    monkeypatch.setattr(ctypes, "memset", memset_then_lock_taken)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            eng.allocate_blocks(sid, other, hashes(8, "lazy"), deadline=started + 0.3)
        assert time.monotonic() - started < 0.8
        monkeypatch.undo()
        holders[0].join()
        wait_for(lambda: eng.stats().open_saves == 0, 5, what="the reaper freeing the save")
        assert eng.allocate_blocks(sid, other, hashes(8, "lazy")).statuses == [AllocStatus.GRANTED] * 8
    finally:
        for holder in holders:
            holder.join()
        eng.close()


def test_give_up_save_never_waits_for_the_lock(engine):
    """A grant the servicer cannot deliver (its deadline passed as the call finished) is freed without
    waiting for the engine lock: at once, or by the reaper once the lock is free."""
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    res = engine.allocate_blocks(sid, iid, hashes(4))
    with held_elsewhere(engine._lock, 1.0):
        started = time.monotonic()
        engine.give_up_save(sid, res.save_id)
        assert time.monotonic() - started < 0.2
    wait_for(lambda: engine.stats().open_saves == 0, 5, what="the reaper freeing the save")
    assert engine.stats().pool_used_bytes == 0
    with pytest.raises(NotFound):
        engine.seal_blocks(sid, res.save_id)


def test_give_up_lease_never_waits_for_the_lock(engine):
    """A lease the servicer cannot deliver (its deadline passed as QueryPrefix finished) is released
    without waiting for the engine lock: at once, or by the reaper once the lock is free, not at the
    lease's TTL (its blocks pinned until then)."""
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    save(engine, sid, iid, hashes(4))
    lease = engine.query_prefix(sid, iid, hashes(4), lease=True, lease_ttl_s=600.0).lease_id
    assert lease and engine.stats().pinned_blocks == 4
    with held_elsewhere(engine._lock, 1.0):
        started = time.monotonic()
        engine.give_up_lease(sid, lease)
        assert time.monotonic() - started < 0.2
    wait_for(lambda: engine.stats().pinned_blocks == 0, 5, what="the reaper releasing the lease")
    with pytest.raises(NotFound):
        engine.release_lease(sid, lease)
    engine.give_up_lease(sid, lease)  # already ended: nothing to do, nothing raised


def test_a_slot_of_a_slab_re_cut_for_another_size_is_zeroed_before_it_is_granted():
    """Review finding F2 across a slab move: the new slots (768 KiB) straddle the old ones (1 MiB), so no
    old slot's owner names them; they are zeroed all the same, not handed out with the old bytes."""
    eng = KVEngine(ServerConfig(pool_size_bytes=8 * MIB, http_addr=None, slab_bytes=4 * MIB))
    try:
        sid = eng.open_session("t").session_id
        victim = eng.register_instance(sid, layout(model_id="victim", block_bytes=MIB)).instance_id
        other = eng.register_instance(sid, layout(model_id="other", block_bytes=768 * 1024)).instance_id
        for part in (hashes(8, "secret")[:4], hashes(8, "secret")[4:]):  # a session: half the pool at once
            assert save(eng, sid, victim, part, fill=0xAB) == [AllocStatus.GRANTED] * 4
        res = eng.allocate_blocks(sid, other, hashes(4, "lazy"))  # a slab of the victim's, re-cut
        assert res.statuses == [AllocStatus.GRANTED] * 4
        view = eng.pool_view()
        assert any(loc.offset % MIB for loc in res.locations)  # slots no old slot started at
        for loc in res.locations:
            assert not view[loc.offset : loc.offset + loc.length].any()
        eng.seal_blocks(sid, res.save_id)
    finally:
        eng.close()


def test_a_lease_pins_and_holds_each_block_once_and_its_release_lets_go_of_all(engine):
    """Leases pin a chain's blocks in one pass (BlockStore.pin / unpin): a block the chain names twice
    is pinned twice but its slab held once, and releasing every lease leaves no pin and no hold."""
    sid = engine.open_session("t").session_id
    iid = engine.register_instance(sid, layout()).instance_id
    hs = hashes(8)
    save(engine, sid, iid, hs)
    slabs = lambda: [s for s in engine.allocator._slabs if s is not None]  # noqa: E731
    assert sum(s.holds for s in slabs()) == 0
    chain = hs[:3] + hs[:3] + hs[3:]  # the first three blocks named twice
    first = engine.query_prefix(sid, iid, chain, lease=True)
    second = engine.query_prefix(sid, iid, hs[:2], lease=True)
    assert first.num_hits == 11 and second.num_hits == 2
    assert engine.stats().pinned_blocks == 8
    assert sum(s.holds for s in slabs()) == 8  # one hold per pinned block, however many pins
    engine.release_lease(sid, first.lease_id)
    assert engine.stats().pinned_blocks == 2 and sum(s.holds for s in slabs()) == 2
    engine.release_lease(sid, second.lease_id)
    assert engine.stats().pinned_blocks == 0 and sum(s.holds for s in slabs()) == 0


def test_stats_waits_for_a_read_lane_pass_only_until_its_deadline(engine):
    """stats() waits for a pass of the read lane's signals in progress (its counts belong in the
    answer), but not past the caller's deadline: a pass held up (a starved thread) costs the answer
    that pass's counts, not the call."""
    if engine.lane is None:
        pytest.skip("the read lane's native module is not available here")
    with held_elsewhere(engine._lane_drain_lock, 3.0):  # a pass of the lane's signals held up
        started = time.monotonic()
        engine.stats(deadline=started + 0.3)
        assert time.monotonic() - started < 1.5  # not the pass's 3 s
    engine.stats()  # no deadline: waits for a pass as before
