"""What more (or less) DRAM would buy: an online miss-ratio curve of the pool's block lookups.

Method: SHARDS, "Spatially Hashed Approximate Reuse Distance Sampling" (C. A. Waldspurger,
N. Park, A. Garthwaite, I. Ahmad, "Efficient MRC Construction with SHARDS", USENIX FAST '15),
in its fixed-size variant:

* **Spatial sampling.** A block key (namespace index + block hash) is sampled when
  ``hash(key) mod P < T``; the rate is R = T / P. Every request of a sampled key is sampled, so
  the reuse distances among sampled keys, scaled by 1 / R, estimate those of the whole stream.
* **Reuse distance** of a request = what LRU would have to hold for it to hit: the bytes of the
  distinct keys requested since the key's previous request, plus the key's own bytes. Computed
  on the sample with a Fenwick tree over sampled-request timestamps holding, at each key's latest
  timestamp, its bytes (Olken's method): the distance is one prefix sum, O(log n).
* **Fixed size** (SHARDS §3.3). At most ``max_keys`` keys are tracked: when a new one would
  exceed it, the tracked key with the largest hash leaves and T drops to its hash, so R adapts
  downwards to the working set and memory stays bounded. R starts at ``max_rate``.
* **CPU budget.** Besides, R drops whenever more than ``max_sampled_per_s`` requests per second
  went through the sample over the last ``BUDGET_PERIOD_S`` (T is lowered in proportion and the
  keys above it leave, exactly as for the fixed size). R never rises again: a key not tracked
  before would look like a first request.
* **Weights instead of rescaling.** A sampled request adds 1 / R (R at that moment) to its
  distance bin: the Horvitz-Thompson form of the paper's histogram rescaling, identical in
  expectation, with no pass over the histogram when R drops.
* **SHARDS_adj.** The miss ratio at capacity C is the sampled weight of distances > C (cold
  misses included) over N, the number of *all* requests: the paper's adjustment of the first
  bucket by the difference between expected and actual samples. Measured against the plain ratio
  (sampled weight of misses over sampled weight of all requests), max |error| over 0.25x..4x
  against an exact byte-LRU, mean / worst points (bench/mrc_check.py --sweep, 6 hash salts each,
  bench/results/mrc_estimators.json): on a Zipf(1.1) stream adj 1.5 / 3.4 vs ratio 13.3 / 21.4 at
  R = 0.1, 0.4 / 0.7 vs 4.9 / 6.6 at the defaults (a few hot keys in or out of the sample swing
  the hit weight; the miss weight, spread over the tail, is stable); on the bench harness's chat
  traces (3 traces) adj 2.9 / 9.6 vs ratio 1.6 / 4.0 at R = 0.1, 0.2 / 0.8 vs 0.2 / 0.4 at the
  defaults. adj is kept, and the defaults keep the sample large.

Unit: **bytes**, not blocks. The pool is one byte budget shared by every namespace's block size:
the allocator's slabs move between sizes, and eviction takes the least recently used block
whatever its size, so the LRU stack that decides hits is one stack of blocks of mixed sizes.
Counting distances in bytes lets one curve answer "what would a pool of 2x the bytes hit" even
when 4 KiB and 1 MiB blocks share it; a curve in blocks would only be right for one size.

The access order follows the engine's recency: a lookup's blocks are fed tail first (the engine
touches hits and restates a saved chain tail first, so the head ends the most recent). The model
is plain LRU over every looked-up block as if each miss were saved right after its lookup: the
engine's W-TinyLFU admission, pinned (leased) blocks, slab-tail waste and the prefix rule (a
block after the first miss counts as a miss even if resident) are not modelled; bench/mrc_check.py
measures how far real runs are from the prediction.

Windows: like the measured hit rate and the HLL ceiling, the distance histogram is kept per
rolling window as a ring of time buckets on the same boundaries, so the prediction for "1x" and
the measured hit rate of a window cover the same requests. The reuse state itself (which key was
seen when) is not windowed: a key's distance is measured from its previous request, however old.

Cost, bounded by construction (bench/mrc_check.py measures it: bench/results/mrc_check.json):
* memory: O(max_keys): per tracked key a dict entry, its key, a heap entry and 4 Fenwick slots,
  plus windows x 15 buckets x 67 bins floats: 5.8 MiB traced at the default 16384 keys;
* CPU per looked-up block: one XXH3 call for every block (~0.1 us; the histogram counts are
  staged in a list and reach the windows' numpy arrays every FOLD_S, as the HLL ceiling's
  registers do, so a 16-key slice pays no numpy call), plus ~5-9 us of Python for each sampled
  one (measured on this 2-core machine under load), at most ``max_sampled_per_s`` of them per
  second: at the default 10,000/s that is at most ~0.1 s of one core per second, on the metrics
  feeder thread, never on the request path.

Not thread-safe by itself: one lock inside serialises ``add`` (the feeder) and reads (scrapes).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from xxhash import xxh3_64_intdigest

from pegaflow.server.metrics.hll_ceiling import BUCKETS_PER_WINDOW, FOLD_S

# The capacity points exported as pegaflow_mrc_predicted_hit_rate{pool_factor}.
POOL_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
# Histogram bins: capacities C * 2**(k / STEPS_PER_OCTAVE) for k in -OCTAVES*STEPS .. +OCTAVES*STEPS,
# so every power of two from 1/16x to 16x (the exported factors among them) is a bin edge.
STEPS_PER_OCTAVE = 8
OCTAVES = 4
EDGES = 2 * OCTAVES * STEPS_PER_OCTAVE + 1
BEYOND = EDGES  # distances above the largest edge
COLD = EDGES + 1  # first requests of a key: a miss at every capacity
BINS = EDGES + 2
_HALF_SPAN = OCTAVES * STEPS_PER_OCTAVE
EDGE_FACTORS = tuple(2.0 ** (k / STEPS_PER_OCTAVE) for k in range(-_HALF_SPAN, _HALF_SPAN + 1))

HASH_BITS = 24
HASH_SPACE = 1 << HASH_BITS
# The sampling hash is XXH3-64 seeded with the salt: independent of the HLL's (another seed).
# Another salt samples another set of keys (bench/mrc_check.py --sweep measures the spread).
DEFAULT_SALT = 0x5A4D_5348_4152_4453

# Defaults: exact (R = 1) for working sets up to 16384 blocks, sampled beyond; see the estimator
# measurements above for what 8192 or 16384 keys buy.
DEFAULT_MAX_KEYS = 16384
DEFAULT_MAX_RATE = 1.0
DEFAULT_MAX_SAMPLED_PER_S = 10_000.0
BUDGET_PERIOD_S = 10.0


def _fenwick(values: Sequence[int]) -> list[int]:
    """A Fenwick (binary indexed) tree over ``values``, 1-based, built in O(n). Slot j (0-based) is
    updated by walking i = j + 1, i += i & -i; the sum of slots [0, j] by i = j + 1, i -= i & -i
    (the walks are inlined in MissRatioCurve._sample, its hot loop)."""
    tree = [0, *values]
    n = len(values)
    for i in range(1, n + 1):
        j = i + (i & -i)
        if j <= n:
            tree[j] += tree[i]
    return tree


class _Ring:
    """One window's distance histograms, a ring of time buckets (WindowedHitRate's boundaries)."""

    __slots__ = ("width", "stamps", "hist", "requests")

    def __init__(self, window_s: float):
        self.width = window_s / BUCKETS_PER_WINDOW
        self.stamps = [-1] * BUCKETS_PER_WINDOW
        self.hist = np.zeros((BUCKETS_PER_WINDOW, BINS), dtype=np.float64)
        self.requests = [0] * BUCKETS_PER_WINDOW

    def add(self, now: float, hist: np.ndarray, requests: int) -> None:
        number = int(now // self.width)
        slot = number % BUCKETS_PER_WINDOW
        if self.stamps[slot] != number:
            self.stamps[slot] = number
            self.hist[slot].fill(0.0)
            self.requests[slot] = 0
        self.hist[slot] += hist
        self.requests[slot] += requests

    def merged(self, now: float) -> tuple[np.ndarray, int]:
        newest = int(now // self.width)
        oldest = newest - BUCKETS_PER_WINDOW
        live = [s for s in range(BUCKETS_PER_WINDOW) if oldest < self.stamps[s] <= newest]
        if not live:
            return np.zeros(BINS), 0
        return self.hist[live].sum(axis=0), sum(self.requests[s] for s in live)


class MissRatioCurve:
    """Predicted LRU hit rate of the stream of block requests at multiples of ``capacity_bytes``."""

    def __init__(
        self,
        capacity_bytes: int,
        windows: dict[str, float],
        max_keys: int = DEFAULT_MAX_KEYS,
        max_rate: float = DEFAULT_MAX_RATE,
        max_sampled_per_s: float = DEFAULT_MAX_SAMPLED_PER_S,
        clock: Callable[[], float] = time.monotonic,
        salt: int = DEFAULT_SALT,
    ):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if not windows:
            raise ValueError("at least one window is needed")
        for name, seconds in windows.items():
            if not (isinstance(name, str) and name and isinstance(seconds, (int, float)) and seconds > 0):
                raise ValueError(f"bad window {name!r}: {seconds!r}")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 16:
            raise ValueError(f"max_keys must be an int >= 16, got {max_keys!r}")
        if not (isinstance(max_rate, (int, float)) and 0 < max_rate <= 1):
            raise ValueError(f"max_rate must be in (0, 1], got {max_rate!r}")
        if not (isinstance(max_sampled_per_s, (int, float)) and max_sampled_per_s > 0):
            raise ValueError(f"max_sampled_per_s must be positive, got {max_sampled_per_s!r}")
        self.capacity_bytes = capacity_bytes
        self.max_keys = max_keys
        self._threshold = max(1, int(max_rate * HASH_SPACE))  # T: sampled when hash < T
        self._clock = clock
        self._salt = salt % (1 << 64)
        self.max_sampled_per_s = float(max_sampled_per_s)
        self._period_start = clock()
        self._period_sampled = 0
        self._rings = {name: _Ring(float(seconds)) for name, seconds in windows.items()}
        # Tracked keys: key -> [timestamp, nbytes, hash]; a max-heap of (-hash, key) to shrink the sample.
        self._keys: dict[bytes, list[int]] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._slots = 4 * max_keys  # timestamps before a compaction renumbers them
        self._tree = _fenwick([0] * self._slots)
        self._now = 0  # next timestamp
        self._tracked_bytes = 0  # sum of the tracked keys' bytes (the tree's total)
        # Bin i of a distance d: the first edge with d <= edge (bisect); BEYOND past the last.
        self._edge_bytes = [f * capacity_bytes for f in EDGE_FACTORS]
        self._lock = threading.Lock()
        # Staging (as HitRateCeiling's): the feeder's 16-key slices add to a plain list; the windows'
        # numpy histograms get it every FOLD_S, at a window bucket's boundary and before every read.
        self._staged_counts = [0.0] * BINS
        self._staged_requests = 0
        self._staged_at = 0.0
        self._staged_until = -math.inf
        self.requests = 0  # every request fed (sampled or not)
        self.sampled_requests = 0
        self.compactions = 0

    @property
    def rate(self) -> float:
        """The current sampling rate R = T / P."""
        return self._threshold / HASH_SPACE

    @property
    def tracked_keys(self) -> int:
        return len(self._keys)

    # ------------------------------------------------------------------ feeding

    def add(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Feeds requests in access order: ``keys[i]`` (bytes, namespace included) of ``sizes[i]``
        bytes. Keys must be bytes; sizes positive."""
        n = len(keys)
        if n != len(sizes):
            raise ValueError(f"{n} keys but {len(sizes)} sizes")
        if n == 0:
            return
        if min(sizes) <= 0:
            raise ValueError("block sizes must be positive")
        if not set(map(type, keys)) <= {bytes}:
            raise TypeError("miss-ratio curve keys must be bytes")
        mask = HASH_SPACE - 1
        with self._lock:
            now = self._clock()
            if now >= self._staged_until:
                self._fold()
                until = now + FOLD_S
                for ring in self._rings.values():
                    until = min(until, (now // ring.width + 1) * ring.width)
                self._staged_at, self._staged_until = now, until
            threshold = self._threshold
            picked = [
                (i, v & mask)
                for i, v in enumerate(map(xxh3_64_intdigest, keys, itertools.repeat(self._salt, n)))
                if v & mask < threshold
            ]
            sampled_before = self.sampled_requests
            if picked:
                self._sample(
                    [keys[i] for i, _ in picked],
                    [int(sizes[i]) for i, _ in picked],
                    [v for _, v in picked],
                    self._staged_counts,
                )
            self._period_sampled += self.sampled_requests - sampled_before
            self._keep_budget(now)
            self._staged_requests += n
            self.requests += n

    def _fold(self) -> None:
        """The staged histogram into every window's bucket of the time it was staged (under the lock)."""
        if not self._staged_requests:
            return
        hist = np.array(self._staged_counts, dtype=np.float64)
        for ring in self._rings.values():
            ring.add(self._staged_at, hist, self._staged_requests)
        self._staged_counts = [0.0] * BINS
        self._staged_requests = 0

    def _sample(self, keys: list[bytes], sizes: list[int], values: list[int], counts: list[float]) -> None:
        # The Fenwick tree's loops are inlined: this loop is the MRC's whole per-sample cost.
        tracked = self._keys
        tree, slots, edges = self._tree, self._slots, self._edge_bytes
        for key, size, value in zip(keys, sizes, values, strict=True):
            if value >= self._threshold:  # the threshold dropped within this batch
                continue
            weight = HASH_SPACE / self._threshold  # 1 / R
            if self._now == slots:
                self._compact()
                tree = self._tree
            now = self._now
            self._now = now + 1
            entry = tracked.get(key)
            if entry is None:
                counts[COLD] += weight
                tracked[key] = [now, size, value]
                heapq.heappush(self._heap, (-value, key))
                delta = size
            else:
                last, old_size = entry[0], entry[1]
                i, before = last + 1, 0  # bytes of keys last seen at or before `last`
                while i > 0:
                    before += tree[i]
                    i -= i & -i
                distance = (self._tracked_bytes - before) * weight + size
                counts[bisect.bisect_left(edges, distance)] += weight
                i = last + 1
                while i <= slots:
                    tree[i] -= old_size
                    i += i & -i
                entry[0], entry[1] = now, size
                delta = size - old_size
            i = now + 1
            while i <= slots:
                tree[i] += size
                i += i & -i
            self._tracked_bytes += delta
            self.sampled_requests += 1
            if entry is None and len(tracked) > self.max_keys:
                self._shrink()

    def _shrink(self) -> None:
        """Fixed size: the tracked key with the largest hash leaves and T drops to its hash."""
        self._lower_threshold(-self._heap[0][0])

    def _keep_budget(self, now: float) -> None:
        """CPU budget: over each period, at most max_sampled_per_s sampled requests per second."""
        elapsed = now - self._period_start
        if elapsed < BUDGET_PERIOD_S:
            return
        observed = self._period_sampled / elapsed
        if observed > self.max_sampled_per_s:
            self._lower_threshold(max(1, int(self._threshold * self.max_sampled_per_s / observed)))
        self._period_start, self._period_sampled = now, 0

    def _lower_threshold(self, threshold: int) -> None:
        """T := threshold; every tracked key with a hash at or above it leaves the sample."""
        self._threshold = min(self._threshold, threshold)
        while self._heap and -self._heap[0][0] >= self._threshold:
            _, key = heapq.heappop(self._heap)
            last, size, _ = self._keys.pop(key)
            i = last + 1
            while i <= self._slots:
                self._tree[i] -= size
                i += i & -i
            self._tracked_bytes -= size

    def _compact(self) -> None:
        """Renumbers the tracked keys' timestamps 0..k-1 in order and rebuilds the tree."""
        order = sorted(self._keys.values(), key=lambda e: e[0])
        values = [0] * self._slots
        for stamp, entry in enumerate(order):
            entry[0] = stamp
            values[stamp] = entry[1]
        self._tree = _fenwick(values)
        self._now = len(order)
        self.compactions += 1

    # ------------------------------------------------------------------ reading

    def predicted_hit_rates(self, window: str, factors: Sequence[float] = POOL_FACTORS) -> dict[float, float]:
        """{factor: predicted LRU hit rate of a pool of factor x capacity_bytes} over the window;
        empty when no request of the window was sampled. Factors must be histogram edges
        (see EDGE_FACTORS)."""
        indices = {f: self.edge_index(f) for f in factors}
        rates = self._edge_hit_rates(window)
        return {} if rates is None else {f: float(rates[i]) for f, i in indices.items()}

    def curve(self, window: str) -> list[tuple[float, float]]:
        """(factor, predicted hit rate) at every histogram edge, 1/16x to 16x; empty without requests."""
        rates = self._edge_hit_rates(window)
        return [] if rates is None else list(zip(EDGE_FACTORS, rates.tolist(), strict=True))

    def distance_histogram(self, window: str) -> tuple[np.ndarray, int]:
        """(weights per bin, requests) over the window: bin e < EDGES holds distances in
        (EDGE_FACTORS[e - 1], EDGE_FACTORS[e]] x capacity, then BEYOND, then COLD."""
        with self._lock:
            ring = self._ring(window)
            self._fold()
            self._staged_until = -math.inf
            return ring.merged(self._clock())

    def _edge_hit_rates(self, window: str) -> np.ndarray | None:
        hist, requests = self.distance_histogram(window)
        if requests == 0 or not hist.any():
            return None
        # Weight of the distances above each edge (beyond and cold included), over ALL requests
        # (SHARDS_adj): misses_above[e + 1] is what a pool of edge e's capacity misses.
        misses_above = hist[::-1].cumsum()[::-1]
        return np.clip(1.0 - misses_above[1 : EDGES + 1] / requests, 0.0, 1.0)

    @staticmethod
    def edge_index(factor: float) -> int:
        k = math.log2(factor) * STEPS_PER_OCTAVE
        if not (k == round(k) and abs(k) <= OCTAVES * STEPS_PER_OCTAVE):
            raise ValueError(f"pool factor {factor} is not a histogram edge (2**(k/8) within [1/16, 16])")
        return int(round(k)) + OCTAVES * STEPS_PER_OCTAVE

    def _ring(self, window: str) -> _Ring:
        try:
            return self._rings[window]
        except KeyError:
            raise KeyError(f"unknown window {window!r}; known: {', '.join(self._rings)}") from None

    def memory_bytes(self) -> int:
        """Approximate bytes held: tracked keys (dict entry, key object, entry list, heap tuple),
        the Fenwick tree's list and ints, and the windows' histograms."""
        with self._lock:
            per_key = 0
            if self._keys:
                sample_key = next(iter(self._keys))
                # dict slot ~ 3 words x 1.5 load, key bytes, entry list of 3 ints, heap tuple.
                per_key = 72 + (33 + len(sample_key)) + (88 + 3 * 28) + (56 + 8) + 28
            tree = 8 * (self._slots + 1) + 32 * self._slots
            hists = sum(r.hist.nbytes for r in self._rings.values())
            return per_key * len(self._keys) + tree + hists
