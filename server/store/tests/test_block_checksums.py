"""Checksums a writer sends with its seal: handed back with every location, and a reader's report
of a mismatch drops the block only when the server's own hash of it disagrees too (a client's word
alone drops nothing); a block other readers still hold stays until a later report."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.common.wire.checksum import checksum
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import AllocStatus, KVEngine
from pegaflow.server.errors import InvalidArgument
from pegaflow.server.store.namespace import KvLayout

BLOCK = 64 * 1024


@pytest.fixture
def engine():
    eng = KVEngine(
        ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, slab_bytes=4 * MIB, reaper_interval_s=3600)
    )
    yield eng
    eng.close()


def written(eng: KVEngine, n: int = 4, tag: str = "b"):
    sid = eng.open_session("t").session_id
    lay = KvLayout(
        model_id="m", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
        block_bytes=BLOCK, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
    )  # fmt: skip
    iid = eng.register_instance(sid, lay).instance_id
    hs = [f"{tag}-{i}".encode() for i in range(n)]
    res = eng.allocate_blocks(sid, iid, hs)
    view = eng.pool_view()
    sums = []
    for i, off in enumerate(res.offsets):
        view[off : off + BLOCK] = np.full(BLOCK, i + 1, dtype=np.uint8)
        sums.append(checksum(view[off : off + BLOCK]))
    return sid, iid, hs, res, sums


def test_checksums_sent_at_seal_come_back_with_the_locations(engine):
    sid, iid, hs, res, sums = written(engine)
    with pytest.raises(InvalidArgument, match="3 checksums for 4 blocks"):
        engine.seal_blocks(sid, res.save_id, checksums=sums[:3])
    engine.seal_blocks(sid, res.save_id, checksums=sums)
    hit = engine.query_prefix(sid, iid, hs, lease=True)
    assert hit.checksums == tuple(sums)
    assert engine.load_blocks(sid, iid, hit.lease_id).checksums == tuple(sums)


def test_a_report_drops_only_a_block_whose_bytes_really_changed(engine):
    sid, iid, hs, res, sums = written(engine)
    engine.seal_blocks(sid, res.save_id, checksums=sums)
    lease = engine.query_prefix(sid, iid, hs, lease=True).lease_id
    engine.release_lease(sid, lease, corrupt_hashes=[hs[1]])  # a false report: the bytes are fine
    assert engine.query_prefix(sid, iid, hs).num_hits == 4
    assert engine.stats().corrupt_blocks == 0
    view = engine.pool_view()
    view[res.offsets[2] + 100] ^= 0x5A  # a scribble through some client's mapping
    lease = engine.query_prefix(sid, iid, hs, lease=True).lease_id
    engine.release_lease(sid, lease, corrupt_hashes=[hs[2]])
    assert engine.query_prefix(sid, iid, hs).num_hits == 2  # dropped: a miss from there on
    assert engine.stats().corrupt_blocks == 1


def test_a_block_other_readers_hold_is_served_to_nobody_and_dropped_when_they_let_go(engine):
    sid, iid, hs, res, sums = written(engine)
    engine.seal_blocks(sid, res.save_id, checksums=sums)
    engine.pool_view()[res.offsets[0]] ^= 1
    other = engine.query_prefix(sid, iid, hs, lease=True).lease_id  # other readers hold it
    third = engine.query_prefix(sid, iid, hs, lease=True).lease_id
    mine = engine.query_prefix(sid, iid, hs, lease=True).lease_id
    engine.release_lease(sid, mine, corrupt_hashes=[hs[0]])
    assert engine.stats().corrupt_blocks == 1  # known bad, still pinned by the other leases ...
    assert engine.query_prefix(sid, iid, hs).num_hits == 0  # ... but no new query is served it
    assert engine.load_blocks(sid, iid, other).num_hits == 0  # nor the other leases' loads
    engine.release_lease(sid, other, corrupt_hashes=[hs[0]])  # the same block reported again
    assert engine.stats().corrupt_blocks == 1  # counted once: a block, not a report
    assert engine.stats().resident_blocks == 4  # the third lease still holds it
    engine.release_lease(sid, third)  # no report: the last reader's release drops it
    assert engine.stats().resident_blocks == 3
    # Saved again, it is written afresh (not EXISTS against the bad copy) and served.
    again = engine.allocate_blocks(sid, iid, hs[:1])
    assert again.statuses == [AllocStatus.GRANTED]
