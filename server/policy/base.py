"""The seam between the engine and an eviction/admission policy.

The engine owns bytes, pins (leases) and the allocator; a policy only orders
resident keys and tells the engine which one to evict next. Keys are opaque
hashables (the engine uses ``(namespace_id, block_hash)``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Sequence


class EvictionPolicy(abc.ABC):
    """Orders resident keys for eviction.

    Contract shared by every implementation:

    * ``on_insert`` is called once a key becomes resident (sealed), with its size
      in bytes; ``on_remove`` once it has left (evicted or deleted). Between the
      two the key is *resident* and the policy tracks it.
    * ``next_victim`` never removes anything: the engine evicts the returned key
      and then calls ``on_remove``. It never returns a key for which
      ``skip(key)`` is true (a leased block) nor a key that is not resident.
    * Implementations are thread-safe: their methods are serialised by an
      internal lock. ``skip`` runs under that lock, so it must not call back into
      the policy.
    """

    name: str
    # W-TinyLFU: candidates that lost against the main region's victim. Always 0 for LRU.
    admission_rejections: int = 0

    @abc.abstractmethod
    def record_lookups(self, keys: Sequence[Hashable]) -> None:
        """Every looked-up key, hit or miss (the frequency signal). On the query path: must be cheap."""

    @abc.abstractmethod
    def on_insert(self, key: Hashable, nbytes: int) -> None:
        """``key`` became resident, occupying ``nbytes`` bytes of the pool."""

    @abc.abstractmethod
    def on_access(self, key: Hashable) -> None:
        """A resident key was hit. Unknown keys are ignored (the hit may race with a removal)."""

    def on_access_many(self, keys: Sequence[Hashable]) -> None:
        """``on_access`` of each key, in order (a lookup's hits, tail first). Policies whose
        accesses are cheap override it to take their lock once for the batch."""
        for key in keys:
            self.on_access(key)

    def on_insert_many(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """``on_insert`` of each ``(key, nbytes)``, in order (a seal's new blocks, tail first).
        Policies whose inserts are cheap override it to take their lock once for the batch."""
        for key, nbytes in items:
            self.on_insert(key, nbytes)

    def on_refresh(self, key: Hashable) -> None:
        """A resident key's recency is renewed without it counting as a hit: a save restating the
        chain the key belongs to, or the load of a block whose lookup already counted. Unknown keys
        are ignored. The default treats it as an access; policies where a hit means more than
        recency (W-TinyLFU's promotion) override it."""
        self.on_access(key)

    def on_refresh_many(self, keys: Sequence[Hashable]) -> None:
        """``on_refresh`` of each key, in order (a save restating its chain's stored blocks)."""
        for key in keys:
            self.on_refresh(key)

    @abc.abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """``key`` left the cache (evicted or deleted by the engine). Unknown keys are ignored."""

    @abc.abstractmethod
    def next_victim(self, skip: Callable[[Hashable], bool]) -> Hashable | None:
        """The key the engine should evict next, ignoring keys for which ``skip(key)`` is true.

        Returns None when nothing is evictable. Does not remove the key.
        """

    def next_victims(self, n: int, skip: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to ``n`` keys the engine should evict next, in that order (``next_victim``'s contract
        for each: none removed, none skipped); fewer only when nothing more is evictable. The
        engine evicts them all, then calls ``on_remove_many``. The default gives one at a time:
        where the order of the next victims depends on each eviction (W-TinyLFU's admission duel
        between the window and the main region) only the first is known."""
        victim = self.next_victim(skip) if n > 0 else None
        return [] if victim is None else [victim]

    def on_remove_many(self, keys: Sequence[Hashable]) -> None:
        """``on_remove`` of each key (a batch of evictions). Policies override it to lock once."""
        for key in keys:
            self.on_remove(key)
