"""Figures of the experiments (matplotlib, Agg backend, PNG), drawn from their JSON reports so a
figure can always be redrawn from committed results."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402  (the backend must be chosen first)
import matplotlib.pyplot as plt  # noqa: E402

SHARED_COLOR = "#2b6cb0"
ISOLATED_COLOR = "#c05621"
NEUTRAL_COLOR = "#718096"
MIB = 1 << 20
GIB = 1 << 30


def _label_bars(ax, bars, fmt: str, inside: bool = False) -> None:
    for bar in bars:
        h = bar.get_height()
        ax.annotate(
            fmt.format(h),
            (bar.get_x() + bar.get_width() / 2, h / 2 if inside else h),
            ha="center",
            va="center" if inside else "bottom",
            fontsize=9 if inside else 8,
            color="white" if inside else "black",
            xytext=(0, 0 if inside else 2),
            textcoords="offset points",
        )


def _throughput_panel(ax, labels, summaries, colors, fmt: str) -> None:
    bars = ax.bar(labels, [x["throughput_rps"] or 0 for x in summaries], color=colors)
    _label_bars(ax, bars, fmt)
    ax.set_title("throughput (req/s)")


def _ttft_panel(ax, labels, summaries, colors) -> None:
    width = 0.38
    xs = range(len(summaries))
    means = [x["ttft_mean_s"] or 0 for x in summaries]
    p99s = [x["ttft_p99_s"] or 0 for x in summaries]
    b1 = ax.bar([x - width / 2 for x in xs], means, width, color=colors, label="mean")
    b2 = ax.bar([x + width / 2 for x in xs], p99s, width, color=colors, alpha=0.5, hatch="//", label="P99")
    _label_bars(ax, b1, "{:.2f}")
    _label_bars(ax, b2, "{:.2f}")
    ax.set_xticks(list(xs), labels)
    ax.set_title("TTFT (s): mean, P99 hatched")


def _hit_rate_bars(ax, labels, values, colors, modelled: list[float] | None) -> None:
    """Measured hit rates as bars, with what the LRU replay model predicted for each as a mark."""
    _label_bars(ax, ax.bar(labels, values, color=colors), "{:.1%}", inside=True)
    if modelled is None:
        return
    ax.scatter(
        range(len(modelled)),
        modelled,
        marker="_",
        s=900,
        color="black",
        zorder=3,
        label="LRU replay model",
    )


def _change_headlines(cmp: dict) -> list[str]:
    """The seed's headline numbers (throughput gain, mean TTFT change) where the run has them."""
    parts = []
    if cmp.get("throughput_gain") is not None:
        parts.append(f"throughput {cmp['throughput_gain']:+.0%}")
    if cmp.get("ttft_mean_change") is not None:
        parts.append(f"mean TTFT {cmp['ttft_mean_change']:+.0%}")
    return parts


def _save(fig, path: pathlib.Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def multi_instance_figure(report: dict, path: pathlib.Path) -> None:
    """Like the seed's figure 4: one fixed budget, shared vs isolated, on throughput, TTFT and hit rates."""
    shared = report["arms"]["shared"]
    isolated = report["arms"][report["comparison"]["isolated_arm"]]
    s, i = shared["summary"], isolated["summary"]
    n = report["setup"]["num_instances"]
    budget = report["budget"]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4.2))
    labels = [
        f"shared pool\n1 x {budget['shared_pool_bytes'] / MIB:.0f} MiB",
        f"isolated pools\n{n} x {budget['isolated_pool_bytes'] / MIB:.0f} MiB"
        + ("" if isolated["arm"] == "isolated" else "\n(one server each)"),
    ]
    colors = [SHARED_COLOR, ISOLATED_COLOR]
    _throughput_panel(axes[0], labels, [s, i], colors, "{:.2f}")
    _ttft_panel(axes[1], labels, [s, i], colors)

    for ax, key, title in (
        (axes[2], "request_hit_rate", "request hit rate"),
        (axes[3], "block_hit_rate", "block hit rate"),
    ):
        model = budget.get("lru_model")
        modelled = [model["shared"][key], model["isolated"][key]] if model else None
        _hit_rate_bars(ax, labels, [s[key] or 0, i[key] or 0], colors, modelled)
        if model:
            ax.legend(loc="lower center", fontsize=7, bbox_to_anchor=(0.5, -0.42))
        ax.set_ylim(0, 1.05)
        ax.set_title(title)
    for k, (value, text, style) in enumerate(
        (
            (shared.get("hll_ceiling"), "server HLL ceiling", "--"),
            (budget.get("exact_ceiling"), "trace's exact ceiling", ":"),
        )
    ):
        if value is not None:
            axes[3].axhline(value, color="black", linestyle=style, linewidth=1)
            axes[3].annotate(
                f"{text} {value:.1%}",
                # right side, above the lower isolated bar; the two ceilings may coincide, so
                # one label goes above its line and the other below
                (0.98, value),
                xycoords=("axes fraction", "data"),
                ha="right",
                va="bottom" if k == 0 else "top",
                fontsize=7,
            )
    cmp = report["comparison"]
    parts = [f"{n} vLLM-CPU instances, same {budget['shared_pool_bytes'] / MIB:.0f} MiB budget"]
    parts += _change_headlines(cmp)
    hit = cmp.get("request_hit_rate_ratio")
    if hit is not None:
        parts.append(f"request hit rate x{hit:.1f}")
    fig.suptitle(" | ".join(parts))
    _save(fig, path)


