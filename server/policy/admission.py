"""TinyLFU admission: frequency sketch + doorkeeper + aging schedule + the admit decision."""

from __future__ import annotations

import numpy as np

from pegaflow.server.policy.doorkeeper import Doorkeeper
from pegaflow.server.policy.frequency_sketch import FrequencySketch


class TinyLFUAdmission:
    """Decides whether a candidate key is worth more than the victim it would displace.

    ``record`` feeds every looked-up key (as uint64 hashes). The first sighting of
    a key since the last aging only sets its doorkeeper bit; later ones count in
    the sketch. Every ``sample_size`` samples (10 x the expected number of
    resident keys) the sketch halves its counters and the doorkeeper is cleared,
    so frequencies describe the recent past rather than all time.
    """

    def __init__(self, expected_keys: int) -> None:
        self._sketch = FrequencySketch(expected_keys)
        # Sized for the longest aging period this sketch table allows (keys grow, the table stays).
        self._doorkeeper = Doorkeeper(self._sketch.max_sample_size)
        self.samples = 0
        self.agings = 0

    @property
    def sample_size(self) -> int:
        return self._sketch.sample_size

    @property
    def capacity(self) -> int:
        return self._sketch.capacity

    @property
    def memory_bytes(self) -> int:
        return self._sketch.memory_bytes + self._doorkeeper.memory_bytes

    def ensure_capacity(self, expected_keys: int) -> None:
        """Sizes for ``expected_keys`` resident keys.

        The aging period lengthens with them; the table is replaced by a larger
        one (forgetting the history) only when the current one is too small.
        """
        if self._sketch.ensure_capacity(expected_keys):
            self._doorkeeper = Doorkeeper(self._sketch.max_sample_size)
            self.samples = 0

    def record(self, hashes: np.ndarray) -> None:
        """Counts one sample per hash; ages exactly when a period's worth of samples has been seen."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        start = 0
        while start < len(hashes):
            take = min(len(hashes) - start, self.sample_size - self.samples)
            self._record_chunk(hashes[start : start + take])
            self.samples += take
            start += take
            if self.samples >= self.sample_size:
                self._age()

    def _record_chunk(self, hashes: np.ndarray) -> None:
        keys, counts = np.unique(hashes, return_counts=True)
        seen_before = self._doorkeeper.admit_first_sightings(keys)
        # A key new to the doorkeeper spends its first occurrence setting its bit there.
        counts = counts - (~seen_before)
        counted = counts > 0
        self._sketch.increment(keys[counted], counts[counted])

    def _age(self) -> None:
        self._sketch.age()
        self._doorkeeper.clear()
        self.samples //= 2
        self.agings += 1

    def frequency(self, hashes: np.ndarray) -> np.ndarray:
        """Estimated recent lookups per key (sketch estimate + the doorkeeper's first sighting)."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        return self._sketch.estimate(hashes).astype(np.int64) + self._doorkeeper.seen(hashes)

    def admit(self, candidate_hash: int, victim_hash: int) -> bool:
        """True when the candidate was looked up more often than the victim.

        Ties keep the victim: a newcomer must prove itself, which is what stops a
        scan of one-off keys from flushing the main region. (Caffeine adds a small
        random admission against crafted hash collisions; the policy salts key
        hashes per instance, so an outsider cannot aim at a victim's counters.)
        """
        return self.frequency_one(candidate_hash) > self.frequency_one(victim_hash)

    def frequency_one(self, h: int) -> int:
        """``frequency`` of one hash, on Python ints (the eviction path decides one pair at a time)."""
        return self._sketch.estimate_one(h) + self._doorkeeper.seen_one(h)
