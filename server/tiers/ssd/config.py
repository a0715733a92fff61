"""SsdTierOptions (what the server's flags become) and SsdConfigError (a start-up refusal).

Defaults and why:

* ``segment_bytes`` 128 MiB. The unit of space reuse and of recovery. Larger segments mean fewer
  summaries to read at start (10 GiB = 80 segments = 160 small reads) but coarser reuse: with
  FIFO frees, up to one segment per path is in the middle of being emptied or filled, so up to
  ``paths x segment_bytes`` of the capacity is not holding live blocks at a given moment, and
  the segment being filled at a crash is scanned whole at the next start (128 MiB at the disk's
  read rate: ~50 ms at 2.5 GB/s). 128 MiB keeps both small next to any useful capacity (≥ 8 GiB)
  and holds 63 blocks of 2 MiB; a 64 MiB block (the DRAM pool's largest) still fits.
  Throughput does not depend on it measurably (bench/ssd_bench.py segment_sweep, 32 / 128 /
  512 MiB, 2 MiB blocks: write 1.88 / 2.01 / 1.44, read 1.41 / 1.49 / 1.52 GB/s, one pass each
  on a disk whose own fio passes vary 1.1-2.4 GB/s): records within a segment are sequential
  whatever its size.
* ``queue_depth`` 32: I/Os in flight per engine, all paths together. On the dev VM's virtual
  disk fio at 2 MiB shows no trend between 4 and 64 in flight (fio_queue_depth_sweep: 0.7-1.9
  GB/s, noise), so the depth is set for real disks: a few NVMe drives sharing one engine, each
  needing several MiB-sized I/Os in flight for its sequential bandwidth (reasoning, not
  measured here).
* ``max_queued`` 1024 requests queued or in flight before write/read raise TierFull (the mover
  counts a drop; bounded memory and latency instead of an unbounded backlog).
* ``recovery_verify`` ``summary``: closed segments are recovered from their summaries without
  reading the records (every read still checks header and checksum, so a record damaged on disk
  later is a CORRUPT miss, never wrong bytes); the segment that was being written is scanned and
  checksummed in full. ``headers`` also reads every record's header block at start (one 4 KiB
  read per block), ``full`` scans and checksums everything (start time = data / read rate).
"""

from __future__ import annotations

import dataclasses

from pegaflow.common.wire.block_record import RECORD_ALIGN

MIB = 1 << 20
GIB = 1 << 30

DEFAULT_SEGMENT_BYTES = 128 * MIB
MIN_SEGMENT_BYTES = 1 * MIB
MAX_SEGMENT_BYTES = 4 * GIB - RECORD_ALIGN  # summary entries hold 32-bit offsets
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_MAX_QUEUED = 1024
RECOVERY_VERIFY = ("summary", "headers", "full")


class SsdConfigError(ValueError):
    """The SSD tier cannot start with these options (the message says why and what to change)."""


@dataclasses.dataclass(frozen=True)
class SsdTierOptions:
    """``paths``: files or directories (a directory gets ``pegaflow-ssd.data`` inside); several
    paths are striped (consecutive blocks go to different paths). ``capacity_bytes``: total over
    all paths, split evenly, rounded down to whole segments per path."""

    paths: tuple[str, ...]
    capacity_bytes: int
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    max_queued: int = DEFAULT_MAX_QUEUED
    io_engine: str = "auto"  # auto | io_uring | threads (engines/__init__.py)
    recovery_verify: str = "summary"  # summary | headers | full
    preallocate: bool = True  # fallocate the files at start: a full disk later cannot starve us
    health_check_interval_s: float = 1.0  # how often a removed / truncated file is looked for

    def __post_init__(self):
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))

    def validate(self) -> None:
        from pegaflow.server.tiers.ssd.engines import ENGINES

        if not self.paths:
            raise SsdConfigError("the SSD tier needs at least one --ssd-cache-path")
        if (
            self.segment_bytes % RECORD_ALIGN
            or not MIN_SEGMENT_BYTES <= self.segment_bytes <= MAX_SEGMENT_BYTES
        ):
            raise SsdConfigError(
                f"segment size {self.segment_bytes} must be a multiple of {RECORD_ALIGN} between "
                f"{MIN_SEGMENT_BYTES} and {MAX_SEGMENT_BYTES} bytes"
            )
        if self.capacity_bytes < len(self.paths) * self.segment_bytes:
            raise SsdConfigError(
                f"SSD capacity {self.capacity_bytes} bytes is too small: {len(self.paths)} path(s) need at "
                f"least one segment of {self.segment_bytes} bytes each "
                f"({len(self.paths) * self.segment_bytes} bytes)"
            )
        if self.queue_depth < 1 or self.max_queued < 1:
            raise SsdConfigError("queue depth and max queued requests must be >= 1")
        if self.io_engine not in ENGINES:
            raise SsdConfigError(f"io engine must be one of {', '.join(ENGINES)}, not {self.io_engine!r}")
        if self.recovery_verify not in RECOVERY_VERIFY:
            raise SsdConfigError(f"recovery verify must be one of {', '.join(RECOVERY_VERIFY)}")
        if self.health_check_interval_s <= 0:
            raise SsdConfigError("health check interval must be > 0")
