"""The I/O engine seam inside the SSD tier: positional vectored reads and writes on O_DIRECT
file descriptors, run off the GIL, a bounded number at a time.

An engine knows nothing of records, segments or tiers: the tier hands it ``IoOp`` objects and
an op turns its own result into a status. Two engines implement it (engines/threads.py,
engines/uring.py); engines/__init__.py picks one (``auto`` = the measured faster one) and
probes io_uring in a child process before trusting it.

Primitives, by role:

``IoOp.prepare(scratch)``  (the op's, called by the engine)
    Called on an engine thread right before the op is started, never under a lock of the
    engine's. Returns the buffers to transfer (memoryviews, each IO_ALIGN-aligned, lengths
    multiples of IO_ALIGN) or ``None`` when the op finished without I/O (it already called its
    own completion: deadline passed, tier turned off). ``scratch`` is a private, aligned
    SCRATCH_BYTES buffer that stays the op's until ``complete`` returns (a record header goes
    there). May take time (a payload checksum at ~18 GB/s, GIL released). May set ``offset``
    (a summary's place is known only once it is built); ``fd`` and ``write`` are fixed.
``IoOp.complete(result)``  (the op's, called by the engine)
    Called once, on an engine thread, with the byte count transferred or ``-errno``. Never
    raises (an exception is logged and the op is lost: ops must not do that).
``IoOp.cancel()``  (the op's, called by the engine)
    Instead of prepare/complete when the engine closes before the op started.
``IoEngine.submit(ops)``
    Any thread, even an engine thread inside ``complete``; never blocks, never raises for I/O.
    The engine runs at most ``queue_depth`` ops at a time; the rest wait in order. Bounding the
    total queue is the tier's job (it raises TierFull before submitting).
``IoPacer.allowed()``  (optional, the server's; engines/__init__.py passes it in)
    Asked before a read starts: ``(depth, recheck_s)``, how many reads may be in flight now (0:
    none may start) and after how many seconds that may have grown. The engine never starts a
    read past it and sleeps at most ``recheck_s`` (capped) before asking again; writes are not
    paced (a write waits for nobody, but one held back holds its DRAM slot and the tier's queue,
    and the demotions behind it get dropped). Without a pacer the limit is ``queue_depth``. Why
    the server slows its own tier's reads: server/movers/foreground_priority.py.
``IoEngine.close()``
    Cancels what has not started, waits for what the kernel still owns (so no buffer is written
    after close returns), stops the threads. Idempotent.
"""

from __future__ import annotations

import abc
import mmap
from collections.abc import Sequence
from typing import Protocol

SCRATCH_BYTES = 4096  # one record header block


class IoOp(abc.ABC):
    __slots__ = ("write", "fd", "offset")

    def __init__(self, write: bool, fd: int, offset: int):
        self.write = write
        self.fd = fd
        self.offset = offset

    @abc.abstractmethod
    def prepare(self, scratch: memoryview) -> list[memoryview] | None: ...

    @abc.abstractmethod
    def complete(self, result: int) -> None: ...

    @abc.abstractmethod
    def cancel(self) -> None: ...


class IoPacer(Protocol):
    held_s: float  # seconds it has held new I/O back in all (the tier's stats show it)

    def allowed(self) -> tuple[int, float]: ...


# An engine waiting on its pacer re-asks at least this often (a pacer's recheck is a hint).
PACER_MAX_SLEEP_S = 0.05


class IoEngine(abc.ABC):
    name: str  # "io_uring" | "threads"
    queue_depth: int

    @abc.abstractmethod
    def submit(self, ops: Sequence[IoOp]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Ops started and not yet completed (a gauge; read without a lock)."""


def aligned_buffer(nbytes: int) -> memoryview:
    """A zeroed, page-aligned anonymous mapping (O_DIRECT needs aligned memory; bytearray is not)."""
    region = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(region)[:nbytes]
