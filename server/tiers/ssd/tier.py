"""SsdTier: the L3 tier behind server/tiers/base.py's ``Tier`` contract, over one or more
preallocated O_DIRECT files (README.md here has the picture and the measured numbers).

Who calls what (the contract is base.py's):

* ``allocate`` / ``free``: the block store, under its lock. They take this tier's own lock for
  a few microseconds (space.py bookkeeping), never wait for I/O and never do any; segment
  headers and summaries they make necessary are handed to the engine's queue.
* ``write`` / ``read``: the tier mover, outside the store's lock. They check the requests,
  queue one engine op per request and return a Future at once; ``TierFull`` when more than
  ``max_queued`` requests would be outstanding. Each write is one vectored write of [record
  header, the caller's buffer]; each read is one vectored read of [header, the caller's buffer]
  and is verified (header fields, tag, generation, payload XXH3) before it answers OK.
  Futures resolve on an engine thread: done-callbacks should be short.
* ``recover``: once, at start, before ``allocate``. Rebuilds the space state from the files
  (recovery.py) and returns the recovered blocks, oldest first.

Concurrency: one lock (``_lock``) guards the space state, the counters and the lane states.
It is never held across I/O, engine submission or a Future's completion (done-callbacks may
call back into ``free``), so there is no lock-order problem with the store's lock.

Faults: an I/O error marks its *lane* (one file) read-only (ENOSPC / EDQUOT / EROFS or a short
count on a write: existing records are still served) or off (EIO, short transfers, anything else); a monitor
thread also turns a lane off when its file is removed, replaced or truncated under us. Each
transition is logged once. Requests on an off lane answer IO_ERROR; when every lane is off the
tier is OFF: ``allocate`` returns nothing and requests answer CANCELLED. Nothing raises out of
the tier for an I/O failure.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, InvalidStateError

import numpy as np

from pegaflow.common.wire import block_record as rec
from pegaflow.server.tiers.base import (
    IO_ALIGN,
    MAX_TAG_BYTES,
    Extent,
    IoStatus,
    ReadRequest,
    RecoveredBlock,
    Reporter,
    Tier,
    TierFull,
    TierHealth,
    TierStats,
    WriteRequest,
    io_bytes,
)
from pegaflow.server.tiers.ssd.config import SsdTierOptions
from pegaflow.server.tiers.ssd.engines import IoPacer, open_engine
from pegaflow.server.tiers.ssd.engines.base import IoOp, aligned_buffer
from pegaflow.server.tiers.ssd.recovery import RecoveryResult, recover_volume
from pegaflow.server.tiers.ssd.segment_format import BLOCK, SegmentHeader, encode_summary
from pegaflow.server.tiers.ssd.space import Segment, Space
from pegaflow.server.tiers.ssd.volume import Lane, LaneState, Volume

log = logging.getLogger(__name__)

assert IO_ALIGN == rec.RECORD_ALIGN == BLOCK and MAX_TAG_BYTES <= rec.MAX_TAG_BYTES

HEADER_BYTES = rec.HEADER_BYTES  # per-record overhead on disk (plus padding to 4 KiB)
_READ_ONLY_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_CLOSE_WAIT_S = 10.0


class _Batch:
    """One write()/read() call: its Future resolves when every request has a status."""

    __slots__ = ("future", "statuses", "remaining", "lock")

    def __init__(self, n: int):
        self.future: Future[list[IoStatus]] = Future()
        self.statuses: list[IoStatus | None] = [None] * n
        self.remaining = n
        self.lock = threading.Lock()

    def done(self, i: int, status: IoStatus) -> None:
        with self.lock:
            self.statuses[i] = status
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            try:
                self.future.set_result(self.statuses)
            except InvalidStateError:  # the caller cancelled the future: nobody is waiting
                pass


def _finished(statuses: list[IoStatus]) -> Future[list[IoStatus]]:
    f: Future[list[IoStatus]] = Future()
    f.set_result(statuses)
    return f


def _buffer(mv: memoryview, length: int, writable: bool, what: str) -> memoryview:
    view = memoryview(mv)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    need = io_bytes(length)
    if len(view) < need:
        raise ValueError(f"{what} buffer of {len(view)} bytes, the extent needs io_bytes({length}) = {need}")
    if writable and view.readonly:
        raise ValueError(f"{what} buffer is read-only")
    if np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data % IO_ALIGN:
        raise ValueError(f"{what} buffer does not start on a {IO_ALIGN}-byte boundary (O_DIRECT needs it)")
    return view[:need]


class SsdTier(Tier):
    name = "ssd"
    persistent = True

    def __init__(self, options: SsdTierOptions, pacer: IoPacer | None = None):
        """``pacer``: the server's say over how much I/O runs at a moment (engines/base.py)."""
        self.options = options
        self._pacer = pacer
        self._volume = Volume(options)  # SsdConfigError: refuse to start
        v = self._volume
        try:
            self._engine = open_engine(
                options.io_engine, options.queue_depth, os.path.dirname(v.lanes[0].path), pacer
            )
        except BaseException:
            v.close()
            raise
        self._generations = itertools.count((v.boot_epoch << 32) + 1)
        self._space = Space(v.lane_count, v.segments_per_lane, v.segment_bytes, self._generations.__next__)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stats = TierStats(name=self.name, capacity_bytes=v.capacity_bytes)
        self._sequences = itertools.count((v.boot_epoch << 40) + 1)
        self._outstanding = 0
        self._internal = 0
        self._closing = False
        self._closed = False
        self._ready = v.fresh  # allocate waits for recover() when the files hold a layout
        self._recovered = False
        self.recovery: RecoveryResult | None = None  # what the last recover() found (diagnostics)
        self._health = TierHealth.OK
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_files, name="ssd-health", daemon=True)
        self._monitor.start()
        log.info(
            "ssd tier: %d path(s) %s, %d GiB in %d segments of %d MiB, engine %s (queue depth %d), %s",
            v.lane_count,
            ", ".join(la.path for la in v.lanes),
            v.capacity_bytes >> 30,
            v.segment_count,
            v.segment_bytes >> 20,
            self._engine.name,
            options.queue_depth,
            "fresh" if v.fresh else f"to recover (boot epoch {v.boot_epoch})",
        )

    # -- facts ----------------------------------------------------------------------------

    @property
    def engine_name(self) -> str:
        return self._engine.name

    @property
    def capacity_bytes(self) -> int:
        return self._volume.capacity_bytes

    @property
    def max_block_bytes(self) -> int:
        """The largest block ``allocate`` accepts (one record per segment)."""
        return self._space.max_record_bytes - HEADER_BYTES

    @property
    def health(self) -> TierHealth:
        return self._health

    def where(self, extent: Extent) -> tuple[str, int]:
        """(file, byte offset in it) of the record at ``extent`` (for logs, tools and tests)."""
        v = self._volume
        g, offset = divmod(extent.address, v.segment_bytes)
        return v.lanes[g % v.lane_count].path, v.segment_file_offset(g) + offset

    # -- space ----------------------------------------------------------------------------

    def allocate(self, block_bytes: int, count: int) -> list[Extent]:
        if count <= 0:
            return []
        with self._lock:
            if not self._ready:
                raise RuntimeError(
                    "SsdTier.allocate before recover(): the files' records would be overwritten"
                )
            if self._closing or self._health == TierHealth.OFF:
                return []
            extents = self._space.allocate(block_bytes, count)
            ops = self._segment_ops_locked()
        if ops:
            self._engine.submit(ops)
        return extents

    def free(self, extents: Sequence[Extent]) -> None:
        if not extents:
            return
        with self._lock:
            self._space.free(extents)
            ops = self._segment_ops_locked()
        if ops:
            self._engine.submit(ops)

    # -- I/O ------------------------------------------------------------------------------

    def write(self, requests: Sequence[WriteRequest]) -> Future[list[IoStatus]]:
        n = len(requests)
        if n == 0:
            return _finished([])
        views = []
        for r in requests:
            if len(r.tag) > MAX_TAG_BYTES:
                raise ValueError(f"tag of {len(r.tag)} bytes > MAX_TAG_BYTES ({MAX_TAG_BYTES})")
            views.append(_buffer(r.source, r.extent.length, False, "write source"))
        batch = _Batch(n)
        now: list[IoOp] = []
        with self._lock:
            if self._closing or self._health == TierHealth.OFF:
                return _finished([IoStatus.CANCELLED] * n)
            if self._outstanding + n > self.options.max_queued:
                self._stats.queue_full_drops += n
                raise TierFull(
                    f"ssd tier: {self._outstanding} requests outstanding, {n} more would pass "
                    f"{self.options.max_queued}"
                )
            located = self._space.begin_writes([r.extent for r in requests])
            self._outstanding += n
            for i, (r, view, (seg, offset)) in enumerate(zip(requests, views, located, strict=True)):
                op = _RecordWrite(self, batch, i, seg, offset, r, view)
                if seg.header_ready is None:
                    seg.waiters.append(op)  # submitted once the segment header is on disk
                else:
                    now.append(op)  # (header failed: prepare answers, the lane is not writable)
        if now:
            self._engine.submit(now)
        return batch.future

    def read(self, requests: Sequence[ReadRequest]) -> Future[list[IoStatus]]:
        n = len(requests)
        if n == 0:
            return _finished([])
        views = [_buffer(r.dest, r.extent.length, True, "read destination") for r in requests]
        batch = _Batch(n)
        with self._lock:
            if self._closing or self._health == TierHealth.OFF:
                return _finished([IoStatus.CANCELLED] * n)
            if self._outstanding + n > self.options.max_queued:
                self._stats.queue_full_drops += n
                raise TierFull(
                    f"ssd tier: {self._outstanding} requests outstanding, {n} more would pass "
                    f"{self.options.max_queued}"
                )
            located = [self._space.check_read(r.extent) for r in requests]
            self._outstanding += n
        ops = [
            _RecordRead(self, batch, i, seg, offset, r, view)
            for i, (r, view, (seg, offset)) in enumerate(zip(requests, views, located, strict=True))
        ]
        self._engine.submit(ops)
        return batch.future

    # -- recovery -------------------------------------------------------------------------

    def recover(self, report: Reporter) -> Iterator[RecoveredBlock]:
        """Rebuilds the space state from the files now (the work is done before this returns)
        and returns the recovered blocks, oldest first. Call once, before ``allocate``."""
        with self._lock:
            if self._recovered:
                raise RuntimeError("SsdTier.recover() called twice")
            self._recovered = True
        v = self._volume
        if v.fresh:
            with self._lock:
                self._ready = True
            return iter(())
        result = recover_volume(v, self._engine, report, self.options.recovery_verify)
        self.recovery = result
        with self._lock:
            self._space.restore(result.segments)
            self._stats.recovered_blocks = len(result.blocks)
            self._stats.recovery_skipped = result.skipped
            self._stats.recovery_seconds = result.seconds
            self._ready = True
            ops = self._segment_ops_locked()
        for lane, err in result.failed_lanes.items():
            self._lane_fault(v.lanes[lane], LaneState.OFF, f"unreadable at start: {os.strerror(err)}")
        if ops:
            self._engine.submit(ops)
        log.info(
            "ssd tier: recovered %d blocks (%.2f GiB) in %.3f s: %d segments from summaries, %d scanned; "
            "%d records skipped, %d older duplicates dropped",
            len(result.blocks),
            result.data_bytes / (1 << 30),
            result.seconds,
            result.summary_segments,
            result.scanned_segments,
            result.skipped,
            result.duplicates,
        )
        return iter(result.blocks)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until no request is outstanding and no segment header or summary write is in
        flight (e.g. before a planned stop, or in tests); False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._outstanding == 0 and self._internal == 0, timeout)

    # -- stats, close -----------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            out = TierStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})
            out.used_bytes = self._space.used_bytes
            out.queue_depth = self._outstanding
            out.paced_seconds = self._pacer.held_s if self._pacer is not None else 0.0
            out.health = self._health
            out.health_reason = "; ".join(
                f"{la.path}: {la.state}: {la.reason}" for la in self._volume.lanes if la.state != LaneState.OK
            )
        return out

    def close(self) -> None:
        """Cancels queued requests, lets in-flight ones finish, writes the summaries of segments
        that have none (a clean restart then reads no segment whole), stops the threads."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop.set()
        self._monitor.join()
        deadline = time.monotonic() + _CLOSE_WAIT_S
        with self._lock:
            self._idle.wait_for(lambda: self._outstanding == 0, timeout=_CLOSE_WAIT_S)
            if self._ready:
                self._space.seal_all()
                for seg in self._space.segments:
                    if seg.pending and not seg.summarized:
                        self._space.abandon_unwritten(seg)
            ops = self._segment_ops_locked()
        if ops:
            self._engine.submit(ops)
        with self._lock:
            self._idle.wait_for(lambda: self._internal == 0, timeout=max(0.0, deadline - time.monotonic()))
        self._engine.close()
        self._volume.close()
        self._closed = True

    # -- internals (engine threads) -------------------------------------------------------

    def _segment_ops_locked(self) -> list[IoOp]:
        """Header / summary writes that the last space change made necessary (lock held)."""
        opened, summarize = self._space.take_events()
        ops: list[IoOp] = []
        for seg in opened:
            header = _HeaderWrite(self, seg)
            if seg.internal:  # the previous generation's summary is still being written
                seg.deferred.append(header)
                continue
            self._space.internal_begin(seg)
            self._internal += 1
            ops.append(header)
        for seg in summarize:
            self._space.internal_begin(seg)
            self._internal += 1
            ops.append(_SummaryWrite(self, seg))
        return ops

    def _lane(self, seg: Segment) -> Lane:
        return self._volume.lanes[seg.lane]

    def _precheck(self, lane: Lane, deadline: float | None, write: bool) -> IoStatus | None:
        """Why a request must not start now (None: go)."""
        if self._closing:
            return IoStatus.CANCELLED
        if lane.state == LaneState.OFF or (write and lane.state == LaneState.READ_ONLY):
            return IoStatus.CANCELLED if self._health == TierHealth.OFF else IoStatus.IO_ERROR
        if deadline is not None and time.monotonic() > deadline:
            return IoStatus.TIMED_OUT
        return None

    def _record_done(self, op: _RecordOp, status: IoStatus, result: int | None) -> None:
        nbytes = op.request.extent.length
        with self._lock:
            if op.write:
                self._space.end_write(
                    op.seg, op.seg_offset, status == IoStatus.OK, op.sequence, op.request.tag
                )
                if status == IoStatus.OK:
                    self._stats.writes += 1
                    self._stats.write_bytes += nbytes
                elif status == IoStatus.IO_ERROR:
                    self._stats.write_errors += 1
            else:
                if status == IoStatus.OK:
                    self._stats.reads += 1
                    self._stats.read_bytes += nbytes
                elif status == IoStatus.IO_ERROR:
                    self._stats.read_errors += 1
                elif status == IoStatus.CORRUPT:
                    self._stats.corrupt_records += 1
            self._outstanding -= 1
            if self._outstanding == 0 or self._internal == 0:
                self._idle.notify_all()
            ops = self._segment_ops_locked()
        if result is not None:
            self._io_fault(self._lane(op.seg), result, op.expected, op.write)
        if ops:
            self._engine.submit(ops)
        op.batch.done(op.index, status)

    def _segment_io_done(self, op: _SegmentOp, ok: bool, result: int | None) -> None:
        seg = op.seg
        waiters: list[IoOp] = []
        with self._lock:
            if isinstance(op, _HeaderWrite):
                seg.header_ready = ok
                waiters, seg.waiters = seg.waiters, []
            self._space.internal_end(seg)
            self._internal -= 1
            ops = self._segment_ops_locked()
            if not seg.internal and seg.deferred:
                ops.append(seg.deferred.pop(0))
                self._space.internal_begin(seg)
                self._internal += 1
            if self._internal == 0 or self._outstanding == 0:
                self._idle.notify_all()
        if result is not None:
            self._io_fault(self._lane(seg), result, op.expected, True)
        if ops:
            self._engine.submit(ops)
        if ok:
            if waiters:
                self._engine.submit(waiters)
        else:
            for w in waiters:
                w.finish(self._precheck(self._lane(seg), None, True) or IoStatus.IO_ERROR)

    def _io_fault(self, lane: Lane, result: int, expected: int, write: bool) -> None:
        """Classifies a failed transfer and degrades its lane (once per state change)."""
        if result < 0:
            err = -result
            if err == errno.ECANCELED:
                return
            name = errno.errorcode.get(err, str(err))
            why = f"{'write' if write else 'read'} failed: {os.strerror(err)} ({name})"
            state = LaneState.READ_ONLY if write and err in _READ_ONLY_ERRNOS else LaneState.OFF
        elif write:  # a direct write stops short when the file system runs out of blocks midway
            why = f"short write ({result} of {expected} bytes): no space left?"
            state = LaneState.READ_ONLY
        else:
            why = f"short read ({result} of {expected} bytes): file truncated?"
            state = LaneState.OFF
        self._lane_fault(lane, state, why)

    def _lane_fault(self, lane: Lane, state: str, why: str) -> None:
        rank = {LaneState.OK: 0, LaneState.READ_ONLY: 1, LaneState.OFF: 2}
        with self._lock:
            if rank[state] <= rank[lane.state]:
                return
            lane.state, lane.reason = state, why
            self._space.disable_lane(lane.index)
            lanes = self._volume.lanes
            if all(la.state == LaneState.OFF for la in lanes):
                self._health = TierHealth.OFF
            else:
                self._health = TierHealth.DEGRADED
            serving = sum(la.state != LaneState.OFF for la in lanes)
            writable = sum(la.state == LaneState.OK for la in lanes)
            ops = self._segment_ops_locked()
        log.error(
            "ssd tier: %s is now %s: %s; %d of %d path(s) serving, %d writable%s",
            lane.path,
            state,
            why,
            serving,
            len(lanes),
            writable,
            "; the SSD tier is OFF (DRAM serving is unaffected)" if serving == 0 else "",
        )
        if ops:
            self._engine.submit(ops)

    def _watch_files(self) -> None:
        """Turns a lane off when its file was removed, replaced or truncated while we run."""
        interval = self.options.health_check_interval_s
        while not self._stop.wait(interval):
            for lane in self._volume.lanes:
                if lane.state == LaneState.OFF:
                    continue
                why = None
                try:
                    st = os.stat(lane.path)
                    if (st.st_dev, st.st_ino) != lane.inode:
                        why = "file replaced at run time (another file now has its name)"
                    elif st.st_size < lane.file_bytes:
                        why = f"file truncated at run time ({st.st_size} bytes, layout: {lane.file_bytes})"
                except FileNotFoundError:
                    why = "file removed at run time"
                except OSError as e:
                    why = f"cannot stat the file: {e.strerror}"
                if why:
                    self._lane_fault(lane, LaneState.OFF, why)


# -- engine ops ---------------------------------------------------------------------------------


class _RecordOp(IoOp):
    __slots__ = ("tier", "batch", "index", "seg", "request", "view", "sequence", "expected", "seg_offset")

    def __init__(
        self, tier: SsdTier, batch: _Batch, index: int, seg: Segment, offset: int, request, view, write
    ):
        lane = tier._lane(seg)
        v = tier._volume
        super().__init__(write, lane.fd, v.segment_file_offset(seg.gid) + offset)
        self.tier = tier
        self.batch = batch
        self.index = index
        self.seg = seg
        self.seg_offset = offset
        self.request = request
        self.view = view
        self.sequence = 0
        self.expected = HEADER_BYTES + len(view)

    def finish(self, status: IoStatus, result: int | None = None) -> None:
        self.tier._record_done(self, status, result)

    def cancel(self) -> None:
        self.finish(IoStatus.CANCELLED)


class _RecordWrite(_RecordOp):
    __slots__ = ()

    def __init__(self, tier, batch, index, seg, offset, request: WriteRequest, view):
        super().__init__(tier, batch, index, seg, offset, request, view, True)

    def prepare(self, scratch: memoryview):
        tier = self.tier
        status = tier._precheck(tier._lane(self.seg), self.request.deadline, True)
        if status is not None:
            self.finish(status)
            return None
        self.sequence = next(tier._sequences)
        header = rec.build_header(
            self.request.tag,
            self.view,
            self.request.extent.length,
            sequence=self.sequence,
            generation=self.seg.generation,
            volume_id=tier._volume.volume_id,
            payload_checksum=self.request.checksum,
        )
        rec.encode_header(header, scratch)
        return [scratch, self.view]

    def complete(self, result: int) -> None:
        if result == self.expected:
            self.finish(IoStatus.OK)
        else:
            self.finish(IoStatus.IO_ERROR, result)


class _RecordRead(_RecordOp):
    __slots__ = ("header_view",)

    def __init__(self, tier, batch, index, seg, offset, request: ReadRequest, view):
        super().__init__(tier, batch, index, seg, offset, request, view, False)
        self.header_view = None

    def prepare(self, scratch: memoryview):
        tier = self.tier
        status = tier._precheck(tier._lane(self.seg), self.request.deadline, False)
        if status is not None:
            self.finish(status)
            return None
        self.header_view = scratch
        return [scratch, self.view]

    def complete(self, result: int) -> None:
        if result != self.expected:
            self.finish(IoStatus.IO_ERROR, result)
            return
        self.finish(IoStatus.OK if self._verified() else IoStatus.CORRUPT)

    def _verified(self) -> bool:
        try:
            h = rec.decode_header(self.header_view)
        except rec.RecordError:
            return False
        r = self.request
        if (h.tag, h.payload_len, h.generation, h.volume_id) != (
            bytes(r.tag),
            r.extent.length,
            self.seg.generation,
            self.tier._volume.volume_id,
        ):
            return False
        return rec.payload_matches(h, self.view)


class _SegmentOp(IoOp):
    __slots__ = ("tier", "seg", "buf", "expected")

    def __init__(self, tier: SsdTier, seg: Segment, file_offset: int):
        super().__init__(True, tier._lane(seg).fd, file_offset)
        self.tier = tier
        self.seg = seg
        self.buf = None
        self.expected = 0

    def _lane_refuses(self) -> bool:
        lane = self.tier._lane(self.seg)
        return lane.state != LaneState.OK and not (
            lane.state == LaneState.READ_ONLY and isinstance(self, _SummaryWrite)
        )

    def complete(self, result: int) -> None:
        if result == self.expected:
            self.tier._segment_io_done(self, True, None)
        else:
            self.tier._segment_io_done(self, False, result)

    def cancel(self) -> None:
        self.tier._segment_io_done(self, False, None)


class _HeaderWrite(_SegmentOp):
    """The segment header of a new generation; record writes of the segment wait for it."""

    __slots__ = ()

    def __init__(self, tier: SsdTier, seg: Segment):
        v = tier._volume
        super().__init__(tier, seg, v.segment_file_offset(seg.gid))
        self.buf = aligned_buffer(BLOCK)
        self.buf[:] = SegmentHeader(
            v.volume_id, seg.lane, seg.index, seg.generation, v.segment_bytes
        ).encode()
        self.expected = BLOCK

    def prepare(self, scratch):
        if self._lane_refuses():
            self.tier._segment_io_done(self, False, None)
            return None
        return [self.buf]


class _SummaryWrite(_SegmentOp):
    """Summary + footer of a sealed segment, one write ending at the segment's end."""

    __slots__ = ("generation",)

    def __init__(self, tier: SsdTier, seg: Segment):
        super().__init__(tier, seg, 0)
        self.generation = seg.generation

    def prepare(self, scratch):
        if self._lane_refuses():
            self.tier._segment_io_done(self, False, None)
            return None
        tier, seg = self.tier, self.seg
        v = tier._volume
        with tier._lock:
            generation = seg.generation
            stale = generation != self.generation or not seg.extents
            entries = [] if stale else tier._space.summary_entries(seg)
        if stale:  # every block of it was freed meanwhile (maybe reopened): nothing to summarize
            tier._segment_io_done(self, True, None)
            return None
        offset, tail = encode_summary(entries, v.volume_id, generation, v.segment_bytes)
        self.buf = aligned_buffer(len(tail))
        self.buf[:] = tail
        self.expected = len(tail)
        self.offset = v.segment_file_offset(seg.gid) + offset
        return [self.buf]
