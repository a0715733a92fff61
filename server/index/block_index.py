"""(namespace, block hash) -> where the block lives and what state it is in.

A block is WRITING from AllocateBlocks until SealBlocks (invisible to queries,
owned by one save) and SEALED afterwards (visible, evictable unless pinned).
Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

from collections import defaultdict

WRITING = 0
SEALED = 1

BlockKey = tuple[int, bytes]  # (namespace index, block hash)


class BlockEntry:
    __slots__ = ("key", "offset", "length", "state", "pins", "save_id")

    def __init__(self, key: BlockKey, offset: int, length: int, save_id: str):
        self.key = key
        self.offset = offset
        self.length = length
        self.state = WRITING
        self.pins = 0  # leases holding this block
        self.save_id: str | None = save_id


class BlockIndex:
    def __init__(self) -> None:
        self._blocks: dict[BlockKey, BlockEntry] = {}
        self._by_offset: dict[int, BlockEntry] = {}
        self._sealed_per_ns: defaultdict[int, int] = defaultdict(int)
        self.sealed = 0
        self.writing = 0
        self.pinned = 0  # blocks with pins > 0

    def get(self, key: BlockKey) -> BlockEntry | None:
        return self._blocks.get(key)

    def at_offset(self, offset: int) -> BlockEntry | None:
        return self._by_offset.get(offset)

    def add_writing_many(
        self, ns_index: int, hashes: list[bytes], offsets: list[int], length: int, save_id: str
    ) -> list[BlockEntry]:
        blocks, by_offset = self._blocks, self._by_offset
        entries = []
        for block_hash, offset in zip(hashes, offsets, strict=True):
            entry = BlockEntry((ns_index, block_hash), offset, length, save_id)
            blocks[entry.key] = entry
            by_offset[offset] = entry
            entries.append(entry)
        self.writing += len(entries)
        return entries

    def seal(self, entry: BlockEntry) -> None:
        entry.state = SEALED
        entry.save_id = None
        self.writing -= 1
        self.sealed += 1
        self._sealed_per_ns[entry.key[0]] += 1

    def remove(self, entry: BlockEntry) -> None:
        del self._blocks[entry.key]
        del self._by_offset[entry.offset]
        if entry.state == SEALED:
            self.sealed -= 1
            self._sealed_per_ns[entry.key[0]] -= 1
        else:
            self.writing -= 1

    def pin(self, entry: BlockEntry) -> bool:
        """True when this is the block's first pin."""
        entry.pins += 1
        if entry.pins == 1:
            self.pinned += 1
            return True
        return False

    def unpin(self, entry: BlockEntry) -> bool:
        """True when this was the block's last pin."""
        entry.pins -= 1
        if entry.pins == 0:
            self.pinned -= 1
            return True
        return False

    def sealed_in(self, ns_index: int) -> int:
        return self._sealed_per_ns.get(ns_index, 0)

    def __len__(self) -> int:
        return len(self._blocks)
