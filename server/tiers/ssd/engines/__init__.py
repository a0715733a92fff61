"""I/O engines of the SSD tier (the seam is engines/base.py) and how one is chosen.

``io_engine``: ``io_uring`` | ``threads`` | ``auto``. ``auto`` is ``AUTO_PREFERENCE`` below,
the engine measured faster on this machine kind (bench/ssd_bench.py; numbers in the tier's
README). io_uring is used only after ``uring_binding.probe`` passed in a child process on the
file system of the tier's first path; otherwise the tier runs on threads and says why in one
log line (asking for ``io_uring`` explicitly falls back the same way: the tier still works, at
the threads' speed).
"""

from __future__ import annotations

import logging

from pegaflow.server.tiers.ssd.engines.base import IoEngine, IoOp
from pegaflow.server.tiers.ssd.engines.threads import ThreadEngine

log = logging.getLogger(__name__)

ENGINES = ("auto", "io_uring", "threads")

# Measured with bench/ssd_bench.py (O_DIRECT, ext4 on the dev VM's virtio disk, QD 32, 1 and 2 MiB
# blocks, the engines interleaved pass by pass; three full runs on 2026-12-01): both engines are
# disk-bound and within a few % of each other, threads slightly ahead. io_uring / threads, paired
# per pass, median per (block size, direction): 0.82-1.06, below 1 in 9 of 12 cells; io_uring
# faster in 29 of 76 passes. On tmpfs (CPU-bound, no disk) io_uring wrote 11 % faster with 29 %
# less CPU per GB, and read 3 % slower. So `auto` is the thread pool: the faster one on the disk,
# and it needs no compiler and no probe child at start. io_uring stays one flag away
# (io_engine=io_uring) and passes the same tests; re-measure on NVMe before switching.
AUTO_PREFERENCE = "threads"


def open_engine(kind: str, queue_depth: int, probe_dir: str) -> IoEngine:
    """An engine of ``kind``; io_uring only after a passing probe in ``probe_dir``."""
    if kind not in ENGINES:
        raise ValueError(f"io_engine must be one of {', '.join(ENGINES)}, not {kind!r}")
    want = AUTO_PREFERENCE if kind == "auto" else kind
    if want == "io_uring":
        from pegaflow.server.tiers.ssd.engines import uring_binding

        why = uring_binding.probe(probe_dir)
        if why is None:
            from pegaflow.server.tiers.ssd.engines.uring import UringEngine

            try:
                return UringEngine(queue_depth)
            except uring_binding.UringUnavailable as e:
                why = str(e)
        log.warning("ssd tier: io_engine=%s: io_uring is unavailable (%s); using the thread pool", kind, why)
    return ThreadEngine(queue_depth)


__all__ = ["ENGINES", "IoEngine", "IoOp", "open_engine"]
