"""Faults at start (clear refusals) and at run time (disk full on a real loop-device file system,
a file removed or truncated under the tier): one log line, the tier degrades or turns off,
every request still gets a status, nothing raises."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from pegaflow.server.tiers.base import IoStatus, TierHealth
from pegaflow.server.tiers.ssd.config import MIB, SsdConfigError
from pegaflow.server.tiers.ssd.testing import fill_fs, loop_fs, need_root_and, shrink_device
from pegaflow.server.tiers.ssd.tests.support import Arena, engines, open_tier, options, read, wait_for, write
from pegaflow.server.tiers.ssd.tier import SsdTier

BLOCK = 100_003


# -- start-up refusals ------------------------------------------------------------------------


def test_refusals_at_start_say_what_is_wrong(tmp_path):
    with pytest.raises(SsdConfigError, match="does not exist"):
        SsdTier(options([tmp_path / "nope" / "file"], 8 * MIB))
    with pytest.raises(SsdConfigError, match="too small"):
        SsdTier(options([tmp_path / "a", tmp_path / "b"], 1 * MIB))  # 2 paths, 1 segment
    with pytest.raises(SsdConfigError, match="same file twice"):
        SsdTier(options([tmp_path, tmp_path / "pegaflow-ssd.data"], 8 * MIB))
    with pytest.raises(SsdConfigError, match="io engine"):
        SsdTier(options([tmp_path], 8 * MIB, engine="aio"))


def test_a_capacity_the_file_system_cannot_hold_is_refused(tmp_path):
    with loop_fs(tmp_path, 32) as (mnt, _, _):
        with pytest.raises(SsdConfigError, match="does not fit"):
            SsdTier(options([mnt], 64 * MIB))
        assert not os.path.exists(mnt / "pegaflow-ssd.data.manifest")


def test_a_path_that_cannot_be_opened_for_o_direct_writing_is_refused(tmp_path):
    need_root_and("mount")
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=16m", "tmpfs", str(ro)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount here: {mounted.stderr.strip()}")
    try:
        with pytest.raises(SsdConfigError, match="cannot be opened for O_DIRECT writing"):
            SsdTier(options([ro], 8 * MIB))
    finally:
        subprocess.run(["umount", str(ro)], check=False)


# -- run-time faults --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", engines())
def test_disk_full_answers_io_error_and_degrades_without_raising(tmp_path, engine, caplog):
    with loop_fs(tmp_path, 24) as (mnt, _, _):
        tier, _ = open_tier([mnt], 16 * MIB, engine, preallocate=False)  # sparse: space taken as written
        arena = Arena(BLOCK, 8)
        try:
            ext = tier.allocate(BLOCK, 4)
            tags = [b"ok%d" % i for i in range(4)]
            assert write(tier, arena, ext, tags) == [IoStatus.OK] * 4
            fill_fs(mnt)
            with caplog.at_level(logging.ERROR):
                statuses = []
                for k in range(6):  # the next segments: their headers and records need new blocks
                    more = tier.allocate(BLOCK, 8)
                    if not more:
                        break
                    statuses += write(tier, arena, more, [b"full%d-%d" % (k, i) for i in range(len(more))])
                    tier.free(more)
            assert IoStatus.IO_ERROR in statuses
            assert tier.health == TierHealth.DEGRADED
            s = tier.stats()
            assert "read-only" in s.health_reason
            assert "No space left" in s.health_reason or "no space left?" in s.health_reason
            assert s.write_errors >= 1
            assert tier.allocate(BLOCK, 1) == []  # no path can take new blocks
            assert read(tier, arena, ext, tags) == [IoStatus.OK] * 4  # what is there is still served
            assert all(arena.holds(i, t) for i, t in enumerate(tags))
            lines = [r for r in caplog.records if "is now read-only" in r.getMessage()]
            assert len(lines) == 1  # one line, not one per failed I/O
        finally:
            tier.close()


@pytest.mark.parametrize("engine", engines())
def test_a_file_removed_at_run_time_turns_its_path_off_and_the_others_carry_on(tmp_path, engine, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    tier, _ = open_tier([a, b], 8 * MIB, engine)
    arena = Arena(BLOCK, 8)
    try:
        ext = tier.allocate(BLOCK, 4)
        tags = [b"r%d" % i for i in range(4)]
        assert write(tier, arena, ext, tags) == [IoStatus.OK] * 4
        on_a = [tier.where(e)[0].startswith(str(a)) for e in ext]
        assert on_a == [True, False, True, False]
        with caplog.at_level(logging.ERROR):
            os.unlink(a / "pegaflow-ssd.data")
            wait_for(lambda: tier.health == TierHealth.DEGRADED, what="the removed file to be noticed")
        assert "file removed at run time" in tier.stats().health_reason
        assert read(tier, arena, ext, tags) == [
            IoStatus.IO_ERROR,
            IoStatus.OK,
            IoStatus.IO_ERROR,
            IoStatus.OK,
        ]
        assert arena.holds(1, tags[1]) and arena.holds(3, tags[3])
        new = tier.allocate(BLOCK, 4)
        assert len(new) == 4 and not any(tier.where(e)[0].startswith(str(a)) for e in new)
        assert write(tier, arena, new, [b"n%d" % i for i in range(4)]) == [IoStatus.OK] * 4
        os.unlink(b / "pegaflow-ssd.data")
        wait_for(lambda: tier.health == TierHealth.OFF, what="the second removal")
        assert tier.allocate(BLOCK, 1) == []
        assert read(tier, arena, ext[1:2], tags[1:2]) == [IoStatus.CANCELLED]
        assert len([r for r in caplog.records if "file removed" in r.getMessage()]) == 2
    finally:
        tier.close()


def test_a_file_truncated_at_run_time_is_never_read_as_ok(tmp_path):
    tier, _ = open_tier([tmp_path], 8 * MIB)
    arena = Arena(BLOCK, 20)
    try:
        ext = tier.allocate(BLOCK, 20)
        tags = [b"t%d" % i for i in range(20)]
        assert write(tier, arena, ext, tags) == [IoStatus.OK] * 20
        os.truncate(tmp_path / "pegaflow-ssd.data", 512 * 1024)
        statuses = read(tier, arena, ext, tags)  # may race the monitor: a short read or CANCELLED
        assert IoStatus.OK not in statuses[5:]
        wait_for(lambda: tier.health == TierHealth.OFF, what="the truncation to be noticed")
        assert "truncated" in tier.stats().health_reason or "short read" in tier.stats().health_reason
        assert set(read(tier, arena, ext, tags)) == {IoStatus.CANCELLED}
    finally:
        tier.close()


@pytest.mark.parametrize("engine", engines())
def test_eio_from_the_device_turns_the_tier_off_and_no_wrong_byte_is_served(tmp_path, engine, caplog):
    """A real EIO: the loop device under the file system shrinks, so the blocks of our file past
    its new end fail in the block layer (this kernel has no device-mapper to inject errors)."""
    with loop_fs(tmp_path, 32) as (mnt, dev, image):
        tier, _ = open_tier([mnt], 16 * MIB, engine)
        arena = Arena(BLOCK, 40)
        try:
            ext = tier.allocate(BLOCK, 40)
            tags = [b"e%d" % i for i in range(40)]
            assert write(tier, arena, ext, tags) == [IoStatus.OK] * 40
            shrink_device(dev, image, 2 * MIB)
            with caplog.at_level(logging.ERROR):
                statuses = read(tier, arena, ext, tags)
            assert IoStatus.IO_ERROR in statuses
            # (CORRUPT too: a block that the shrunk device still has may hold other bytes now)
            assert set(statuses) <= {IoStatus.OK, IoStatus.IO_ERROR, IoStatus.CANCELLED, IoStatus.CORRUPT}
            assert all(
                arena.holds(i, t)
                for i, (t, st) in enumerate(zip(tags, statuses, strict=True))
                if st == IoStatus.OK
            )
            assert tier.health == TierHealth.OFF  # its only path failed
            assert "Input/output error" in tier.stats().health_reason
            assert tier.allocate(BLOCK, 1) == []
            assert set(read(tier, arena, ext, tags)) == {IoStatus.CANCELLED}
            assert len([r for r in caplog.records if "is now off" in r.getMessage()]) == 1
        finally:
            tier.close()
