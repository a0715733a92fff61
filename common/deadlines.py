"""Waiting by an absolute deadline (``time.monotonic``), the way every RPC handler gets its time."""

from __future__ import annotations

import threading
import time


def acquire_by(lock: threading.Lock, deadline: float | None) -> bool:
    """Takes ``lock``, waiting until ``deadline`` at most (None: as long as it takes). False, the
    lock not taken, if the deadline passed first; the caller then does without what it guards."""
    if deadline is None:
        return lock.acquire()
    return lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))
