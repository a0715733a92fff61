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

from pegaflow.server.tiers.ssd.engines.base import IoEngine, IoOp, IoPacer
from pegaflow.server.tiers.ssd.engines.threads import ThreadEngine

log = logging.getLogger(__name__)

ENGINES = ("auto", "io_uring", "threads")

# Measured with bench/ssd_bench.py (O_DIRECT, ext4 on the dev VM's virtio disk, QD 32, 1 and 2 MiB
# blocks, fio and both engines interleaved pass by pass; five full runs on 2026-12-01, load 7-15
# from other work on the 2 cores). On the disk both engines are close: sum of median GB/s
# (write + read, 1 + 2 MiB) threads vs io_uring 4.83/4.69, 9.39/9.03, 7.31/7.07, 7.16/6.92,
# 6.79/7.06: threads ahead in 4 of 5 runs, by 3-4 %, well inside one run's spread (+-30 %).
# On tmpfs (no disk: CPU-bound) neither wins steadily (io_uring writes +11 % and 2x in two runs,
# -9 % in the third) but io_uring needs 18-29 % less CPU per GB (one thread instead of 32).
# `auto` is the thread pool: ahead on the disk, and it needs no compiler and no probe child at
# start. io_uring is one flag away (io_engine=io_uring), passes the same tests, and is the one
# to try where the disks outrun the CPUs.
AUTO_PREFERENCE = "threads"


def open_engine(kind: str, queue_depth: int, probe_dir: str, pacer: IoPacer | None = None) -> IoEngine:
    """An engine of ``kind``; io_uring only after a passing probe in ``probe_dir``; ``pacer``
    (optional) limits its depth from moment to moment (engines/base.py)."""
    if kind not in ENGINES:
        raise ValueError(f"io_engine must be one of {', '.join(ENGINES)}, not {kind!r}")
    want = AUTO_PREFERENCE if kind == "auto" else kind
    if want == "io_uring":
        from pegaflow.server.tiers.ssd.engines import uring_binding

        why = uring_binding.probe(probe_dir)
        if why is None:
            from pegaflow.server.tiers.ssd.engines.uring import UringEngine

            try:
                return UringEngine(queue_depth, pacer=pacer)
            except uring_binding.UringUnavailable as e:
                why = str(e)
        log.warning("ssd tier: io_engine=%s: io_uring is unavailable (%s); using the thread pool", kind, why)
    return ThreadEngine(queue_depth, pacer=pacer)


__all__ = ["ENGINES", "IoEngine", "IoOp", "IoPacer", "open_engine"]
