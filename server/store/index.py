"""(namespace, block hash) -> the block: its state, which tiers hold it, who pins it.

A block is WRITING from AllocateBlocks until SealBlocks (a DRAM slot owned by
one save, invisible to queries) and SEALED afterwards. A sealed block has a
copy in DRAM, on SSD, or both, and each copy is *ready* (its bytes may be
read) or in flight (bytes arriving: a promotion from SSD, a fetch from a peer,
a demotion write to SSD). A sealed block with no copy left leaves the index.

Who may touch what: leases pin (``pins``) and keep the DRAM copy from being
evicted; in-flight tier I/O counts in ``io`` and keeps both copies it uses
from being freed (a read into a DRAM slot, a write out of one). Not
thread-safe: the block store calls it under the engine lock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pegaflow.common.wire.types import Tier
from pegaflow.server.tiers.base import Extent

WRITING = 0
SEALED = 1

NO_SLOT = -1

BlockKey = tuple[int, bytes]  # (namespace index, block hash)


class BlockEntry:
    __slots__ = (
        "key",
        "length",
        "state",
        "pins",
        "io",
        "save_id",
        "dram",
        "dram_ready",
        "ssd",
        "ssd_ready",
        "filling_from",
        "held",
        "checksum",
        "corrupt",
    )

    def __init__(self, key: BlockKey, length: int):
        self.key = key
        self.length = length
        self.state = WRITING
        self.pins = 0  # leases holding this block
        self.io = 0  # tier transfers in flight that read or write one of its copies
        self.save_id: str | None = None
        self.dram = NO_SLOT  # pool offset of its DRAM slot, or NO_SLOT
        self.dram_ready = False  # the slot holds the block's bytes (sealed, promoted or fetched)
        self.ssd: Extent | None = None
        self.ssd_ready = False
        # While a DRAM slot is being filled from below: where from (Tier.SSD / Tier.REMOTE).
        self.filling_from: Tier | None = None
        self.held = False  # its DRAM slot's slab is marked immovable (see BlockStore._rehold)
        self.checksum: int | None = None  # XXH3-64 of its bytes, once hashed (movers/block_hasher.py)
        # Its DRAM copy failed its checksum while leases held it: served to nobody from then on,
        # dropped when the last of them lets go (BlockStore.drop_corrupt).
        self.corrupt = False

    @property
    def offset(self) -> int:
        return self.dram

    @property
    def filling(self) -> bool:
        return self.filling_from is not None

    @property
    def resident(self) -> bool:
        """Sealed and held by at least one tier (ready or arriving)."""
        return self.state == SEALED and (self.dram != NO_SLOT or self.ssd_ready)

    def __repr__(self) -> str:
        return (
            f"BlockEntry(ns={self.key[0]}, hash={self.key[1][:6].hex()}, state={self.state}, "
            f"dram={self.dram}{'+' if self.dram_ready else ''}, "
            f"ssd={self.ssd}{'+' if self.ssd_ready else ''}, "
            f"pins={self.pins}, io={self.io})"
        )


class BlockIndex:
    """The blocks, by key and by DRAM slot, with counts per state and tier."""

    def __init__(self) -> None:
        self._blocks: dict[BlockKey, BlockEntry] = {}
        self._by_slot: dict[int, BlockEntry] = {}
        self._sealed_per_ns: defaultdict[int, int] = defaultdict(int)
        self._entries_per_ns: defaultdict[int, int] = defaultdict(int)  # any state
        self.sealed = 0
        self.writing = 0
        self.pinned = 0  # blocks with pins > 0
        self.dram_ready = 0
        self.ssd_ready = 0
        # get(key) -> the entry or None: the dict's own method, not a method calling it (the store
        # looks up every block of every grant, seal and eviction: a frame each was ~6 % of its time).
        self.get = self._blocks.get

    def at_slot(self, offset: int) -> BlockEntry | None:
        return self._by_slot.get(offset)

    def add_writing_many(
        self, ns_index: int, hashes: Sequence[bytes], length: int, slots: Sequence[int], save_id: str
    ) -> list[BlockEntry]:
        """A WRITING entry per (hash, slot) pair, in the slot its save was granted (one pass: a grant's
        hot path)."""
        blocks, by_slot = self._blocks, self._by_slot
        out = []
        for block_hash, slot in zip(hashes, slots, strict=False):
            entry = BlockEntry((ns_index, block_hash), length)
            entry.save_id = save_id
            entry.dram = slot
            blocks[entry.key] = entry
            by_slot[slot] = entry
            out.append(entry)
        if out:
            self._entries_per_ns[ns_index] += len(out)
            self.writing += len(out)
        return out

    def add_recovered(self, key: BlockKey, length: int, extent: Extent) -> BlockEntry:
        """A sealed block a persistent tier still holds (start-up recovery)."""
        entry = BlockEntry(key, length)
        entry.state = SEALED
        entry.ssd = extent
        entry.ssd_ready = True
        self._blocks[key] = entry
        self._entries_per_ns[key[0]] += 1
        self.sealed += 1
        self.ssd_ready += 1
        self._sealed_per_ns[key[0]] += 1
        return entry

    def add_recovered_slot(self, key: BlockKey, length: int, slot: int, block_checksum: int) -> BlockEntry:
        """A sealed block a persistent pool still holds (its journal named it, its bytes verified)."""
        entry = BlockEntry(key, length)
        entry.state = SEALED
        entry.dram = slot
        entry.dram_ready = True
        entry.checksum = block_checksum
        self._blocks[key] = entry
        self._by_slot[slot] = entry
        self._entries_per_ns[key[0]] += 1
        self.sealed += 1
        self.dram_ready += 1
        self._sealed_per_ns[key[0]] += 1
        return entry

    def add_fetching(self, key: BlockKey, length: int, slot: int) -> BlockEntry:
        """A block another node holds, arriving into a DRAM slot: sealed (its bytes are another node's
        sealed bytes) but not readable until every byte arrived and its checksum matched."""
        entry = BlockEntry(key, length)
        entry.state = SEALED
        entry.dram = slot
        entry.filling_from = Tier.REMOTE
        self._blocks[key] = entry
        self._by_slot[slot] = entry
        self._entries_per_ns[key[0]] += 1
        self.sealed += 1
        self._sealed_per_ns[key[0]] += 1
        return entry

    def seal(self, entry: BlockEntry) -> None:
        entry.state = SEALED
        entry.save_id = None
        entry.dram_ready = True
        self.writing -= 1
        self.sealed += 1
        self.dram_ready += 1
        self._sealed_per_ns[entry.key[0]] += 1

    # --------------------------------------------------------------- DRAM copy

    def attach_slot(self, entry: BlockEntry, slot: int, source: Tier) -> None:
        """A sealed block gets a DRAM slot that ``source`` is about to fill (promotion, fetch)."""
        entry.dram = slot
        entry.dram_ready = False
        entry.filling_from = source
        self._by_slot[slot] = entry

    def slot_filled(self, entry: BlockEntry) -> None:
        entry.dram_ready = True
        entry.filling_from = None
        self.dram_ready += 1

    def detach_slot(self, entry: BlockEntry) -> int:
        """Forgets the block's DRAM copy (evicted, or a fill failed); returns the slot to free."""
        slot = entry.dram
        del self._by_slot[slot]
        if entry.dram_ready:
            self.dram_ready -= 1
        entry.dram = NO_SLOT
        entry.dram_ready = False
        entry.filling_from = None
        return slot

    def detach_slots(self, entries: Sequence[BlockEntry]) -> list[int]:
        """``detach_slot`` of each, in one pass (an eviction batch); their slots, in order."""
        by_slot = self._by_slot
        slots = []
        ready = 0
        for entry in entries:
            slot = entry.dram
            del by_slot[slot]
            if entry.dram_ready:
                ready += 1
            entry.dram = NO_SLOT
            entry.dram_ready = False
            entry.filling_from = None
            slots.append(slot)
        self.dram_ready -= ready
        return slots

    # ---------------------------------------------------------------- SSD copy

    def attach_ssd(self, entry: BlockEntry, extent: Extent) -> None:
        entry.ssd = extent
        entry.ssd_ready = False

    def ssd_written(self, entry: BlockEntry) -> None:
        entry.ssd_ready = True
        self.ssd_ready += 1

    def detach_ssd(self, entry: BlockEntry) -> Extent:
        extent = entry.ssd
        assert extent is not None
        if entry.ssd_ready:
            self.ssd_ready -= 1
        entry.ssd = None
        entry.ssd_ready = False
        return extent

    # ---------------------------------------------------------------- removal

    def remove(self, entry: BlockEntry) -> None:
        """Drops a block whose copies were all detached (or a WRITING block being aborted)."""
        del self._blocks[entry.key]
        ns = entry.key[0]
        left = self._entries_per_ns[ns] - 1
        if left:
            self._entries_per_ns[ns] = left
        else:
            del self._entries_per_ns[ns]
        if entry.dram != NO_SLOT:
            self._by_slot.pop(entry.dram, None)
            if entry.dram_ready:
                self.dram_ready -= 1
        if entry.ssd_ready:
            self.ssd_ready -= 1
        if entry.state == SEALED:
            self.sealed -= 1
            if self._sealed_per_ns[ns] == 1:
                del self._sealed_per_ns[ns]
            else:
                self._sealed_per_ns[ns] -= 1
        else:
            self.writing -= 1
        if entry.pins:
            self.pinned -= 1
            entry.pins = 0  # a lease that still lists it unpins nothing

    def forget_many(self, entries: Sequence[BlockEntry]) -> None:
        """``remove`` of each, in one pass: for an eviction batch, whose blocks are sealed and left with
        no copy at all (anything else takes ``remove`` itself)."""
        blocks, per_ns, sealed_per_ns = self._blocks, self._entries_per_ns, self._sealed_per_ns
        for entry in entries:
            if entry.state != SEALED or entry.dram != NO_SLOT or entry.ssd_ready or entry.pins:
                self.remove(entry)
                continue
            key = entry.key
            del blocks[key]
            ns = key[0]
            left = per_ns[ns] - 1
            if left:
                per_ns[ns] = left
            else:
                del per_ns[ns]
            left = sealed_per_ns[ns] - 1
            if left:
                sealed_per_ns[ns] = left
            else:
                del sealed_per_ns[ns]
            self.sealed -= 1

    # ------------------------------------------------------------------- pins

    def pin_many(self, entries: Sequence[BlockEntry]) -> list[BlockEntry]:
        """``pin`` of each; the entries this gave their first pin."""
        first = []
        for entry in entries:  # a chain may name a block twice: its second pin is not a first
            if entry.pins == 0:
                first.append(entry)
            entry.pins += 1
        self.pinned += len(first)
        return first

    def unpin_many(self, entries: Sequence[BlockEntry]) -> list[BlockEntry]:
        """``unpin`` of each; the entries whose last pin this was."""
        last = []
        for entry in entries:
            if entry.pins > 0:
                entry.pins -= 1
                if entry.pins == 0:
                    last.append(entry)
        self.pinned -= len(last)
        return last

    def sealed_in(self, ns_index: int) -> int:
        return self._sealed_per_ns.get(ns_index, 0)

    def entries_in(self, ns_index: int) -> int:
        """Blocks of the namespace in any state (writing, sealed in any tier)."""
        return self._entries_per_ns.get(ns_index, 0)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def items(self):
        return self._blocks.items()
