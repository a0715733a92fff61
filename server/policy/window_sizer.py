"""Feedback sizing of the W-TinyLFU window from ghost hits (the adaptation rule of ARC).

A 1% window suits frequency-skewed traffic, but on recency-skewed traffic (a
sliding working set) new keys reach the admission duel before they could earn a
frequency and lose against keys that were popular a moment ago; a large window
serves them by recency instead. Which one the traffic needs shows in the
misses: a key missed again soon after the window evicted it (a hit in the
*window ghost*) says the window was too small; a key missed again soon after the
main region evicted it (a hit in the *main ghost*) says the main region was.
Each such miss moves the window's share of capacity by the key's size, scaled
by the ratio of the ghosts' sizes as in ARC, so adaptation follows every miss
rather than waiting for a sampled hit-rate trend.

Ghosts remember hashes only, in Bloom filters (two generations, each sized for
the number of resident keys), so they cost ~2 bytes per resident key instead
of a second index of the cache's keys.
"""

from __future__ import annotations

from pegaflow.server.policy.bloom import BloomFilter

MIN_GENERATION_KEYS = 1024


class GhostList:
    """The keys evicted from one region over the last one to two generations, approximately.

    A generation closes after as many evictions as there were resident keys when
    it opened; membership is "in the current or the previous generation".
    Bloom filters give ~3% false positives and cannot forget single keys, so a
    key stays a ghost for its generation even after it is re-inserted.
    """

    def __init__(self) -> None:
        self._generation_keys = MIN_GENERATION_KEYS
        self._current = BloomFilter(self._generation_keys)
        self._previous = BloomFilter(self._generation_keys)
        self._current_count = 0
        self._current_bytes = 0
        self._previous_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes evicted into the remembered generations."""
        return self._current_bytes + self._previous_bytes

    @property
    def memory_bytes(self) -> int:
        return self._current.memory_bytes + self._previous.memory_bytes

    def add(self, h: int, nbytes: int, resident_keys: int) -> None:
        if self._current_count >= self._generation_keys:
            self._previous, self._previous_bytes = self._current, self._current_bytes
            self._generation_keys = max(MIN_GENERATION_KEYS, resident_keys)
            self._current = BloomFilter(self._generation_keys)
            self._current_count = 0
            self._current_bytes = 0
        self._current.add_one(h)
        self._current_count += 1
        self._current_bytes += nbytes

    def __contains__(self, h: int) -> bool:
        return self._current.contains_one(h) or self._previous.contains_one(h)


class WindowSizer:
    """Keeps ``fraction`` (the window's share of capacity) within [min_fraction, max_fraction]."""

    def __init__(self, initial_fraction: float, *, min_fraction: float, max_fraction: float) -> None:
        if not 0.0 < min_fraction <= initial_fraction <= max_fraction < 1.0:
            raise ValueError(
                "need 0 < min_fraction <= initial_fraction <= max_fraction < 1, got "
                f"{min_fraction}, {initial_fraction}, {max_fraction}"
            )
        self.fraction = initial_fraction
        self.min_fraction = min_fraction
        self.max_fraction = max_fraction
        self._window_ghost = GhostList()
        self._main_ghost = GhostList()
        self.grows = 0
        self.shrinks = 0

    @property
    def memory_bytes(self) -> int:
        return self._window_ghost.memory_bytes + self._main_ghost.memory_bytes

    def record_eviction(self, h: int, nbytes: int, from_window: bool, resident_keys: int) -> None:
        """Key hash ``h`` of ``nbytes`` was evicted from the window (or from the main region)."""
        ghost = self._window_ghost if from_window else self._main_ghost
        ghost.add(h, nbytes, resident_keys)

    def record_insert(self, h: int, nbytes: int, capacity: int) -> bool:
        """A new key became resident (after a miss); returns True when ``fraction`` changed."""
        in_window_ghost = h in self._window_ghost
        in_main_ghost = h in self._main_ghost
        if in_window_ghost == in_main_ghost:
            # Not a ghost, or (false positive or evicted from both lately) no clear signal.
            return False
        window_bytes = max(1, self._window_ghost.nbytes)
        main_bytes = max(1, self._main_ghost.nbytes)
        if in_window_ghost:
            step = nbytes * max(1.0, main_bytes / window_bytes) / capacity
        else:
            step = -nbytes * max(1.0, window_bytes / main_bytes) / capacity
        before = self.fraction
        self.fraction = min(self.max_fraction, max(self.min_fraction, before + step))
        if self.fraction == before:
            return False
        if step > 0:
            self.grows += 1
        else:
            self.shrinks += 1
        return True
