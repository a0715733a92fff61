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

# Measured with bench/ssd_bench.py on this machine kind; see server/tiers/ssd/README.md.
AUTO_PREFERENCE = "io_uring"


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
