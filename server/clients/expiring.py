"""A table of objects that expire: leases and saves (one class for both).

Objects are looked up by id and handed back by ``expired(now)`` once their
``expires_at`` has passed. Removal is O(1); the expiry heap keeps stale entries
of removed objects and is rebuilt before they pile up. Not thread-safe: the
engine calls it under its own lock.
"""

from __future__ import annotations

import heapq
from typing import Generic, Protocol, TypeVar


class Expiring(Protocol):
    id: str
    expires_at: float


T = TypeVar("T", bound=Expiring)


class ExpiringTable(Generic[T]):
    def __init__(self) -> None:
        self._items: dict[str, T] = {}
        self._expiry: list[tuple[float, str]] = []

    def add(self, item: T) -> None:
        self._items[item.id] = item
        heapq.heappush(self._expiry, (item.expires_at, item.id))

    def renew(self, item: T, expires_at: float) -> None:
        """Moves ``item``'s expiry (the old heap entry goes stale and is skipped)."""
        item.expires_at = expires_at
        heapq.heappush(self._expiry, (expires_at, item.id))

    def get(self, ident: str) -> T | None:
        return self._items.get(ident)

    def remove(self, ident: str) -> T | None:
        return self._items.pop(ident, None)

    def expired(self, now: float) -> list[T]:
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            at, ident = heapq.heappop(self._expiry)
            item = self._items.get(ident)
            if item is not None and item.expires_at == at:
                out.append(item)
        if len(self._expiry) > 4 * len(self._items) + 1024:
            self._expiry = [(item.expires_at, item.id) for item in self._items.values()]
            heapq.heapify(self._expiry)
        return out

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))
