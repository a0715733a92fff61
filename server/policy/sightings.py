"""Lookup sightings of blocks that no tier held: the memory behind "second sighting" placement.

A block that DRAM evicted before anyone reused it is gone; when a later request asks for it, the
lookup misses, the engine recomputes it and saves it again. That second save is the moment to
write it to SSD: the block has now been asked for twice, so it is not a one-off, and its reuse
distance is longer than DRAM holds, which is exactly what the SSD tier is for. Writing only
blocks that are hit while still in DRAM (the other half of the rule) never catches these.

Two Bloom filters: the first lookup miss of a key sets it in ``once``, a later one in ``twice``;
``seen_again`` asks ``twice``. A key's own request looks it up once before saving it, so one
miss is not enough. Both filters are cleared after about ``expected_keys`` distinct misses (the
aging period), so the memory is fixed (2 x 8 bits per expected key) and old sightings fade; a
false positive (~3 %) costs one unneeded disk write, never a wrong byte.
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable, Sequence

import numpy as np

from pegaflow.server.policy.bloom import BloomFilter
from pegaflow.server.policy.key_hash import salted_hashes


class LookupSightings:
    def __init__(self, expected_keys: int) -> None:
        self.expected_keys = max(1, int(expected_keys))
        self._once = BloomFilter(self.expected_keys)
        self._twice = BloomFilter(self.expected_keys)
        self._salt = secrets.randbits(63)
        self._since_clear = 0

    @property
    def memory_bytes(self) -> int:
        return self._once.memory_bytes + self._twice.memory_bytes

    def missed(self, keys: Sequence[Hashable]) -> None:
        """A lookup found none of ``keys`` in any tier."""
        if not keys:
            return
        hashes = np.unique(salted_hashes(keys, self._salt))
        if self._since_clear + len(hashes) > self.expected_keys:
            self._once.clear()
            self._twice.clear()
            self._since_clear = 0
        before = self._once.put(hashes)
        self._twice.put(hashes[before])
        self._since_clear += int((~before).sum())

    def seen_again(self, keys: Sequence[Hashable]) -> np.ndarray:
        """Per key: True if lookups missed it at least twice since the last clear."""
        if not keys:
            return np.zeros(0, dtype=bool)
        return self._twice.contains(salted_hashes(keys, self._salt))
