"""Where records go: segments, their states, FIFO reuse, per-extent bookkeeping. No I/O here.

Not thread-safe: the tier calls every method under its own short lock (the block store's
``allocate``/``free`` and the engine threads' completions both end up here). Each call is O(1)
per extent (plus O(lanes) to find a lane with room), never blocks and never does I/O; what
needs I/O (a segment header to write, a summary to write) is handed back as *events* the tier
turns into engine ops outside the lock.

Segments, per lane::

    FREE --open--> OPEN --full / lane off--> SEALED
      ^                                          |
      +---- every extent freed (next generation; its header write queued) ----+

* Each lane has at most one OPEN segment; ``allocate`` hands out extents round-robin over the
  lanes that can write (extent k of a call goes to the lane after extent k-1's), each from its
  lane's open segment, front to back. A segment that cannot fit the next record is SEALED and
  the lane opens the first segment of its FREE queue; with none free the lane is *stalled* and
  ``allocate`` returns fewer extents (the store frees its oldest blocks and asks again).
* The block store frees in allocation order, so each lane's oldest segment empties first and
  goes to the back of that lane's FREE queue: space is reused FIFO and never grows.
* A record of ``b`` bytes occupies ``record_bytes(b)`` (4 KiB header + b rounded up to 4 KiB).
  A segment keeps its first 4 KiB (segment header), its last 4 KiB (footer) and room for a
  summary entry per record (``summary_reserve``) free of records.

A segment's writes are ordered: the summary of generation G completes before the header of G+1
is written, which completes before any record of G+1 is written (the tier enforces the last two
with ``deferred`` and ``waiters``).

Extent states: ALLOCATED -> WRITING -> WRITTEN (or FAILED, which may be written again); freed
from any state but WRITING. A SEALED segment with no ALLOCATED/WRITING extent and a WRITTEN one
gets a summary (event); its extents stay live until freed.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from pegaflow.common.wire.block_record import record_bytes
from pegaflow.server.tiers.base import Extent
from pegaflow.server.tiers.ssd.segment_format import BLOCK, SummaryEntry, summary_reserve

FREE, OPEN, SEALED = "free", "open", "sealed"
ALLOCATED, WRITING, WRITTEN, FAILED = 0, 1, 2, 3


class Segment:
    __slots__ = (
        "gid",
        "lane",
        "index",
        "state",
        "generation",
        "prev_generation",
        "cursor",
        "count",
        "extents",
        "pending",
        "live_bytes",
        "header_ready",
        "waiters",
        "internal",
        "deferred",
        "summarized",
        "needs_header",
    )

    def __init__(self, gid: int, lane: int, index: int):
        self.gid = gid
        self.lane = lane
        self.index = index
        self.state = FREE
        self.generation = 0
        self.prev_generation = 0  # what the segment held before (orders the FREE queue after a restart)
        self.cursor = BLOCK
        self.count = 0  # records placed in this generation (for the summary reserve)
        # offset -> [state, payload_len, sequence, tag]
        self.extents: dict[int, list] = {}
        self.pending = 0  # ALLOCATED + WRITING
        self.live_bytes = 0
        self.header_ready: bool | None = False
        self.waiters: list = []  # record writes waiting for the segment header (the tier's ops)
        self.internal = 0  # segment-level writes in flight (header, summary)
        self.deferred: list = []  # a header write waiting for the previous generation's summary
        self.summarized = False
        self.needs_header = True  # its next generation's header is not written yet

    def __repr__(self) -> str:
        return f"Segment(g={self.gid}, {self.state}, gen={self.generation:#x}, live={len(self.extents)})"


class Space:
    def __init__(self, lanes: int, segments_per_lane: int, segment_bytes: int, new_generation):
        self.lanes = lanes
        self.segment_bytes = segment_bytes
        self._new_generation = new_generation  # () -> int, unique and increasing
        self.segments = [Segment(g, g % lanes, g // lanes) for g in range(lanes * segments_per_lane)]
        self.free_queue: list[collections.deque[Segment]] = [collections.deque() for _ in range(lanes)]
        for seg in self.segments:
            self.free_queue[seg.lane].append(seg)
        self.open: list[Segment | None] = [None] * lanes
        self.writable = [True] * lanes
        self._next_lane = 0
        self.used_bytes = 0
        # Events for the tier (drained by take_events):
        self.opened: list[Segment] = []  # need their header written
        self.to_summarize: list[Segment] = []
        self.max_record_bytes = segment_bytes - 2 * BLOCK - summary_reserve(1)

    # -- lookups ----------------------------------------------------------------------------

    def locate(self, address: int) -> tuple[Segment, int]:
        g, offset = divmod(address, self.segment_bytes)
        if not 0 <= g < len(self.segments):
            raise ValueError(f"address {address} is not in this tier")
        return self.segments[g], offset

    def address(self, seg: Segment, offset: int) -> int:
        return seg.gid * self.segment_bytes + offset

    # -- allocate / free --------------------------------------------------------------------

    def allocate(self, block_bytes: int, count: int) -> list[Extent]:
        span = record_bytes(block_bytes)
        if block_bytes <= 0 or span > self.max_record_bytes:
            raise ValueError(
                f"block of {block_bytes} bytes does not fit a segment of {self.segment_bytes} bytes "
                f"(largest block: {self.max_record_bytes - BLOCK})"
            )
        out: list[Extent] = []
        stalled = [not w for w in self.writable]
        n_stalled = sum(stalled)
        lane = self._next_lane
        while len(out) < count and n_stalled < self.lanes:
            if not stalled[lane]:
                seg = self._room(lane, span)
                if seg is None:
                    stalled[lane] = True
                    n_stalled += 1
                else:
                    offset = seg.cursor
                    seg.cursor += span
                    seg.count += 1
                    seg.extents[offset] = [ALLOCATED, block_bytes, 0, b""]
                    seg.pending += 1
                    seg.live_bytes += span
                    self.used_bytes += span
                    out.append(Extent(self.address(seg, offset), block_bytes))
                    lane = (lane + 1) % self.lanes
                    continue
            lane = (lane + 1) % self.lanes
        self._next_lane = lane
        return out

    def _fits(self, seg: Segment, span: int) -> bool:
        return seg.cursor + span + summary_reserve(seg.count + 1) + BLOCK <= self.segment_bytes

    def _new_header(self, seg: Segment) -> None:
        """Gives ``seg`` its next generation; the tier writes that header (event ``opened``)."""
        seg.prev_generation = seg.generation
        seg.generation = self._new_generation()
        seg.header_ready = None  # None: being written; True: on disk; False: the write failed
        seg.needs_header = False
        self.opened.append(seg)

    def _room(self, lane: int, span: int) -> Segment | None:
        seg = self.open[lane]
        if seg is not None and self._fits(seg, span):
            return seg
        if seg is not None:
            self._seal(seg)
        queue = self.free_queue[lane]
        if not queue:
            return None
        seg = queue.popleft()
        seg.state = OPEN
        if seg.needs_header:  # (else its next generation's header went out when it emptied)
            self._new_header(seg)
        seg.cursor = BLOCK
        seg.count = 0
        seg.summarized = False
        self.open[lane] = seg
        return seg

    def _seal(self, seg: Segment) -> None:
        seg.state = SEALED
        if self.open[seg.lane] is seg:
            self.open[seg.lane] = None
        self._settle(seg)

    def _settle(self, seg: Segment) -> None:
        """A sealed segment either needs its summary, or is empty and goes back to FREE.

        An emptied segment gets its next generation's header at once: on disk it invalidates
        every record the segment held (a restart does not bring freed blocks back), and the
        segment's next fill need not wait for it. It is reusable at once, even while its
        summary write is still in flight: the tier holds the header write (and so every record
        write) until the segment's earlier writes have completed (``Segment.deferred``)."""
        if seg.state != SEALED or seg.pending:
            return
        if not seg.extents:
            seg.state = FREE
            self._new_header(seg)
            self.free_queue[seg.lane].append(seg)
        elif not seg.summarized and any(e[0] == WRITTEN for e in seg.extents.values()):
            seg.summarized = True  # claimed: the summary write is about to be queued
            self.to_summarize.append(seg)

    def free(self, extents: Sequence[Extent]) -> None:
        located = []
        for ext in extents:  # check everything before changing anything
            seg, offset = self.locate(ext.address)
            entry = seg.extents.get(offset)
            if entry is None:
                raise ValueError(f"free of an extent the SSD tier did not hand out (or freed twice): {ext}")
            if entry[0] == WRITING:
                raise ValueError(f"free of an extent while it is being written: {ext}")
            located.append((seg, offset))
        for seg, offset in located:
            entry = seg.extents.pop(offset, None)
            if entry is None:  # the same extent twice in one call
                continue
            if entry[0] == ALLOCATED:
                seg.pending -= 1
            span = record_bytes(entry[1])
            seg.live_bytes -= span
            self.used_bytes -= span
            self._settle(seg)

    # -- writes -----------------------------------------------------------------------------

    def begin_writes(self, extents: Sequence[Extent]) -> list[tuple[Segment, int]]:
        """Marks ``extents`` WRITING (all or none: raises ValueError before changing anything)."""
        located = []
        seen = set()
        for ext in extents:
            seg, offset = self.locate(ext.address)
            entry = seg.extents.get(offset)
            if entry is None or entry[1] != ext.length:
                raise ValueError(f"write to an extent the SSD tier did not hand out: {ext}")
            if entry[0] == WRITING or entry[0] == WRITTEN or ext.address in seen:
                raise ValueError(f"extent {ext} is already written or being written")
            seen.add(ext.address)
            located.append((seg, offset))
        for seg, offset in located:
            entry = seg.extents[offset]
            if entry[0] == FAILED:
                seg.pending += 1
            entry[0] = WRITING
        return located

    def end_write(self, seg: Segment, offset: int, ok: bool, sequence: int, tag: bytes) -> None:
        entry = seg.extents[offset]
        seg.pending -= 1
        if ok:
            entry[0], entry[2], entry[3] = WRITTEN, sequence, tag
        else:
            entry[0] = FAILED
        self._settle(seg)

    def check_read(self, ext: Extent) -> tuple[Segment, int]:
        seg, offset = self.locate(ext.address)
        entry = seg.extents.get(offset)
        if entry is None or entry[0] != WRITTEN or entry[1] != ext.length:
            raise ValueError(f"read of an extent that holds no written record of this length: {ext}")
        return seg, offset

    # -- segment-level I/O ------------------------------------------------------------------

    def internal_begin(self, seg: Segment) -> None:
        seg.internal += 1

    def internal_end(self, seg: Segment) -> None:
        seg.internal -= 1
        self._settle(seg)

    def take_events(self) -> tuple[list[Segment], list[Segment]]:
        opened, self.opened = self.opened, []
        summarize, self.to_summarize = self.to_summarize, []
        return opened, summarize

    def summary_entries(self, seg: Segment) -> list[SummaryEntry]:
        return [
            SummaryEntry(off, e[1], e[2], e[3]) for off, e in sorted(seg.extents.items()) if e[0] == WRITTEN
        ]

    # -- lanes --------------------------------------------------------------------------------

    def disable_lane(self, lane: int) -> None:
        """No more allocation on ``lane``; its open segment is sealed."""
        self.writable[lane] = False
        seg = self.open[lane]
        if seg is not None:
            self._seal(seg)

    def seal_all(self) -> None:
        """Seals every open segment (at close: their summaries can be written)."""
        for seg in list(self.open):
            if seg is not None:
                self._seal(seg)

    def abandon_unwritten(self, seg: Segment) -> None:
        """At close: extents handed out but never written no longer hold the summary back."""
        for entry in seg.extents.values():
            if entry[0] == ALLOCATED:
                entry[0] = FAILED
                seg.pending -= 1
        self._settle(seg)

    # -- recovery -----------------------------------------------------------------------------

    def restore(self, found: Iterable) -> None:
        """Rebuilds the state from recovery (``recovery.SegmentFound`` per segment): segments with
        live records are SEALED and hold them; the rest are FREE, oldest content first."""
        for q in self.free_queue:
            q.clear()
        free = []
        for f in found:
            seg = self.segments[f.gid]
            seg.generation = f.generation
            seg.prev_generation = f.generation
            seg.extents = {r.offset: [WRITTEN, r.payload_len, r.sequence, r.tag] for r in f.records}
            seg.pending = 0
            seg.count = len(f.records)
            seg.live_bytes = sum(record_bytes(r.payload_len) for r in f.records)
            self.used_bytes += seg.live_bytes
            seg.header_ready = True
            seg.needs_header = True  # a FREE one gets a new generation when it is next opened
            if seg.extents:
                seg.state = SEALED
                seg.cursor = max(off + record_bytes(e[1]) for off, e in seg.extents.items())
                seg.summarized = f.summarized
                if not seg.summarized:
                    seg.summarized = True
                    self.to_summarize.append(seg)
            else:
                seg.state = FREE
                free.append(seg)
        for seg in sorted(free, key=lambda s: (s.prev_generation, s.index)):
            self.free_queue[seg.lane].append(seg)
