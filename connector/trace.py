"""Per-phase timestamps of the connector, for finding where a request's time goes.

Off by default. `PEGAFLOW_TRACE=<dir>` (set for the vLLM process tree) makes every connector
process append its spans to `<dir>/<role>-<pid>.jsonl`, one JSON object per line:

    {"name": "lease", "t0": 1234.5678, "t1": 1234.5691, "thread": "pegaflow-load_0", ...fields}

t0/t1 are time.monotonic() seconds: CLOCK_MONOTONIC is one clock for every process of the
host, so spans of the scheduler (EngineCore), the workers and a benchmark line up. A point
event has t1 == t0. Recording appends a tuple to a list (about a microsecond, no lock: a
list append is atomic under the GIL); a daemon thread writes the lines out every half
second and at exit, so no file I/O sits on the step's path.

Spans recorded (role: name, what it covers):

  scheduler  lookup            get_num_new_matched_tokens' prefix lookup (the RPC, inside schedule())
  scheduler  build_meta        point: end of schedule() (loads / saves planned this step)
  worker     step              handle_preemptions .. wait_for_save returns (the forward + hooks)
  worker     lease             the load thread's QueryPrefix(lease) RPCs of one request
  worker     load_layer        the load thread's copy of one layer (all requests of the step)
  worker     load_all          the load thread's copy of every layer at once (resident fast path)
  worker     layer_wait        the forward waiting in wait_for_layer_load (one layer)
  worker     finish_step       wait_for_save's own work (close loads, queue saves)
  worker     save_batches      one save job on the save thread: its batches allocated, copied, sealed
  worker     save_copy         one batch's copy into the pool, inside save_batches
  worker     release           ReleaseLease RPCs after a load (housekeeping thread)

`summarize(events, windows)` condenses them per phase (count, total, mean, P50/P99 ms) and per
time window (a benchmark pass); `summarize_dir` reads a trace folder.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ENV = "PEGAFLOW_TRACE"


class Tracer:
    def __init__(self, directory: str | None, role: str):
        self.enabled = bool(directory)
        self._events: list[tuple] = []
        self._path: pathlib.Path | None = None
        if not self.enabled:
            return
        d = pathlib.Path(directory)  # type: ignore[arg-type]
        d.mkdir(parents=True, exist_ok=True)
        self._path = d / f"{role}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()  # one flusher at a time (the thread or atexit)
        threading.Thread(target=self._flush_loop, name="pegaflow-trace", daemon=True).start()
        atexit.register(self.flush)

    def span(self, name: str, t0: float, t1: float | None = None, **fields: Any) -> None:
        """Record [t0, t1] (t1 default: now). Call only under `if tracer.enabled`."""
        self._events.append(
            (name, t0, time.monotonic() if t1 is None else t1, threading.current_thread().name, fields)
        )

    def point(self, name: str, **fields: Any) -> None:
        t = time.monotonic()
        self._events.append((name, t, t, threading.current_thread().name, fields))

    def flush(self) -> None:
        if self._path is None:
            return
        with self._lock:
            events, self._events = self._events, []
            if not events:
                return
            with open(self._path, "a") as f:
                for name, t0, t1, thread, fields in events:
                    f.write(json.dumps({"name": name, "t0": t0, "t1": t1, "thread": thread, **fields}) + "\n")

    def _flush_loop(self) -> None:
        while True:
            time.sleep(0.5)
            self.flush()


_tracers: dict[str, Tracer] = {}


def tracer(role: str) -> Tracer:
    """The process's tracer of `role` ("scheduler", "worker"), enabled by PEGAFLOW_TRACE."""
    t = _tracers.get(role)
    if t is None:
        t = _tracers[role] = Tracer(os.environ.get(ENV), role)
    return t


# ------------------------------------------------------------------ reading


def read_dir(directory: str | os.PathLike) -> list[dict]:
    events: list[dict] = []
    for path in sorted(pathlib.Path(directory).glob("*.jsonl")):
        role = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            if line.strip():
                ev = json.loads(line)
                ev["role"] = role
                events.append(ev)
    events.sort(key=lambda e: e["t0"])
    return events


def _pct(ordered: Sequence[float], q: float) -> float:
    return ordered[max(0, min(len(ordered) - 1, -(-int(q * len(ordered)) // 100) - 1))]


def phase_table(events: Iterable[Mapping]) -> dict[str, dict]:
    """Per span name: count, total / mean / P50 / P99 / max duration in ms."""
    by: dict[str, list[float]] = {}
    for ev in events:
        by.setdefault(ev["name"], []).append((ev["t1"] - ev["t0"]) * 1e3)
    out = {}
    for name, ds in sorted(by.items()):
        ordered = sorted(ds)
        out[name] = {
            "count": len(ds),
            "total_ms": round(sum(ds), 3),
            "mean_ms": round(sum(ds) / len(ds), 3),
            "p50_ms": round(_pct(ordered, 50), 3),
            "p99_ms": round(_pct(ordered, 99), 3),
            "max_ms": round(ordered[-1], 3),
        }
    return out


def summarize(events: Sequence[Mapping], windows: Mapping[str, tuple[float, float]] | None = None) -> dict:
    """The phase table of all events, and of the events inside each named [t0, t1] window."""
    out: dict[str, Any] = {"all": phase_table(events)}
    for label, (w0, w1) in (windows or {}).items():
        out[label] = phase_table(e for e in events if w0 <= e["t0"] <= w1)
    return out


def summarize_dir(
    directory: str | os.PathLike, windows: Mapping[str, tuple[float, float]] | None = None
) -> dict:
    return summarize(read_dir(directory), windows)
