"""Pieces every experiment's command line shares: work directories, logging of phases, the
HLL window that covers a run."""

from __future__ import annotations

import datetime
import os
import pathlib
import sys
import tempfile
import time

from pegaflow.server.config import parse_duration


def say(msg: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


def make_workdir(requested: str | None, experiment: str) -> pathlib.Path:
    """Where logs, traces and raw locust output go (never committed). Default: a fresh folder under
    $TEST_TMPDIR (Bazel) or the system temp dir."""
    if requested:
        path = pathlib.Path(requested)
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
    # Short: vLLM puts ZMQ sockets (107-byte path limit) a few levels below it.
    return pathlib.Path(tempfile.mkdtemp(prefix=f"pfb-{experiment}-", dir=base))


def window_covering(windows: dict[str, float] | list[str], seconds: float) -> str | None:
    """The shortest HLL window name ("15m", "1h", ...) that spans `seconds`; else the longest."""
    names = list(windows)
    if not names:
        return None
    spans = sorted((parse_duration(n), n) for n in names)
    for span, name in spans:
        if span >= seconds:
            return name
    return spans[-1][1]


class Stopwatch:
    def __init__(self):
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0
