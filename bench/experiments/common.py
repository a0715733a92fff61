"""Pieces every experiment's command line shares: work directories, logging of phases, the HLL
window that covers a run, the flags and memory warning of the trace-replay experiments, the trace
replay itself and `--redraw` of a saved report. The A/B skeleton on top of them is ab.py."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable

from pegaflow.bench.harness import loadgen, results, traces
from pegaflow.bench.harness.procs import mem_available_bytes
from pegaflow.server.config import parse_duration

MIB = 1 << 20
GIB = 1 << 30

# Same in every arm of a trace replay. The production defaults (200 / 500 ms) give up a hit rather
# than stall a step; a saturated 2-core box can exceed them, which would measure the CPU, not the pool.
SLOW_MACHINE_CONNECTOR_TIMEOUTS: tuple[tuple[str, int], ...] = (
    ("lookup_timeout_ms", 5000),
    ("load_timeout_ms", 10000),
)


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


def experiment_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help shows the module doc as written (it explains how to run the experiment)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=pathlib.Path, help="where the JSON, CSV and PNG go (default: the workdir)")
    ap.add_argument("--workdir", help="logs and raw outputs (default: a fresh temp folder)")
    ap.add_argument("--model-cache", type=pathlib.Path, help="tiny model cache folder")


def add_trace_overrides(ap: argparse.ArgumentParser, budget_help: str) -> None:
    """--requests, --users, --budget-mib: applied to a setup by `apply_trace_overrides`."""
    ap.add_argument("--requests", type=int, help="trace length (default: the setup's)")
    ap.add_argument("--users", type=int, help="concurrent locust users")
    ap.add_argument("--budget-mib", type=int, help=budget_help)


def apply_trace_overrides(setup, args: argparse.Namespace):
    """The setup (a frozen dataclass with `trace`, `users` and `budget_bytes`) with the flags of
    `add_trace_overrides` that were given."""
    if args.requests is not None:
        setup = dataclasses.replace(setup, trace=dataclasses.replace(setup.trace, num_requests=args.requests))
    if args.users is not None:
        setup = dataclasses.replace(setup, users=args.users)
    if args.budget_mib is not None:
        setup = dataclasses.replace(setup, budget_bytes=args.budget_mib * MIB)
    return setup


def warn_if_memory_short(need: int) -> None:
    """A warning, not a refusal: the estimate is rough, and a run that swaps still says so in its
    numbers (the report records free memory at start)."""
    if mem_available_bytes() < need:
        say(f"warning: {mem_available_bytes() / GIB:.1f} GiB available, ~{need / GIB:.1f} GiB needed")


def replay_trace(
    arm: str,
    setup,
    trace: traces.Trace,
    endpoints: list[str],
    model_name: str,
    arm_dir: pathlib.Path,
    **options,
) -> loadgen.LoadResult:
    """The trace through locust against a running fleet, paced as the setup says (`users`,
    `think_time_s`, `max_run_s`), every record tagged with its arm for the combined CSV. `options`:
    more of loadgen.run_trace's (record_tokens, logprobs)."""
    load = loadgen.run_trace(
        trace,
        endpoints,
        model_name,
        arm_dir / "load",
        users=setup.users,
        max_run_s=setup.max_run_s,
        label=arm,
        think_time_s=setup.think_time_s,
        **options,
    )
    for r in load.records:
        r["arm"] = arm
    return load


def redraw(
    path: pathlib.Path, derive: Callable[[dict], None], figure: Callable[[dict, pathlib.Path], None]
) -> None:
    """Recomputes a saved report's derived numbers in place and redraws its figure next to it, so
    committed results follow changes to the analysis without a rerun."""
    report = json.loads(path.read_text())
    derive(report)
    results.write_json(path, report)
    figure(report, path.with_suffix(".png"))
    say(f"rewrote {path} and {path.with_suffix('.png')}")
