"""The read lane inside the engine (in-process KVEngine, real memfd pool, real policy, the lane's
serving thread on a real socket): what the lane pins is never evicted or freed, its calls count and
refresh recency as the engine's own do, and it answers while the engine is busy."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pegaflow.client.frame_link import LocalRpcError
from pegaflow.client.read_lane import NOT_RUN, ReadLaneClient
from pegaflow.common.wire import read_lane as wire
from pegaflow.common.wire.checksum import checksum
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.errors import InvalidArgument, NotFound, ResourceExhausted
from pegaflow.server.store.namespace import KvLayout

BLOCK = 256 * 1024


class Served:
    """An engine, its lane serving on a socket, one session and instance, a lane client."""

    def __init__(self, tmp_path, **config):
        config.setdefault("pool_size_bytes", 32 * MIB)
        config.setdefault("slab_bytes", 4 * MIB)
        self.engine = KVEngine(ServerConfig(http_addr=None, **config))
        assert self.engine.lane is not None, "the read lane must build on this machine"
        path = str(tmp_path / "lane.sock")
        self.engine.lane.serve(path, self.engine.epoch)
        self.sid = self.engine.open_session("t").session_id
        self.iid = self.register(BLOCK)
        self.client = ReadLaneClient(path, self.engine.epoch, 4096)

    def register(self, block_bytes: int, sid: str | None = None) -> str:
        layout = KvLayout(model_id=f"m{block_bytes}", block_bytes=block_bytes, dtype="u8")
        return self.engine.register_instance(sid or self.sid, layout).instance_id

    def save(self, hashes, fill: int, iid: str | None = None, sums: bool = False) -> None:
        res = self.engine.allocate_blocks(self.sid, iid or self.iid, hashes)
        view = self.engine.pool_view()
        digests = []
        for loc in res.locations:
            if loc is not None:
                view[loc.offset : loc.offset + loc.length] = fill
                digests.append(checksum(view[loc.offset : loc.offset + loc.length]))
        if res.save_id:
            self.engine.seal_blocks(self.sid, res.save_id, checksums=digests if sums else ())

    def query(self, hashes, lease=True, sid=None, iid=None):
        lease_id = self.client.new_lease_id() if lease else 0
        return self.client.query(
            sid or self.sid, iid or self.iid, hashes, lease_id, None, False, time.monotonic() + 5
        )

    def release(self, hit, loaded=0, sid=None):
        return self.client.release(
            sid or self.sid, wire.parse_lease_name(hit.lease_id), loaded, time.monotonic() + 5
        )

    def present(self, key: bytes) -> bool:
        entry = self.engine._store.index.get((self.ns_index(), key))
        return entry is not None and entry.dram_ready

    def ns_index(self, iid: str | None = None) -> int:
        return self.engine.instance_namespace(self.sid, iid or self.iid).index

    def close(self) -> None:
        self.client.close()
        self.engine.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    yield s
    s.close()


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def test_a_block_a_lane_lease_reads_is_never_evicted_and_keeps_its_bytes(served):
    served.save(keys(8, "kept"), fill=7)
    hit = served.query(keys(8, "kept"))
    assert hit.num_hits == 8
    for round_ in range(4):  # four pools' worth of other saves: everything else is evicted
        for lo in range(0, 128, 32):
            served.save(keys(32, f"churn{round_}-{lo}"), fill=1)
    view = served.engine.pool_view()
    for loc in hit.locations:
        assert np.all(view[loc.offset : loc.offset + loc.length] == 7)
    assert all(served.present(k) for k in keys(8, "kept"))
    served.release(hit)
    for lo in range(0, 256, 32):
        served.save(keys(32, f"after-{lo}"), fill=2)
    assert not any(served.present(k) for k in keys(8, "kept"))  # evictable again once released


def test_a_slab_move_never_takes_a_block_a_lane_lease_reads(served):
    small = keys(128, "small")
    for lo in range(0, 128, 32):  # the pool full: 8 slabs of 16 blocks of 256 KiB
        served.save(small[lo : lo + 32], fill=5)
    # Every other block touched, so the least recent blocks are spread over all the slabs: evicting
    # them empties none, and a 1 MiB block needs a slab moved to its size.
    for k in small[::2]:
        served.query([k], lease=False)
    served.engine.stats()  # the recency of what the lane served, applied
    hit = served.query([b"small-0"])  # in the first slab, which is as empty as any
    big = served.register(1024 * 1024)
    for i in range(12):
        served.save([f"big-{i}".encode()], fill=9, iid=big)
    assert served.engine.allocator.slab_moves > 0
    view = served.engine.pool_view()
    loc = hit.locations[0]
    assert np.all(view[loc.offset : loc.offset + loc.length] == 5)
    assert served.present(b"small-0")
    served.release(hit)


def test_a_corrupt_block_a_lane_lease_reads_is_hidden_at_once_and_dropped_after_its_release(served):
    served.save([b"bad"], fill=3, sums=True)
    first, second = served.query([b"bad"]), served.query([b"bad"])
    entry = served.engine._store.index.get((served.ns_index(), b"bad"))
    served.engine.pool_view()[entry.dram] ^= 0xFF  # the bytes change under their checksum
    # The first reader reports it through the engine (the lane leaves corrupt reports to it).
    served.engine.release_lease(served.sid, first.lease_id, corrupt_hashes=[b"bad"])
    assert entry.corrupt and served.query([b"bad"], lease=False).num_hits == 0
    assert served.engine._store.index.get(entry.key) is entry  # the second reader still reads it
    slot = entry.dram
    served.release(second)
    deadline = time.monotonic() + 5
    while served.engine._store.index.get(entry.key) is not None:  # dropped by the signal thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert served.engine._store.index.at_slot(slot) is None


def test_lane_calls_count_as_the_engines_and_refresh_recency(served):
    for i in range(128):  # one block per save, oldest first: block-0 is the least recent
        served.save([f"block-{i}".encode()], fill=1)
    assert served.query(keys(8, "block") + [b"missing"], lease=False).num_hits == 8
    stats = served.engine.stats()  # applies what the lane served so far
    assert (stats.lookup_queries, stats.dram_hits, stats.misses) == (1, 8, 1)
    for lo in range(0, 16, 4):
        served.save(keys(4, f"new{lo}"), fill=2)
    # The 16 least recent blocks went, and the 8 the lane's lookup touched were not among them.
    assert all(served.present(k) for k in keys(8, "block"))
    assert not any(served.present(f"block-{i}".encode()) for i in range(8, 24))


def test_the_lane_answers_while_the_engine_lock_is_held(served):
    served.save(keys(4, "x"), fill=1)
    with served.engine._lock:
        started = time.monotonic()
        hit = served.query(keys(4, "x"))
        assert hit.num_hits == 4 and time.monotonic() - started < 1.0
        assert served.release(hit) is None


def test_the_lease_quota_is_one_over_both_lanes_and_a_session_end_releases_lane_leases(served):
    served.save(keys(64, "q"), fill=1)  # the quota: half the 32 MiB pool, 64 blocks
    held = served.engine.query_prefix(served.sid, served.iid, keys(40, "q"), lease=True)
    assert held.num_hits == 40
    assert served.query(keys(64, "q")) is NOT_RUN  # would pass the quota: the engine cuts it
    cut = served.engine.query_prefix(served.sid, served.iid, keys(64, "q"), lease=True)
    assert cut.num_hits == 24
    served.engine.release_lease(served.sid, cut.lease_id)
    hit = served.query(keys(24, "q"))
    assert hit.num_hits == 24
    with pytest.raises(ResourceExhausted):
        served.engine.query_prefix(served.sid, served.iid, keys(1, "q"), lease=True)
    served.engine.release_lease(served.sid, held.lease_id)
    assert served.query(keys(40, "q")).num_hits == 40
    assert served.engine.lane.stats()["leases"] == 2
    served.engine.close_session(served.sid)
    assert served.engine.lane.stats()["leases"] == 0
    assert served.engine.stats().pinned_blocks == 0
    assert served.query(keys(1, "q")) is NOT_RUN  # the session is gone: the engine says so


def test_a_lane_lease_released_through_the_engine_or_expired_frees_its_pins(served):
    served.save(keys(2, "r"), fill=1)
    hit = served.query(keys(2, "r"))
    served.engine.release_lease(served.sid, hit.lease_id, loaded_bytes=2 * BLOCK)
    assert served.engine.stats().load_bytes == 2 * BLOCK
    short = served.client.query(
        served.sid, served.iid, keys(2, "r"), served.client.new_lease_id(), 0.2, False, time.monotonic() + 5
    )
    assert served.engine.stats().live_leases == 1
    time.sleep(0.25)
    served.engine.reap()
    stats = served.engine.stats()
    assert stats.live_leases == 0 and stats.expired_leases == 1
    assert short.num_hits == 2


def test_many_threads_query_and_evict_at_once_and_no_leased_byte_changes(served):
    """Lane queries pin without the engine lock while saves evict under it: whatever a lease got
    stays the block it named until released."""
    served.save(keys(32, "hot"), fill=4)  # two readers' leases of 32 blocks: within the quota of 64
    stop = threading.Event()
    errors: list[str] = []

    def reader():
        client = ReadLaneClient(served.client._link.path, served.engine.epoch, 4096)
        view = served.engine.pool_view()
        try:
            while not stop.is_set():
                hit = client.query(
                    served.sid,
                    served.iid,
                    keys(32, "hot"),
                    client.new_lease_id(),
                    None,
                    False,
                    time.monotonic() + 5,
                )
                for loc in hit.locations:
                    if not np.all(view[loc.offset : loc.offset + loc.length] == 4):
                        errors.append(f"changed under a lease at {loc.offset}")
                if hit.lease_id:
                    client.release(served.sid, wire.parse_lease_name(hit.lease_id), 0, time.monotonic() + 5)
        except Exception as exc:  # noqa: BLE001 - any failure of a reader fails the test
            errors.append(repr(exc))
        finally:
            client.close()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for round_ in range(6):
            for lo in range(0, 128, 32):
                served.save(keys(32, f"evict{round_}-{lo}"), fill=8)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


def test_evicting_a_block_a_lane_lease_took_after_the_policy_chose_it_is_refused(served):
    """The race the policy's skip cannot see (a lane lease pins without the engine lock): the lane's
    unpublish is the one atomic check, and the store keeps the block."""
    served.save([b"raced"], fill=6)
    hit = served.query([b"raced"])
    entry = served.engine._store.index.get((served.ns_index(), b"raced"))
    with served.engine._lock:
        assert served.engine._store._evict_dram(entry) is False
    assert served.present(b"raced") and served.query([b"raced"], lease=False).num_hits == 1
    served.release(hit)
    with served.engine._lock:
        assert served.engine._store._evict_dram(entry) is True
    assert not served.present(b"raced") and served.query([b"raced"], lease=False).num_hits == 0


def test_a_pool_all_pinned_by_lane_leases_refuses_a_save_at_once(tmp_path):
    """Every victim the policy offers is refused by the lane: the allocation must end (NO_SPACE), not
    go round the recency order for ever under the engine lock."""
    served = Served(tmp_path, session_leased_fraction=1.0)  # one session may pin the whole pool
    try:
        for lo in range(0, 128, 32):
            served.save(keys(32, f"all{lo}"), fill=1)
        hits = [served.query(keys(32, f"all{lo}")) for lo in range(0, 128, 32)]
        assert sum(h.num_hits for h in hits) == 128
        started = time.monotonic()
        res = served.engine.allocate_blocks(served.sid, served.iid, keys(8, "new"))
        assert time.monotonic() - started < 2.0
        assert [s.name for s in res.statuses] == ["NO_SPACE"] * 8
        for hit in hits:
            served.release(hit)
        res = served.engine.allocate_blocks(served.sid, served.iid, keys(8, "after"))
        assert [s.name for s in res.statuses] == ["GRANTED"] * 8
    finally:
        served.close()


def test_load_blocks_of_a_lane_lease_answers_its_blocks_for_its_own_namespace_only(served):
    served.save(keys(4, "lb"), fill=1)
    hit = served.query(keys(4, "lb"))
    res = served.engine.load_blocks(served.sid, served.iid, hit.lease_id)
    assert res.num_hits == 4 and res.offsets == [loc.offset for loc in hit.locations]
    other = served.register(512 * 1024)  # another layout: another namespace
    with pytest.raises(InvalidArgument):
        served.engine.load_blocks(served.sid, other, hit.lease_id)
    served.release(hit)
    with pytest.raises(NotFound):
        served.engine.load_blocks(served.sid, served.iid, hit.lease_id)


def test_another_session_can_neither_release_nor_load_a_lane_lease(served):
    """Lease ids are bound to the session that took them: another local client that learns one gets
    NOT_FOUND on the lane and through the engine, and the lease keeps pinning its blocks."""
    served.save(keys(2, "mine"), fill=1)
    hit = served.query(keys(2, "mine"))
    other = served.engine.open_session("other").session_id
    other_iid = served.register(BLOCK, sid=other)
    with pytest.raises(LocalRpcError) as err:
        served.client.release(other, wire.parse_lease_name(hit.lease_id), 0, time.monotonic() + 5)
    assert err.value.code().name == "NOT_FOUND"
    with pytest.raises(NotFound):
        served.engine.release_lease(other, hit.lease_id)
    with pytest.raises(NotFound):
        served.engine.load_blocks(other, other_iid, hit.lease_id)
    assert served.engine.lane.pinned((served.ns_index(), b"mine-0"))
    assert served.release(hit) is None
