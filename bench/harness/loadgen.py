"""Runs the locust load generator (bench/harness/locust_user.py) headless in its own process, with
its live progress on our stdout, and collects what it wrote.

Locust runs in a child process so that gevent's monkey-patching stays out of the orchestrator
(which also drives subprocesses, gRPC and psutil) and so that its CPU time is its own.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import urllib.request

from pegaflow.bench.harness.procs import ManagedProcess
from pegaflow.bench.harness.traces import Trace

LOCUSTFILE = pathlib.Path(__file__).resolve().with_name("locust_user.py")


@dataclasses.dataclass
class LoadResult:
    records: list[dict]  # one per trace request, in completion order (see locust_user.py)
    summary: dict  # counts, first/last request times, the locust process's CPU time
    locust_exit_code: int | None  # None: killed after it did not quit (steady_load.finish)
    out_dir: pathlib.Path

    @property
    def failed(self) -> int:
        return sum(not r["ok"] for r in self.records)


def run_trace(
    trace: Trace,
    endpoints: list[str],
    model_name: str,
    out_dir: pathlib.Path,
    users: int,
    max_run_s: float,
    label: str = "load",
    request_timeout_s: float = 900.0,
    think_time_s: float = 0.0,
    record_tokens: bool = False,
    logprobs: int = 0,
) -> LoadResult:
    """Replays `trace` against `endpoints` (instance i = endpoints[i]) with `users` concurrent
    closed-loop users; returns when every request completed or after `max_run_s`. `record_tokens`:
    every record also carries the generated token ids (and the top-`logprobs` logprobs of each)."""
    if users <= 0:
        raise ValueError(f"users must be > 0, got {users}")
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / f"{label}-trace.jsonl"
    trace.save(trace_path)
    request_log = out_dir / f"{label}-requests.jsonl"
    summary_path = out_dir / f"{label}-locust-summary.json"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--users",
        str(users),
        "--spawn-rate",
        str(users),
        "--host",
        endpoints[0],
        "--run-time",
        f"{int(max_run_s)}s",
        "--stop-timeout",
        "10",
        "--csv",
        str(out_dir / f"{label}-locust"),
        "--loglevel",
        "WARNING",
        "--trace",
        str(trace_path),
        "--endpoints",
        ",".join(endpoints),
        "--model-name",
        model_name,
        "--request-log",
        str(request_log),
        "--summary",
        str(summary_path),
        "--request-timeout",
        str(request_timeout_s),
        "--think-time",
        str(think_time_s),
    ]
    if record_tokens:
        cmd += ["--record-tokens", "--logprobs", str(logprobs)]
    proc = ManagedProcess(cmd, log_path=out_dir / f"{label}-locust.log", echo_prefix=f"[{label}] ")
    proc.start()
    try:
        exit_code = proc.wait(timeout_s=max_run_s + 60)
    finally:
        proc.stop()  # no-op once it exited; stops it on an interrupt
    if not summary_path.exists():
        raise RuntimeError(f"locust exited {exit_code} without a summary; see {proc.log_path}")
    records = [json.loads(line) for line in request_log.read_text().splitlines() if line.strip()]
    summary = json.loads(summary_path.read_text())
    return LoadResult(records, summary, exit_code, out_dir)


def run_warmup(endpoints: list[str], model_name: str, timeout_s: float = 120.0, logprobs: int = 0) -> None:
    """One short request per instance: a fresh vLLM's first request pays one-time lazy init
    (0.1 - 10 s), which must not land on the first measured request. The prompt is shorter than
    one KV block, so it leaves nothing in any cache. `logprobs`: ask for them too, when the measured
    requests will (the first request with logprobs compiles vLLM's sampler kernels: ~20 s here)."""
    request = {"model": model_name, "prompt": [11, 12, 13, 14], "max_tokens": 2, "temperature": 0.0}
    if logprobs:
        request.update(logprobs=logprobs, return_tokens_as_token_ids=True, return_token_ids=True)
    body = json.dumps(request)
    for endpoint in endpoints:
        req = urllib.request.Request(
            f"{endpoint}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            if r.status != 200:
                raise RuntimeError(f"warm-up request to {endpoint} answered HTTP {r.status}")
            r.read()
