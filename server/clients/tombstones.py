"""Ids of leases and saves that a client released or aborted before the server had created them.

A client whose QueryPrefix(lease) or AllocateBlocks timed out releases / aborts
by the id it chose; if the server only reads that call later (it was stalled),
the id is here and the call is refused instead of pinning or reserving blocks
for a caller that has gone. Entries live as long as a late call could still
arrive (the write timeout), at most ``capacity`` of them. Not thread-safe: the
engine calls it under its own lock.
"""

from __future__ import annotations

from collections import deque


class Tombstones:
    def __init__(self, ttl_s: float, capacity: int = 65536):
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._ids: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()

    def add(self, ident: str, now: float) -> None:
        if ident in self._ids:
            return
        if len(self._order) >= self.capacity:
            self._ids.discard(self._order.popleft()[1])
        self._ids.add(ident)
        self._order.append((now + self.ttl_s, ident))

    def __contains__(self, ident: str) -> bool:
        return ident in self._ids

    def prune(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            self._ids.discard(self._order.popleft()[1])

    def __len__(self) -> int:
        return len(self._ids)
