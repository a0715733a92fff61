"""A Bloom filter over uint64 key hashes, with batch (numpy) and single-key (Python int) operations.

Used by the doorkeeper (first sightings) and by the window sizer's ghost lists
(recent evictions). Memory is one bit per slot, packed in uint64 words.
Hashes must already be well mixed (``key_hash.salted_hash[es]``): the probes
are taken from their two 32-bit halves directly, which keeps the single-key
path (run per eviction) to a few integer operations.
"""

from __future__ import annotations

import numpy as np

from pegaflow.server.policy.key_hash import ceil_pow2

NUM_HASHES = 3
# 8 bits per expected key with 3 hashes: ~3% false positives when full.
BITS_PER_KEY = 8
MIN_BITS = 4096
# Probes come from 32-bit halves of the hash.
MAX_BITS = 1 << 32

_SHIFT_WORD = np.uint64(6)
_BIT_IN_WORD = np.uint64(63)
_ONE = np.uint64(1)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


class BloomFilter:
    """Set membership with no false negatives and ~3% false positives at ``expected_keys`` keys."""

    def __init__(self, expected_keys: int) -> None:
        bits = min(ceil_pow2(max(BITS_PER_KEY * max(1, int(expected_keys)), MIN_BITS)), MAX_BITS)
        self.num_bits = bits
        self._mask = np.uint64(bits - 1)
        self._words = np.zeros(bits // 64, dtype=np.uint64)
        # Item access through a memoryview avoids numpy's scalar overhead on the single-key path.
        self._word_view = memoryview(self._words)
        self._hash_steps = np.arange(NUM_HASHES, dtype=np.uint64)[:, None]

    @property
    def memory_bytes(self) -> int:
        return self._words.nbytes

    def _bit_indexes(self, hashes: np.ndarray) -> np.ndarray:
        # Double hashing (Kirsch-Mitzenmacher): h1 + i*h2 gives NUM_HASHES independent-enough probes.
        h = np.asarray(hashes, dtype=np.uint64)
        h1 = h & _LOW32
        h2 = (h >> _SHIFT32) | _ONE
        return (h1 + self._hash_steps * h2) & self._mask

    def _test(self, bits: np.ndarray) -> np.ndarray:
        set_bits = (self._words[bits >> _SHIFT_WORD] >> (bits & _BIT_IN_WORD)) & _ONE
        return set_bits.astype(bool).all(axis=0)

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """Per key: True if it was (probably) added since the last clear."""
        if len(hashes) == 0:
            return np.zeros(0, dtype=bool)
        return self._test(self._bit_indexes(hashes))

    def put(self, hashes: np.ndarray) -> np.ndarray:
        """Adds the keys; returns, per key, whether it was (probably) present before this call.

        Keys must be distinct within one call (callers pass ``np.unique`` output):
        a key repeated in the batch reads as absent for each of its copies.
        """
        if len(hashes) == 0:
            return np.zeros(0, dtype=bool)
        bits = self._bit_indexes(hashes)
        present = self._test(bits)
        flat = bits.ravel()
        np.bitwise_or.at(self._words, flat >> _SHIFT_WORD, _ONE << (flat & _BIT_IN_WORD))
        return present

    def _bits_one(self, h: int) -> list[int]:
        # Same probes as _bit_indexes, on Python ints (the sums stay far below 2**64, where numpy would wrap).
        h1 = h & 0xFFFFFFFF
        h2 = (h >> 32) | 1
        mask = self.num_bits - 1
        return [(h1 + i * h2) & mask for i in range(NUM_HASHES)]

    def contains_one(self, h: int) -> bool:
        """``contains`` of one hash (an int < 2**64) without numpy's per-call overhead."""
        # The probes of _bits_one, inlined: this runs several times per eviction.
        h1 = h & 0xFFFFFFFF
        h2 = (h >> 32) | 1
        mask = self.num_bits - 1
        words = self._word_view
        for i in range(NUM_HASHES):
            bit = (h1 + i * h2) & mask
            if not (words[bit >> 6] >> (bit & 63)) & 1:
                return False
        return True

    def add_one(self, h: int) -> None:
        words = self._word_view
        for bit in self._bits_one(h):
            words[bit >> 6] |= 1 << (bit & 63)

    def clear(self) -> None:
        self._words.fill(0)
