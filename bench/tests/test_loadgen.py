"""The locust load generator against two small OpenAI-style streaming HTTP servers run by the test:
routing, session ordering, TTFT at the first token, usage parsing, failures. (Real vLLM is
exercised by the multi-instance regression, bench/multi_instance.py.)"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pegaflow.bench.harness import loadgen
from pegaflow.bench.harness.sse import parse_sse_line
from pegaflow.bench.harness.traces import TraceSpec, generate

FIRST_TOKEN_DELAY_S = 0.15
DECODE_GAP_S = 1.0
SPEC = TraceSpec(
    seed=5,
    num_requests=14,
    num_system_prompts=2,
    system_prompt_tokens=64,
    concurrent_sessions=3,
    turns_min=2,
    turns_max=3,
    user_turn_tokens=16,
    assistant_turn_tokens=8,
    one_off_share=0.2,
    one_off_tokens=40,
    max_tokens=2,
    max_prompt_tokens=512,
)


class StreamingServer:
    """Answers POST /v1/completions with a token stream: the first token after
    FIRST_TOKEN_DELAY_S, the second DECODE_GAP_S later, then a usage chunk whose cached_tokens is
    half the prompt. Prompts listed in `fail_prompts` get HTTP 500. Records per prompt when its
    request arrived and when the last bytes of its answer were about to be sent (time.monotonic of
    this process)."""

    def __init__(self, fail_prompts=()):
        self.fail_prompts = {tuple(p) for p in fail_prompts}
        self.arrivals: dict[tuple, float] = {}
        self.ends: dict[tuple, float] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = tuple(body["prompt"])
                with outer.lock:
                    outer.arrivals[prompt] = time.monotonic()
                if prompt in outer.fail_prompts:
                    payload = b'{"error": "injected"}'
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def event(obj):
                    data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                time.sleep(FIRST_TOKEN_DELAY_S)
                event({"choices": [{"index": 0, "text": "a"}]})
                time.sleep(DECODE_GAP_S)
                event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]})
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": len(prompt) // 2},
                }
                event({"choices": [], "usage": usage})
                # Taken before the last bytes leave: the client cannot have finished reading earlier.
                with outer.lock:
                    outer.ends[prompt] = time.monotonic()
                event("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    trace = generate(SPEC)
    failing = next(r for r in trace if r.kind == "one_off")
    fail = [failing.prompt.tolist()]
    with StreamingServer(fail) as s0, StreamingServer(fail) as s1:
        result = loadgen.run_trace(
            trace, [s0.url, s1.url], "tiny", tmp_path_factory.mktemp("load"), users=3, max_run_s=120
        )
    return trace, failing, (s0, s1), result


def test_every_request_is_sent_once_to_the_instance_its_route_names(replay):
    trace, failing, servers, result = replay
    assert sorted(r["index"] for r in result.records) == list(range(len(trace)))
    for r in trace:
        owner = servers[r.instance(2)]
        other = servers[1 - r.instance(2)]
        assert tuple(r.prompt.tolist()) in owner.arrivals
        assert tuple(r.prompt.tolist()) not in other.arrivals


def test_a_turn_is_sent_only_after_the_previous_turn_completed(replay):
    trace, _failing, servers, _result = replay
    arrivals = {**servers[0].arrivals, **servers[1].arrivals}
    ends = {**servers[0].ends, **servers[1].ends}
    by_index = {r.index: r for r in trace}
    followups = [r for r in trace if r.depends_on is not None]
    assert followups
    for r in followups:
        prev = tuple(by_index[r.depends_on].prompt.tolist())
        assert arrivals[tuple(r.prompt.tolist())] >= ends[prev]


def test_ttft_is_taken_at_the_first_token_and_usage_is_parsed(replay):
    _trace, failing, _servers, result = replay
    ok = [r for r in result.records if r["ok"]]
    assert len(ok) == len(result.records) - 1
    for r in ok:
        assert r["ttft_s"] >= FIRST_TOKEN_DELAY_S
        # Taken at the first token, not at the end of the stream, which comes DECODE_GAP_S later
        # (half of it as slack for a busy machine scheduling the reader late).
        assert r["e2e_s"] - r["ttft_s"] >= DECODE_GAP_S / 2
        assert r["cached_tokens"] == r["prompt_tokens"] // 2
        assert r["usage_prompt_tokens"] == r["prompt_tokens"] and r["completion_tokens"] == 2


def test_a_failed_request_is_recorded_and_fails_the_locust_run(replay):
    _trace, failing, _servers, result = replay
    (bad,) = [r for r in result.records if not r["ok"]]
    assert bad["index"] == failing.index and "HTTP 500" in bad["error"]
    assert result.failed == 1
    assert result.locust_exit_code != 0
    assert result.summary["requests_failed"] == 1
    assert result.summary["requests_completed"] == len(result.records)
    assert result.summary["process_cpu_user_s"] > 0


def test_locust_stats_csv_carries_ttft_per_instance(replay):
    *_, result = replay
    stats = (result.out_dir / "load-locust_stats.csv").read_text()
    assert "ttft i0" in stats and "ttft i1" in stats


def test_sse_lines():
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    with pytest.raises(Exception, match="malformed"):
        parse_sse_line("data: {not json")
