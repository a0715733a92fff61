"""What a long run samples from the processes it watches: resident memory, open file descriptors and
threads straight from /proc (cheap enough to read every few seconds, and what a leak shows in), and a
thread that calls a sampling function at a fixed period.

/proc/PID/status gives VmRSS and Threads; /proc/PID/fd lists the open descriptors (sockets, the
pool's memfd, log files, epoll instances): a leak of any of them grows that directory.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

KIB = 1024


def proc_status(pid: int) -> dict:
    """{"rss_bytes", "threads", "fds"} of one process; raises ProcessLookupError if it is gone."""
    try:
        text = open(f"/proc/{pid}/status").read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    return {**parse_status(text), "fds": fds}


def parse_status(text: str) -> dict:
    """VmRSS (bytes) and Threads from the text of /proc/PID/status."""
    out = {"rss_bytes": None, "threads": None}
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit.lower() != "kb":
                raise ValueError(f"unexpected VmRSS unit {unit!r}")
            out["rss_bytes"] = int(value) * KIB
        elif line.startswith("Threads:"):
            out["threads"] = int(line.split()[1])
    if out["rss_bytes"] is None or out["threads"] is None:
        raise ValueError("no VmRSS / Threads in /proc/PID/status (a kernel thread or a zombie?)")
    return out


class PeriodicSampler:
    """Calls `sample()` every `interval_s` on a thread (the first call at start) and keeps what it
    returns, each with `t` (wall-clock seconds) added. A sample that raises is kept as
    {"t", "error"}, so a gap in the data says why. `stop()` takes one last sample."""

    def __init__(self, sample: Callable[[], dict], interval_s: float, name: str = "sampler"):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._sample = sample
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _take(self) -> None:
        t = time.time()
        try:
            row = {"t": t, **self._sample()}
        except Exception as exc:  # kept in the data, see the class doc
            row = {"t": t, "error": f"{type(exc).__name__}: {exc}"}
        with self._lock:
            self.samples.append(row)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._take()
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> PeriodicSampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 30)
        self._take()
        return self.snapshot()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.samples)


def tree_status(pid: int) -> dict:
    """{"processes", "fds", "threads"} summed over a process and its descendants (a vLLM engine is
    three processes); processes that exit while being read are skipped."""
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return {"processes": 0, "fds": 0, "threads": 0}
    out = {"processes": 0, "fds": 0, "threads": 0}
    for p in pids:
        try:
            st = proc_status(p)
        except (ProcessLookupError, ValueError, PermissionError):
            continue
        out["processes"] += 1
        out["fds"] += st["fds"]
        out["threads"] += st["threads"]
    return out
