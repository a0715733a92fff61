"""64-bit hashes of opaque keys, and the mixer that derives independent indexes from them.

Keys are arbitrary hashables (the engine uses ``(namespace_id, block_hash)``), so
the first step is Python's own ``hash``. ``hash`` of small ints is the identity,
so every index is taken from a splitmix64 mix, never from the raw hash; the
policy mixes in a random per-instance salt first (``salted_hashes``), so an
outsider cannot predict which counters or bits a key lands on.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MUL1_INT = 0xBF58476D1CE4E5B9
_MUL2_INT = 0x94D049BB133111EB
_MUL1 = np.uint64(_MUL1_INT)
_MUL2 = np.uint64(_MUL2_INT)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def hash_keys(keys: Sequence[Hashable]) -> np.ndarray:
    """One uint64 per key (same key, same value within this process)."""
    return np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)).view(np.uint64)


def salted_hashes(keys: Sequence[Hashable], salt: int) -> np.ndarray:
    """``hash_keys`` mixed with ``salt``: the hashes the sketch and the doorkeeper are fed."""
    return mix64(hash_keys(keys), salt)


def mix64(hashes: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 finaliser of ``hashes + seed * golden``: a different well-spread hash per seed.

    ``hashes`` must be a uint64 array (array arithmetic wraps modulo 2**64 silently).
    """
    # The offset is computed on Python ints: numpy warns on uint64 *scalar* overflow.
    z = hashes + np.uint64((seed * _GOLDEN) & _MASK64)
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


def mix64_int(h: int, seed: int) -> int:
    """``mix64`` of one value on Python ints (bit-identical; avoids numpy's per-call overhead)."""
    z = (h + seed * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1_INT) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2_INT) & _MASK64
    return z ^ (z >> 31)


def salted_hash(key: Hashable, salt: int) -> int:
    """``salted_hashes`` of one key, as a Python int."""
    return mix64_int(hash(key) & _MASK64, salt)


def ceil_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
