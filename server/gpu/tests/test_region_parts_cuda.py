"""A pool with tenant regions (tiers/dram/region.py: several memfds mapped back to back) is registered
with CUDA as one range, and GPU copies reach each part's own memfd: what a kernel writes at a region's
offset is what that region's client reads through its fd, and the reverse.

Skipped (cleanly, at collection) where CuPy or a GPU is missing -- as in CI."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from pegaflow.server.config import MIB
from pegaflow.server.gpu import cuda_runtime

if not cuda_runtime.available():
    pytest.skip("needs CuPy and a CUDA GPU", allow_module_level=True)

from pegaflow.server.gpu.ipc import PinnedHostRegion  # noqa: E402
from pegaflow.server.tiers.dram.region import PoolRegion  # noqa: E402


def test_one_registration_spans_every_part_and_copies_land_in_each_memfd():
    cupy = cuda_runtime.cupy_module()
    region = PoolRegion.create_with_parts(64 * MIB, [("t1", 16 * MIB), ("t2", 16 * MIB)], 16 * MIB)
    view = np.frombuffer(region.buffer, dtype=np.uint8)
    pinned = PinnedHostRegion(view.ctypes.data, view.nbytes)
    try:
        with cupy.cuda.Device(0):
            host = cupy.ndarray(
                (view.nbytes,),
                dtype=cupy.uint8,
                memptr=cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(pinned.device_addr, view.nbytes, region), 0
                ),
            )
            n = 2 * MIB
            for value, part in enumerate(region.parts, start=7):
                # Device -> host: a copy that ends at the part's last byte (its neighbour starts next).
                start = part.base + part.size_bytes - n
                host[start : start + n] = cupy.full(n, value, dtype=cupy.uint8)
            cupy.cuda.Device(0).synchronize()
            for value, part in enumerate(region.parts, start=7):
                got = os.pread(part.fd, n, part.size_bytes - n)  # that part's own memfd
                assert got == bytes([value]) * n
            # Host -> device: bytes a region's client writes through its own mapping.
            t2 = region.part("t2")
            client = mmap.mmap(t2.fd, t2.size_bytes, mmap.MAP_SHARED)
            try:
                pattern = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
                client[:n] = pattern.tobytes()
                on_gpu = cupy.empty(n, dtype=cupy.uint8)
                on_gpu[:] = host[t2.base : t2.base + n]
                assert (cupy.asnumpy(on_gpu) == pattern).all()
            finally:
                client.close()
            del host
    finally:
        pinned.close()
        del view
        region.close()
