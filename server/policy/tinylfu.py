"""W-TinyLFU: a small LRU window in front of a segmented LRU main region guarded by TinyLFU admission.

Regions (each a byte-weighted LRU list; every resident key is in exactly one):

* window (~1% of capacity): every new key enters here, so a burst of new keys
  with short-term reuse is served by recency alone;
* probation: main-region keys not hit since they arrived there;
* protected (~80% of the main region): main-region keys hit while in probation.
  When it outgrows its budget its coldest keys fall back to probation.

When the engine needs space and the window is at or over its budget, the window's
coldest key (the candidate) competes with the main region's victim (coldest of
probation, else of protected): the one the frequency sketch has seen less often
is evicted, ties evicting the candidate. A scan of one-off keys thus passes
through the window without displacing the frequently used main region.

The window's share adapts (``WindowSizer``): misses on keys the window evicted
lately grow it, misses on keys the main region evicted lately shrink it, so
recency-skewed traffic gets an LRU-like large window and scan-heavy traffic
keeps the 1% window that lets admission protect the main region.

Capacity follows the engine: ``capacity_bytes`` is the pool's size, but the
pool may be full earlier (allocator fragmentation). A call to ``next_victim``
means "full at the current resident bytes", so the region budgets are taken from
an effective capacity that shrinks to that total and grows back with inserts.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Hashable, Sequence

from pegaflow.server.policy.admission import TinyLFUAdmission
from pegaflow.server.policy.base import EvictionPolicy
from pegaflow.server.policy.key_hash import salted_hash, salted_hashes
from pegaflow.server.policy.lru_list import ByteLRU
from pegaflow.server.policy.validation import positive_int
from pegaflow.server.policy.window_sizer import WindowSizer

WINDOW_FRACTION = 0.01
MAX_WINDOW_FRACTION = 0.99
PROTECTED_FRACTION = 0.80
# Lookups are buffered and fed to the sketch in batches: one numpy pass per batch
# instead of per query keeps record_lookups at a list.extend on the query path.
LOOKUP_BATCH = 1024
# An eviction decision first feeds the sketch the buffered lookups, but only once
# there are this many: a handful of stale samples does not change a decision,
# while a numpy pass per eviction would dominate the eviction's cost.
DECISION_DRAIN_MIN = 64
# The sketch starts sized for this many keys and doubles as the cache fills.
INITIAL_EXPECTED_KEYS = 1024

_NO_KEY = object()


class WTinyLFUPolicy(EvictionPolicy):
    """Byte-weighted W-TinyLFU (see the module docstring). Thread-safe."""

    name = "w-tinylfu"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        window_fraction: float = WINDOW_FRACTION,
        protected_fraction: float = PROTECTED_FRACTION,
        adaptive_window: bool = True,
        lookup_batch: int = LOOKUP_BATCH,
        salt: int | None = None,
    ) -> None:
        self._capacity_bytes = positive_int(capacity_bytes, "capacity_bytes")
        if not 0.0 < window_fraction < 1.0:
            raise ValueError(f"window_fraction must be in (0, 1), got {window_fraction!r}")
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in (0, 1), got {protected_fraction!r}")
        # Without adaptation the window stays at window_fraction (min == max).
        self._sizer = WindowSizer(
            window_fraction,
            min_fraction=window_fraction,
            max_fraction=max(window_fraction, MAX_WINDOW_FRACTION) if adaptive_window else window_fraction,
        )
        self._protected_fraction = protected_fraction
        self._lookup_batch = positive_int(lookup_batch, "lookup_batch")
        # Random by default so counter positions cannot be predicted; fixed in tests for determinism.
        self._salt = secrets.randbits(64) if salt is None else salt

        self.admission_rejections = 0
        self._lock = threading.Lock()
        # Guards only _pending, so the query path never waits behind eviction work.
        self._pending_lock = threading.Lock()
        self._pending: list[Hashable] = []

        self._window = ByteLRU()
        self._probation = ByteLRU()
        self._protected = ByteLRU()
        self._region: dict[Hashable, ByteLRU] = {}
        self._admission = TinyLFUAdmission(INITIAL_EXPECTED_KEYS)
        # The key next_victim returned last: its on_remove is an eviction (feeds the window
        # sizer's ghosts), and asking again before it is removed does not count a second rejection.
        self._last_victim: object = _NO_KEY
        self._set_capacity(self._capacity_bytes)

    # -- introspection (not part of the EvictionPolicy seam) --

    def __len__(self) -> int:
        return len(self._region)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._region

    @property
    def resident_bytes(self) -> int:
        return self._window.nbytes + self._probation.nbytes + self._protected.nbytes

    def region_of(self, key: Hashable) -> str | None:
        """'window', 'probation', 'protected', or None if not resident."""
        with self._lock:
            region = self._region.get(key)
            if region is None:
                return None
            return {id(self._window): "window", id(self._probation): "probation"}.get(id(region), "protected")

    def region_bytes(self) -> dict[str, int]:
        with self._lock:
            return {
                "window": self._window.nbytes,
                "probation": self._probation.nbytes,
                "protected": self._protected.nbytes,
            }

    @property
    def window_fraction(self) -> float:
        return self._sizer.fraction

    def frequency(self, key: Hashable) -> int:
        """The admission filter's estimate for ``key`` (after feeding it the pending lookups)."""
        with self._lock:
            self._drain_pending()
            return self._admission.frequency_one(salted_hash(key, self._salt))

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by tests)."""
        with self._lock:
            regions = (self._window, self._probation, self._protected)
            total = 0
            for region in regions:
                keys = list(region)
                assert len(keys) == len(region)
                assert region.nbytes == sum(region.size_of(k) for k in keys)
                for k in keys:
                    assert self._region.get(k) is region, f"{k!r} misfiled"
                total += len(keys)
            assert total == len(self._region), "a key is tracked by no region or by two"

    # -- the EvictionPolicy seam --

    def record_lookups(self, keys: Sequence[Hashable]) -> None:
        if len(keys) == 0:
            return
        with self._pending_lock:
            self._pending.extend(keys)
            if len(self._pending) < self._lookup_batch:
                return
            batch, self._pending = self._pending, []
        with self._lock:
            self._record(batch)

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        nbytes = positive_int(nbytes, "nbytes")
        with self._lock:
            region = self._region.get(key)
            if region is not None:
                # A re-seal of a resident key: keep its region, take the new size, count it as a use.
                region.remove(key)
                region.add(key, nbytes)
            else:
                self._window.add(key, nbytes)
                self._region[key] = self._window
                if len(self._region) > self._admission.capacity:
                    # The aging period follows the resident key count (10 x); the table doubles when full.
                    self._admission.ensure_capacity(len(self._region))
                if self._sizer.record_insert(salted_hash(key, self._salt), nbytes, self._effective_capacity):
                    self._set_capacity(self._effective_capacity)
            total = self.resident_bytes
            if total > self._effective_capacity:
                self._set_capacity(total)
            self._spill_window()

    def on_access(self, key: Hashable) -> None:
        with self._lock:
            region = self._region.get(key)
            if region is None:
                return
            if region is self._probation:
                nbytes = self._probation.remove(key)
                self._protected.add(key, nbytes)
                self._region[key] = self._protected
                self._demote_protected()
            else:
                region.touch(key)

    def on_refresh(self, key: Hashable) -> None:
        # Recency within the key's own region only: no promotion, since no new use happened.
        with self._lock:
            region = self._region.get(key)
            if region is not None:
                region.touch(key)

    def on_remove(self, key: Hashable) -> None:
        with self._lock:
            region = self._region.pop(key, None)
            if region is None:
                return
            nbytes = region.remove(key)
            if self._is_last_victim(key):
                self._last_victim = _NO_KEY
                self._sizer.record_eviction(
                    salted_hash(key, self._salt), nbytes, region is self._window, len(self._region)
                )

    def next_victim(self, skip: Callable[[Hashable], bool]) -> Hashable | None:
        with self._lock:
            self._drain_pending(DECISION_DRAIN_MIN)
            total = self.resident_bytes
            if 0 < total < self._effective_capacity:
                # The engine is out of space at `total`: size the regions for that.
                self._set_capacity(total)
            victim, rejected = self._choose_victim(skip)
            if victim is None:
                return None
            if rejected and not self._is_last_victim(victim):
                self.admission_rejections += 1
            self._last_victim = victim
            return victim

    # -- internals (called with self._lock held) --

    def _choose_victim(self, skip: Callable[[Hashable], bool]) -> tuple[Hashable | None, bool]:
        """(key to evict, whether it is a window candidate that lost the admission duel)."""
        victim = self._probation.coldest_unskipped(skip)
        if victim is None:
            victim = self._protected.coldest_unskipped(skip)

        # At budget counts: the insert this eviction makes room for enters the window
        # and pushes the window's coldest key out, so that key competes now.
        if self._window.nbytes >= self._window_budget:
            candidate = self._window.coldest_unskipped(skip)
            if candidate is not None:
                if victim is None:
                    return candidate, False
                if self._admission.admit(salted_hash(candidate, self._salt), salted_hash(victim, self._salt)):
                    self._move(candidate, self._window, self._probation)
                    return victim, False
                return candidate, True

        if victim is not None:
            return victim, False
        return self._window.coldest_unskipped(skip), False

    def _is_last_victim(self, key: Hashable) -> bool:
        return self._last_victim is not _NO_KEY and self._last_victim == key

    def _set_capacity(self, capacity: int) -> None:
        self._effective_capacity = capacity
        self._window_budget = max(1, int(capacity * self._sizer.fraction))
        self._main_budget = max(1, capacity - self._window_budget)
        self._protected_budget = max(1, int(self._main_budget * self._protected_fraction))

    def _move(self, key: Hashable, src: ByteLRU, dst: ByteLRU) -> None:
        dst.add(key, src.remove(key))
        self._region[key] = dst

    def _spill_window(self) -> None:
        """Moves window overflow into probation for free while the main region has room.

        Once the main region is full the overflow stays in the window: it is
        admitted (or not) only when the engine asks for a victim.
        """
        window = self._window
        while window.nbytes > self._window_budget:
            key = window.coldest()
            if self._probation.nbytes + self._protected.nbytes + window.size_of(key) > self._main_budget:
                return
            self._move(key, window, self._probation)

    def _demote_protected(self) -> None:
        protected = self._protected
        while protected.nbytes > self._protected_budget and len(protected) > 1:
            self._move(protected.coldest(), protected, self._probation)

    def _drain_pending(self, at_least: int = 1) -> None:
        with self._pending_lock:
            if len(self._pending) < at_least:
                return
            batch, self._pending = self._pending, []
        self._record(batch)

    def _record(self, batch: list[Hashable]) -> None:
        self._admission.record(salted_hashes(batch, self._salt))
