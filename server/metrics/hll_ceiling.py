"""The hit-rate ceiling r* = (N - U) / N over rolling windows, U counted with HyperLogLog.

Over a window, N block requests touched U distinct blocks; even an infinite
cache misses each distinct block once, so no cache can hit more than
(N - U) / N of them. Shown beside the measured hit rate it tells an operator
whether more capacity could help.

Each window is a ring of time buckets (``BUCKETS_PER_WINDOW`` = 15 of them,
fewer above precision 15, each 1/15 of the window long): a bucket holds the HyperLogLog registers of the keys
requested in its time span and their exact count N. Reading a window merges
the registers of its live buckets (element-wise max, the HLL union) and sums
their counts, so the window rolls forward a bucket at a time: it covers
between 14/15 of its length and all of it.

Staging: the metrics feeder calls ``add`` with small slices (16 keys, so it can
yield the GIL between them), where a numpy call's fixed cost (~3-5 us) outweighs
the keys' own work. So ``add`` folds a slice into one staging register array, a
``bytearray`` updated in a plain Python loop (hll_sketch.fold_keys_into: cheaper
than any numpy call for 16 keys). The staged registers and count go to every
window's newest bucket at once (one ``np.maximum`` of 2**p bytes per window) every
``FOLD_S``, when the newest bucket of any window would change (so every key still
lands in the bucket of its time span), and before every read. The hashing runs
under the lock (~0.1 us a key); the lock only serialises the feeder with scrapes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from pegaflow.server.metrics.hll_sketch import (
    HyperLogLog,
    estimate_registers,
    fold_keys_into,
)

BUCKETS_PER_WINDOW = 15
# Register memory per window (live buckets, one spare kept for reuse, the merge of a read) stays below this.
MAX_WINDOW_BYTES = 1 << 20
# Fewer buckets would make the window's trailing edge too coarse.
MIN_BUCKETS = 4
# The longest keys wait in the staging registers before they reach the windows.
FOLD_S = 0.05


class _Bucket:
    __slots__ = ("index", "registers", "requests")

    def __init__(self, index: int, registers: np.ndarray) -> None:
        self.index = index
        self.registers = registers
        self.requests = 0


class _Window:
    """The bucket ring of one window. Not thread-safe: HitRateCeiling serialises access."""

    def __init__(self, seconds: float, precision: int, buckets: int) -> None:
        self.precision = precision
        self.buckets = buckets
        self.bucket_seconds = seconds / buckets
        self.ring: deque[_Bucket] = deque()
        self._spare: np.ndarray | None = None

    def _expire(self, now_index: int) -> None:
        while self.ring and self.ring[0].index <= now_index - self.buckets:
            self._spare = self.ring.popleft().registers

    def bucket_index(self, now: float) -> int:
        return math.floor(now / self.bucket_seconds)

    def merge(self, now_index: int, registers: np.ndarray, requests: int) -> None:
        """Max-merges ``registers`` (the staged keys) and their ``requests`` into the newest bucket."""
        self._expire(now_index)
        if not self.ring or self.ring[-1].index < now_index:
            if self._spare is not None:
                fresh, self._spare = self._spare, None
                fresh.fill(0)
            else:
                fresh = np.zeros(1 << self.precision, dtype=np.uint8)
            self.ring.append(_Bucket(now_index, fresh))
        # A clock that steps back (it should not: monotonic) lands in the newest bucket.
        bucket = self.ring[-1]
        np.maximum(bucket.registers, registers, out=bucket.registers)
        bucket.requests += requests

    def merged(self, now_index: int) -> tuple[int, np.ndarray | None]:
        """(N, union of the live buckets' registers), None when no bucket is live."""
        self._expire(now_index)
        if not self.ring:
            return 0, None
        requests = sum(b.requests for b in self.ring)
        merged = self.ring[0].registers.copy()
        for bucket in list(self.ring)[1:]:
            np.maximum(merged, bucket.registers, out=merged)
        return requests, merged

    def memory_bytes(self) -> int:
        arrays = len(self.ring) + (self._spare is not None)
        return arrays * (1 << self.precision)


class HitRateCeiling:
    """Windowed r* = (N - U) / N over the keys passed to ``add``. Thread-safe."""

    def __init__(
        self,
        windows: dict[str, float],
        precision: int = 14,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not windows:
            raise ValueError("at least one window is needed")
        # Validates the precision (type and range) once, with the sketch's own rules.
        HyperLogLog(precision)
        buckets = min(BUCKETS_PER_WINDOW, MAX_WINDOW_BYTES // (1 << precision) - 2)
        if buckets < MIN_BUCKETS:
            raise ValueError(
                f"precision {precision} is too large: {MIN_BUCKETS} buckets of {1 << precision} registers "
                f"would not fit in {MAX_WINDOW_BYTES} bytes per window"
            )
        self._windows: dict[str, _Window] = {}
        for name, seconds in windows.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"window names must be non-empty strings, got {name!r}")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise TypeError(f"window {name!r}: seconds must be a number, got {seconds!r}")
            if not math.isfinite(seconds) or seconds <= 0:
                raise ValueError(f"window {name!r}: seconds must be positive and finite, got {seconds!r}")
            self._windows[name] = _Window(float(seconds), precision, buckets)
        self.precision = precision
        self._clock = clock
        self._lock = threading.Lock()
        self._staged_bytes = bytearray(1 << precision)  # updated in Python (fold_keys_into)
        self._staged = np.frombuffer(self._staged_bytes, dtype=np.uint8)  # the same bytes, for numpy
        self._staged_requests = 0
        self._staged_at = 0.0
        self._staged_until = -math.inf  # staged keys must reach the windows before this time

    @property
    def windows(self) -> list[str]:
        return list(self._windows)

    def add(self, keys: Sequence[bytes]) -> None:
        """Counts one request per key (N) and folds the keys into the distinct estimate (U)."""
        if len(keys) == 0:
            return
        with self._lock:
            now = self._clock()
            if now >= self._staged_until:
                self._fold()
                # The next fold is due at FOLD_S or at the next bucket boundary of any window.
                until = now + FOLD_S
                for w in self._windows.values():
                    until = min(until, (w.bucket_index(now) + 1) * w.bucket_seconds)
                self._staged_until = until
                self._staged_at = now
            fold_keys_into(self._staged_bytes, keys, self.precision)
            self._staged_requests += len(keys)

    def _fold(self) -> None:
        """The staged keys into every window's bucket of the time they were staged (under the lock)."""
        if not self._staged_requests:
            return
        at = self._staged_at
        for window in self._windows.values():
            window.merge(window.bucket_index(at), self._staged, self._staged_requests)
        self._staged.fill(0)
        self._staged_requests = 0

    def counts(self, window: str) -> tuple[int, float]:
        """(N, U estimate) over the window; U is capped at N (never more distinct keys than requests)."""
        ring = self._window(window)
        with self._lock:
            self._fold()
            self._staged_until = -math.inf
            requests, registers = ring.merged(ring.bucket_index(self._clock()))
        if registers is None:
            return 0, 0.0
        # The estimate (a bincount and a short loop) runs outside the lock.
        return requests, min(estimate_registers(registers, self.precision), float(requests))

    def ceiling(self, window: str) -> float | None:
        """r* = (N - U) / N over the window; None when N == 0."""
        requests, distinct = self.counts(window)
        if requests == 0:
            return None
        return (requests - distinct) / requests

    def memory_bytes(self, window: str) -> int:
        """Bytes of HyperLogLog registers the window holds, counting the merge a read makes.

        Bounded by MAX_WINDOW_BYTES by construction (see ``__init__``).
        """
        ring = self._window(window)
        with self._lock:
            return ring.memory_bytes() + (1 << self.precision)

    def _window(self, name: str) -> _Window:
        try:
            return self._windows[name]
        except KeyError:
            raise KeyError(f"unknown window {name!r}; known: {', '.join(self._windows)}") from None
