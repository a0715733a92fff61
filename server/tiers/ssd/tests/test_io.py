"""SsdTier reads and writes on real O_DIRECT files, the same behaviour on both engines."""

from __future__ import annotations

import time

import pytest

from pegaflow.server.tiers.base import (
    Extent,
    IoStatus,
    ReadRequest,
    TierFull,
    TierHealth,
    WriteRequest,
    io_bytes,
)
from pegaflow.server.tiers.ssd.config import MIB
from pegaflow.server.tiers.ssd.tests.support import (
    Arena,
    engines,
    flip_byte,
    open_tier,
    read,
    wait_for,
    write,
)

pytestmark = pytest.mark.parametrize("engine", engines())

SIZES = [1, 100, 4095, 4096, 4097, 65_536, 100_003, 262_144, 333_333]


def test_write_then_read_is_byte_identical_for_many_sizes(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 16 * MIB, engine)
    try:
        for size in SIZES:
            arena = Arena(size, 6)
            tags = [f"{size}/{i}".encode() for i in range(6)]
            ext = tier.allocate(size, 6)
            assert len(ext) == 6
            assert write(tier, arena, ext, tags) == [IoStatus.OK] * 6
            assert read(tier, arena, ext, tags) == [IoStatus.OK] * 6
            assert all(arena.holds(i, t) for i, t in enumerate(tags)), size
            tier.free(ext)
            arena.close()
        s = tier.stats()
        assert s.writes == s.reads == 6 * len(SIZES)
        assert s.write_bytes == s.read_bytes == 6 * sum(SIZES)
        assert s.corrupt_records == s.read_errors == s.write_errors == 0
        assert s.used_bytes == 0 and s.queue_depth == 0
    finally:
        tier.close()


def test_blocks_stripe_over_several_paths(tmp_path, engine):
    dirs = [tmp_path / n for n in "abc"]
    for d in dirs:
        d.mkdir()
    tier, _ = open_tier(dirs, 12 * MIB, engine)
    arena = Arena(200_000, 9)
    try:
        ext = tier.allocate(200_000, 9)
        tags = [b"s%d" % i for i in range(9)]
        assert write(tier, arena, ext, tags) == [IoStatus.OK] * 9
        files = [tier.where(e)[0] for e in ext]
        assert files[:3] == [
            str(d / "pegaflow-ssd.data") for d in dirs
        ]  # consecutive blocks, different disks
        assert read(tier, arena, ext, tags) == [IoStatus.OK] * 9
        assert all(arena.holds(i, t) for i, t in enumerate(tags))
    finally:
        tier.close()
        arena.close()


def test_a_flipped_payload_or_header_byte_reads_as_corrupt_never_ok(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 8 * MIB, engine)
    arena = Arena(50_000, 3)
    try:
        ext = tier.allocate(50_000, 3)
        tags = [b"a", b"b", b"c"]
        assert write(tier, arena, ext, tags) == [IoStatus.OK] * 3
        path, off = tier.where(ext[0])
        flip_byte(path, off + 4096 + 49_999)  # last payload byte of a
        path, off = tier.where(ext[1])
        flip_byte(path, off + 60)  # a header byte of b (inside the sequence number)
        assert read(tier, arena, ext, tags) == [IoStatus.CORRUPT, IoStatus.CORRUPT, IoStatus.OK]
        assert arena.holds(2, b"c")
        assert tier.stats().corrupt_records == 2
        assert tier.health == TierHealth.OK  # a bad record is a miss, not a failing disk
    finally:
        tier.close()
        arena.close()


def test_a_record_of_another_tag_is_corrupt(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 8 * MIB, engine)
    arena = Arena(10_000, 1)
    try:
        ext = tier.allocate(10_000, 1)
        assert write(tier, arena, ext, [b"mine"]) == [IoStatus.OK]
        assert read(tier, arena, ext, [b"other"]) == [IoStatus.CORRUPT]
    finally:
        tier.close()
        arena.close()


def test_a_full_queue_raises_tier_full_and_counts_the_drop(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 8 * MIB, engine, max_queued=4)
    arena = Arena(100_000, 8)
    try:
        ext = tier.allocate(100_000, 8)
        with pytest.raises(TierFull):
            write(tier, arena, ext[:5], [b"%d" % i for i in range(5)])
        assert tier.stats().queue_full_drops == 5
        assert write(tier, arena, ext[:4], [b"%d" % i for i in range(4)]) == [IoStatus.OK] * 4
        assert write(tier, arena, ext[4:8], [b"%d" % i for i in range(4, 8)]) == [IoStatus.OK] * 4
        assert tier.stats().queue_depth == 0
    finally:
        tier.close()
        arena.close()


