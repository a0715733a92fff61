"""The free-slot reserve: free DRAM slots kept ahead of the saves that will need them.

A save's AllocateBlocks used to evict its own victims on the request path: under a full pool that
was about half of the call (64 blocks of 256 KiB on the 2-vCPU dev VM: 291 us in the engine against
153 us with free slots; the effect through a real server is bench/free_reserve_ab.py's). Like a
kernel's free-page watermark, the engine now evicts the
policy's next victims ahead, in short slices under its lock, on a thread of its own, while the client
is still copying its bytes, so the next allocation finds free slots. The policy's order is unchanged:
the reserve only evicts earlier what the next saves would have evicted anyway, and costs at most its
size of cache (by default 1/64 of the pool, at most 512 MiB: a handful of the largest batches).

A size gets a reserve only once a save of it had to evict for itself: a pool that merely filled up
keeps every block it holds (nothing is evicted before anything needs the room), and one that saves
into a full pool from then on finds its next slots free. This class only remembers which block sizes
are saved under that pressure (per allocator part, so a tenant's region keeps its own reserve) and
how many free slots each should have; the block store evicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A size nobody saved for this long keeps what it has free but gets no more evictions ahead.
IDLE_S = 30.0
# A part (the pool, a tenant's region) never has more than this share of itself reserved.
MAX_PART_FRACTION = 1 / 32
# Reserved slots another namespace held are zeroed ahead only for a namespace that made this many saves
# of the size in a row (block_store.take_unzeroed_reserve).
SOLE_SAVER_STREAK = 4
# At most this many bytes of slots are held out of the allocator to be zeroed at once (~6 ms of memset
# here): a save arriving meanwhile evicts other victims rather than find its reserve gone.
ZERO_AHEAD_MAX_BYTES = 64 << 20


def default_reserve_bytes(pool_bytes: int) -> int:
    return min(pool_bytes // 64, 512 << 20)


class FreeSlotReserve:
    def __init__(self, reserve_bytes: int = 0, clock: Callable[[], float] = time.monotonic):
        if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be a non-negative int, got {reserve_bytes!r}")
        self.bytes = reserve_bytes
        self._clock = clock
        # (block_bytes, part) -> (tenant, namespace index of the last save, its time) of the sizes saved
        # under pressure; and per size how many saves in a row came from that namespace.
        self._sizes: dict[tuple[int, int], tuple[str, int, float]] = {}
        self._streak: dict[tuple[int, int], int] = {}

    def used(self, block_bytes: int, part: int, tenant: str, evicted: bool, ns_index: int = -1) -> None:
        """A save of namespace ``ns_index`` allocated slots of this size in ``part``; ``evicted``: it had
        to evict for them (the block store calls it per allocation)."""
        key = (block_bytes, part)
        if evicted or key in self._sizes:
            last = self._sizes.get(key)
            same = last is not None and last[1] == ns_index
            self._streak[key] = self._streak.get(key, 0) + 1 if same else 1
            self._sizes[key] = (tenant, ns_index, self._clock())

    def sizes(self) -> list[tuple[int, int, str]]:
        """(block_bytes, part, tenant) of the sizes saved under pressure within IDLE_S; older ones are
        forgotten (until a save of theirs evicts again)."""
        now = self._clock()
        for key in [k for k, (_, _, last) in self._sizes.items() if now - last > IDLE_S]:
            del self._sizes[key]
            self._streak.pop(key, None)
        return [(block_bytes, part, tenant) for (block_bytes, part), (tenant, _, _) in self._sizes.items()]

    def sole_saver(self, block_bytes: int, part: int) -> int:
        """The namespace that made the last SOLE_SAVER_STREAK saves of this size in ``part``, -1 when
        saves of several namespaces interleave (the next saver is then a guess, and slots zeroed for
        the wrong one would be zeroed twice)."""
        key = (block_bytes, part)
        entry = self._sizes.get(key)
        if entry is None or self._streak.get(key, 0) < SOLE_SAVER_STREAK:
            return -1
        return entry[1]

    def slots(self, block_bytes: int, part_bytes: int) -> int:
        """Free slots of ``block_bytes`` to keep in a part of ``part_bytes``: at least one."""
        return max(1, min(self.bytes, int(part_bytes * MAX_PART_FRACTION)) // block_bytes)
