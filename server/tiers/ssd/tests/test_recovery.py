"""Recovery after a clean stop and after SIGKILL of a real writer process; corrupt, torn and
truncated records are reported and skipped, never served; stale generations never come back."""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from pegaflow.server.tiers.base import Extent, IoStatus, ReadRequest
from pegaflow.server.tiers.ssd.config import MIB
from pegaflow.server.tiers.ssd.tests.support import Arena, engines, flip_byte, open_tier, payload, read, write

BLOCK = 100_003  # not a multiple of 4096
SEG = 1 * MIB
CAP = 6 * MIB  # 2 paths x 3 segments of 1 MiB; 9 records of BLOCK per segment


def _dirs(tmp_path, n=2):
    out = []
    for i in range(n):
        d = tmp_path / f"disk{i}"
        d.mkdir(exist_ok=True)
        out.append(d)
    return out


def run_writer(paths, engine, count, kill_after_writes=None, then="exit", first=0, timeout=60.0):
    """Runs writer_child; SIGKILLs it after ``kill_after_writes`` acknowledged writes (mid-stream)
    or after DONE (``then="hang"``). Returns the events it printed before it died."""
    cmd = [
        sys.executable,
        "-m",
        "pegaflow.server.tiers.ssd.tests.writer_child",
        *map(str, paths),
        "--engine",
        engine,
        "--block",
        str(BLOCK),
        "--count",
        str(count),
        "--capacity",
        str(CAP),
        "--segment",
        str(SEG),
        "--then",
        then,
        "--first",
        str(first),
    ]
    # Block-buffered stdout, as under Bazel: what the child did not flush dies with it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    events, buf, writes = [], b"", 0
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    killed = False
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                ev = line.decode().split()
                events.append(ev)
                writes += ev[0] == "W"
                if not killed and (
                    (kill_after_writes and writes >= kill_after_writes) or (then == "hang" and ev == ["DONE"])
                ):
                    proc.send_signal(signal.SIGKILL)
                    killed = True  # keep reading: lines it wrote before dying are still in the pipe
        else:
            raise AssertionError("writer child did not finish in time")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        sel.close()
    err = proc.stderr.read().decode()
    if killed:
        assert proc.returncode == -signal.SIGKILL, err
    else:
        assert proc.returncode == 0, err
    return events


def _read_all(tier, blocks):
    arena = Arena(BLOCK, len(blocks) or 1)
    statuses = read(tier, arena, [b.extent for b in blocks], [b.tag for b in blocks])
    good = [arena.holds(i, b.tag) for i, b in enumerate(blocks)]
    arena.close()
    return statuses, good


