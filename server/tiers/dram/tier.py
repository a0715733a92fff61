"""L1: the shared DRAM pool as a tier (the region every local client maps, carved by the slab allocator).

Its extents are pool slots: ``Extent(address=offset, length=block_bytes)``. Clients write and read
them in place through their own mapping, so this tier has no I/O of its own to queue: ``write`` and
``read`` are synchronous copies, there for completeness and tests. What other tiers need from it is
``view``: the slot as an O_DIRECT-ready buffer to read into or write from, without a bounce copy.

Slab moves (reassigning a whole slab to another block size) stay the block store's business: it
reaches the allocator directly (``allocator``), because choosing which blocks to evict is policy.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from pegaflow.server.tiers.base import (
    Extent,
    IoStatus,
    ReadRequest,
    Tier,
    TierStats,
    WriteRequest,
    io_bytes,
)
from pegaflow.server.tiers.dram.allocator import IO_SLOT_ALIGN, SLOT_ALIGN, SlabAllocator
from pegaflow.server.tiers.dram.region import PoolRegion


class DramTier(Tier):
    name = "dram"
    persistent = False

    def __init__(self, region: PoolRegion, slab_bytes: int | None = None, io_aligned: bool = False):
        """``io_aligned``: slots start on IO_ALIGN and their stride is a multiple of it (set when a tier
        below DRAM reads and writes slots in place)."""
        self.region = region
        part_slabs = ()
        if len(region.parts) > 1:
            # Tenant regions: the region was cut on slab boundaries (PoolRegion.create_with_parts),
            # so each part is whole slabs and no slab straddles two memfds.
            if not slab_bytes or any(p.base % slab_bytes or p.size_bytes % slab_bytes for p in region.parts):
                raise ValueError("a region with tenant parts needs the slab size it was cut on")
            part_slabs = [part.size_bytes // slab_bytes for part in region.parts[1:]]
        self.allocator = SlabAllocator(
            region.size_bytes, slab_bytes, IO_SLOT_ALIGN if io_aligned else SLOT_ALIGN, part_slabs
        )
        self._view = np.frombuffer(region.buffer, dtype=np.uint8)

    # ------------------------------------------------------------------ space

    def allocate(self, block_bytes: int, count: int) -> list[Extent]:
        return [Extent(o, block_bytes) for o in self.allocator.allocate_many(block_bytes, count, hold=True)]

    def free(self, extents: Sequence[Extent]) -> None:
        for extent in extents:
            self.allocator.free(extent.address)

    # ------------------------------------------------------------------- bytes

    def view(self, offset: int, length: int) -> memoryview:
        """The slot at ``offset`` as a buffer of io_bytes(length): what another tier's I/O fills or
        drains (the padding after ``length`` is the slot's own, see allocator.IO_SLOT_ALIGN)."""
        return memoryview(self._view[offset : offset + io_bytes(length)])

    def pool_view(self) -> np.ndarray:
        return self._view

    def zero(self, slots: Sequence[tuple[int, int]], deadline: float | None = None) -> int:
        """Zeroes ``(offset, length)`` slots, in order, with libc memset through ctypes (a CFUNCTYPE
        call: the GIL is released, where numpy's fill would hold it for the whole of a large batch).
        Returns how many of the leading slots were zeroed: all of them, unless ``deadline``
        (time.monotonic()) passed first; it is checked before each slot, so it is overrun by one
        slot's memset at most."""
        base = self._view.ctypes.data
        for done, (offset, length) in enumerate(slots):
            if deadline is not None and time.monotonic() >= deadline:
                return done
            ctypes.memset(base + offset, 0, length)
        return len(slots)

    def write(self, requests: Sequence[WriteRequest]) -> Future[list[IoStatus]]:
        for r in requests:
            n = r.extent.length
            self._view[r.extent.address : r.extent.address + n] = np.frombuffer(r.source, np.uint8, n)
        return _done([IoStatus.OK] * len(requests))

    def read(self, requests: Sequence[ReadRequest]) -> Future[list[IoStatus]]:
        for r in requests:
            n = r.extent.length
            np.frombuffer(r.dest, np.uint8, n)[:] = self._view[r.extent.address : r.extent.address + n]
        return _done([IoStatus.OK] * len(requests))

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name, capacity_bytes=self.region.size_bytes, used_bytes=self.allocator.used_bytes
        )

    def close(self) -> None:
        self._view = None
        self.region.close()


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