SSD_TIER_COLORS = {
    "dram": ISOLATED_COLOR,
    "dram-tinylfu": "#d69e2e",
    "ssd-on-reuse": SHARED_COLOR,
    "ssd-on-seal": "#2c7a7b",
}


def ssd_tier_figure(report: dict, path: pathlib.Path) -> None:
    """One DRAM budget: DRAM only (LRU, W-TinyLFU: the seed's figure 6 point, a small cache needs
    more than recency) against DRAM + SSD (two write policies), on throughput, TTFT and hit rates."""
    budget = report["budget"]
    arms = [a for a in ("dram", "dram-tinylfu", "ssd-on-reuse", "ssd-on-seal") if a in report["arms"]]
    names = {
        "dram": "DRAM only\nLRU",
        "dram-tinylfu": "DRAM only\nW-TinyLFU",
        "ssd-on-reuse": "DRAM + SSD\nwrite at reuse",
        "ssd-on-seal": "DRAM + SSD\nwrite at seal",
    }
    labels = [names[a] for a in arms]
    summaries = [report["arms"][a]["summary"] for a in arms]
    colors = [SSD_TIER_COLORS[a] for a in arms]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4))
    _throughput_panel(axes[0], labels, summaries, colors, "{:.2f}")
    _ttft_panel(axes[1], labels, summaries, colors)
    model = budget.get("lru_model") or {}
    for ax, key, title in (
        (axes[2], "block_hit_rate", "block hit rate"),
        (axes[3], "request_hit_rate", "request hit rate"),
    ):
        modelled = [model[a][key] if a in model else float("nan") for a in arms] if model else None
        _hit_rate_bars(ax, labels, [x[key] or 0 for x in summaries], colors, modelled)
        if model:
            ax.legend(loc="lower center", fontsize=7, bbox_to_anchor=(0.5, -0.42))
        ax.set_ylim(0, 1.05)
        ax.set_title(title)
    if budget.get("exact_ceiling") is not None:
        axes[2].axhline(budget["exact_ceiling"], color="black", linestyle=":", linewidth=1)
        axes[2].annotate(
            f"trace's exact ceiling {budget['exact_ceiling']:.1%}",
            (0.98, budget["exact_ceiling"]),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom",
            fontsize=7,
        )
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    parts = [
        f"DRAM {budget['dram_pool_bytes'] / MIB:.0f} MiB for a "
        f"{budget['trace_working_set_bytes'] / MIB:.0f} MiB working set (1 vLLM-CPU instance)"
    ]
    parts += _change_headlines(report.get("comparison") or {})
    fig.suptitle(" | ".join(parts))
    _save(fig, path)


