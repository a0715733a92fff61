"""Recovery: what the tier's files still hold after a restart (clean or kill -9), read through
the tier's own I/O engine, so the reads are O_DIRECT, parallel and off the GIL.

Per segment (all segments of all lanes, in parallel batches):

1. Read the segment header (first 4 KiB) and the tail (last 64 KiB: footer + summary).
   No header: never used since the file was initialised: FREE. A damaged header: reported, and
   nothing in the segment is trusted. The header's generation is the only one whose records
   count: a record of an earlier fill of the segment is stale and never comes back.
2. A footer of the header's generation with a summary that checks out lists the segment's
   records: no record is read (``verify="summary"``, the default: reads check every record they
   serve anyway). ``verify="headers"`` reads each listed record's header block and drops what
   does not match; ``verify="full"`` ignores summaries and scans every segment.
3. Otherwise (the segment being written at the crash, or a summary that did not make it) the
   segment is *scanned*: read whole, records found front to back at 4 KiB steps, every record's
   header and payload checksummed. Torn, corrupt and partial records are reported through
   ``report(where, why)`` and skipped; a valid header of another generation is stale (silent).
4. The newest sequence number of each tag wins; older copies are dropped (freed internally).

Like LevelDB's log::Reader, recovery never guesses: what it cannot vouch for is reported and
left out; the tier's space state is rebuilt from exactly what it yields (space.Space.restore).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future

from pegaflow.common.wire import block_record as rec
from pegaflow.server.tiers.base import Extent, RecoveredBlock
from pegaflow.server.tiers.ssd.engines.base import IoEngine, IoOp, aligned_buffer
from pegaflow.server.tiers.ssd.segment_format import (
    BLOCK,
    Footer,
    FormatError,
    SegmentHeader,
    decode_summary,
)
from pegaflow.server.tiers.ssd.volume import Volume

log = logging.getLogger(__name__)

TAIL_BYTES = 64 * 1024
SCAN_CHUNK = 8 << 20
HEADER_BATCH = 256  # segments whose header + tail are read per batch (bounds memory: 17 MiB)


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    offset: int
    payload_len: int
    sequence: int
    tag: bytes


@dataclasses.dataclass
class SegmentFound:
    gid: int
    generation: int = 0
    records: list[Found] = dataclasses.field(default_factory=list)
    summarized: bool = False  # recovered from a summary (no need to write one)


@dataclasses.dataclass
class RecoveryResult:
    segments: list[SegmentFound]
    blocks: list[RecoveredBlock]  # oldest first (sequence order)
    skipped: int = 0
    duplicates: int = 0
    scanned_segments: int = 0
    summary_segments: int = 0
    data_bytes: int = 0  # bytes of the recovered records
    seconds: float = 0.0
    failed_lanes: dict[int, int] = dataclasses.field(default_factory=dict)  # lane -> errno seen


class _Read(IoOp):
    """One plain read into ``buf`` for recovery; resolves ``future`` with the byte count or -errno."""

    __slots__ = ("buf", "future")

    def __init__(self, fd: int, offset: int, buf: memoryview):
        super().__init__(False, fd, offset)
        self.buf = buf
        self.future: Future[int] = Future()

    def prepare(self, scratch):
        return [self.buf]

    def complete(self, result: int) -> None:
        self.future.set_result(result)

    def cancel(self) -> None:
        self.future.set_result(-errno.ECANCELED)


def _read_all(engine: IoEngine, reads: list[tuple[int, int, memoryview]]) -> list[int]:
    ops = [_Read(fd, off, buf) for fd, off, buf in reads]
    engine.submit(ops)
    return [op.future.result() for op in ops]


class _Recovery:
    def __init__(self, volume: Volume, engine: IoEngine, report: Callable[[str, str], None], verify: str):
        self.v = volume
        self.engine = engine
        self._report = report
        self.verify = verify
        self.result = RecoveryResult(
            segments=[SegmentFound(g) for g in range(volume.segment_count)], blocks=[]
        )

    def report(self, g: int, offset: int, why: str) -> None:
        self.result.skipped += 1
        try:
            self._report(self.v.where(g, offset), why)
        except Exception:  # a reporter's bug must not stop recovery
            log.exception("ssd recovery: the reporter raised")

    def _io_failed(self, g: int, offset: int, res: int, what: str) -> None:
        lane = g % self.v.lane_count
        err = -res if res < 0 else errno.EIO
        if lane not in self.result.failed_lanes:
            self.result.failed_lanes[lane] = err
        self.report(g, offset, f"{what} unreadable: {os.strerror(err) if res < 0 else f'short read ({res})'}")

    # -- step 1-2 ---------------------------------------------------------------------------

    def run(self) -> RecoveryResult:
        t0 = time.monotonic()
        v = self.v
        seg_bytes = v.segment_bytes
        tail = min(TAIL_BYTES, seg_bytes - BLOCK)
        to_scan: list[tuple[int, int]] = []  # (g, generation)
        to_check: list[tuple[int, int, list[Found]]] = []
        gids = [g for g in range(v.segment_count) if g % v.lane_count not in self.result.failed_lanes]
        for start in range(0, len(gids), HEADER_BATCH):
            batch = gids[start : start + HEADER_BATCH]
            heads = aligned_buffer(BLOCK * len(batch))
            tails = aligned_buffer(tail * len(batch))
            reads = []
            for i, g in enumerate(batch):
                fd = v.lanes[g % v.lane_count].fd
                base = v.segment_file_offset(g)
                reads.append((fd, base, heads[i * BLOCK : (i + 1) * BLOCK]))
                reads.append((fd, base + seg_bytes - tail, tails[i * tail : (i + 1) * tail]))
            results = _read_all(self.engine, reads)
            for i, g in enumerate(batch):
                rh, rt = results[2 * i], results[2 * i + 1]
                if rh != BLOCK:
                    self._io_failed(g, 0, rh, "segment header")
                    continue
                gen = self._segment_generation(g, heads[i * BLOCK : (i + 1) * BLOCK])
                if gen is None:
                    continue
                self.result.segments[g].generation = gen
                entries = None
                if self.verify != "full" and rt == tail:
                    entries = self._summary(g, gen, tails[i * tail : (i + 1) * tail])
                if entries is None:
                    to_scan.append((g, gen))
                elif self.verify == "headers":
                    to_check.append((g, gen, entries))
                else:
                    self._accept(g, entries, summarized=True)
            del heads, tails
        for g, gen, entries in to_check:
            self._check_headers(g, gen, entries)
        if to_scan:
            buf = aligned_buffer(seg_bytes)
            for g, gen in to_scan:
                if g % v.lane_count not in self.result.failed_lanes:
                    self._scan(g, gen, buf)
        self._dedup()
        self.result.seconds = time.monotonic() - t0
        return self.result

    def _segment_generation(self, g: int, block) -> int | None:
        lane, index = self.v.segment_lane(g)
        try:
            head = SegmentHeader.decode(block)
        except FormatError as e:
            if str(e).startswith("no "):
                return None  # never used: nothing to say
            self.report(g, 0, f"{e}: the segment's records are not trusted")
            return None
        if (head.volume_id, head.lane, head.index, head.segment_bytes) != (
            self.v.volume_id,
            lane,
            index,
            self.v.segment_bytes,
        ):
            self.report(g, 0, "segment header of another layout: the segment's records are not trusted")
            return None
        return head.generation

    def _summary(self, g: int, gen: int, tail) -> list[Found] | None:
        try:
            footer = Footer.decode(tail[len(tail) - BLOCK :])
        except FormatError as e:
            if not str(e).startswith("no "):
                self.report(g, self.v.segment_bytes - BLOCK, f"{e}; scanning the segment instead")
            return None
        if footer.volume_id != self.v.volume_id or footer.generation != gen:
            return None  # a summary of an earlier fill: the segment was being refilled
        if footer.summary_len + BLOCK > len(tail):
            tail = self._read_tail(g, footer.summary_len)
            if tail is None:
                return None
        try:
            entries = decode_summary(tail, footer, self.v.segment_bytes)
        except FormatError as e:
            self.report(g, self.v.segment_bytes - BLOCK, f"{e}; scanning the segment instead")
            return None
        return [Found(e.offset, e.payload_len, e.sequence, e.tag) for e in entries]

    def _read_tail(self, g: int, summary_len: int):
        nbytes = -(-(summary_len + BLOCK) // BLOCK) * BLOCK
        buf = aligned_buffer(nbytes)
        fd = self.v.lanes[g % self.v.lane_count].fd
        off = self.v.segment_file_offset(g) + self.v.segment_bytes - nbytes
        (res,) = _read_all(self.engine, [(fd, off, buf)])
        if res != nbytes:
            self._io_failed(g, self.v.segment_bytes - nbytes, res, "segment summary")
            return None
        return buf

    def _accept(self, g: int, found: list[Found], summarized: bool) -> None:
        seg = self.result.segments[g]
        seg.records = found
        seg.summarized = summarized
        if summarized:
            self.result.summary_segments += 1

    # -- step 2b: verify="headers" --------------------------------------------------------------

    def _check_headers(self, g: int, gen: int, entries: list[Found]) -> None:
        fd = self.v.lanes[g % self.v.lane_count].fd
        base = self.v.segment_file_offset(g)
        buf = aligned_buffer(BLOCK * max(1, len(entries)))
        views = [buf[i * BLOCK : (i + 1) * BLOCK] for i in range(len(entries))]
        results = _read_all(self.engine, [(fd, base + e.offset, views[i]) for i, e in enumerate(entries)])
        good = []
        for e, view, res in zip(entries, views, results, strict=True):
            if res != BLOCK:
                self._io_failed(g, e.offset, res, "record header")
                continue
            try:
                h = rec.decode_header(view)
            except rec.RecordError as err:
                self.report(g, e.offset, str(err))
                continue
            if (h.tag, h.payload_len, h.sequence, h.generation, h.volume_id) != (
                e.tag,
                e.payload_len,
                e.sequence,
                gen,
                self.v.volume_id,
            ):
                self.report(g, e.offset, "record header does not match the segment summary")
                continue
            good.append(e)
        self._accept(g, good, summarized=True)

    # -- step 3: scan -----------------------------------------------------------------------

    def _scan(self, g: int, gen: int, buf: memoryview) -> None:
        v = self.v
        seg_bytes = v.segment_bytes
        fd = v.lanes[g % v.lane_count].fd
        base = v.segment_file_offset(g)
        end = seg_bytes - BLOCK
        reads = [
            (fd, base + off, buf[off : min(off + SCAN_CHUNK, end)]) for off in range(BLOCK, end, SCAN_CHUNK)
        ]
        for (_, off, view), res in zip(reads, _read_all(self.engine, reads), strict=True):
            if res != len(view):
                self._io_failed(g, off - base, res, "segment data")
                return
        self.result.scanned_segments += 1
        found = []
        pos = BLOCK
        while pos + BLOCK <= end:
            block = buf[pos : pos + BLOCK]
            if bytes(block[:4]) != rec.MAGIC:
                pos += BLOCK
                continue
            try:
                h = rec.decode_header(block)
            except rec.RecordError as err:
                self.report(g, pos, str(err))
                pos += BLOCK
                continue
            if h.volume_id != v.volume_id or h.generation != gen:
                pos += BLOCK  # stale: a record of an earlier fill of this segment
                continue
            span = h.record_bytes
            if pos + span > end:
                self.report(g, pos, "record runs past the segment's end (partial record)")
                pos += BLOCK
                continue
            if not rec.payload_matches(h, buf[pos + BLOCK : pos + BLOCK + h.payload_len]):
                self.report(g, pos, "payload checksum mismatch (torn or corrupt record)")
                pos += span
                continue
            found.append(Found(pos, h.payload_len, h.sequence, h.tag))
            pos += span
        self._accept(g, found, summarized=False)

    # -- step 4 -------------------------------------------------------------------------------

    def _dedup(self) -> None:
        seg_bytes = self.v.segment_bytes
        newest: dict[bytes, tuple[int, int, Found]] = {}
        for seg in self.result.segments:
            for f in seg.records:
                cur = newest.get(f.tag)
                if cur is None or f.sequence > cur[0]:
                    newest[f.tag] = (f.sequence, seg.gid, f)
        keep = {(gid, f.offset) for _, gid, f in newest.values()}
        for seg in self.result.segments:
            before = len(seg.records)
            seg.records = [f for f in seg.records if (seg.gid, f.offset) in keep]
            self.result.duplicates += before - len(seg.records)
        blocks = sorted(newest.values(), key=lambda t: t[0])
        self.result.blocks = [
            RecoveredBlock(f.tag, Extent(gid * seg_bytes + f.offset, f.payload_len)) for _, gid, f in blocks
        ]
        self.result.data_bytes = sum(f.payload_len for _, _, f in blocks)


def recover_volume(
    volume: Volume, engine: IoEngine, report: Callable[[str, str], None], verify: str = "summary"
) -> RecoveryResult:
    """Everything the volume's files still hold that can be vouched for (see the module docstring)."""
    return _Recovery(volume, engine, report, verify).run()
