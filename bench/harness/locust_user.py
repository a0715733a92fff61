"""Locustfile: replays a trace (bench.harness.traces) against a fleet of vLLM OpenAI servers with
streaming /v1/completions, measuring time to first token per request.

Run headless by bench.harness.loadgen (or by hand):
    python -m locust -f bench/harness/locust_user.py --headless -u 8 -r 8 --host http://127.0.0.1:8000 \\
        --trace trace.jsonl --endpoints http://127.0.0.1:8000,http://127.0.0.1:8001 \\
        --model-name tiny --request-log requests.jsonl --summary summary.json

Load model: closed loop. `-u` users are the concurrency; each user takes the next request of the
trace in trace order, waits if it is a session turn whose previous turn is still running (a user
does not type turn k+1 before reading reply k), sends it to instance `route % len(endpoints)` and
takes the next one `--think-time` seconds after it completed (default 0). With `-u 1` the replay
is strictly sequential, so which blocks a cache holds at each lookup depends only on the trace
and the cache policy. The run quits by itself when every request of the trace has completed.

Metrics: one locust request event per trace request, named "ttft i<instance>", whose
response_time is the TTFT in ms (time from sending to the first streamed chunk that carries a
generated token); locust's live table and CSVs therefore show TTFT percentiles. Everything else
(end-to-end latency, prompt / cached / completion tokens from the final usage chunk, errors) goes
to the per-request JSON-lines log, and the process's own CPU time to the summary file.
"""

from __future__ import annotations

import json
import resource
import time

import gevent
import gevent.event
import locust.stats
from geventhttpclient import HTTPClient
from locust import User, constant, events, task
from locust.exception import StopUser

from pegaflow.bench.harness.sse import StreamError, parse_sse_line
from pegaflow.bench.harness.traces import Trace, TraceRequest

# The live table is a progress display here; every 2 s (locust's default) floods long runs.
locust.stats.CONSOLE_STATS_INTERVAL_SEC = 10
PROGRESS_INTERVAL_S = 10.0


class TraceDispatcher:
    """Hands out a trace's requests in order and tracks their completion (one per locust process;
    all users are greenlets of one thread, so no locking is needed)."""

    def __init__(self, trace: Trace, on_all_done):
        self._requests = trace.requests
        self._next = 0
        self._done = {r.index: gevent.event.Event() for r in self._requests}
        self.completed = 0
        self.failed = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self._on_all_done = on_all_done

    @property
    def total(self) -> int:
        return len(self._requests)

    def take(self) -> TraceRequest | None:
        if self._next >= len(self._requests):
            return None
        request = self._requests[self._next]
        self._next += 1
        if request.depends_on is not None:
            self._done[request.depends_on].wait()
        if self.first_start is None:
            self.first_start = time.time()
        return request

    def complete(self, request: TraceRequest, ok: bool) -> None:
        self.completed += 1
        self.failed += not ok
        self.last_end = time.time()
        # A failed turn still releases the session's next turn: the user retypes and moves on.
        self._done[request.index].set()
        if self.completed == len(self._requests):
            self._on_all_done()


class _Run:
    """State of this locust process: parsed options, trace, dispatcher, output files."""

    def __init__(self, environment):
        opts = environment.parsed_options
        self.environment = environment
        self.endpoints = [e.rstrip("/") for e in opts.endpoints.split(",") if e.strip()]
        if not self.endpoints:
            raise ValueError("--endpoints: give at least one base URL")
        self.model_name = opts.model_name
        self.trace = Trace.load(opts.trace)
        self.dispatcher = TraceDispatcher(self.trace, self._all_done)
        self.request_log = open(opts.request_log, "w")  # closed in write_summary, at quit
        self.summary_path = opts.summary
        self.wall_start = time.time()

    def _all_done(self) -> None:
        # Quit from a fresh greenlet: quitting kills every user greenlet, including the caller.
        gevent.spawn(self.environment.runner.quit)

    def log(self, record: dict) -> None:
        self.request_log.write(json.dumps(record) + "\n")
        self.request_log.flush()

    def progress(self) -> None:
        while True:
            gevent.sleep(PROGRESS_INTERVAL_S)
            d = self.dispatcher
            elapsed = time.time() - (d.first_start or time.time())
            rate = d.completed / elapsed if elapsed > 0 else 0.0
            print(
                f"[trace] {d.completed}/{d.total} requests done, {d.failed} failed, "
                f"{rate:.2f} req/s over {elapsed:.0f} s",
                flush=True,
            )

    def write_summary(self) -> None:
        self.request_log.close()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        d = self.dispatcher
        summary = {
            "trace_fingerprint": self.trace.fingerprint(),
            "requests_total": d.total,
            "requests_completed": d.completed,
            "requests_failed": d.failed,
            "first_request_start": d.first_start,
            "last_request_end": d.last_end,
            "process_wall_s": time.time() - self.wall_start,
            "process_cpu_user_s": usage.ru_utime,
            "process_cpu_system_s": usage.ru_stime,
            "process_max_rss_kib": usage.ru_maxrss,
            "endpoints": self.endpoints,
            "users": self.environment.parsed_options.num_users,
        }
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=2)


