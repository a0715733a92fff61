"""Multi-size slab allocator over the pool region (see README.md here for the behaviour).

The pool is cut into equal slabs. A slab is free or assigned to exactly one
block size; an assigned slab is an array of equal slots. Namespaces with equal
block sizes share slabs. Because every slot of a slab has the same size, a freed
slot is always reusable by the next block of that size: there is no external
fragmentation *inside* a size, only (a) the tail of each slab that is smaller
than a slot and (b) free slots stranded in one size while another size needs
room. (b) is bounded by returning a slab to the free list as soon as it is
empty, and by ``reclaimable_slab``: when one size is out of room and the pool
is full, the engine evicts every block of a whole slab of another size and the
slab changes size, so no namespace can starve another.

Not thread-safe: the engine calls it under its own lock. Offsets are byte
offsets into the region; the allocator never touches the bytes.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Collection, Sequence

from pegaflow.server.config import MIB

MIN_SLAB_BYTES = 4 * MIB
MAX_SLAB_BYTES = 64 * MIB
# Slots start on this boundary so the GPU copy kernel can use 16-byte (and wider) loads.
SLOT_ALIGN = 256
# With a tier below DRAM, slots start on an O_DIRECT boundary and their stride is a multiple of it,
# so the SSD tier reads and writes a slot in place (tiers/base.py, IO_ALIGN), padding included.
IO_SLOT_ALIGN = 4096


def default_slab_bytes(capacity_bytes: int) -> int:
    """The largest power of two <= capacity/32, clamped to [4 MiB, 64 MiB].

    Aim: at least ~32 slabs so several block sizes can coexist in small pools,
    while slabs stay large enough for multi-MiB blocks. The slab size is also
    the largest block the pool serves.
    """
    target = max(capacity_bytes // 32, 1)
    slab = 1 << (target.bit_length() - 1)
    return max(MIN_SLAB_BYTES, min(MAX_SLAB_BYTES, slab))


def slot_stride(block_bytes: int, align: int = SLOT_ALIGN) -> int:
    return -(-block_bytes // align) * align


class _Slab:
    __slots__ = ("index", "part", "base", "block_bytes", "stride", "nslots", "free", "used", "holds")

    def __init__(self, index: int, part: int, base: int, block_bytes: int, stride: int, nslots: int):
        self.index = index
        self.part = part
        self.base = base
        self.block_bytes = block_bytes
        self.stride = stride
        self.nslots = nslots
        # Popped from the end: a fresh slab hands out ascending offsets, so a batch
        # of new blocks is contiguous and a client can copy it in one go.
        self.free = [base + i * stride for i in range(nslots - 1, -1, -1)]
        self.used = 0
        self.holds = 0  # blocks in this slab that must not move (being written or leased)


class _SizeClass:
    __slots__ = ("block_bytes", "stride", "slabs", "partial", "partial_heap", "used", "free_slots", "cuts")

    def __init__(self, block_bytes: int, stride: int):
        self.block_bytes = block_bytes
        self.stride = stride
        self.slabs: set[int] = set()
        # Slabs with at least one free slot. Filling the lowest-numbered first packs a
        # size into few slabs, so the others drain and can be handed back or moved.
        self.partial: set[int] = set()
        self.partial_heap: list[int] = []
        self.used = 0
        self.free_slots = 0  # free slots in this size's slabs
        self.cuts = 0  # slabs assigned to this size so far: each brings free slots of unknown contents


@dataclasses.dataclass(frozen=True)
class SizeClassStats:
    block_bytes: int
    slabs: int
    used_blocks: int
    free_slots: int
    slot_tail_bytes: int  # per-slab bytes too small for another slot, times slabs


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    capacity_bytes: int
    slab_bytes: int
    total_slabs: int
    free_slabs: int
    used_bytes: int  # sum of block_bytes of allocated blocks
    stranded_bytes: int  # bytes in assigned slabs not holding a block (free slots, tails, padding)
    unusable_bytes: int  # pool tail smaller than a slab
    classes: tuple[SizeClassStats, ...]


class SlabAllocator:
    """``part_slabs``: with tenant regions (tiers/dram/region.py), how many slabs each part after the
    first (the shared pool, which takes the rest) holds, in order. A slab belongs to one part for
    good: a part's blocks get only its slabs, so a tenant's region holds only its blocks."""

    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int | None = None,
        slot_align: int = SLOT_ALIGN,
        part_slabs: Sequence[int] = (),
    ):
        slab_bytes = slab_bytes or default_slab_bytes(capacity_bytes)
        if slot_align <= 0 or slot_align & (slot_align - 1):
            raise ValueError(f"slot_align must be a power of two, got {slot_align}")
        if slab_bytes <= 0 or slab_bytes % slot_align:
            raise ValueError(f"slab_bytes must be a positive multiple of {slot_align}, got {slab_bytes}")
        self.slot_align = slot_align
        if capacity_bytes < slab_bytes:
            raise ValueError(f"pool of {capacity_bytes} bytes is smaller than one slab ({slab_bytes} bytes)")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.total_slabs = capacity_bytes // slab_bytes
        self._slabs: list[_Slab | None] = [None] * self.total_slabs
        shared = self.total_slabs - sum(part_slabs)
        if shared < 1 or any(n < 1 for n in part_slabs):
            raise ValueError(
                f"{self.total_slabs} slabs cannot hold parts of {list(part_slabs)} slabs and a pool"
            )
        bounds = [0, shared]
        for n in part_slabs:
            bounds.append(bounds[-1] + n)
        self._part_of_slab = [p for p in range(len(bounds) - 1) for _ in range(bounds[p], bounds[p + 1])]
        self._part_bytes = [(bounds[p + 1] - bounds[p]) * slab_bytes for p in range(len(bounds) - 1)]
        # Per part, a min-heap: free slabs are handed out lowest address first, so a batch that needs
        # several gets adjacent ones when there are, and its blocks form one run (one long copy).
        self._free_by_part = [list(range(bounds[p], bounds[p + 1])) for p in range(len(bounds) - 1)]
        # Per slab, how many times it was cut into slots of a stride other than its last one (0: never
        # cut). A slot of a slab re-cut so straddles the old slots, whose bytes it holds: the block
        # store zeroes such a slot before granting it (see assignment()). A slab freed and cut again for
        # the same stride has the same slots, holding what they held.
        self._assignments = [0] * self.total_slabs
        self._last_stride = [0] * self.total_slabs
        self._classes: dict[tuple[int, int], _SizeClass] = {}  # (part, block bytes) -> its slabs
        self.used_bytes = 0
        self.slab_moves = 0  # slabs reassigned from one size to another

    @property
    def max_block_bytes(self) -> int:
        return self.slab_bytes

    @property
    def free_slabs(self) -> int:
        return sum(map(len, self._free_by_part))

    @property
    def parts(self) -> int:
        return len(self._free_by_part)

    def assignment(self, offset: int) -> int:
        """How many times the slab holding ``offset`` was cut into slots of a new stride, this cut
        included: 1 for a slab of a fresh pool cut for one stride only (its slots hold the pool's zeros
        or what a block of that slot wrote), more once it held slots of another stride or its bytes
        were forgotten (forget_contents)."""
        return self._assignments[offset // self.slab_bytes]

    def forget_contents(self) -> None:
        """Every slab's bytes are unknown from now on (a pool file a previous process wrote): its
        first cut counts as a re-cut (assignment() > 1), so the block store zeroes each slot before
        its first grant."""
        self._assignments = [max(n, 1) for n in self._assignments]

    def part_bytes(self, part: int) -> int:
        """The bytes of ``part``'s slabs."""
        return self._part_bytes[part]

    def part_of(self, offset: int) -> int:
        """The part (0: the shared pool) whose slab holds ``offset``."""
        return self._part_of_slab[offset // self.slab_bytes]

    def fits(self, block_bytes: int) -> bool:
        return 0 < block_bytes <= self.slab_bytes

    def allocate(self, block_bytes: int, hold: bool = False, part: int = 0) -> int | None:
        """Offset of a fresh slot for a block of this size, or None when neither a slot nor a slab is free.

        With ``hold`` the slot is also held (see ``hold``), in the same step.
        """
        got = self.allocate_many(block_bytes, 1, hold, part)
        return got[0] if got else None

    def allocate_many(self, block_bytes: int, count: int, hold: bool = False, part: int = 0) -> list[int]:
        """Up to ``count`` fresh slots of ``part`` (fewer when its free slots and slabs run out),
        ascending per slab."""
        cls = self._class(part, block_bytes)
        free_slabs = self._free_by_part[part]
        out: list[int] = []
        while len(out) < count:
            slab = self._partial_slab(cls)
            if slab is None:
                if not free_slabs:
                    break
                slab = self._assign_slab(cls, heapq.heappop(free_slabs))
            take = min(count - len(out), len(slab.free))
            taken = slab.free[-take:]
            del slab.free[-take:]
            # Ascending, so blocks freed together (an evicted batch) are handed out as one run.
            taken.sort()
            out.extend(taken)
            slab.used += take
            if hold:
                slab.holds += take
            if not slab.free:
                cls.partial.discard(slab.index)
        cls.used += len(out)
        cls.free_slots -= len(out)
        self.used_bytes += len(out) * block_bytes
        return out

    def available(self, block_bytes: int, part: int = 0) -> int:
        """Slots a block of this size could get in ``part`` without evicting: its free slots plus the
        part's free slabs."""
        cls = self._classes.get((part, block_bytes))
        free_in_class = cls.free_slots if cls is not None else 0
        return free_in_class + len(self._free_by_part[part]) * (
            self.slab_bytes // slot_stride(block_bytes, self.slot_align)
        )

    def free_slots(self, block_bytes: int, part: int = 0) -> int:
        """Free slots of this size in ``part``'s slabs already cut for it (free slabs not counted)."""
        cls = self._classes.get((part, block_bytes))
        return cls.free_slots if cls is not None else 0

    def cuts(self, block_bytes: int, part: int = 0) -> int:
        """How many slabs of ``part`` were assigned to this size so far (monotonic)."""
        cls = self._classes.get((part, block_bytes))
        return cls.cuts if cls is not None else 0

    def free(self, offset: int) -> None:
        """Returns a slot. An emptied slab goes back to its part's free list, available to any size."""
        self.free_many((offset,), self._slab_at(offset).block_bytes)

    def slab_usage(self, offset: int) -> tuple[int, int, int]:
        """(slab index, slots in use, part) of the slab holding the allocated slot ``offset``: freeing
        ``used`` of its slots hands the slab back to its part's free slabs."""
        slab = self._slab_at(offset)
        return slab.index, slab.used, slab.part

    def slots_per_slab(self, block_bytes: int) -> int:
        """Slots of this size a free slab gives (``available`` counts each free slab as that many)."""
        return self.slab_bytes // slot_stride(block_bytes, self.slot_align)

    def free_many(self, offsets: Sequence[int], block_bytes: int) -> None:
        """``free`` of slots of one size this allocator handed out, in order, in one pass (an eviction
        batch's hot path). Validated as ``free`` validates: a bad offset raises, the ones before it
        freed."""
        slabs, size, classes = self._slabs, self.slab_bytes, self._classes
        capacity = self.capacity_bytes
        for offset in offsets:
            slab = slabs[offset // size] if 0 <= offset < capacity else None
            if slab is None or (offset - slab.base) % slab.stride or slab.block_bytes != block_bytes:
                raise ValueError(f"offset {offset} is not an allocated slot of {block_bytes} bytes")
            cls = classes[(slab.part, block_bytes)]
            if not slab.free:
                self._mark_partial(cls, slab.index)
            slab.free.append(offset)
            slab.used -= 1
            cls.used -= 1
            cls.free_slots += 1
            self.used_bytes -= block_bytes
            if slab.used == 0:
                if slab.holds:
                    raise AssertionError(f"slab {slab.index} emptied with {slab.holds} holds")
                self._release_slab(cls, slab)

    def restore(self, slots: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Marks ``(offset, block_bytes)`` slots as allocated on a fresh allocator (a restarted server
        re-adopting the blocks its persistent pool still holds). Returns the slots it refused: an
        offset that is not a slot of its size in a slab free or already of that size, or one given
        twice. Not held: the caller decides."""
        if self.used_bytes:
            raise ValueError("restore() needs a fresh allocator")
        refused: list[tuple[int, int]] = []
        taken: dict[int, set[int]] = {}
        for offset, block_bytes in slots:
            if not self.fits(block_bytes) or not 0 <= offset < self.total_slabs * self.slab_bytes:
                refused.append((offset, block_bytes))
                continue
            index = offset // self.slab_bytes
            part = self._part_of_slab[index]
            cls = self._class(part, block_bytes)
            slab = self._slabs[index]
            if slab is None:
                self._free_by_part[part].remove(index)
                slab = self._assign_slab(cls, index)
            rel = offset - slab.base
            if slab.block_bytes != block_bytes or rel % slab.stride or rel // slab.stride >= slab.nslots:
                refused.append((offset, block_bytes))
                continue
            mine = taken.setdefault(index, set())
            if offset in mine:
                refused.append((offset, block_bytes))
                continue
            mine.add(offset)
        for free_slabs in self._free_by_part:
            heapq.heapify(free_slabs)
        for index, offsets in taken.items():
            slab = self._slabs[index]
            cls = self._classes[(slab.part, slab.block_bytes)]
            slab.free = [o for o in slab.free if o not in offsets]
            slab.used = len(offsets)
            cls.used += len(offsets)
            cls.free_slots -= len(offsets)
            self.used_bytes += len(offsets) * slab.block_bytes
            if not slab.free:
                cls.partial.discard(index)
        for index in range(self.total_slabs):  # slabs assigned above but left empty go back
            slab = self._slabs[index]
            if slab is not None and slab.used == 0:
                self._release_slab(self._classes[(slab.part, slab.block_bytes)], slab)
        return refused

    def hold(self, offset: int) -> None:
        """Marks a block as immovable (being written, or pinned by a lease)."""
        self._slab_at(offset).holds += 1

    def unhold(self, offset: int) -> None:
        slab = self._slab_at(offset)
        if slab.holds <= 0:
            raise AssertionError(f"unbalanced unhold in slab {slab.index}")
        slab.holds -= 1

    def hold_many(self, offsets: list[int]) -> None:
        """``hold`` of offsets this allocator handed out (not re-validated: a lease's hot path)."""
        slabs, size = self._slabs, self.slab_bytes
        for offset in offsets:
            slabs[offset // size].holds += 1

    def unhold_many(self, offsets: list[int]) -> None:
        """``unhold`` of offsets this allocator handed out (not re-validated: a seal's hot path)."""
        slabs, size = self._slabs, self.slab_bytes
        for offset in offsets:
            slabs[offset // size].holds -= 1

    def reclaimable_slab(
        self, for_block_bytes: int, part: int = 0, exclude: Collection[int] = ()
    ) -> int | None:
        """A slab of ``part`` of another size whose blocks may all be evicted (no holds), the emptiest
        first; none of ``exclude`` (slab indices the caller found it cannot move after all).

        The engine evicts the blocks at ``used_offsets(slab)``; the last free()
        returns the slab to the free list and the next allocate() takes it.
        """
        best: _Slab | None = None
        for slab in self._slabs:
            if slab is None or slab.holds or slab.block_bytes == for_block_bytes or slab.part != part:
                continue
            if exclude and slab.index in exclude:
                continue
            if best is None or slab.used < best.used:
                best = slab
                if slab.used == 1:
                    break
        return None if best is None else best.index

    def used_offsets(self, slab_index: int) -> list[int]:
        slab = self._slabs[slab_index]
        if slab is None:
            return []
        free = set(slab.free)
        return [
            slab.base + i * slab.stride for i in range(slab.nslots) if slab.base + i * slab.stride not in free
        ]

    def note_slab_move(self) -> None:
        self.slab_moves += 1

    def stats(self) -> AllocatorStats:
        by_size: dict[int, list[int]] = {}  # block bytes -> [slabs, used, free slots, tail bytes], all parts
        stranded = 0
        for cls in self._classes.values():
            nslabs = len(cls.slabs)
            if nslabs == 0 and cls.used == 0:
                continue
            free_slots = sum(len(self._slabs[i].free) for i in cls.slabs)
            tail = self.slab_bytes - (self.slab_bytes // cls.stride) * cls.stride
            row = by_size.setdefault(cls.block_bytes, [0, 0, 0, 0])
            for i, value in enumerate((nslabs, cls.used, free_slots, tail * nslabs)):
                row[i] += value
            stranded += nslabs * self.slab_bytes - cls.used * cls.block_bytes
        classes = [SizeClassStats(size, *row) for size, row in by_size.items()]
        return AllocatorStats(
            capacity_bytes=self.capacity_bytes,
            slab_bytes=self.slab_bytes,
            total_slabs=self.total_slabs,
            free_slabs=self.free_slabs,
            used_bytes=self.used_bytes,
            stranded_bytes=stranded,
            unusable_bytes=self.capacity_bytes - self.total_slabs * self.slab_bytes,
            classes=tuple(sorted(classes, key=lambda c: c.block_bytes)),
        )

    # ---------------------------------------------------------------- internals

    def _slab_at(self, offset: int) -> _Slab:
        slab = self._slabs[offset // self.slab_bytes] if 0 <= offset < self.capacity_bytes else None
        if slab is None or (offset - slab.base) % slab.stride:
            raise ValueError(f"offset {offset} is not an allocated slot")
        return slab

    def _class(self, part: int, block_bytes: int) -> _SizeClass:
        cls = self._classes.get((part, block_bytes))
        if cls is None:
            if not self.fits(block_bytes):
                raise ValueError(f"block of {block_bytes} bytes exceeds the slab size {self.slab_bytes}")
            cls = self._classes[(part, block_bytes)] = _SizeClass(
                block_bytes, slot_stride(block_bytes, self.slot_align)
            )
        return cls

    def _partial_slab(self, cls: _SizeClass) -> _Slab | None:
        heap = cls.partial_heap
        while heap:
            index = heap[0]
            slab = self._slabs[index]
            if index in cls.partial and slab is not None and slab.block_bytes == cls.block_bytes:
                return slab
            heapq.heappop(heap)  # stale entry: the slab filled up, or left this size
        return None

    def _assign_slab(self, cls: _SizeClass, index: int) -> _Slab:
        nslots = self.slab_bytes // cls.stride
        if self._last_stride[index] != cls.stride:
            self._assignments[index] += 1
            self._last_stride[index] = cls.stride
        slab = _Slab(
            index, self._part_of_slab[index], index * self.slab_bytes, cls.block_bytes, cls.stride, nslots
        )
        self._slabs[index] = slab
        cls.slabs.add(index)
        cls.free_slots += nslots
        cls.cuts += 1
        self._mark_partial(cls, index)
        return slab

    @staticmethod
    def _mark_partial(cls: _SizeClass, index: int) -> None:
        cls.partial.add(index)
        heapq.heappush(cls.partial_heap, index)
        if len(cls.partial_heap) > 4 * len(cls.partial) + 64:
            # Stale entries only leave from the top; rebuild before they pile up.
            cls.partial_heap = sorted(cls.partial)

    def _release_slab(self, cls: _SizeClass, slab: _Slab) -> None:
        cls.free_slots -= len(slab.free)
        self._slabs[slab.index] = None
        cls.slabs.discard(slab.index)
        cls.partial.discard(slab.index)
        heapq.heappush(self._free_by_part[slab.part], slab.index)
