"""Tier reads yield to requests that are served from DRAM now (issue 11: "while a 1 GiB prefix is
being promoted, requests that hit DRAM see TTFT within 10 % of a run without promotions").

Why: on the dev VM a DRAM-hit request's TTFT rose 12-31 % while the SSD tier promoted 1 GiB
prefixes (bench/results/promotion_under_load_qd*.json), and as much while fio read the same disk
with no pegaflow at all; the time went into vLLM's prefill compute, not into pegaflow's lookup or
load, and pinning the server to another CPU did not remove it (the virtual disk's work on the host
competes with the engine's compute). Reading the disk less while such a request runs is the only
lever the cache has, so the order is: a request that can be served now first, one that waits for
the disk next (shortest job first, as a disk scheduler's idle class does for background I/O).

The engine calls ``ready_hit()`` when a prefix query found all its blocks in DRAM. For
``hold_s`` after that, no new tier read starts (what is in flight finishes: at a low depth one
2 MiB op is ~1 ms); for ``calm_s`` after the last such query at most ``busy_depth`` reads run, so
the disk's queue drains within the next hold; after that the tier runs at its own depth again.

Only reads (promotions) are paced. Writes (demotions) are not: under the default placement a
block is written at its DRAM hit, so pacing writes by DRAM hits would hold back every write
behind the very hits that cause it, their DRAM slots stay pinned, the in-flight bound fills and
later demotions are dropped (measured with bench/ssd_server_bench.py: the write phase is such a
stream of DRAM hits).

Starvation: holds are paid from a bucket that fills at ``max_hold_share`` seconds per second
(capacity two holds: a lookup and its load, a few ms apart, extend one hold; a new hold starts
only when a whole one is in the bucket), so under a steady stream of DRAM hits the tier's reads
still run at least ``1 - max_hold_share`` of the time: a waiting promotion is slowed, never stopped.

The tier's engines see only ``allowed()`` (engines/base.py IoPacer): a depth and when to ask
again; no keys, no requests, no policy of their own.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

UNLIMITED = 1 << 30  # "no limit from here": the engine's queue depth is the bound


class ForegroundPriority:
    def __init__(
        self,
        hold_s: float = 0.03,
        busy_depth: int = 2,
        calm_s: float = 1.0,
        max_hold_share: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ):
        if busy_depth < 1:
            raise ValueError("busy_depth must be >= 1")
        if hold_s < 0 or calm_s < 0 or not 0 <= max_hold_share < 1:
            raise ValueError("hold_s and calm_s must be >= 0 and max_hold_share in [0, 1)")
        self.busy_depth = busy_depth
        self.hold_s = hold_s
        self.calm_s = calm_s
        self.max_hold_share = max_hold_share
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._hold_until = now  # no new read before this
        self._calm_until = now  # at most busy_depth before this
        self._bucket_cap = 2 * hold_s
        self._bucket = self._bucket_cap  # seconds of hold that may still be granted
        self._bucket_at = now
        self.ready_hits = 0
        self.held_s = 0.0  # granted hold time (a counter; holds that overlap count once)

    def ready_hit(self) -> None:
        """A query was served wholly from DRAM: hold tier reads back for ``hold_s`` (what the
        bucket allows) and keep their depth low for ``calm_s``."""
        with self._lock:
            now = self._clock()
            self.ready_hits += 1
            self._calm_until = max(self._calm_until, now + self.calm_s)
            self._bucket = min(self._bucket_cap, self._bucket + (now - self._bucket_at) * self.max_hold_share)
            self._bucket_at = now
            start = max(now, self._hold_until)
            if start == now and self._bucket < self.hold_s - 1e-9:
                grant = 0.0  # a new hold is whole or none: slivers of a hold help no request
            else:
                grant = min(now + self.hold_s - start, self._bucket)
            if grant > 0:
                self._bucket -= grant
                self._hold_until = start + grant
                self.held_s += grant

    def allowed(self) -> tuple[int, float]:
        """(reads that may be in flight now, seconds after which that may have grown; inf when it is
        not limited: the engine's own depth applies). Lock-free read: a stale answer is off by one
        ready hit."""
        now = self._clock()
        if now < self._hold_until:
            return 0, self._hold_until - now
        if now < self._calm_until:
            return self.busy_depth, self._calm_until - now
        return UNLIMITED, math.inf
