"""The lookup sketches in their own process (sketch_process.py): the same numbers as in-process,
and a child that dies, stalls or is fed garbage never stalls or breaks the server's side."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import pytest

from pegaflow.common.wire import frames
from pegaflow.server.metrics import sketch_process
from pegaflow.server.metrics.lookup_sketches import LookupRecord, LookupSketches
from pegaflow.server.metrics.sketch_process import SketchProcess, decode_records, encode_records
from pegaflow.server.testing import held_elsewhere

WINDOWS = {"15m": 900.0, "1h": 3600.0}
CAPACITY = 64 << 20


def records(n_lookups: int, tag: str = "k", per: int = 32) -> list[LookupRecord]:
    # A working set of 40 chains, revisited: both sketches see reuse.
    return [
        LookupRecord(i % 3, 64 << 10, [f"{tag}-{i % 40}-{j}".encode() for j in range(per)])
        for i in range(n_lookups)
    ]


@pytest.fixture
def proc():
    p = SketchProcess(WINDOWS, CAPACITY, restart_backoff_s=0.0, io_timeout_s=2.0)
    assert p.wait_ready(), "the sketches' process did not start"
    yield p
    p.close()


def test_records_round_trip_with_fixed_and_varying_hash_lengths():
    recs = [
        LookupRecord(7, 4096, [b"a" * 32, b"b" * 32]),
        LookupRecord(1 << 31, 1 << 30, [b"x", b"yy", b"", b"zzz"]),
        LookupRecord(0, 0, []),
    ]
    frame = encode_records(recs)
    assert decode_records(memoryview(frame)[5:]) == recs


def test_a_truncated_record_is_refused():
    frame = encode_records([LookupRecord(1, 4096, [b"a" * 32] * 4)])
    with pytest.raises(ValueError):
        decode_records(memoryview(frame)[5:-1])
    with pytest.raises(ValueError):
        decode_records(memoryview(b"\x01\x02\x03"))
    huge = struct.pack("<IQIH", 1, 4096, 0xFFFFFFFF, 32) + b"a" * 32  # a count nothing could hold
    with pytest.raises(ValueError):
        decode_records(memoryview(huge))


def test_the_process_counts_what_the_in_process_sketches_count(proc):
    local = LookupSketches(WINDOWS, CAPACITY)
    for lo in range(0, 400, 50):
        batch = records(400)[lo : lo + 50]
        local.add(batch)
        proc.add(batch)
    mine, theirs = local.snapshot(), proc.snapshot()
    assert theirs is not None
    assert theirs.requests == mine.requests == 400 * 32
    assert theirs.ceiling == pytest.approx(mine.ceiling)
    assert 0.5 < theirs.ceiling["15m"] < 1.0  # 40 chains revisited 10 times
    assert theirs.mrc_sampled_requests == mine.mrc_sampled_requests > 0
    for window in WINDOWS:
        assert theirs.mrc_predicted[window] == pytest.approx(mine.mrc_predicted[window])
    assert theirs.hll_memory_bytes == mine.hll_memory_bytes
    assert proc.dropped_records == 0 and proc.restarts == 0


@pytest.mark.timeout(30)
def test_a_killed_child_is_replaced_and_counts_afresh(proc):
    proc.add(records(10))
    assert proc.snapshot().requests == 320
    old = proc.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.snapshot() is None or proc.pid == old:  # the failed call restarts it
        assert time.monotonic() < deadline
    proc.add(records(3))
    snap = proc.snapshot()
    assert snap.requests == 96  # a new child: its windows start empty
    assert proc.restarts == 1


@pytest.mark.timeout(30)
def test_a_stalled_child_holds_the_feeder_for_one_timeout_then_is_replaced(proc):
    proc.add(records(1))
    assert proc.snapshot() is not None
    stalled = proc.pid
    os.kill(stalled, signal.SIGSTOP)
    try:
        record = records(1, per=64)
        longest = 0.0
        for _ in range(20_000):  # ~25 MiB of frames, far beyond what the socket holds
            started = time.monotonic()
            proc.add(record)
            longest = max(longest, time.monotonic() - started)
        # One add waits out one io_timeout_s (2 s), then a new child starts (its lookups wait in the
        # backlog, never in the feeder) and reads: no add waits much longer (timed per add, so a
        # loaded machine's slower loop does not count against it).
        assert 2.0 <= longest < 2.0 + 1.5
        assert proc.pid != stalled and proc.restarts == 1
        assert proc.dropped_records >= 1  # the frame that could not be handed over, and any backlog overflow
    finally:
        try:
            os.kill(stalled, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the restart, as it should be
    assert proc.snapshot().requests > 0


@pytest.mark.timeout(60)
def test_a_starting_child_never_holds_the_feeder_and_gets_the_backlog_in_order():
    p = SketchProcess(WINDOWS, CAPACITY, restart_backoff_s=0.0, io_timeout_s=2.0)
    # Stopped while it imports (a fresh interpreter takes far longer to say READY than this takes):
    # a child that cannot start yet, as on a loaded host at nice +10.
    os.kill(p.pid, signal.SIGSTOP)
    try:
        record = records(1, per=64)
        frame_bytes = len(encode_records(record))
        n_adds = 2 * sketch_process.BACKLOG_BYTES // frame_bytes
        longest = 0.0
        for _ in range(n_adds):
            started = time.monotonic()
            p.add(record)
            longest = max(longest, time.monotonic() - started)
        assert longest < 1.0  # backlogged or dropped: never a wait on the socket
        kept = sketch_process.BACKLOG_BYTES // frame_bytes
        assert p.dropped_records == n_adds - kept
        assert p.restarts == 0
    finally:
        os.kill(p.pid, signal.SIGCONT)
    try:
        assert p.wait_ready()
        snap = p.snapshot()
        assert snap is not None and snap.requests == kept * 64  # the backlog, every record once
        p.add(records(2))
        assert p.snapshot().requests == kept * 64 + 2 * 32 and p.restarts == 0
    finally:
        p.close()


def test_a_child_that_never_becomes_ready_is_replaced():
    p = SketchProcess(WINDOWS, CAPACITY, restart_backoff_s=0.0, io_timeout_s=0.5, start_timeout_s=1.0)
    stopped = p.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        p.add(records(3))  # backlogged
        time.sleep(1.1)
        assert p.snapshot() is None  # past the start timeout: killed, its backlog counted
        assert p.dropped_records == 3 and p.pid is None
        assert p.wait_ready(30.0) and p.pid != stopped and p.restarts == 1
        p.add(records(1))
        assert p.snapshot().requests == 32
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.close()


@pytest.mark.timeout(30)
def test_a_snapshot_from_a_stalled_child_is_none_within_the_timeout(proc):
    assert proc.snapshot() is not None
    stalled = proc.pid
    os.kill(stalled, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert proc.snapshot() is None
        assert time.monotonic() - started < 2.0 + 1.0
    finally:
        try:
            os.kill(stalled, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.snapshot() is not None and proc.pid != stalled


@pytest.mark.timeout(30)
def test_garbage_on_the_socket_ends_the_child_and_a_new_one_takes_over(proc):
    proc.add(records(2))
    old = proc.pid
    with proc._lock:
        proc._sock.sendall(b"\x05\x00\x00\x00\x01\xff\xff\xff\xff")  # a FEED frame of a truncated record
    deadline = time.monotonic() + 10
    while proc.snapshot() is None or proc.pid == old:
        assert time.monotonic() < deadline
    assert proc.restarts == 1


def test_the_child_exits_when_the_server_side_closes():
    p = SketchProcess(WINDOWS, CAPACITY)
    child = p._proc
    p.close()
    assert child.wait(timeout=5) == 0


def test_the_child_runs_below_the_server_s_priority(proc):
    assert proc.snapshot() is not None
    assert os.getpriority(os.PRIO_PROCESS, proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + min(
        sketch_process.CHILD_NICE, 19 - os.getpriority(os.PRIO_PROCESS, 0)
    )


@pytest.mark.timeout(30)
def test_a_snapshot_with_a_deadline_gives_up_in_time_and_keeps_a_child_that_is_behind(proc):
    proc.add(records(1))
    assert proc.snapshot().requests == 32
    behind = proc.pid
    os.kill(behind, signal.SIGSTOP)  # a child seconds behind, as at nice +10 on a busy host
    try:
        proc.add(records(1))
        started = time.monotonic()
        assert proc.snapshot(deadline=started + 0.3).requests == 32  # the last one stands in
        assert time.monotonic() - started < 1.5  # not the io timeout (2 s); slack for a loaded CI host
        started = time.monotonic()
        assert proc.snapshot(deadline=started + 0.3).requests == 32  # its answer still owed: no second ask
        assert time.monotonic() - started < 1.5
        assert len(proc._owed) == 1
    finally:
        os.kill(behind, signal.SIGCONT)
    proc.add(records(2))
    # The owed answer is read first: this one counts every record fed before it.
    assert proc.snapshot().requests == 4 * 32
    assert proc.pid == behind and proc.restarts == 0


@pytest.fixture
def patient():
    """A process whose io timeout is far past the deadlines below: a stopped child is behind, never
    taken for a stalled one (so a deadline, not the stall timeout, is what a snapshot waits for)."""
    p = SketchProcess(WINDOWS, CAPACITY, restart_backoff_s=0.0, io_timeout_s=30.0)
    assert p.wait_ready(), "the sketches' process did not start"
    yield p
    p.close()


@pytest.mark.timeout(60)
def test_a_snapshot_asked_while_the_child_is_behind_is_the_last_one_after_the_short_wait(patient):
    patient.add(records(1))
    assert patient.snapshot().requests == 32
    behind = patient.pid
    os.kill(behind, signal.SIGSTOP)
    try:
        patient.add(records(1))
        started = time.monotonic()
        snap = patient.snapshot(deadline=started + 10.0)
        took = time.monotonic() - started
        assert snap is not None and snap.requests == 32  # the last one, not None
        assert took < sketch_process.FRESH_WAIT_S + 1.0  # not the 10 s deadline
        assert snap.age_s >= sketch_process.FRESH_WAIT_S  # aged from its own ask, before this call began
    finally:
        os.kill(behind, signal.SIGCONT)
    assert patient.pid == behind and patient.restarts == 0


@pytest.mark.timeout(60)
def test_with_no_snapshot_to_stand_in_one_is_waited_for_until_the_deadline_then_none(patient):
    behind = patient.pid
    os.kill(behind, signal.SIGSTOP)
    try:
        patient.add(records(1))
        started = time.monotonic()
        assert patient.snapshot(deadline=started + 2.0) is None
        took = time.monotonic() - started
        assert 2.0 <= took < 2.0 + 1.0  # the whole deadline: nothing to answer with sooner; not past it
        # A child that catches up before the deadline is worth the wait: its answer (owed since the
        # first ask: no second one) is this one's.
        threading.Timer(1.0, os.kill, (behind, signal.SIGCONT)).start()
        started = time.monotonic()
        snap = patient.snapshot(deadline=started + 10.0)
        assert snap is not None and snap.requests == 32
        assert 1.0 <= time.monotonic() - started < 10.0
    finally:
        os.kill(behind, signal.SIGCONT)
    assert patient.pid == behind and patient.restarts == 0


@pytest.mark.timeout(60)
def test_a_snapshot_older_than_the_stand_in_age_does_not_stand_in():
    p = SketchProcess(WINDOWS, CAPACITY, restart_backoff_s=0.0, io_timeout_s=30.0, max_stand_in_age_s=1.0)
    try:
        assert p.wait_ready()
        p.add(records(1))
        assert p.snapshot().requests == 32
        time.sleep(1.2)
        behind = p.pid
        os.kill(behind, signal.SIGSTOP)
        try:
            p.add(records(1))
            started = time.monotonic()
            assert p.snapshot(deadline=started + 2.0) is None  # waited for, until the deadline
            assert time.monotonic() - started >= 2.0
            assert p.last_snapshot().requests == 32  # kept, only too old to stand in
        finally:
            os.kill(behind, signal.SIGCONT)
        assert p.snapshot().requests == 64 and p.restarts == 0
    finally:
        p.close()


@pytest.mark.timeout(60)
def test_a_late_answer_becomes_the_last_snapshot_aged_from_its_own_ask_never_a_later_one(patient):
    patient.add(records(1))
    assert patient.snapshot().requests == 32
    child = patient.pid
    os.kill(child, signal.SIGSTOP)
    try:
        patient.add(records(1))  # 64 fed
        assert patient.snapshot(deadline=time.monotonic() + 10.0).requests == 32  # ask A owed
        asked_by = time.monotonic()  # A was asked before this
        patient.add(records(1))  # 96 fed, after A's ask
        os.kill(child, signal.SIGCONT)
        assert frames.readable(patient._sock, 10.0)  # A's answer written, not yet read
        os.kill(child, signal.SIGSTOP)
        time.sleep(1.0)  # an answer that waits unread: its age must show it
        started = time.monotonic()
        late = patient.snapshot(deadline=started + 10.0)  # reads A's answer, asks B, B is owed
        # A's answer: what was fed before A's ask (not the 96 fed before B's), aged from A's ask,
        # not from when it was read.
        assert late.requests == 64
        assert late.age_s >= started + sketch_process.FRESH_WAIT_S - asked_by
        assert len(patient._owed) == 1
        patient.add(records(1))  # 128 fed, after B's ask
        assert patient.snapshot(deadline=time.monotonic() + 10.0).requests == 64  # B still owed
        assert len(patient._owed) == 1  # no second ask while one is owed
    finally:
        os.kill(child, signal.SIGCONT)
    fresh = patient.snapshot()  # B's answer (96) is read first, then its own: 128
    assert fresh.requests == 128 and fresh.age_s < 10.0
    assert patient.last_snapshot().requests == 128
    assert patient.pid == child and patient.restarts == 0


@pytest.mark.timeout(30)
def test_a_snapshot_the_feeder_keeps_from_the_socket_is_the_last_one_after_the_short_wait(proc):
    proc.add(records(1))
    assert proc.snapshot().requests == 32
    with held_elsewhere(proc._lock, 5.0):  # the feeder handing a frame to a child that is behind
        started = time.monotonic()
        assert proc.snapshot(deadline=started + 4.0).requests == 32
        assert time.monotonic() - started < sketch_process.FRESH_WAIT_S + 1.0  # not the 4 s deadline
    assert proc.snapshot().requests == 32 and proc.restarts == 0


@pytest.mark.timeout(30)
def test_a_snapshot_with_a_deadline_does_not_wait_for_the_feeder_past_it(proc):
    with held_elsewhere(proc._lock, 3.0):  # the feeder handing a frame to a child that is behind
        started = time.monotonic()
        assert proc.snapshot(deadline=started + 0.2) is None
        assert time.monotonic() - started < 1.5  # not the holder's 3 s
    assert proc.snapshot() is not None and proc.restarts == 0


@pytest.mark.timeout(60)
def test_an_add_with_a_deadline_never_waits_for_room_in_a_full_socket(proc):
    behind = proc.pid
    os.kill(behind, signal.SIGSTOP)
    try:
        record = records(1, per=64)
        longest = 0.0
        for _ in range(20_000):  # ~25 MiB of frames, far beyond what the socket holds
            started = time.monotonic()
            proc.add(record, deadline=started + 0.2)
            longest = max(longest, time.monotonic() - started)
        assert longest < 1.5  # without the room check one add waits out the io timeout (2 s)
        assert proc.dropped_records > 0 and proc.restarts == 0 and proc.pid == behind
    finally:
        os.kill(behind, signal.SIGCONT)
    assert proc.snapshot().requests == 64 * (20_000 - proc.dropped_records)


@pytest.mark.timeout(60)
def test_a_snapshot_with_a_deadline_never_waits_to_ask_a_child_whose_socket_is_full(proc):
    behind = proc.pid
    os.kill(behind, signal.SIGSTOP)
    try:
        for per in (64, 1):  # big frames until they no longer fit, then the smallest ones
            dropped = proc.dropped_records
            while proc.dropped_records == dropped:
                proc.add(records(1, per=per), deadline=time.monotonic() + 0.2)
        started = time.monotonic()
        assert proc.snapshot(deadline=started + 0.3) is None
        assert time.monotonic() - started < 1.5  # not the io timeout (2 s) of a blocked send
        assert proc.pid == behind and proc.restarts == 0
    finally:
        os.kill(behind, signal.SIGCONT)
    assert proc.snapshot() is not None and proc.restarts == 0