RUN: _Run | None = None


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("pegaflow trace replay")
    group.add_argument("--trace", required=True, help="trace file written by bench.harness.traces")
    group.add_argument("--endpoints", required=True, help="comma-separated vLLM base URLs, one per instance")
    group.add_argument("--model-name", required=True, help="the servers' --served-model-name")
    group.add_argument("--request-log", required=True, help="per-request JSON-lines output")
    group.add_argument("--summary", required=True, help="run summary JSON output (counts, CPU time)")
    group.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    group.add_argument(
        "--record-tokens",
        action="store_true",
        help="log each response's generated token ids (completion_token_ids), to compare runs",
    )
    group.add_argument(
        "--logprobs",
        type=int,
        default=0,
        help="with --record-tokens: also log the top-N logprobs of each generated token, keyed by id",
    )
    group.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds a user waits after each completed request before taking the next one",
    )


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    global RUN
    RUN = _Run(environment)
    CompletionUser.network_timeout = environment.parsed_options.request_timeout
    CompletionUser.wait_time = constant(environment.parsed_options.think_time)


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    gevent.spawn(RUN.progress)


@events.quitting.add_listener
def _on_quitting(environment, **_kwargs) -> None:
    if RUN is not None:
        RUN.write_summary()


class CompletionUser(User):
    """Streams one trace request at a time. geventhttpclient is used directly (locust's
    FastHttpSession reads a streamed body in fixed-size blocks, which would hold the first token
    until 4 KiB of stream had arrived); results go to locust through `events.request.fire`."""

    wait_time = constant(0)
    network_timeout = 900.0
    connection_timeout = 30.0

    def on_start(self) -> None:
        self._clients = [
            HTTPClient.from_url(
                endpoint,
                concurrency=1,
                network_timeout=self.network_timeout,
                connection_timeout=self.connection_timeout,
            )
            for endpoint in RUN.endpoints
        ]

    def on_stop(self) -> None:
        for client in self._clients:
            client.close()

    @task
    def send_next(self) -> None:
        request = RUN.dispatcher.take()
        if request is None:
            raise StopUser()
        instance = request.instance(len(RUN.endpoints))
        record = self._send(request, instance)
        RUN.log(record)
        RUN.dispatcher.complete(request, record["ok"])

    def _send(self, request: TraceRequest, instance: int) -> dict:
        body = {
            "model": RUN.model_name,
            "prompt": request.prompt.tolist(),
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        opts = self.environment.parsed_options
        if opts.record_tokens:
            body["return_token_ids"] = True
            if opts.logprobs:
                body["logprobs"] = opts.logprobs
                body["return_tokens_as_token_ids"] = True  # top-N keyed "token_id:<id>"
        record = {
            "index": request.index,
            "instance": instance,
            "kind": request.kind,
            "session": request.session,
            "turn": request.turn,
            "prompt_tokens": len(request.prompt),
            "start": time.time(),
            "ttft_s": None,
            "e2e_s": None,
            "usage_prompt_tokens": None,
            "cached_tokens": None,
            "completion_tokens": None,
            "ok": False,
            "error": None,
        }
        if opts.record_tokens:
            record["completion_token_ids"] = []
            if opts.logprobs:
                record["top_logprobs"] = []
        error: Exception | None = None
        received = 0
        t0 = time.perf_counter()
        try:
            response = self._clients[instance].post(
                "/v1/completions",
                body=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                if response.status_code != 200:
                    raise StreamError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
                received = self._read_stream(response, t0, record)
            finally:
                response.release()
            if record["ttft_s"] is None:
                raise StreamError("stream ended without a generated token")
            if record["usage_prompt_tokens"] not in (None, len(request.prompt)):
                raise StreamError(
                    f"server counted {record['usage_prompt_tokens']} prompt tokens, "
                    f"sent {len(request.prompt)}"
                )
            record["ok"] = True
        except Exception as e:  # every failure is recorded and reported, then the replay goes on
            error = e
            record["error"] = f"{type(e).__name__}: {e}"
        record["e2e_s"] = time.perf_counter() - t0
        self.environment.events.request.fire(
            request_type="POST",
            name=f"ttft i{instance}",
            response_time=1000.0 * (record["ttft_s"] if record["ok"] else record["e2e_s"]),
            response_length=received,
            exception=error,
            context={"index": request.index},
        )
        return record

    @staticmethod
    def _read_stream(response, t0: float, record: dict) -> int:
        """Consumes the event stream line by line (each line as soon as it arrives); returns bytes read."""
        received = 0
        while True:
            line = response.readline(b"\n")
            if not line:
                return received
            received += len(line)
            event = parse_sse_line(line.decode("utf-8", errors="replace"))
            if event is None:
                continue
            if "error" in event:
                raise StreamError(f"server error in stream: {event['error']}")
            if event.get("choices") and record["ttft_s"] is None:
                record["ttft_s"] = time.perf_counter() - t0
            if "completion_token_ids" in record:
                for choice in event.get("choices") or ():
                    record["completion_token_ids"].extend(choice.get("token_ids") or ())
                    logprobs = choice.get("logprobs") or {}
                    if "top_logprobs" in record and logprobs.get("top_logprobs"):
                        record["top_logprobs"].extend(logprobs["top_logprobs"])
            usage = event.get("usage")
            if usage:
                record["usage_prompt_tokens"] = usage.get("prompt_tokens")
                record["completion_tokens"] = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                record["cached_tokens"] = details.get("cached_tokens")
