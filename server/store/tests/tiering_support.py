"""A slow, byte-holding lower tier for the block store's unit tests.

It implements the Tier contract (server/tiers/base.py) over a dict, with its I/O completing on a
thread after an optional delay and faults injectable per address, so the store's tiering logic
(demotion, promotion, pins, FIFO reclaim, failures) is tested without a disk. The real SSD tier
(server/tiers/ssd) has its own tests; the engine's end-to-end SSD tests use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from pegaflow.server.tiers.base import (
    Extent,
    IoStatus,
    ReadRequest,
    RecoveredBlock,
    Tier,
    TierStats,
    WriteRequest,
    io_bytes,
)


class SlowTier(Tier):
    name = "ssd"
    persistent = True

    def __init__(self, capacity_blocks: int, delay_s: float = 0.0):
        self.capacity_blocks = capacity_blocks
        self.delay_s = delay_s
        self.records: dict[int, tuple[bytes, bytes]] = {}  # address -> (tag, bytes)
        self.allocated: set[int] = set()
        self._next = 0
        self.corrupt: set[int] = set()  # addresses whose reads answer CORRUPT
        self.reads = self.writes = 0
        self.gate = threading.Event()  # cleared: I/O waits for it (to hold transfers in flight)
        self.gate.set()
        self._threads: list[threading.Thread] = []

    def allocate(self, block_bytes: int, count: int) -> list[Extent]:
        room = self.capacity_blocks - len(self.allocated)
        out = []
        for _ in range(min(count, room)):
            address = self._next
            self._next += io_bytes(block_bytes) + 4096
            self.allocated.add(address)
            out.append(Extent(address, block_bytes))
        return out

    def free(self, extents: Sequence[Extent]) -> None:
        for extent in extents:
            self.allocated.remove(extent.address)
            self.records.pop(extent.address, None)

    def _later(self, fn) -> Future:
        future: Future = Future()

        def run():
            self.gate.wait()
            time.sleep(self.delay_s)
            future.set_result(fn())

        t = threading.Thread(target=run, daemon=True)
        self._threads.append(t)
        t.start()
        return future

    def write(self, requests: Sequence[WriteRequest]) -> Future[list[IoStatus]]:
        def run():
            for r in requests:
                self.records[r.extent.address] = (r.tag, bytes(r.source[: r.extent.length]))
                self.writes += 1
            return [IoStatus.OK] * len(requests)

        return self._later(run)

    def read(self, requests: Sequence[ReadRequest]) -> Future[list[IoStatus]]:
        def run():
            out = []
            for r in requests:
                self.reads += 1
                tag, data = self.records.get(r.extent.address, (None, None))
                if r.extent.address in self.corrupt or tag != r.tag:
                    out.append(IoStatus.CORRUPT)
                    continue
                np.frombuffer(r.dest, np.uint8, r.extent.length)[:] = np.frombuffer(data, np.uint8)
                out.append(IoStatus.OK)
            return out

        return self._later(run)

    def recover(self, report):
        for address in sorted(self.records):
            tag, data = self.records[address]
            yield RecoveredBlock(tag, Extent(address, len(data)))

    def stats(self) -> TierStats:
        return TierStats(name=self.name, capacity_bytes=self.capacity_blocks, used_bytes=len(self.allocated))

    def settle(self) -> None:
        for t in self._threads:
            t.join(5)
