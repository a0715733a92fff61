"""The two sketches of the lookup stream, as one object: the HyperLogLog hit-rate ceiling
(hll_ceiling.py) and the miss-ratio curve (miss_ratio_curve.py).

They are the only per-block work the metrics do (an XXH3 call per key, register updates, the
MRC's sampled reuse distances), so they are kept behind one narrow interface that can run in the
server's interpreter (``LookupSketches``, here) or in a process of its own (sketch_process.py,
the server's default: their Python shared the GIL with the request path, see there).

    sketches = LookupSketches(windows, capacity_bytes)
    sketches.add([LookupRecord(ns_index, block_bytes, hashes), ...])   # in access order
    snap = sketches.snapshot()          # SketchSnapshot: plain numbers, what the collectors export
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import NamedTuple

from pegaflow.server.metrics.hll_ceiling import HitRateCeiling
from pegaflow.server.metrics.miss_ratio_curve import POOL_FACTORS, MissRatioCurve


class LookupRecord(NamedTuple):
    """One LOOKUP query's requested block hashes, in the order they were requested. ``block_bytes``
    0: the namespace is gone (released since); the HLL counts its keys, the MRC cannot size them."""

    ns_index: int
    block_bytes: int
    hashes: Sequence[bytes]


@dataclasses.dataclass(frozen=True)
class SketchSnapshot:
    """What both sketches say now; windows by name, pool factors as floats."""

    ceiling: dict[str, float | None]  # r* per window (None: no lookups in the window)
    hll_memory_bytes: dict[str, int]
    mrc_predicted: dict[str, dict[float, float]]  # window -> pool factor -> predicted hit rate
    mrc_rate: float
    mrc_tracked_keys: int
    mrc_memory_bytes: int
    mrc_sampled_requests: int
    requests: int  # block keys fed since start

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["mrc_predicted"] = {w: [[f, r] for f, r in p.items()] for w, p in self.mrc_predicted.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> SketchSnapshot:
        d = dict(d)
        d["mrc_predicted"] = {w: {float(f): float(r) for f, r in p} for w, p in d["mrc_predicted"].items()}
        return cls(**d)


def block_key(ns_index: int, block_hash: bytes) -> bytes:
    """The key both sketches count: namespace index (4 bytes LE) + block hash."""
    return ns_index.to_bytes(4, "little") + block_hash


class LookupSketches:
    """HLL ceiling + miss-ratio curve over the same keys. Thread-safe (one lock)."""

    def __init__(self, windows: dict[str, float], capacity_bytes: int, mrc_options: dict | None = None):
        self.windows = dict(windows)
        self.ceiling = HitRateCeiling(self.windows)
        self.mrc = MissRatioCurve(capacity_bytes, self.windows, **(mrc_options or {}))
        self.requests = 0
        self._lock = threading.Lock()

    def add(self, records: Sequence[LookupRecord], deadline: float | None = None) -> None:
        # deadline: SketchProcess's interface; computed here, nothing to wait for
        keys: list[bytes] = []
        mrc_keys: list[bytes] = []
        sizes: list[int] = []
        for ns_index, block_bytes, hashes in records:
            prefix = ns_index.to_bytes(4, "little")
            ns_keys = [prefix + h for h in hashes]
            keys += ns_keys
            if block_bytes <= 0:  # a namespace released since its lookup: counted, not priced
                continue
            # Tail first: the engine leaves a chain's head the most recent (see miss_ratio_curve).
            ns_keys.reverse()
            mrc_keys += ns_keys
            sizes += [block_bytes] * len(ns_keys)
        if not keys:
            return
        with self._lock:
            self.ceiling.add(keys)
            if mrc_keys:
                self.mrc.add(mrc_keys, sizes)
            self.requests += len(keys)

    def snapshot(self, deadline: float | None = None) -> SketchSnapshot:
        with self._lock:
            return SketchSnapshot(
                ceiling={w: self.ceiling.ceiling(w) for w in self.windows},
                hll_memory_bytes={w: self.ceiling.memory_bytes(w) for w in self.windows},
                mrc_predicted={w: self.mrc.predicted_hit_rates(w, POOL_FACTORS) for w in self.windows},
                mrc_rate=self.mrc.rate,
                mrc_tracked_keys=self.mrc.tracked_keys,
                mrc_memory_bytes=self.mrc.memory_bytes(),
                mrc_sampled_requests=self.mrc.sampled_requests,
                requests=self.requests,
            )

    def close(self) -> None:
        pass
