"""bench/ttft.py --step-timing: the vLLM plugin records each timed call, and the summary keeps
each pass's own calls, only the steps that scheduled tokens, and pools the warm passes per mode."""

from __future__ import annotations

import json

from pegaflow.bench.harness import step_timing
from pegaflow.bench.harness.vllm_step_timing import pegaflow_step_timing as plugin


def test_the_plugin_records_each_call_with_its_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv(plugin.ENV, str(tmp_path))
    monkeypatch.setattr(plugin, "_out", None)

    class Output:
        total_num_scheduled_tokens = 16

    class Runner:
        def execute_model(self, scheduler_output):
            return "ran"

    plugin._timed(Runner, "execute_model", "execute_model", count_tokens=True)
    plugin._timed(Runner, "execute_model", "execute_model", count_tokens=True)  # once only
    assert Runner().execute_model(Output()) == "ran"
    plugin._out.close()
    lines = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert len(lines) == 1
    assert lines[0]["n"] == "execute_model" and lines[0]["tokens"] == 16
    assert lines[0]["t1"] >= lines[0]["t0"]


def test_each_pass_gets_its_own_calls_and_empty_steps_are_left_out():
    def span(n, t0, ms, tokens=None):
        s = {"n": n, "t0": t0, "t1": t0 + ms / 1e3}
        if tokens is not None:
            s["tokens"] = tokens
        return s

    spans = [
        span("execute_model", 1.0, 30.0, tokens=16),
        span("execute_model", 1.1, 0.2, tokens=0),  # an empty step: not a prefill
        span("prepare_inputs", 1.0, 1.0),
        span("schedule", 0.99, 0.5),
        span("execute_model", 5.0, 40.0, tokens=16),
        span("execute_model", 5.2, 20.0, tokens=16),
        span("schedule", 5.0, 5.0),
        span("execute_model", 9.0, 99.0, tokens=10000),  # outside every window
    ]
    windows = {
        "concurrent-warm-1": (0.9, 2.0),
        "concurrent-warm-2": (4.9, 6.0),
        "concurrent-cold-0": (8.0, 8.5),
    }
    per = step_timing.summarize(spans, windows)
    assert per["concurrent-warm-1"]["execute_model"] == {
        "count": 1, "median_ms": 30.0, "p90_ms": 30.0, "max_ms": 30.0
    }  # fmt: skip
    assert per["concurrent-warm-1"]["prepare_inputs"]["count"] == 1
    assert per["concurrent-warm-2"]["execute_model"]["count"] == 2
    assert per["concurrent-cold-0"]["execute_model"] == {"count": 0}
    warm = step_timing.summarize_warm(spans, windows)
    assert list(warm) == ["concurrent-warm"]
    assert warm["concurrent-warm"]["execute_model"]["count"] == 3
    assert warm["concurrent-warm"]["execute_model"]["max_ms"] == 40.0
    assert warm["concurrent-warm"]["schedule"]["count"] == 2


def test_the_engine_finds_the_plugin_before_its_own_pythonpath(tmp_path):
    env = step_timing.engine_env(tmp_path / "floor", "/elsewhere")
    assert env[plugin.ENV] == str(tmp_path / "floor")
    first, rest = env["PYTHONPATH"].split(":", 1)
    assert first == str(step_timing.PLUGIN_DIR) and rest == "/elsewhere"
    assert (step_timing.PLUGIN_DIR / "pegaflow_step_timing-1.0.dist-info" / "entry_points.txt").exists()
