"""Measured hit rate over rolling windows (15m / 1h / 24h), shown beside the HLL ceiling.

Each window is a ring of time buckets, as many as the HLL ceiling uses and on
the same boundaries (so the measured rate and the ceiling cover the same span);
a rate is hits / requests over the buckets still inside the window, so it moves
in steps of one bucket. Memory is constant. Not thread-safe: one
feeder thread updates it and reads go through ``rates()`` under the caller's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pegaflow.server.metrics.hll_ceiling import BUCKETS_PER_WINDOW as BUCKETS


class _Ring:
    __slots__ = ("width", "hits", "requests", "stamps")

    def __init__(self, window_s: float):
        self.width = window_s / BUCKETS
        self.hits = [0] * BUCKETS
        self.requests = [0] * BUCKETS
        self.stamps = [-1] * BUCKETS  # which bucket number each slot currently holds

    def add(self, now: float, hits: int, requests: int) -> None:
        number = int(now // self.width)
        slot = number % BUCKETS
        if self.stamps[slot] != number:
            self.stamps[slot] = number
            self.hits[slot] = 0
            self.requests[slot] = 0
        self.hits[slot] += hits
        self.requests[slot] += requests

    def rate(self, now: float) -> float | None:
        newest = int(now // self.width)
        hits = requests = 0
        for slot in range(BUCKETS):
            if newest - BUCKETS < self.stamps[slot] <= newest:
                hits += self.hits[slot]
                requests += self.requests[slot]
        return hits / requests if requests else None


class WindowedHitRate:
    def __init__(self, windows: dict[str, float], clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._rings = {name: _Ring(seconds) for name, seconds in windows.items()}

    def add(self, hits: int, requests: int) -> None:
        now = self._clock()
        for ring in self._rings.values():
            ring.add(now, hits, requests)

    def rates(self) -> dict[str, float | None]:
        now = self._clock()
        return {name: ring.rate(now) for name, ring in self._rings.items()}
