"""vLLM's own step timings in every engine of a benchmark (the plugin in vllm_step_timing/ records
them), summarized per benchmark pass: where a connector engine's extra time per request goes,
next to an engine without one, timed the same way.

Per pass window: ``execute_model`` of the steps that scheduled tokens (an engine's empty steps are
left out), its ``prepare_inputs`` part, ``sample_tokens``, and every ``schedule`` call (EngineCore;
a connector's lookup runs inside it). Milliseconds: count, median, p90, max.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
from collections.abc import Mapping

from pegaflow.bench.harness.vllm_step_timing.pegaflow_step_timing import ENV

PLUGIN_DIR = pathlib.Path(__file__).resolve().parent / "vllm_step_timing"
CALLS = ("schedule", "prepare_inputs", "execute_model", "sample_tokens")


def engine_env(directory: pathlib.Path, pythonpath: str | None = None) -> dict[str, str]:
    """The variables that make an engine record its step timings into ``directory``;
    ``pythonpath``: the engine's own PYTHONPATH, kept after the plugin's directory."""
    path = str(PLUGIN_DIR) + (os.pathsep + pythonpath if pythonpath else "")
    return {ENV: str(directory), "PYTHONPATH": path}


def load(directory: pathlib.Path) -> list[dict]:
    spans: list[dict] = []
    for f in sorted(pathlib.Path(directory).glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans


def _stats(ms: list[float]) -> dict:
    if not ms:
        return {"count": 0}
    ordered = sorted(ms)
    return {
        "count": len(ms),
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "max_ms": round(ordered[-1], 3),
    }


def summarize(spans: list[dict], windows: Mapping[str, tuple[float, float]]) -> dict:
    """Per window (a pass's monotonic start and end): each call's durations; execute_model only
    in steps that scheduled tokens."""
    out: dict = {}
    for name, (w0, w1) in windows.items():
        inside = [s for s in spans if w0 <= s["t0"] <= w1]
        row = {}
        for call in CALLS:
            picked = [s for s in inside if s["n"] == call]
            if call == "execute_model":
                picked = [s for s in picked if (s.get("tokens") or 0) > 0]
            row[call] = _stats([1e3 * (s["t1"] - s["t0"]) for s in picked])
        out[name] = row
    return out


def summarize_warm(spans: list[dict], windows: Mapping[str, tuple[float, float]]) -> dict:
    """The warm passes of each mode pooled (windows named ``<mode>-<kind>-<round>``): ``<mode>-warm``."""
    modes = sorted({n.split("-")[0] for n in windows if n.split("-")[1] == "warm"})
    out: dict = {}
    for mode in modes:
        keep = [w for n, w in windows.items() if n.startswith(f"{mode}-warm-")]
        chosen = [s for s in spans if any(w0 <= s["t0"] <= w1 for w0, w1 in keep)]
        out[f"{mode}-warm"] = summarize(chosen, {"all": (float("-inf"), float("inf"))})["all"]
    return out
