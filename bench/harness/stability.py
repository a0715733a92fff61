"""The soak's verdict, as arithmetic on what it sampled: is a resource flat, is the tail latency
stable, did anything fail.

"Flat" (memory, open fds, threads): the samples after warm-up are fitted with a least-squares line
over the last `fraction` (2/3) of the run, and the line's rise over that window must stay within
`max(abs_tol, rel_tol x median)`. A leak of a fixed amount per request grows linearly with a steady
load and shows as a slope; start-up growth (caches filling, the pool's pages, lazy imports) lands
in the first third, which the fit leaves out; noise around a flat level gives a slope near zero.
The rise is what the fit predicts over the window, not max - min, so one outlier sample does not
decide it. The JSON keeps the slope per hour, to say what the window's rise means for a longer run.

"Stable" (TTFT p99): the run after warm-up is cut into thirds by request start time; the last
third's p99 must be within `max_ratio` of the first third's. Each third needs `min_requests`
answers, or the verdict says it could not decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class FlatRule:
    abs_tol: float  # allowed fitted rise over the analysed window, in the series' unit
    rel_tol: float = 0.0  # ... or this fraction of the window's median, whichever is larger
    unit: str = ""

    def tolerance(self, median: float) -> float:
        return max(self.abs_tol, self.rel_tol * abs(median))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def linear_fit(ts: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope per second, value at ts[0]) of the least-squares line; slope 0 for one point."""
    t = np.asarray(ts, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if len(t) != len(y) or len(t) == 0:
        raise ValueError("linear_fit needs equally long, non-empty series")
    if len(t) == 1 or np.ptp(t) == 0:
        return 0.0, float(y.mean())
    slope, intercept = np.polyfit(t - t[0], y, 1)
    return float(slope), float(intercept)


def flatness(
    ts: Sequence[float], ys: Sequence[float], rule: FlatRule, fraction: float = 2 / 3, min_points: int = 4
) -> dict:
    """Fits the samples within the last `fraction` of [ts[0], ts[-1]]; `flat` is None when fewer than
    `min_points` fall there (not decidable)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    pairs = sorted((float(t), float(y)) for t, y in zip(ts, ys, strict=True) if y is not None)
    if not pairs:
        return {"points": 0, "flat": None, "rule": rule.to_dict()}
    t_end = pairs[-1][0]
    cut = t_end - fraction * (t_end - pairs[0][0])
    window = [(t, y) for t, y in pairs if t >= cut]
    out: dict = {"points": len(window), "rule": rule.to_dict()}
    if len(window) < min_points:
        out["flat"] = None
        return out
    wt, wy = zip(*window, strict=True)
    slope, start_value = linear_fit(wt, wy)
    span = wt[-1] - wt[0]
    median = float(np.median(wy))
    rise = slope * span
    tolerance = rule.tolerance(median)
    out.update(
        window_s=span,
        slope_per_hour=slope * 3600.0,
        fitted_rise=rise,
        tolerance=tolerance,
        flat=bool(rise <= tolerance),
        first=wy[0],
        last=wy[-1],
        min=min(wy),
        max=max(wy),
        median=median,
        fit_start=start_value,
        fit_t0=wt[0],
    )
    return out


def series(samples: Sequence[Mapping], path: Sequence[str]) -> tuple[list[float], list[float]]:
    """(t, value) of the samples that hold `path` (nested keys), skipping error samples."""
    ts, ys = [], []
    for s in samples:
        value = s
        for key in path:
            if not isinstance(value, Mapping) or key not in value:
                value = None
                break
            value = value[key]
        if value is None:
            continue
        ts.append(float(s["t"]))
        ys.append(float(value))
    return ts, ys


def _p(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def per_minute(
    records: Sequence[Mapping], t0: float, bucket_s: float = 60.0, wrong: set | None = None
) -> list:
    """Per bucket of request start time (minutes since t0): requests, failed, wrong answers (indices
    in `wrong`), TTFT p50 / p99 of the successful ones, and the share that loaded >= 1 block."""
    buckets: dict[int, list[Mapping]] = {}
    for r in records:
        buckets.setdefault(int((r["start"] - t0) // bucket_s), []).append(r)
    rows = []
    for k in sorted(buckets):
        rs = buckets[k]
        ok = [r for r in rs if r["ok"]]
        ttft = [r["ttft_s"] for r in ok]
        rows.append(
            {
                "minute": k * bucket_s / 60.0,
                "requests": len(rs),
                "failed": len(rs) - len(ok),
                "wrong": sum(r.get("index") in wrong for r in ok) if wrong else 0,
                "ttft_p50_s": _p(ttft, 50),
                "ttft_p99_s": _p(ttft, 99),
                "request_hit_rate": (sum((r.get("cached_tokens") or 0) > 0 for r in ok) / len(ok))
                if ok
                else None,
            }
        )
    return rows


def p99_stability(
    records: Sequence[Mapping],
    t_start: float,
    t_end: float,
    warmup_s: float,
    max_ratio: float,
    min_requests: int = 20,
) -> dict:
    """TTFT p99 of the first and last thirds of [t_start + warmup_s, t_end] (by request start)."""
    lo = t_start + warmup_s
    if t_end <= lo:
        return {"stable": None, "reason": "the run is shorter than its warm-up"}
    third = (t_end - lo) / 3.0
    ok = [r for r in records if r["ok"] and lo <= r["start"] <= t_end]
    parts = [
        [r["ttft_s"] for r in ok if lo + k * third <= r["start"] < lo + (k + 1) * third] for k in range(3)
    ]
    parts[2] += [r["ttft_s"] for r in ok if r["start"] == lo + 3 * third]
    out = {
        "warmup_s": warmup_s,
        "max_ratio": max_ratio,
        "requests_per_third": [len(p) for p in parts],
        "p50_per_third_s": [_p(p, 50) for p in parts],
        "p99_per_third_s": [_p(p, 99) for p in parts],
    }
    if min(len(parts[0]), len(parts[2])) < min_requests:
        out.update(stable=None, reason=f"fewer than {min_requests} answers in the first or last third")
        return out
    first, last = out["p99_per_third_s"][0], out["p99_per_third_s"][2]
    ratio = last / first if first else None
    out.update(ratio_last_to_first=ratio, stable=bool(ratio is not None and ratio <= max_ratio))
    return out


def verdict(
    failed: int,
    wrong_requests: int,
    unchecked: int,
    resources: Mapping[str, Mapping],
    latency: Mapping,
) -> dict:
    """Passed when nothing failed, no answer was wrong or unchecked, every resource is flat and the
    p99 is stable; every reason it did not pass is listed (undecidable counts as not passed)."""
    problems = []
    if failed:
        problems.append(f"{failed} request(s) failed")
    if wrong_requests:
        problems.append(f"{wrong_requests} answer(s) differ from the reference")
    if unchecked:
        problems.append(f"{unchecked} answer(s) could not be checked against the reference")
    for name, r in resources.items():
        if r.get("flat") is None:
            problems.append(f"{name}: too few samples to decide ({r.get('points', 0)})")
        elif not r["flat"]:
            problems.append(
                f"{name}: rises {r['fitted_rise']:.4g} {r['rule']['unit']} over the last "
                f"{r['window_s']:.0f} s (tolerance {r['tolerance']:.4g})"
            )
    if latency.get("stable") is None:
        problems.append(f"TTFT p99: not decidable ({latency.get('reason')})")
    elif not latency["stable"]:
        problems.append(
            f"TTFT p99: last third {latency['p99_per_third_s'][2]:.3f} s is "
            f"{latency['ratio_last_to_first']:.2f}x the first third's (allowed {latency['max_ratio']}x)"
        )
    return {"passed": not problems, "problems": problems}
