"""A byte-weighted recency list: the building block of LRUPolicy and of each W-TinyLFU region.

Not thread-safe on its own; the policies that own these lists serialise access.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator


class ByteLRU:
    """Keys in recency order (coldest first) with their sizes and the running byte total.

    Every operation is O(1) except ``coldest_unskipped``, which is amortised O(1)
    per returned key (see there).
    """

    __slots__ = ("_entries", "nbytes")

    def __init__(self) -> None:
        # OrderedDict is a C hash map threaded on a doubly linked list: O(1)
        # insert, delete, move_to_end and first-key lookup.
        self._entries: OrderedDict[Hashable, int] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        """Coldest first."""
        return iter(self._entries)

    def size_of(self, key: Hashable) -> int:
        return self._entries[key]

    def add(self, key: Hashable, nbytes: int) -> None:
        """Adds ``key`` as the most recent entry. The key must not be present."""
        self._entries[key] = nbytes
        self.nbytes += nbytes

    def touch(self, key: Hashable) -> None:
        """Makes ``key`` the most recent entry."""
        self._entries.move_to_end(key)

    def touch_present(self, keys: Iterable[Hashable]) -> None:
        """``touch`` of each key that is present, in order (the last one ends the most recent)."""
        entries, move = self._entries, self._entries.move_to_end
        for key in keys:
            if key in entries:
                move(key)

    def remove(self, key: Hashable) -> int:
        """Removes ``key`` and returns its size."""
        nbytes = self._entries.pop(key)
        self.nbytes -= nbytes
        return nbytes

    def coldest(self) -> Hashable | None:
        return next(iter(self._entries), None)

    def coldest_unskipped_many(self, n: int, skip: Callable[[Hashable], bool]) -> list[Hashable]:
        """The ``n`` coldest keys for which ``skip(key)`` is false (fewer when there are not as
        many), coldest first: ``coldest_unskipped`` repeated with each key removed in between, in
        one pass. The skipped keys passed over move to the most recent end, as there."""
        entries = self._entries
        out: list[Hashable] = []
        passed: list[Hashable] = []
        if n <= 0:
            return out
        for key in entries:  # nothing moves while iterating; the passed keys move after
            (passed if skip(key) else out).append(key)
            if len(out) >= n:
                break
        for key in passed:
            entries.move_to_end(key)
        return out

    def coldest_unskipped(self, skip: Callable[[Hashable], bool]) -> Hashable | None:
        """The coldest key for which ``skip(key)`` is false, or None.

        Skipped keys (pinned by a lease, i.e. being read right now) are moved to
        the most recent end as they are passed over. Otherwise a run of pinned
        keys at the cold end would be rescanned on every call and evicting k
        keys past p pinned ones would cost O(k * p); with the rotation each
        pinned key is passed over at most once per full sweep of the list.
        A call examines each key at most once, so when everything is pinned it
        costs O(n) and returns None.
        """
        entries = self._entries
        for _ in range(len(entries)):
            key = next(iter(entries))
            if not skip(key):
                return key
            entries.move_to_end(key)
        return None