def test_a_request_past_its_deadline_is_timed_out_and_can_be_written_again(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 8 * MIB, engine)
    arena = Arena(20_000, 2)
    try:
        ext = tier.allocate(20_000, 2)
        arena.fill(0, b"x")
        past = time.monotonic() - 1
        reqs = [WriteRequest(ext[0], b"x", arena.slot(0), deadline=past)]
        assert tier.write(reqs).result(10) == [IoStatus.TIMED_OUT]
        assert write(tier, arena, ext[:1], [b"x"]) == [IoStatus.OK]  # the extent is still ours
        reqs = [ReadRequest(ext[0], b"x", arena.slot(1), deadline=past)]
        assert tier.read(reqs).result(10) == [IoStatus.TIMED_OUT]
    finally:
        tier.close()
        arena.close()


def test_contract_violations_raise_value_error(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 8 * MIB, engine)
    arena = Arena(10_000, 2)
    try:
        ext = tier.allocate(10_000, 1)
        with pytest.raises(ValueError, match="boundary"):
            tier.write([WriteRequest(ext[0], b"t", arena.view[512 : 512 + io_bytes(10_000)])])
        with pytest.raises(ValueError, match="needs"):
            tier.write([WriteRequest(ext[0], b"t", arena.view[:4096])])
        with pytest.raises(ValueError, match="tag"):
            tier.write([WriteRequest(ext[0], b"t" * 200, arena.slot(0))])
        with pytest.raises(ValueError, match="did not hand out"):
            tier.write([WriteRequest(Extent(ext[0].address + 8192, 10_000), b"t", arena.slot(0))])
        with pytest.raises(ValueError, match="no written record"):
            tier.read([ReadRequest(ext[0], b"t", arena.slot(0))])
        write(tier, arena, ext, [b"t"])
        with pytest.raises(ValueError, match="read-only"):
            tier.read([ReadRequest(ext[0], b"t", memoryview(bytes(arena.slot(0))))])
    finally:
        tier.close()
        arena.close()


def test_close_cancels_what_has_not_started_and_then_refuses(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 8 * MIB, engine, queue_depth=1)
    arena = Arena(100_000, 20)
    try:
        ext = tier.allocate(100_000, 20)
        tags = [b"%d" % i for i in range(20)]
        for i, t in enumerate(tags):
            arena.fill(i, t)
        fut = tier.write(
            [WriteRequest(e, t, arena.slot(i)) for i, (e, t) in enumerate(zip(ext, tags, strict=True))]
        )
        tier.close()
        statuses = fut.result(10)
        assert set(statuses) <= {IoStatus.OK, IoStatus.CANCELLED}
        assert tier.write([WriteRequest(ext[0], b"0", arena.slot(0))]).result(1) == [IoStatus.CANCELLED]
        assert tier.allocate(100_000, 1) == []
        tier.close()  # idempotent
    finally:
        arena.close()


def test_many_batches_in_flight_at_once_all_complete(tmp_path, engine):
    tier, _ = open_tier([tmp_path], 16 * MIB, engine, queue_depth=8)
    arena = Arena(65_536, 64)
    try:
        ext = tier.allocate(65_536, 64)
        futs = []
        for k in range(8):
            tags = [b"m%d" % (k * 8 + i) for i in range(8)]
            for i, t in enumerate(tags):
                arena.fill(k * 8 + i, t)
            reqs = [WriteRequest(ext[k * 8 + i], t, arena.slot(k * 8 + i)) for i, t in enumerate(tags)]
            futs.append(tier.write(reqs))
        assert all(f.result(30) == [IoStatus.OK] * 8 for f in futs)
        wait_for(lambda: tier.stats().queue_depth == 0, what="queue drained")
        tags = [b"m%d" % i for i in range(64)]
        assert read(tier, arena, ext, tags) == [IoStatus.OK] * 64
        assert all(arena.holds(i, t) for i, t in enumerate(tags))
    finally:
        tier.close()
        arena.close()
