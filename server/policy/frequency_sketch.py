"""Count-min sketch of key frequencies with saturating 4-bit-range counters and halving (aging).

The sketch answers "about how often was this key looked up recently" in a fixed
amount of memory: ``DEPTH`` rows of counters, each key mapped to one counter per
row, its estimate the minimum over the rows (collisions only ever inflate a
counter). Counters saturate at 15, as in TinyLFU: admission only needs to tell
"rare" from "popular", and ``age`` halving all counters keeps them in range and
lets old popularity fade. The caller decides when to age (see
``TinyLFUAdmission``); ``sample_size`` is the recommended period.

All operations take batches of uint64 key hashes (``key_hash.hash_keys``) so a
batch costs a few numpy calls instead of a Python loop.
"""

from __future__ import annotations

import numpy as np

from pegaflow.server.policy.key_hash import ceil_pow2, mix64, mix64_int

DEPTH = 4
MAX_COUNT = 15
# Counters per row per expected key: 2 x 4 rows = 8 bytes per key, Caffeine's density.
COUNTERS_PER_KEY = 2
MIN_WIDTH = 256
# Row indexes are 32-bit slices of a 64-bit mix.
MAX_WIDTH = 1 << 32
# Aging period in samples per expected key (the TinyLFU paper's W = 10 x cache size).
SAMPLES_PER_KEY = 10

_SHIFT32 = np.uint64(32)


class FrequencySketch:
    """Frequency estimates for about ``capacity`` distinct live keys."""

    def __init__(self, capacity: int) -> None:
        self.width = 0
        self.capacity = 0
        self._table = np.zeros((DEPTH, 0), dtype=np.uint8)
        self._cells = memoryview(self._table.reshape(-1))
        self.ensure_capacity(capacity)

    @property
    def sample_size(self) -> int:
        """Samples after which the counters should be halved."""
        return SAMPLES_PER_KEY * self.capacity

    @property
    def max_sample_size(self) -> int:
        """``sample_size`` at the most keys this table serves before it must grow."""
        return SAMPLES_PER_KEY * (self.width // COUNTERS_PER_KEY)

    @property
    def memory_bytes(self) -> int:
        return self._table.nbytes

    def ensure_capacity(self, capacity: int) -> bool:
        """Grows the table for ``capacity`` keys; returns True when it did (counters restart at 0).

        Counters cannot be rehashed into a wider table, so growing forgets the
        history; the table only grows, by powers of two, so that happens
        O(log n) times over a cache's warm-up.
        """
        capacity = max(1, int(capacity))
        width = min(ceil_pow2(max(COUNTERS_PER_KEY * capacity, MIN_WIDTH)), MAX_WIDTH)
        if width <= self.width:
            self.capacity = max(self.capacity, min(capacity, width // COUNTERS_PER_KEY))
            return False
        self.width = width
        self.capacity = capacity
        self._table = np.zeros((DEPTH, width), dtype=np.uint8)
        # Item access through a memoryview costs ~50 ns against ~100 ns for numpy scalar indexing.
        self._cells = memoryview(self._table.reshape(-1))
        self._mask = np.uint64(width - 1)
        self._row_offsets = (np.arange(DEPTH, dtype=np.uint64) * np.uint64(width))[:, None]
        return True

    def _flat_indexes(self, hashes: np.ndarray) -> np.ndarray:
        """(DEPTH, n) indexes into the flattened table: one counter per row per key."""
        a = mix64(hashes, 1)
        b = mix64(hashes, 2)
        mask = self._mask
        cols = np.stack((a & mask, (a >> _SHIFT32) & mask, b & mask, (b >> _SHIFT32) & mask))
        return cols + self._row_offsets

    def increment(self, hashes: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Adds ``counts[i]`` (default 1) to key ``hashes[i]``, saturating at ``MAX_COUNT``."""
        if len(hashes) == 0:
            return
        flat = self._flat_indexes(np.asarray(hashes, dtype=np.uint64)).ravel()
        if counts is None:
            slots, adds = np.unique(flat, return_counts=True)
        else:
            # Two keys (or rows) may share a counter: sum their increments before saturating.
            slots, inverse = np.unique(flat, return_inverse=True)
            adds = np.bincount(inverse, weights=np.tile(np.asarray(counts, dtype=np.int64), DEPTH))
            adds = adds.astype(np.int64)
        table = self._table.reshape(-1)
        table[slots] = np.minimum(table[slots].astype(np.int64) + adds, MAX_COUNT)

    def estimate(self, hashes: np.ndarray) -> np.ndarray:
        """The estimated count of each key (never below its true count since the last reset, up to 15)."""
        if len(hashes) == 0:
            return np.zeros(0, dtype=np.uint8)
        flat = self._flat_indexes(np.asarray(hashes, dtype=np.uint64))
        return self._table.reshape(-1)[flat].min(axis=0)

    def estimate_one(self, h: int) -> int:
        """``estimate`` of one hash (an int < 2**64) without numpy's per-call overhead."""
        a = mix64_int(h, 1)
        b = mix64_int(h, 2)
        mask = self.width - 1
        w = self.width
        cells = self._cells
        return min(
            cells[a & mask],
            cells[w + ((a >> 32) & mask)],
            cells[2 * w + (b & mask)],
            cells[3 * w + ((b >> 32) & mask)],
        )

    def age(self) -> None:
        """Halves every counter, so that past popularity fades."""
        self._table >>= 1

    def reset(self) -> None:
        self._table.fill(0)
