"""The soak's verdict arithmetic (bench/harness/stability.py)."""

import numpy as np
import pytest

from pegaflow.bench.harness import stability
from pegaflow.bench.harness.stability import FlatRule, flatness

MIB = 1 << 20


def test_linear_fit_recovers_a_slope():
    ts = np.arange(0, 100, 10.0)
    slope, start = stability.linear_fit(ts + 1000, 5 + 0.5 * ts)
    assert slope == pytest.approx(0.5) and start == pytest.approx(5)
    assert stability.linear_fit([1.0], [3.0]) == (0.0, 3.0)


def test_noise_around_a_level_is_flat_and_a_leak_is_not():
    rng = np.random.default_rng(0)
    ts = np.arange(0, 1800, 10.0)
    noise = 200 * MIB + rng.normal(0, 2 * MIB, len(ts))
    rule = FlatRule(16 * MIB, 0.02, "bytes")
    assert flatness(ts, noise, rule)["flat"] is True
    leak = noise + ts * (30 * MIB / 1800)  # 30 MiB over the run: 20 MiB over the last 2/3
    out = flatness(ts, leak, rule)
    assert out["flat"] is False and out["fitted_rise"] == pytest.approx(20 * MIB, rel=0.15)
    assert out["slope_per_hour"] == pytest.approx(60 * MIB, rel=0.1)


def test_growth_in_the_first_third_is_warm_up_not_a_leak():
    ts = np.arange(0, 600, 10.0)
    ys = np.where(ts < 150, 100 + ts, 250.0)  # grows, then flat
    assert flatness(ts, ys, FlatRule(2))["flat"] is True
    assert flatness(ts, ys, FlatRule(2), fraction=1.0)["flat"] is False


def test_one_outlier_does_not_decide_and_too_few_points_are_undecidable():
    ts = np.arange(0, 300, 10.0)
    ys = np.full(len(ts), 40.0)
    ys[20] = 60
    assert flatness(ts, ys, FlatRule(2))["flat"] is True
    assert flatness([0, 10, 20], [1, 2, 3], FlatRule(1))["flat"] is None
    assert flatness([], [], FlatRule(1))["flat"] is None


def test_relative_tolerance_scales_with_the_level():
    rule = FlatRule(1.0, 0.1)
    assert rule.tolerance(5.0) == 1.0 and rule.tolerance(100.0) == 10.0


def _records(t0, n, ttft, spacing=1.0):
    return [{"start": t0 + i * spacing, "ok": True, "ttft_s": ttft(i), "cached_tokens": 128 * (i % 2)}
            for i in range(n)]  # fmt: skip


def test_p99_stability_compares_the_thirds_after_warm_up():
    steady = _records(0, 300, lambda i: 0.5 + 0.01 * (i % 7))
    out = stability.p99_stability(steady, 0, 300, warmup_s=30, max_ratio=1.5)
    assert out["stable"] is True and out["requests_per_third"] == [90, 90, 90]
    worse = _records(0, 300, lambda i: 0.5 if i < 200 else 2.0)
    assert stability.p99_stability(worse, 0, 300, warmup_s=30, max_ratio=1.5)["stable"] is False
    slow_start = _records(0, 300, lambda i: 5.0 if i < 30 else 0.5)  # only the warm-up was slow
    assert stability.p99_stability(slow_start, 0, 300, warmup_s=30, max_ratio=1.5)["stable"] is True
    few = _records(0, 20, lambda i: 0.5)
    assert stability.p99_stability(few, 0, 20, warmup_s=2, max_ratio=1.5)["stable"] is None


def test_per_minute_buckets_by_start_time():
    recs = _records(100, 180, lambda i: 0.1 * (1 + i // 60))
    recs[5]["ok"] = False
    rows = stability.per_minute(recs, 100, wrong={7, 8})
    assert [r["requests"] for r in rows] == [60, 60, 60]
    assert rows[0]["failed"] == 1 and rows[1]["ttft_p50_s"] == pytest.approx(0.2)
    assert rows[0]["request_hit_rate"] == pytest.approx(29 / 59)


def test_verdict_lists_every_problem():
    flat = {"flat": True}
    rising = {"flat": False, "fitted_rise": 5.0, "window_s": 600, "tolerance": 2.0, "rule": {"unit": "fds"}}
    latency = {"stable": True}
    assert stability.verdict(0, 0, 0, {"a": flat}, latency) == {"passed": True, "problems": []}
    v = stability.verdict(
        1, 2, 0, {"a": flat, "fds": rising, "b": {"flat": None, "points": 2}}, {"stable": None}
    )
    assert not v["passed"] and len(v["problems"]) == 5


def test_series_reads_nested_paths_and_skips_error_samples():
    samples = [{"t": 1, "server": {"rss": 5}}, {"t": 2, "error": "gone"}, {"t": 3, "server": {"rss": 7}}]
    assert stability.series(samples, ("server", "rss")) == ([1.0, 3.0], [5.0, 7.0])
