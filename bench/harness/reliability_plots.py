"""Figures of the reliability runs, drawn from their JSON reports (so a committed result can be
redrawn): the fault matrix (one row per scenario: every request's TTFT over time, hits and misses,
the fault's window; the block hit rate before / during / after) and the soak (server memory, fds
and threads with the fitted line the verdict used, the engines' memory, TTFT p50 / p99 per minute)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

HIT_COLOR = "#2b6cb0"
MISS_COLOR = "#a0aec0"
FAIL_COLOR = "#c53030"
FAULT_COLOR = "#f6ad55"
MIB = 1 << 20


def _save(fig, path: pathlib.Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def faults_figure(report: dict, path: pathlib.Path) -> None:
    scenarios = report["scenarios"]
    n = max(1, len(scenarios))
    fig, axes = plt.subplots(n, 2, figsize=(14, 3.2 * n), squeeze=False, gridspec_kw={"width_ratios": [4, 1]})
    for row, (name, sc) in enumerate(scenarios.items()):
        ax, bars = axes[row]
        o = sc["outcome"]
        t = o["times"]
        t0 = t["load_start"]
        pts = sc.get("timeline") or []
        for label, color, marker, keep in (
            ("loaded >= 1 block", HIT_COLOR, "o", lambda p: p[3] and p[2] > 0),
            ("no block loaded", MISS_COLOR, "o", lambda p: p[3] and p[2] == 0),
            ("failed", FAIL_COLOR, "x", lambda p: not p[3]),
        ):
            sel = [p for p in pts if keep(p)]
            if sel:
                ax.scatter(
                    [p[0] for p in sel], [p[1] for p in sel], s=14, color=color, marker=marker, label=label
                )
        ax.axvspan(
            t["injected"] - t0,
            max(t["recovered"] - t0, t["injected"] - t0 + 0.3),
            color=FAULT_COLOR,
            alpha=0.35,
            label="fault",
        )
        if o["time_to_first_hit_s"] is not None:
            ax.axvline(
                t["recovered"] - t0 + o["time_to_first_hit_s"],
                color=HIT_COLOR,
                ls="--",
                lw=1,
                label=f"first hit after recovery (+{o['time_to_first_hit_s']:.1f} s)",
            )
        verdict = "PASS" if sc["verdict"]["passed"] else "FAIL"
        ax.set_title(
            f"{name}: {o['requests']} requests, {o['failed']} failed, {o['wrong_requests']} wrong answers "
            f"({o['wrong_tokens']} tokens) - {verdict}",
            fontsize=10,
        )
        ax.set_xlabel("seconds since the scenario's traffic started")
        ax.set_ylabel("TTFT (s)")
        ax.legend(fontsize=7, loc="upper right")
        phases = ("before", "during", "after")
        values = [o["phases"][p]["block_hit_rate"] or 0.0 for p in phases]
        b = bars.bar(phases, values, color=[HIT_COLOR, FAULT_COLOR, HIT_COLOR])
        for rect, v in zip(b, values, strict=True):
            bars.annotate(
                f"{v:.0%}", (rect.get_x() + rect.get_width() / 2, v), ha="center", va="bottom", fontsize=8
            )
        bars.set_ylim(0, 1.1)
        bars.set_title("block hit rate", fontsize=10)
    _save(fig, path)


def _fit_line(ax, flat: dict, t0: float, scale: float, color: str) -> None:
    if not flat or flat.get("flat") is None:
        return
    x0 = flat["fit_t0"] - t0
    x1 = x0 + flat["window_s"]
    y0 = flat["fit_start"] / scale
    y1 = (flat["fit_start"] + flat["fitted_rise"]) / scale
    ax.plot([x0 / 60, x1 / 60], [y0, y1], color=color, ls="--", lw=1.5)


def soak_figure(report: dict, path: pathlib.Path) -> None:
    samples = [s for s in report["samples"] if "error" not in s]
    t0 = report["load_start"]
    minutes = [(s["t"] - t0) / 60 for s in samples]
    flat = report["verdict_details"]["resources"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    ax.plot(
        minutes,
        [s["server"]["rss_bytes"] / MIB for s in samples],
        color="#2b6cb0",
        label="pegaflow-server RSS",
    )
    _fit_line(ax, flat.get("server_rss_bytes"), t0, MIB, "#1a365d")
    ax.set_ylabel("MiB")
    ax.set_title("pegaflow-server RSS (fit over the last 2/3 dashed)")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(minutes, [s["server"]["fds"] for s in samples], label="server open fds", color="#2f855a")
    ax.plot(minutes, [s["server"]["threads"] for s in samples], label="server threads", color="#9c4221")
    _fit_line(ax, flat.get("server_fds"), t0, 1, "#22543d")
    _fit_line(ax, flat.get("server_threads"), t0, 1, "#7b341e")
    ax.set_title("pegaflow-server open fds and threads")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for k in range(len(samples[0]["engines"]) if samples else 0):
        ax.plot(
            minutes, [s["engines"][k]["pss_bytes"] / MIB for s in samples], label=f"engine {k} PSS (tree)"
        )
        _fit_line(ax, flat.get(f"engine{k}_pss_bytes"), t0, MIB, "black")
    ax.set_ylabel("MiB")
    ax.set_xlabel("minutes")
    ax.set_title("vLLM engines' memory")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    rows = report["per_minute"]
    xs = [r["minute"] + 0.5 for r in rows]
    ax.plot(xs, [r["ttft_p50_s"] for r in rows], marker="o", label="TTFT p50")
    ax.plot(xs, [r["ttft_p99_s"] for r in rows], marker="o", label="TTFT p99")
    lat = report["verdict_details"]["latency"]
    ax.set_xlabel("minutes")
    ax.set_ylabel("s")
    ratio = lat.get("ratio_last_to_first")
    ax.set_title("TTFT per minute" + (f" (last/first third p99: {ratio:.2f}x)" if ratio else ""))
    ax.legend(fontsize=8)
    v = report["verdict"]
    fig.suptitle(
        f"soak {report['minutes']:.0f} min: {report['requests']['total']} requests, "
        f"{report['requests']['failed']} failed, {report['tokens']['wrong_requests']} wrong - "
        f"{'PASS' if v['passed'] else 'FAIL'}",
        fontsize=11,
    )
    _save(fig, path)
