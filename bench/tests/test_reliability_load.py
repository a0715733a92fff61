"""The recurring trace, the live request log and the streamed request of the reliability runs
(bench/harness/steady_load.py)."""

import http.server
import json
import threading

import numpy as np
import pytest

from pegaflow.bench.harness import traces
from pegaflow.bench.harness.steady_load import cycle_trace, passes_for, read_records, stream_request

SPEC = traces.TraceSpec(
    seed=5, num_requests=20, system_prompt_tokens=64, user_turn_tokens=16, assistant_turn_tokens=8,
    one_off_tokens=32, max_tokens=4, max_prompt_tokens=512,
)  # fmt: skip


def test_cycle_repeats_prompts_keeps_session_order_and_reroutes_each_pass(tmp_path):
    base = traces.generate(SPEC)
    cyc = cycle_trace(base, 3)
    n = len(base)
    assert len(cyc) == 3 * n and [r.index for r in cyc] == list(range(3 * n))
    for p in range(3):
        for r, b in zip(cyc.requests[p * n : (p + 1) * n], base.requests, strict=True):
            assert np.array_equal(r.prompt, b.prompt) and r.max_tokens == b.max_tokens
            assert r.depends_on == (None if b.depends_on is None else b.depends_on + p * n)
    assert [r.route for r in cyc.requests[:n]] == [r.route for r in base.requests]
    assert [r.route for r in cyc.requests[n : 2 * n]] != [r.route for r in base.requests]
    assert cycle_trace(base, 3).fingerprint() == cyc.fingerprint()  # deterministic
    path = tmp_path / "t.jsonl"
    cyc.save(path)  # what locust loads: the fingerprint holds
    assert traces.Trace.load(path).fingerprint() == cyc.fingerprint()
    with pytest.raises(ValueError):
        cycle_trace(base, 0)


def test_passes_cover_the_run():
    assert passes_for(72, 4.0, 1800) * 72 >= 4.0 * 1800
    assert passes_for(72, 1.0, 10) == 2


def test_read_records_skips_the_line_being_written(tmp_path):
    path = tmp_path / "r.jsonl"
    assert read_records(path) == []
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"b": ')
    assert read_records(path) == [{"a": 1}]


class _FakeCompletions(http.server.BaseHTTPRequestHandler):
    """A real HTTP server streaming OpenAI-style events: what stream_request must parse."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == [0]:
            self.send_response(500)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for tok in (11, 12):
            self.wfile.write(f"data: {json.dumps({'choices': [{'token_ids': [tok]}]})}\n\n".encode())
        usage = {"usage": {"completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 128}}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


def test_stream_request_records_tokens_usage_and_failures():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        first = []
        r = stream_request(url, "m", [5, 6], 2, on_first_token=lambda: first.append(1), index=3, instance=1)
        assert r["ok"] and r["completion_token_ids"] == [11, 12] and r["cached_tokens"] == 128
        assert first == [1] and r["ttft_s"] <= r["e2e_s"] and (r["index"], r["instance"]) == (3, 1)
        bad = stream_request(url, "m", [0], 2)
        assert not bad["ok"] and "500" in bad["error"]
    finally:
        server.shutdown()