def mla_dedup_figure(report: dict, path: pathlib.Path) -> None:
    """Like the seed's figure 4: one fixed budget, store-once vs per-rank, on throughput, TTFT and
    hit rates (LRU model marks, request and block ceilings)."""
    once, per = report["arms"]["once"], report["arms"]["per_rank"]
    s, p = once["summary"], per["summary"]
    budget = report["budget"]
    tp = report["setup"]["tp"]
    labels = ["stored once\n(1 copy / TP group)", f"stored per rank\n({tp} copies)"]
    # store-once shares one copy across ranks as the shared pool does across instances
    colors = [SHARED_COLOR, ISOLATED_COLOR]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4.4))
    _throughput_panel(axes[0], labels, [s, p], colors, "{:.3f}")
    _ttft_panel(axes[1], labels, [s, p], colors)

    ceilings = {
        "request_hit_rate": [(budget.get("request_ceiling"), "request ceiling of the trace", ":")],
        "block_hit_rate": [
            (budget.get("exact_ceiling"), "exact ceiling of the trace", ":"),
            (once.get("hll_ceiling"), "server HLL ceiling", "--"),
        ],
    }
    rebased = (report.get("hll") or {}).get("ceiling_one_lookup_per_block")
    reported = once.get("hll_ceiling")
    if rebased is not None and (reported is None or abs(rebased - reported) > 0.005):
        # results from a server that counted every leasing query as a lookup (see hll_per_request_lookup)
        ceilings["block_hit_rate"][1] = (reported, "server HLL as reported (counts every lease)", "--")
        ceilings["block_hit_rate"].append((rebased, "server HLL, one lookup per block", "-."))
    model = budget["lru_model"]
    for ax, key, title in (
        (axes[2], "request_hit_rate", "request hit rate"),
        (axes[3], "block_hit_rate", "block hit rate"),
    ):
        _hit_rate_bars(
            ax, labels, [s[key] or 0, p[key] or 0], colors, [model["once"][key], model["per_rank"][key]]
        )
        for i, (value, text, style) in enumerate(ceilings[key]):
            if value is not None:
                ax.axhline(value, color="black", linestyle=style, linewidth=1)
                ax.annotate(
                    f"{text} {value:.1%}",
                    # right side: above the (lower) per-rank bar; close ceilings above / below their line
                    (0.98, min(value, 1.06)),
                    xycoords=("axes fraction", "data"),
                    ha="right",
                    va="top" if i == 1 else "bottom",
                    fontsize=7,
                )
        ax.legend(loc="lower center", fontsize=7, bbox_to_anchor=(0.5, -0.42))
        ax.set_ylim(0, 1.12)
        ax.set_title(title)
    parts = [
        f"tiny DeepSeek-V3 (61 layers, {budget['block_bytes']:,} B blocks), TP={tp}, "
        f"same {budget['pool_bytes'] / MIB:.0f} MiB pool"
    ]
    fig.suptitle(" | ".join(parts + _change_headlines(report["comparison"])))
    _save(fig, path)


def startup_figure(report: dict, path: pathlib.Path) -> None:
    """Like the seed's figure 2: vLLM time to ready with the host pool owned by the vLLM worker
    (embedded) or already owned by pegaflow-server, per pool size; medians, min-max whiskers."""
    sizes = report["pool_sizes_bytes"]
    modes = [("embedded", "pool owned by the vLLM worker (embedded)", ISOLATED_COLOR)]
    modes.append(("server", "pool pre-owned by pegaflow-server", SHARED_COLOR))
    fig, ax = plt.subplots(figsize=(max(7.5, 2.2 * len(sizes) + 2), 4.8))
    width = 0.38
    for k, (mode, label, color) in enumerate(modes):
        med, lo, hi = [], [], []
        for size in sizes:
            stats = report["modes"][mode][str(size)]["ready_s_stats"]
            med.append(stats["median"])
            lo.append(stats["median"] - stats["min"])
            hi.append(stats["max"] - stats["median"])
        xs = [x + (k - 0.5) * width for x in range(len(sizes))]
        bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, color=color, label=label)
        _label_bars(ax, bars, "{:.1f} s")
        if mode == "embedded":
            prefault = [
                report["modes"][mode][str(size)].get("pool_prefault_s_stats", {}).get("median", 0.0)
                for size in sizes
            ]
            if any(prefault):
                ax.bar(
                    xs,
                    prefault,
                    width,
                    fill=False,
                    hatch="//",
                    edgecolor="black",
                    linewidth=0,
                    label="of which: the worker pre-faulting the pool",
                )
    baseline = report.get("baseline_ready_s_stats")
    if baseline is not None:
        ax.axhline(
            baseline["median"],
            color=NEUTRAL_COLOR,
            linestyle="--",
            linewidth=1,
            label=f"vLLM without a connector: {baseline['median']:.1f} s",
        )
    scaling = report.get("scaling")
    if scaling and scaling.get("pool_gib_for_seed_ratio"):
        ax.text(
            0.99,
            0.97,
            f"embedded start: at least +{scaling['lowest_extra_s_per_gib']:.2f} s per GiB of pool\n"
            f"at that rate the seed's 2.15x needs P = {scaling['pool_gib_for_seed_ratio']:.0f} GiB;\n"
            f"at the seed's 500 GiB: {scaling['predicted_ratio_at_seed_pool']:.1f}x",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7,
        )
    ax.set_ylim(0, ax.get_ylim()[1] * 1.5)  # room for the legend above the bars
    ax.set_xticks(range(len(sizes)), [f"{s / GIB:.0f} GiB" for s in sizes])
    ax.set_xlabel("host KV pool size P")
    ax.set_ylabel("vLLM time to ready (s), median")
    ratios = [report["ratio_by_size"][str(s)] for s in sizes]
    ax.set_title(
        "vLLM startup with a host KV pool: "
        + ", ".join(f"{s / GIB:.0f} GiB {r:.2f}x" for s, r in zip(sizes, ratios, strict=True) if r)
    )
    ax.legend(loc="upper left", fontsize=7)
    _save(fig, path)


