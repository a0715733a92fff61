"""The tier seam: where sealed blocks' bytes reside on this host (DRAM, SSD).

A tier is *space and I/O*, nothing else. It hands out extents for blocks of a
given size, frees them, moves bytes between its extents and caller buffers
asynchronously, and (if it persists) says at start what it still holds. It
knows no namespaces, no leases or pins and no policy: the block store
(server/store/) decides what goes where and when, pins what is being read, and
picks victims. A tier's ``tag`` (the opaque identity written beside each
block) is what recovery hands back; only the block store gives it meaning.

Primitives, by role (in the spirit of vLLM's connector base: when each is
called, what it may do, how it fails):

``allocate(block_bytes, count)``
    Called by the block store under its lock. Returns up to ``count`` extents
    able to hold ``block_bytes`` each; fewer (maybe none) when the tier is full.
    Must not block or do I/O: a full tier is answered at once, and the store
    frees victims (``free``) and asks again.
``free(extents)``
    Called by the block store under its lock, for extents no transfer still
    uses (the store guarantees it). No I/O; the space is reusable at once.
``write(requests)`` / ``read(requests)``
    Called by the tier mover (server/movers/tier_io.py) *outside* the store's
    lock. Queue the I/O and return a ``concurrent.futures.Future`` at once; the
    future resolves to one ``IoStatus`` per request, in order. Never raise for
    an I/O failure (it is a status); raise ``TierFull`` only when the tier's
    own queue is full (the caller counts a drop). Bytes move without a bounce
    copy where the medium allows it and without holding the GIL. A read checks
    the record it reads (header and checksum) and answers CORRUPT rather than
    hand over a byte it cannot vouch for.
``recover(report)``
    Called once at start, before the server serves. Yields every intact record
    (``RecoveredBlock``: its tag and extent); calls ``report(where, why)`` for
    each record it skips (torn, corrupt, unreadable). After it, ``allocate``
    never hands out space that a yielded extent occupies until it is freed.
``health`` / ``stats()``
    Read by metrics at any time, without a lock: a torn read is one scrape off.
``close()``
    Stops the tier's workers; queued I/O resolves as CANCELLED.

DRAM is a tier too (server/tiers/dram/): its extents are slots of the shared
pool that clients map, and its ``view`` gives the buffer other tiers read into
and write from. A remote node is *not* a tier (it owns no space here): it is a
read-through source over a transport, server/peers/.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import NamedTuple


class Extent(NamedTuple):
    """Where one block's bytes are in one tier. ``address`` means what the tier says (DRAM: the
    byte offset in the pool; SSD: where its record starts); ``length`` is the block's bytes."""

    address: int
    length: int


class IoStatus(enum.IntEnum):
    OK = 0
    CORRUPT = 1  # read: header or checksum did not match (never served)
    IO_ERROR = 2  # EIO, ENOSPC, a file gone: the tier may degrade itself
    CANCELLED = 3  # the tier closed or turned itself off before the I/O ran
    TIMED_OUT = 4  # the request's deadline passed before it could run


# Buffers handed to a tier's I/O start on an IO_ALIGN boundary and are io_bytes(length) long:
# the DRAM tier's slots are laid out so (server/tiers/dram/allocator.py, slot_align), which lets
# an O_DIRECT tier read and write them in place. Only the first ``extent.length`` bytes are the
# block's; a read may overwrite the padding after them.
IO_ALIGN = 4096


def io_bytes(length: int) -> int:
    """``length`` rounded up to IO_ALIGN: the size of the buffer a tier's I/O may touch."""
    return -(-length // IO_ALIGN) * IO_ALIGN


@dataclasses.dataclass(frozen=True, slots=True)
class WriteRequest:
    extent: Extent  # from this tier's allocate
    tag: bytes  # opaque identity stored with the bytes (recovery gives it back); <= MAX_TAG_BYTES
    source: memoryview  # IO_ALIGN-aligned, io_bytes(extent.length) long (a DRAM slot)
    deadline: float | None = None  # time.monotonic(); not started after it
    # The block's XXH3-64 as the store knows it (hashed at seal), or None. A tier that checksums its
    # records stores this one instead of hashing the source again: one pass fewer over the bytes,
    # and a block changed in DRAM since its seal is then caught at its next read (CORRUPT).
    checksum: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ReadRequest:
    extent: Extent
    tag: bytes  # what the record must carry: a record of another block is CORRUPT
    dest: memoryview  # IO_ALIGN-aligned, io_bytes(extent.length) long (a DRAM slot)
    deadline: float | None = None


MAX_TAG_BYTES = 128


class RecoveredBlock(NamedTuple):
    tag: bytes
    extent: Extent


class TierHealth(enum.IntEnum):
    OK = 0
    DEGRADED = 1  # errors seen; still serving (e.g. one of several files failed)
    OFF = 2  # turned itself off: allocate returns nothing, reads answer CANCELLED


@dataclasses.dataclass
class TierStats:
    """One tier's counters and gauges, read by metrics and GetStats (monotonic counters)."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    health: TierHealth = TierHealth.OK
    health_reason: str = ""
    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    read_errors: int = 0
    write_errors: int = 0
    corrupt_records: int = 0
    queue_depth: int = 0  # requests queued or in flight now
    queue_full_drops: int = 0
    recovered_blocks: int = 0
    recovery_skipped: int = 0
    recovery_seconds: float = 0.0
    paced_seconds: float = 0.0  # new I/O held back for requests served from a faster tier


class TierFull(Exception):
    """The tier's I/O queue is full: the request was not queued (a drop, counted by the caller)."""


Reporter = Callable[[str, str], None]  # (where, why) for each record recovery skipped


class Tier(abc.ABC):
    """Space and asynchronous I/O for sealed blocks; see the module docstring for the contract."""

    name: str  # "dram" | "ssd": the metric label and the wire Tier's name
    persistent: bool = False

    @abc.abstractmethod
    def allocate(self, block_bytes: int, count: int) -> list[Extent]: ...

    @abc.abstractmethod
    def free(self, extents: Sequence[Extent]) -> None: ...

    @abc.abstractmethod
    def write(self, requests: Sequence[WriteRequest]) -> Future[list[IoStatus]]: ...

    @abc.abstractmethod
    def read(self, requests: Sequence[ReadRequest]) -> Future[list[IoStatus]]: ...

    def recover(self, report: Reporter) -> Iterator[RecoveredBlock]:
        """Nothing survives a restart by default (DRAM)."""
        return iter(())

    @property
    def health(self) -> TierHealth:
        return TierHealth.OK

    @property
    def max_block_bytes(self) -> int:
        """The largest block ``allocate`` accepts (a larger one raises ValueError)."""
        return 1 << 62

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    def close(self) -> None:  # noqa: B027 - optional: a tier with no workers has nothing to stop
        """Stops the tier's workers; queued I/O resolves as CANCELLED. Idempotent."""
