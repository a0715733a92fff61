"""The doorkeeper: absorbs the first occurrence of each key before it reaches the frequency sketch.

Most keys of a scan are seen once; counting them in the sketch would only add
collisions. TinyLFU therefore lets the first occurrence set the key's bits in a
Bloom filter here, and only later occurrences reach the sketch; a key's
frequency is its sketch estimate plus one if the doorkeeper holds it. The
filter is cleared whenever the sketch ages, so it holds about one aging period
of keys and is sized for that many.
"""

from __future__ import annotations

import numpy as np

from pegaflow.server.policy.bloom import BloomFilter


class Doorkeeper:
    """First-sighting filter for about ``expected_keys`` distinct keys per aging period."""

    def __init__(self, expected_keys: int) -> None:
        self._filter = BloomFilter(expected_keys)

    @property
    def memory_bytes(self) -> int:
        return self._filter.memory_bytes

    def admit_first_sightings(self, unique_hashes: np.ndarray) -> np.ndarray:
        """Marks the keys as seen; returns per key whether it had been seen before (so counts in the sketch).

        ``unique_hashes`` must not repeat a key (the caller counts repeats itself).
        """
        return self._filter.put(unique_hashes)

    def seen(self, hashes: np.ndarray) -> np.ndarray:
        """Per key: True if it was (probably) sighted since the last clear. No false negatives."""
        return self._filter.contains(hashes)

    def seen_one(self, h: int) -> bool:
        return self._filter.contains_one(h)

    def clear(self) -> None:
        self._filter.clear()
