"""Steady traffic for the reliability runs (fault matrix, soak): a trace whose prompts recur, the
locust replay running in the background while faults are injected, and single streamed requests
sent outside locust.

- `cycle_trace`: a base trace repeated pass after pass, every prompt recurring with the same tokens
  (so each has one reference answer and, from the second pass on, its blocks can be hits); each
  pass draws new routes, so a prompt an engine saved in one pass is usually loaded by the other
  engine in the next (answers then depend on bytes another process wrote).
- `BackgroundLoad`: `loadgen.run_trace` on a thread, with the records of completed requests readable
  while it runs (locust flushes each one to its JSON-lines log as it completes), ended by its run
  time or early by `finish()`.
- `stream_request`: one greedy streamed completion with a callback at its first token, recorded
  like a locust record (for an engine the fault injection drives itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from pegaflow.bench.harness import loadgen
from pegaflow.bench.harness.sse import parse_sse_line
from pegaflow.bench.harness.traces import ROUTE_BITS, Trace, TraceRequest


def cycle_trace(base: Trace, passes: int, route_seed: int = 1) -> Trace:
    """`base` repeated `passes` times: pass p holds every request of `base` with index
    p * len(base) + i, its session dependency shifted the same way (a session's turns stay in
    order within a pass), the same prompt, and a route drawn from (route_seed, p)."""
    if passes <= 0:
        raise ValueError(f"passes must be > 0, got {passes}")
    n = len(base)
    requests: list[TraceRequest] = []
    for p in range(passes):
        if p == 0:
            routes = [r.route for r in base.requests]
        else:
            rng = np.random.default_rng([route_seed, p])
            routes = [int(x) for x in rng.integers(0, 1 << ROUTE_BITS, size=n)]
        for r, route in zip(base.requests, routes, strict=True):
            requests.append(
                dataclasses.replace(
                    r,
                    index=p * n + r.index,
                    route=route,
                    depends_on=None if r.depends_on is None else p * n + r.depends_on,
                )
            )
    return Trace(base.spec, tuple(requests))


def passes_for(base_len: int, max_rate_rps: float, seconds: float) -> int:
    """Passes that a run of `seconds` at no more than `max_rate_rps` cannot exhaust."""
    if base_len <= 0:
        raise ValueError("the base trace is empty")
    return max(1, int(np.ceil(max_rate_rps * seconds / base_len)) + 1)


def read_records(path: pathlib.Path) -> list[dict]:
    """The complete lines of a JSON-lines log that may still be written (a partial last line is
    skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written
    return out


class BackgroundLoad:
    """The trace replayed by locust on a background thread: `start()`, then `records()` at any time,
    then `result()` (waits for locust to finish: every request done or `run_s` passed)."""

    def __init__(
        self,
        trace: Trace,
        endpoints: list[str],
        model_name: str,
        out_dir: pathlib.Path,
        *,
        users: int,
        run_s: float,
        label: str,
        think_time_s: float = 0.0,
        request_timeout_s: float = 300.0,
    ):
        self.trace = trace
        self.endpoints = list(endpoints)
        self.model_name = model_name
        self.out_dir = pathlib.Path(out_dir)
        self.users = users
        self.run_s = run_s
        self.label = label
        self.think_time_s = think_time_s
        self.request_timeout_s = request_timeout_s
        self.request_log = self.out_dir / f"{label}-requests.jsonl"
        self._result: loadgen.LoadResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"load-{label}", daemon=True)
        self.started_at: float | None = None

    def _run(self) -> None:
        try:
            self._result = loadgen.run_trace(
                self.trace,
                self.endpoints,
                self.model_name,
                self.out_dir,
                users=self.users,
                max_run_s=self.run_s,
                label=self.label,
                think_time_s=self.think_time_s,
                request_timeout_s=self.request_timeout_s,
                record_tokens=True,
            )
        except BaseException as exc:  # re-raised by result()
            self._error = exc

    def start(self) -> BackgroundLoad:
        self.started_at = time.time()
        self._thread.start()
        return self

    def records(self) -> list[dict]:
        return read_records(self.request_log)

    def running(self) -> bool:
        return self._thread.is_alive()

    def finish(self, timeout_s: float = 60.0) -> loadgen.LoadResult:
        """Ends the replay now: SIGINT to the locust process (it quits as at the end of its run
        time and writes its summary; requests still in flight are not recorded), then `result()`.
        A locust that has not quit by `timeout_s` (seen on a crowded machine: users blocked in
        requests past --stop-timeout) is killed, and the result is the request log as written so
        far, with an empty summary and no exit code: every completed request is still there."""
        self._signal_locust(signal.SIGINT)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._signal_locust(signal.SIGKILL)
            self._thread.join(30.0)
            if self._thread.is_alive() or self._result is None:
                return loadgen.LoadResult(self.records(), {}, None, self.out_dir)
        return self.result(0)

    def _signal_locust(self, sig: int) -> None:
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if str(self.request_log) in proc.cmdline():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(os.getpgid(proc.pid), sig)

    def result(self, timeout_s: float | None = None) -> loadgen.LoadResult:
        self._thread.join(timeout=timeout_s if timeout_s is not None else self.run_s + 120)
        if self._thread.is_alive():
            raise TimeoutError(f"locust run {self.label} still running")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def stream_request(
    base_url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    on_first_token: Callable[[], None] | None = None,
    timeout_s: float = 120.0,
    index: int | None = None,
    instance: int | None = None,
) -> dict:
    """One greedy streamed /v1/completions; returns a record shaped like locust_user's (ok, error,
    start, ttft_s, e2e_s, cached_tokens, completion_token_ids). Never raises for the request's own
    failure (it is recorded)."""
    body = {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    record: dict = {
        "index": index,
        "instance": instance,
        "prompt_tokens": len(prompt),
        "start": time.time(),
        "ttft_s": None,
        "e2e_s": None,
        "cached_tokens": None,
        "completion_tokens": None,
        "completion_token_ids": [],
        "ok": False,
        "error": None,
    }
    t0 = time.perf_counter()
    req = urllib.request.Request(
        base_url.rstrip("/") + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                event = parse_sse_line(raw.decode("utf-8", errors="replace"))
                if event is None:
                    continue
                if "error" in event:
                    raise RuntimeError(f"server error in stream: {event['error']}")
                choices = event.get("choices") or ()
                if choices and record["ttft_s"] is None:
                    record["ttft_s"] = time.perf_counter() - t0
                    if on_first_token is not None:
                        on_first_token()
                for choice in choices:
                    record["completion_token_ids"].extend(choice.get("token_ids") or ())
                usage = event.get("usage")
                if usage:
                    record["completion_tokens"] = usage.get("completion_tokens")
                    record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if record["ttft_s"] is None:
            raise RuntimeError("stream ended without a generated token")
        record["ok"] = True
    except Exception as exc:  # recorded, never swallowed: the caller counts it
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["e2e_s"] = time.perf_counter() - t0
    return record