@pytest.mark.parametrize("engine", engines())
def test_sigkill_mid_stream_recovers_exactly_the_completed_records(tmp_path, engine):
    paths = _dirs(tmp_path)
    events = run_writer(paths, engine, count=400, kill_after_writes=120)  # capacity ~54: reuse happened
    acked, freed_at = {}, {}
    for i, ev in enumerate(events):
        if ev[0] == "W":
            acked[ev[1].encode()] = (int(ev[2]), i)
        elif ev[0] == "F":
            freed_at[ev[1].encode()] = i
    live = {t: a for t, (a, _) in acked.items() if t not in freed_at}
    reports = []
    tier, blocks = open_tier(paths, CAP, engine, reports=reports, segment_bytes=SEG)
    try:
        got = {b.tag: b.extent.address for b in blocks}
        for tag, addr in live.items():
            assert got.get(tag) == addr, f"acknowledged block {tag} at {addr} not recovered"
        # A freed block whose segment was written again after the free (a new generation) is stale.
        stale = 0
        for tag, when in freed_at.items():
            seg = acked[tag][0] // SEG
            if any(a // SEG == seg and i > when for a, i in acked.values()):
                assert tag not in got, f"stale record {tag} of a reused segment came back"
                stale += 1
        assert stale >= 20  # the check above had cases to look at
        statuses, good = _read_all(tier, blocks)
        assert statuses == [IoStatus.OK] * len(blocks) and all(good)
        assert len(blocks) <= 54 and tier.stats().recovered_blocks == len(blocks)
        assert tier.recovery.scanned_segments >= 1  # the open segments had no summary
        # New writes never land on a live recovered record.
        taken = [(b.extent.address, b.extent.address + 4096 + BLOCK) for b in blocks]
        new = tier.allocate(BLOCK, 100)
        for e in new:
            assert all(e.address + 4096 + BLOCK <= lo or e.address >= hi for lo, hi in taken)
        arena = Arena(BLOCK, len(new) or 1)
        tags = [b"new%d" % i for i in range(len(new))]
        assert write(tier, arena, new, tags) == [IoStatus.OK] * len(new)
        statuses, good = _read_all(tier, blocks)
        assert statuses == [IoStatus.OK] * len(blocks) and all(good)
    finally:
        tier.close()


@pytest.mark.parametrize("engine", engines())
def test_clean_close_restarts_from_summaries_without_scanning(tmp_path, engine):
    paths = _dirs(tmp_path)
    run_writer(paths, engine, count=30)  # exits cleanly: close() writes the open segments' summaries
    tier, blocks = open_tier(paths, CAP, engine, segment_bytes=SEG)
    try:
        assert sorted(b.tag for b in blocks) == [b"k%06d" % i for i in range(30)]
        assert tier.recovery.scanned_segments == 0 and tier.recovery.skipped == 0
        assert [b.tag for b in blocks] == sorted(b.tag for b in blocks) or len(blocks) == 30
        statuses, good = _read_all(tier, blocks)
        assert statuses == [IoStatus.OK] * 30 and all(good)
    finally:
        tier.close()


def _crash_state(tmp_path, count=40):
    """Files as a kill -9 leaves them: sealed segments summarized, the open ones not."""
    paths = _dirs(tmp_path)
    events = run_writer(paths, "threads", count=count, then="hang")
    where = {ev[1].encode(): int(ev[2]) for ev in events if ev[0] == "W"}
    assert len(where) == count
    return paths, where


def _file_offset(paths, address):
    g, off = divmod(address, SEG)
    return str(paths[g % 2] / "pegaflow-ssd.data"), (g // 2) * SEG + off


def _open_seg_record(where, lane=0):
    """The last record of ``lane``: in its open (unsummarized) segment."""
    return max((a, t) for t, a in where.items() if (a // SEG) % 2 == lane)[1]


def test_corruption_in_the_open_segment_is_reported_and_skipped(tmp_path):
    paths, where = _crash_state(tmp_path)
    torn_payload = _open_seg_record(where, lane=0)
    bad_header = _open_seg_record(where, lane=1)
    f, off = _file_offset(paths, where[torn_payload])
    flip_byte(f, off + 4096 + 777)
    f, off = _file_offset(paths, where[bad_header])
    flip_byte(f, off + 20)
    reports = []
    tier, blocks = open_tier(paths, CAP, reports=reports, segment_bytes=SEG)
    try:
        got = {b.tag for b in blocks}
        assert got == set(where) - {torn_payload, bad_header}
        whys = " | ".join(why for _, why in reports)
        assert "payload checksum mismatch" in whys and "header checksum mismatch" in whys
        assert len(reports) == 2 and tier.stats().recovery_skipped == 2
        statuses, good = _read_all(tier, blocks)
        assert statuses == [IoStatus.OK] * len(blocks) and all(good)
    finally:
        tier.close()


@pytest.mark.parametrize("verify", ["summary", "headers", "full"])
def test_corruption_in_a_summarized_segment_is_never_served(tmp_path, verify):
    paths, where = _crash_state(tmp_path)
    victim = b"k000000"  # first record of lane 0: a sealed, summarized segment
    other = b"k000003"  # lane 1, also summarized: its header gets a flipped byte
    f, off = _file_offset(paths, where[victim])
    flip_byte(f, off + 4096 + BLOCK - 1)
    f, off = _file_offset(paths, where[other])
    flip_byte(f, off + 40)
    reports = []
    tier, blocks = open_tier(paths, CAP, reports=reports, segment_bytes=SEG, recovery_verify=verify)
    try:
        got = {b.tag: b for b in blocks}
        if verify == "summary":  # trusted at start, caught by the read
            assert set(got) == set(where) and reports == []
            arena = Arena(BLOCK, 2)
            assert read(tier, arena, [got[victim].extent, got[other].extent], [victim, other]) == [
                IoStatus.CORRUPT,
                IoStatus.CORRUPT,
            ]
            assert tier.stats().corrupt_records == 2
        elif verify == "headers":  # the header is read at start; the payload only by a read
            assert set(got) == set(where) - {other} and len(reports) == 1
            arena = Arena(BLOCK, 1)
            assert read(tier, arena, [got[victim].extent], [victim]) == [IoStatus.CORRUPT]
        else:
            assert set(got) == set(where) - {victim, other} and len(reports) == 2
        rest = [b for t, b in got.items() if t not in (victim, other)]
        statuses, good = _read_all(tier, rest)
        assert statuses == [IoStatus.OK] * len(rest) and all(good)
    finally:
        tier.close()


@pytest.mark.parametrize("where", ["summary", "footer"])
def test_a_damaged_summary_falls_back_to_scanning_the_segment(tmp_path, where):
    paths, found = _crash_state(tmp_path)
    f = str(paths[0] / "pegaflow-ssd.data")
    flip_byte(f, SEG - 4096 - 10 if where == "summary" else SEG - 4096 + 30)  # segment 0's tail
    reports = []
    tier, blocks = open_tier(paths, CAP, reports=reports, segment_bytes=SEG)
    try:
        assert {b.tag for b in blocks} == set(found)  # every record, found by the scan
        assert len(reports) == 1 and "scanning the segment instead" in reports[0][1]
        assert f"{f}+{SEG - 4096}" in reports[0][0]
        statuses, good = _read_all(tier, blocks)
        assert statuses == [IoStatus.OK] * len(blocks) and all(good)
    finally:
        tier.close()


def test_a_truncated_file_loses_what_was_cut_and_nothing_else(tmp_path, caplog):
    paths, where = _crash_state(tmp_path)
    lane0 = sorted((a, t) for t, a in where.items() if (a // SEG) % 2 == 0)
    cut_addr, cut_tag = lane0[12]  # in lane 0's second segment
    f, off = _file_offset(paths, cut_addr)
    os.truncate(f, off + 4096 + 50_000)  # in the middle of cut_tag's payload
    reports = []
    with caplog.at_level(logging.ERROR):
        tier, blocks = open_tier(paths, CAP, reports=reports, segment_bytes=SEG)
    try:
        lost = {t for a, t in lane0 if a >= cut_addr}
        assert {b.tag for b in blocks} == set(where) - lost
        assert "truncated" in caplog.text
        assert any(str(a) for a in reports)  # the cut record (or its segment's summary) was reported
        statuses, good = _read_all(tier, blocks)
        assert statuses == [IoStatus.OK] * len(blocks) and all(good)
        assert os.path.getsize(f) == 3 * SEG + 4096  # the layout's size again
    finally:
        tier.close()


def test_the_newest_copy_of_a_tag_wins(tmp_path):
    arena = Arena(BLOCK, 2)
    tier, _ = open_tier([tmp_path], 4 * MIB, segment_bytes=SEG)
    ext = tier.allocate(BLOCK, 2)
    arena.fill(0, b"old-bytes")
    arena.fill(1, b"new-bytes")
    from pegaflow.server.tiers.base import WriteRequest

    assert tier.write([WriteRequest(ext[0], b"same", arena.slot(0))]).result(10) == [IoStatus.OK]
    assert tier.write([WriteRequest(ext[1], b"same", arena.slot(1))]).result(10) == [IoStatus.OK]
    tier.close()
    tier, blocks = open_tier([tmp_path], 4 * MIB, segment_bytes=SEG)
    try:
        assert [b.extent for b in blocks] == [ext[1]]
        out = Arena(BLOCK, 1)
        assert tier.read([ReadRequest(ext[1], b"same", out.slot(0))]).result(10) == [IoStatus.OK]
        assert (out.array[:BLOCK] == payload(b"new-bytes", BLOCK)).all()
        assert tier.recovery.duplicates == 1
        # The older copy's space was freed internally: the whole capacity is allocatable again.
        assert tier.stats().used_bytes == 4096 + 102_400
    finally:
        tier.close()


@pytest.mark.parametrize("verify", ["summary", "full"])  # from the summary, and by a scan
def test_stale_records_of_a_reopened_segment_never_come_back(tmp_path, verify):
    arena = Arena(BLOCK, 9)
    tier, _ = open_tier([tmp_path], 2 * MIB, segment_bytes=SEG)  # 2 segments, one path
    first = tier.allocate(BLOCK, 18)
    assert len(first) == 18
    tags = [b"old%02d" % i for i in range(18)]
    assert write(tier, arena, first[:9], tags[:9]) == [IoStatus.OK] * 9
    assert write(tier, arena, first[9:], tags[9:]) == [IoStatus.OK] * 9
    tier.free(first[:9])  # segment 0 empties ...
    again = tier.allocate(BLOCK, 1)  # ... and is reopened: a new generation
    assert again[0].address == first[0].address
    assert write(tier, arena, again, [b"fresh"]) == [IoStatus.OK]
    tier.close()
    tier, blocks = open_tier([tmp_path], 2 * MIB, segment_bytes=SEG, recovery_verify=verify)
    try:
        got = {b.tag for b in blocks}
        assert got == {b"fresh", *tags[9:]}  # old01..old08 are intact on disk, but stale
    finally:
        tier.close()


def test_blocks_of_an_emptied_segment_do_not_come_back(tmp_path):
    """Emptying a segment writes its next generation's header at once, and a summary lists only
    blocks live when it is written: after this clean stop no freed block comes back."""
    arena = Arena(BLOCK, 9)
    tier, _ = open_tier([tmp_path], 3 * MIB, segment_bytes=SEG)
    ext = tier.allocate(BLOCK, 18)
    tags = [b"b%02d" % i for i in range(18)]
    assert write(tier, arena, ext[:9], tags[:9]) == [IoStatus.OK] * 9
    assert write(tier, arena, ext[9:], tags[9:]) == [IoStatus.OK] * 9
    tier.free(ext[:9])  # all of segment 0
    tier.free(ext[9:10])  # one block of segment 1
    tier.close()
    tier, blocks = open_tier([tmp_path], 3 * MIB, segment_bytes=SEG)
    try:
        assert {b.tag for b in blocks} == set(tags[10:])
    finally:
        tier.close()


def test_different_flags_reinitialise_with_one_log_line_and_never_misread(tmp_path, caplog):
    paths, where = _crash_state(tmp_path)
    with caplog.at_level(logging.WARNING):
        tier, blocks = open_tier(paths, 4 * MIB, segment_bytes=SEG)  # another capacity
    try:
        assert blocks == []
        lines = [r for r in caplog.records if "re-initialising" in r.getMessage()]
        assert len(lines) == 1 and "capacity_bytes" in lines[0].getMessage()
        with pytest.raises(ValueError):  # nothing of the old layout is addressable
            tier.read([ReadRequest(Extent(where[b"k000000"], BLOCK), b"k000000", Arena(BLOCK, 1).slot(0))])
        assert os.path.getsize(paths[0] / "pegaflow-ssd.data") == 2 * SEG + 4096
    finally:
        tier.close()
    tier, blocks = open_tier(paths[:1], 4 * MIB, segment_bytes=SEG)  # other paths: again
    tier.close()
    assert blocks == []


def test_recovery_rate_is_fast_from_summaries(tmp_path):
    """Not a benchmark (bench/ssd_bench.py is): a guard that recovery reads summaries, not data."""
    tier, _ = open_tier([tmp_path], 64 * MIB, segment_bytes=4 * MIB)
    arena = Arena(1 * MIB, 8)
    n = 0
    while True:
        ext = tier.allocate(1 * MIB, 8)
        if not ext:
            break
        assert write(tier, arena, ext, [b"r%d" % (n + i) for i in range(len(ext))]) == [IoStatus.OK] * len(
            ext
        )
        n += len(ext)
    tier.close()
    tier, blocks = open_tier([tmp_path], 64 * MIB, segment_bytes=4 * MIB)
    try:
        assert len(blocks) == n >= 48
        assert tier.recovery.scanned_segments == 0 and tier.recovery.summary_segments == 16
    finally:
        tier.close()