def remote_read_figure(report: dict, path: pathlib.Path) -> None:
    """Like the seed's figure 5: per-pull effective throughput of >= 1 GiB prefixes pulled by node B
    from node A (mean, P99, peak) next to same-run iperf3, the ratios put on the seed's NICs, and the
    TTFT of one prompt served by a remote hit, a local DRAM hit and recompute."""
    pulls = (report.get("pulls") or {}).get("by_streams") or {}
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6))
    ax = axes[0]
    colors = [SHARED_COLOR, ISOLATED_COLOR, "#2f855a", "#6b46c1"]
    x0 = 0
    for k, (streams, raw) in enumerate(pulls.items()):
        color = colors[k % len(colors)]
        for r in raw["rounds"]:
            xs = list(range(x0, x0 + len(r["pulls"])))
            ax.scatter(xs, [p["gbps"] or 0 for p in r["pulls"]], color=color, s=22, zorder=3)
            if r["iperf3"]:
                ax.hlines(r["iperf3"]["gbps"], xs[0] - 0.4, xs[-1] + 0.4, color=NEUTRAL_COLOR, linewidth=3)
            x0 += len(r["pulls"])
        s = (raw.get("stats") or {}).get("pull_gbps")
        if s:
            for key, style in (("mean", "-"), ("p99", "--"), ("peak", ":")):
                ax.axhline(
                    s[key],
                    color=color,
                    linestyle=style,
                    linewidth=1,
                    label=f"{streams} streams {key} {s[key]:.2f}",
                )
        x0 += 1
    ax.plot([], [], color=NEUTRAL_COLOR, linewidth=3, label="iperf3, same streams, that round")
    ax.set_xlabel("pull (in order; rounds of iperf3 then pulls)")
    ax.set_ylabel("effective GB/s (bytes / LOOKUP to all readable)")
    size = next(iter(pulls.values()))["pools"]["b"] / GIB if pulls else 0
    ax.set_title(f"{size:g} GiB prefix pulls, B <- A, through pegaflow-server", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[1]
    width = 0.38
    keys = ("mean", "p99", "peak")
    for k, (streams, raw) in enumerate(pulls.items()):
        st = raw.get("stats") or {}
        pull, base = st.get("pull_gbps"), st.get("iperf3_gbps")
        if not pull:
            continue
        xs = [i + k * (len(keys) + 1) for i in range(len(keys))]
        bars = ax.bar([x - width / 2 for x in xs], [pull[key] for key in keys], width, color=SHARED_COLOR)
        _label_bars(ax, bars, "{:.2f}")
        if base:
            bb = ax.bar([x + width / 2 for x in xs], [base[key] for key in keys], width, color=NEUTRAL_COLOR)
            _label_bars(ax, bb, "{:.2f}")
        ax.set_xticks(xs, [f"{key}\n{streams} str." for key in keys], fontsize=8)
        ratio = st.get("round_ratio")
        if ratio:
            ax.annotate(
                f"round ratio to iperf3: median {ratio['median']:.0%}, worst {ratio['worst']:.0%}\n"
                f"load1 median {st['load1']['median']:.1f}, worst {st['load1']['worst']:.1f} (2 cores)",
                (0.02, 0.97), xycoords="axes fraction", va="top", fontsize=7,
            )  # fmt: skip
    ax.legend(
        handles=[
            matplotlib.patches.Patch(color=SHARED_COLOR, label="pulls"),
            matplotlib.patches.Patch(color=NEUTRAL_COLOR, label="iperf3 (same streams, same run)"),
        ],
        fontsize=7,
        loc="lower right",
    )
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.set_title("pulls vs iperf3 (GB/s): mean, P99, peak", fontsize=10)

    ax = axes[2]
    scaled = next((raw.get("scaled") for raw in pulls.values() if raw.get("scaled")), None)
    if scaled:
        rows = scaled["rows"]
        xs = list(range(len(keys)))
        label = "ours: ratio to iperf3 x line rate (capped at it)"
        ours = ax.bar([x - width / 2 for x in xs], [rows[key]["scaled_gbps"] for key in keys], width,
                      color=SHARED_COLOR, label=label)  # fmt: skip
        seed = ax.bar([x + width / 2 for x in xs], [rows[key]["seed_gbps"] for key in keys], width,
                      color=ISOLATED_COLOR, label="seed (RDMA READ, production)")  # fmt: skip
        _label_bars(ax, ours, "{:.0f}")
        _label_bars(ax, seed, "{:.0f}")
        ax.set_xticks(xs, keys)
        cores = scaled["cores_needed_at_line_rate"]
        ax.annotate(
            "TCP here would need at 400 GB/s:\n"
            + "\n".join(f"{n}: {c:.0f} cores" for n, c in cores.items() if "client" not in n),
            (0.02, 0.97), xycoords="axes fraction", va="top", fontsize=7,
        )  # fmt: skip
        ax.set_ylim(0, max(scaled["line_gbps"], ax.get_ylim()[1]) * 1.3)
        ax.axhline(scaled["line_gbps"], color="black", linestyle=":", linewidth=1)
        ax.legend(fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no iperf3 baseline in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("scaled to 8 x 400 Gbit/s (GB/s; line rate dotted)", fontsize=10)

    ax = axes[3]
    ttft = report.get("ttft_per_prompt")
    skipped = (report.get("ttft") or {}).get("skipped")
    if ttft:
        arms = ("recompute", "remote", "local")
        med = [ttft["median_ttft_s"][a] * 1e3 for a in arms]
        bars = ax.bar(arms, med, color=[ISOLATED_COLOR, SHARED_COLOR, NEUTRAL_COLOR])
        _label_bars(ax, bars, "{:.0f} ms")
        for i, a in enumerate(arms):
            ax.scatter([i] * len(ttft["per_prompt"]), [p["ttft_s"][a] * 1e3 for p in ttft["per_prompt"]],
                       color="black", s=8, zorder=3)  # fmt: skip
        ax.set_yscale("log")
        r = ttft["remote_over_local"]
        note = f"remote / local: median {r['median']:.2f}x, worst {r['worst']:.2f}x (target <= 1.5x)"
        if not ttft["remote_hit_used"]:
            note += (
                "\nremote = B's FIRST request: it computed (no wait\nfor the pull); the pull served 'local'"
            )
        extra, fetch = ttft.get("remote_minus_local_s"), ttft.get("b_mean_fetch_s_during_remote")
        if extra and fetch:
            note += f"\nremote - local: median {extra['median'] * 1e3:.0f} ms; the fetch {fetch * 1e3:.0f} ms"
        diff = ttft.get("max_logprob_diff_to_recompute")
        note += (
            f"\ntokens identical: {ttft['tokens_identical']}; logprobs within {diff or 0:.4f} of recompute's"
        )
        ax.annotate(note, (0.02, 0.97), xycoords="axes fraction", va="top", fontsize=7)
        ax.set_ylim(top=ax.get_ylim()[1] * 8)
        ax.set_ylabel("TTFT (ms), median; dots: each prompt")
    else:
        ax.text(0.5, 0.5, "vLLM part " + ("skipped:\n" + _wrap(skipped) if skipped else "not run"),
                ha="center", va="center", transform=ax.transAxes, fontsize=7)  # fmt: skip
    ax.set_title("TTFT: recompute (A), remote hit, local hit (B)", fontsize=10)
    fig.suptitle(
        "remote read: two pegaflow nodes in network namespaces, TCP over one veth pair, 2 shared cores"
    )
    _save(fig, path)


def _wrap(text: str, width: int = 60) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))
