"""What the SSD tier's tests share: a page-aligned "DRAM" arena, deterministic block bytes per
tag, tier construction with small segments, and the engines to run every behavioural test on."""

from __future__ import annotations

import hashlib
import mmap
import os
import time

import numpy as np
import pytest

from pegaflow.server.tiers.base import ReadRequest, WriteRequest, io_bytes
from pegaflow.server.tiers.ssd.config import MIB, SsdTierOptions
from pegaflow.server.tiers.ssd.engines import uring_binding
from pegaflow.server.tiers.ssd.tier import SsdTier

SEGMENT = 1 * MIB  # small segments: reuse and recovery paths run on a few MiB


def engines() -> list:
    """Both engines as pytest params; io_uring is skipped (with the reason) where its probe fails."""
    why = uring_binding.probe(os.environ.get("TMPDIR", "/tmp"))
    return [
        pytest.param("threads", id="threads"),
        pytest.param("io_uring", id="io_uring", marks=pytest.mark.skipif(why is not None, reason=str(why))),
    ]


def payload(tag: bytes, length: int) -> np.ndarray:
    """The bytes block ``tag`` holds (so any process can check what it reads)."""
    seed = int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)


class Arena:
    """Slots of io_bytes(block) in one anonymous mapping: page-aligned like the DRAM pool's."""

    def __init__(self, block: int, slots: int):
        self.block = block
        self.stride = io_bytes(block)
        self.map = mmap.mmap(-1, self.stride * slots)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.view = memoryview(self.map)

    def slot(self, i: int) -> memoryview:
        return self.view[i * self.stride : (i + 1) * self.stride]

    def fill(self, i: int, tag: bytes) -> None:
        self.array[i * self.stride : i * self.stride + self.block] = payload(tag, self.block)

    def holds(self, i: int, tag: bytes) -> bool:
        got = self.array[i * self.stride : i * self.stride + self.block]
        return bool(np.array_equal(got, payload(tag, self.block)))

    def scribble(self, i: int) -> None:
        self.array[i * self.stride : (i + 1) * self.stride] = 0xEE

    def close(self) -> None:
        """Drops our references; the mapping goes when the last view of it does (a finished op
        may still hold a slice until its engine thread picks the next op)."""
        del self.array, self.view, self.map


def options(paths, capacity=8 * MIB, engine="threads", **kw) -> SsdTierOptions:
    kw.setdefault("segment_bytes", SEGMENT)
    kw.setdefault("health_check_interval_s", 0.05)
    return SsdTierOptions(paths=tuple(str(p) for p in paths), capacity_bytes=capacity, io_engine=engine, **kw)


def open_tier(paths, capacity=8 * MIB, engine="threads", reports=None, **kw) -> tuple[SsdTier, list]:
    """A tier over ``paths`` after its recovery: (tier, recovered blocks); skips go to ``reports``."""
    tier = SsdTier(options(paths, capacity, engine, **kw))
    sink = reports if reports is not None else []
    return tier, list(tier.recover(lambda where, why: sink.append((where, why))))


def write(tier: SsdTier, arena: Arena, extents, tags, first_slot: int = 0, timeout: float = 30):
    for i, tag in enumerate(tags):
        arena.fill(first_slot + i, tag)
    reqs = [
        WriteRequest(e, t, arena.slot(first_slot + i))
        for i, (e, t) in enumerate(zip(extents, tags, strict=True))
    ]
    return tier.write(reqs).result(timeout)


def read(tier: SsdTier, arena: Arena, extents, tags, first_slot: int = 0, timeout: float = 30):
    for i in range(len(tags)):
        arena.scribble(first_slot + i)
    reqs = [
        ReadRequest(e, t, arena.slot(first_slot + i))
        for i, (e, t) in enumerate(zip(extents, tags, strict=True))
    ]
    return tier.read(reqs).result(timeout)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def flip_byte(path: str, offset: int) -> None:
    """Flips one byte of a file in place (buffered I/O; the tier reads with O_DIRECT, so the page
    cache is dropped for the file first)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), offset)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
