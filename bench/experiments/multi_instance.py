"""Multi-instance sharing: N real vLLM-CPU instances behind a random load balancer, with one total
KV budget B, either as one pool shared through pegaflow-server ("shared") or as N pools of B/N
embedded in each vLLM worker ("isolated"). Same trace, same model, same CPU placement.

    python -m pegaflow.bench.experiments.multi_instance --out bench/results      # full (~20 min)
    python -m pegaflow.bench.experiments.multi_instance --regression             # reduced check, 2 instances

Choosing B. The trace is replayed through an LRU model of both layouts first (bench.harness.
cachesim). B is the smallest shared pool whose replay reaches `budget_fraction` (90 %) of the hit
rate an unbounded pool gets: the shared pool then holds the trace's hot working set (the hot
system prompts plus the histories of the sessions in flight), while each isolated pool of B/N
cannot, although every instance sees every system prompt and most sessions (no affinity). The
simulated hit rates of both layouts are recorded next to the measured ones.

The regression (`--regression`, what `bazel test //bench:multi_instance` runs) fails if any
request fails or if the shared pool's block hit rate does not beat the isolated pools' by at least
REGRESSION_MIN_GAP. Why that cannot flake: the trace is fixed (seeded), requests are replayed one
at a time in trace order (one locust user) with a pause after each for the asynchronous save to
land, and the connector's lookup/load deadlines are raised so a slow machine turns no hit into a
miss. Which blocks a pool holds at each lookup then depends only on the trace and the LRU policy,
not on timing. The LRU model predicts 0.75 vs 0.43 (gap 0.32); a run measured 0.752 vs 0.411, and
the threshold asks for less than two thirds of that gap.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import uuid

from pegaflow.bench.experiments import ab, common
from pegaflow.bench.experiments.common import GIB, MIB, Stopwatch, say, window_covering
from pegaflow.bench.harness import cachesim, connector_config, models, plots, results, traces
from pegaflow.bench.harness.pegaflow_proc import PegaflowServerProcess, get_stats
from pegaflow.bench.harness.procs import machine_busy_cpu_seconds, mem_available_bytes
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig, VllmFleet
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec

ARMS = ("shared", "isolated")
ALL_ARMS = ("shared", "isolated", "isolated-servers")
REGRESSION_MIN_GAP = 0.2
MIN_INSTANCES, MAX_INSTANCES = 3, 8
# Left free for the pool(s), pegaflow-server, locust, page cache and the rest of the machine.
MEMORY_HEADROOM = 3 * GIB


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    num_instances: int
    trace: traces.TraceSpec
    model: TinyModelSpec = models.BENCH_MODEL
    users: int = 8  # concurrent closed-loop users across the fleet
    think_time_s: float = 0.0
    budget_fraction: float = 0.9
    budget_bytes: int | None = None  # explicit B; None: chosen from the trace (see module doc)
    vllm_kv_cache_bytes: int = 512 * MIB
    max_model_len: int = 8192
    connector_timeouts: tuple[tuple[str, int], ...] = common.SLOW_MACHINE_CONNECTOR_TIMEOUTS
    placement: CpuPlacement = CpuPlacement()
    ready_timeout_s: float = 600.0
    max_run_s: float = 3600.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["connector_timeouts"] = dict(self.connector_timeouts)
        return d


FULL = Setup(
    name="full",
    num_instances=4,
    trace=traces.TraceSpec(
        seed=0,
        num_requests=600,
        num_system_prompts=8,
        system_prompt_tokens=2000,
        system_zipf=1.0,
        concurrent_sessions=24,
        turns_min=2,
        turns_max=6,
        user_turn_tokens=200,
        assistant_turn_tokens=100,
        one_off_share=0.1,
        one_off_tokens=2000,
        max_tokens=16,
        max_prompt_tokens=8000,
    ),
    users=8,
)

REGRESSION = Setup(
    name="regression",
    num_instances=2,
    trace=traces.TraceSpec(
        seed=0,
        num_requests=64,
        num_system_prompts=4,
        system_prompt_tokens=768,
        system_zipf=1.0,
        concurrent_sessions=6,
        turns_min=2,
        turns_max=4,
        user_turn_tokens=96,
        assistant_turn_tokens=32,
        one_off_share=0.1,
        one_off_tokens=512,
        max_tokens=4,
        max_prompt_tokens=2048,
    ),
    users=1,
    think_time_s=0.3,
    vllm_kv_cache_bytes=256 * MIB,
    max_model_len=4096,
    ready_timeout_s=480.0,
    max_run_s=600.0,
)


def instance_footprint(setup: Setup) -> int:
    """Memory of one vLLM instance tree: ~1.8 GiB of processes (PSS with a small KV cache,
    recipes/vllm-cpu.md) plus its KV cache. The pools (B in total, a few hundred MiB here) come
    out of MEMORY_HEADROOM."""
    return int(1.8 * GIB) + setup.vllm_kv_cache_bytes


def instances_that_fit(setup: Setup, available: int | None = None) -> int:
    """As many instances as free memory holds (the seed ran 8), at least MIN_INSTANCES."""
    available = mem_available_bytes() if available is None else available
    fit = (available - MEMORY_HEADROOM) // instance_footprint(setup)
    return int(max(MIN_INSTANCES, min(MAX_INSTANCES, fit)))


def plan_budget(setup: Setup, blocks: list[cachesim.RequestBlocks], block_bytes: int) -> dict:
    """Pool sizes for both arms plus what the LRU replay predicts for them."""
    n = setup.num_instances
    if setup.budget_bytes is not None:
        per_instance = setup.budget_bytes // n
        target_blocks = None
    else:
        target_blocks = cachesim.budget_for_shared_hit_rate(blocks, setup.budget_fraction)
        per_instance = models.smallest_pool_for_blocks(math.ceil(target_blocks / n), block_bytes)
    shared_bytes = per_instance * n
    shared_capacity = models.pool_capacity_blocks(shared_bytes, block_bytes)
    isolated_capacity = models.pool_capacity_blocks(per_instance, block_bytes)
    if isolated_capacity == 0:
        raise ValueError(f"an isolated pool of {per_instance} bytes holds no block of {block_bytes} bytes")
    one_pool = [dataclasses.replace(b, instance_route=0) for b in blocks]
    sim_shared = cachesim.simulate(one_pool, 1, shared_capacity)
    sim_isolated = cachesim.simulate(blocks, n, isolated_capacity)
    ceiling = cachesim.exact_ceiling(blocks)
    return {
        "rule": None
        if target_blocks is None
        else f"smallest shared pool reaching {setup.budget_fraction:.0%} of an unbounded pool's LRU hit rate",
        "target_blocks": target_blocks,
        "block_bytes": block_bytes,
        "shared_pool_bytes": shared_bytes,
        "isolated_pool_bytes": per_instance,
        "shared_capacity_blocks": shared_capacity,
        "isolated_capacity_blocks_each": isolated_capacity,
        "trace_distinct_blocks": ceiling.distinct,
        "trace_block_lookups": ceiling.lookups,
        "exact_ceiling": ceiling.ceiling,
        "isolated_exact_ceilings": [c.ceiling for c in cachesim.per_instance_ceilings(blocks, n)],
        "unbounded_shared_lru": cachesim.simulate(one_pool, 1, ceiling.distinct).to_dict(),
        "lru_model": {"shared": sim_shared.to_dict(), "isolated": sim_isolated.to_dict()},
    }


def _pool_layout(arm: str, setup: Setup, budget: dict) -> tuple[int, int, bool]:
    """(number of pools, bytes per pool, owned by pegaflow-server processes?) of an arm."""
    n = setup.num_instances
    if arm == "shared":
        return 1, budget["shared_pool_bytes"], True
    if arm == "isolated":
        return n, budget["isolated_pool_bytes"], False
    if arm == "isolated-servers":
        return n, budget["isolated_pool_bytes"], True
    raise ValueError(f"unknown arm {arm!r}; known: shared, isolated, isolated-servers")


def _cpu_snapshot(fleet: VllmFleet, servers: list[PegaflowServerProcess]) -> dict:
    return {
        "vllm": fleet.cpu_seconds(),
        "servers": [s.cpu_seconds() for s in servers],
        "machine_busy": machine_busy_cpu_seconds(),
    }


def _cpu_delta(before: dict, after: dict, locust_summary: dict) -> dict:
    """Where the machine's CPU went while the trace ran: our vLLM trees, pegaflow-servers, the
    locust process, and everything else on the machine (other users of a shared box)."""
    vllm = [a - b for a, b in zip(after["vllm"], before["vllm"], strict=True)]
    servers = [a - b for a, b in zip(after["servers"], before["servers"], strict=True)]
    # locust started after the "before" snapshot and exited before "after": its whole life counts.
    load = locust_summary["process_cpu_user_s"] + locust_summary["process_cpu_system_s"]
    busy = after["machine_busy"] - before["machine_busy"]
    return {
        "vllm_total": sum(vllm),
        "vllm_per_instance": vllm,
        "pegaflow_servers": sum(servers),
        "locust": load,
        "machine_busy": busy,
        "other_processes": busy - sum(vllm) - sum(servers) - load,
    }


def run_arm(
    arm: str,
    setup: Setup,
    model_dir: pathlib.Path,
    trace: traces.Trace,
    budget: dict,
    workdir: pathlib.Path,
) -> ab.ArmReport:
    """One layout of the budget, end to end: pools up, fleet up, warm-up, trace, scrape, all down.

    shared: one pegaflow-server of B, every instance attached to it. isolated: each vLLM worker
    owns an embedded pool of B/N. isolated-servers: one pegaflow-server of B/N per instance (the
    same isolation without the embedded mode: separates the effect of sharing from the process
    boundary)."""
    n = setup.num_instances
    arm_dir = workdir / arm
    timeouts = dict(setup.connector_timeouts)
    pools, pool_bytes, server_owned = _pool_layout(arm, setup, budget)
    clock = Stopwatch()
    servers: list[PegaflowServerProcess] = []
    engine_ids: list[str] = []
    try:
        if server_owned:
            for k in range(pools):
                servers.append(
                    PegaflowServerProcess(
                        pool_bytes, arm_dir, name=f"pegaflow-server{k}", ready_timeout_s=setup.ready_timeout_s
                    )
                )
            server_ready_s = [s.start() for s in servers]
            say(f"{arm}: {pools} pegaflow-server(s) of {pool_bytes / MIB:.0f} MiB ready")
            kv_configs = [connector_config.shared_pool(servers[i % pools].addr, timeouts) for i in range(n)]
        else:
            server_ready_s = []
            # Each embedded engine serves its GetStats on a port it binds itself (port 0) and publishes
            # under its engine id, read before the fleet stops. A port picked here beforehand was once
            # taken first by another process (CI: a GetStats to it ran past its deadline).
            engine_ids = [f"pegaflow-mi-{arm}-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
            kv_configs = [
                connector_config.embedded_pool(pool_bytes, timeouts, "127.0.0.1:0", engine_id=engine_id)
                for engine_id in engine_ids
            ]
        vcfgs = [
            VllmConfig(
                model=str(model_dir),
                max_model_len=setup.max_model_len,
                kv_cache_bytes=setup.vllm_kv_cache_bytes,
                kv_transfer_config=kv,
                placement=setup.placement,
                block_tokens=models.CPU_BLOCK_TOKENS,
            )
            for kv in kv_configs
        ]

        def pools_after(fleet: VllmFleet) -> tuple[dict, list[dict], list[dict]]:
            cpu = _cpu_snapshot(fleet, servers)
            stats = [s.stats() for s in servers] or [
                get_stats(connector_config.embedded_address(engine_id, server))
                for engine_id, server in zip(engine_ids, fleet.servers, strict=True)
            ]
            return cpu, stats, [s.memory() for s in servers]

        run = ab.replay_on_fleet(
            arm, setup, vcfgs, trace, arm_dir, before=lambda f: _cpu_snapshot(f, servers), after=pools_after
        )
    finally:
        for s in servers:
            s.stop()
    cpu_after, pool_stats, server_memory = run.after
    records = run.load.records
    measured = {
        "by_instance": _as_dicts(results.summarize_by(records, "instance", models.CPU_BLOCK_TOKENS)),
        "by_kind": _as_dicts(results.summarize_by(records, "kind", models.CPU_BLOCK_TOKENS)),
        "vllm_counters_delta": run.counters_delta,
        "vllm_memory": run.memory,
        "locust": run.load.summary,
        "locust_exit_code": run.load.locust_exit_code,
        "cpu_seconds_during_trace": _cpu_delta(run.before, cpu_after, run.load.summary),
        "wall_s": clock.elapsed(),
    }
    if pool_stats:
        measured["pool_stats"] = pool_stats
        measured["server_memory"] = server_memory
        window = window_covering(pool_stats[0].get("measured_hit_rate", {}), clock.elapsed())
        measured["hll_window"] = window
        # Per pool: the ceiling of the block stream that pool saw, next to its measured hit rate.
        measured["hll_ceiling_per_pool"] = [st.get("hll_ceiling", {}).get(window) for st in pool_stats]
        measured["pool_hit_rate_per_pool"] = [
            st.get("measured_hit_rate", {}).get(window) for st in pool_stats
        ]
        if pools == 1:
            measured["hll_ceiling"] = measured["hll_ceiling_per_pool"][0]
            measured["pool_hit_rate"] = measured["pool_hit_rate_per_pool"][0]
    started = {
        "pools": pools,
        "pool_bytes_each": pool_bytes,
        "pool_owner": "pegaflow-server" if server_owned else "vllm-worker (embedded)",
        "kv_transfer_configs": kv_configs,
        "server_ready_s": server_ready_s,
        "vllm_ready_s": run.ready_s,
    }
    summary = results.summarize_requests(records, models.CPU_BLOCK_TOKENS)
    return ab.ArmReport(arm, started, summary, measured, records)


def _as_dicts(summaries: dict[str, results.RequestSummary]) -> dict[str, dict]:
    return {k: v.to_dict() for k, v in summaries.items()}


def run(
    setup: Setup,
    workdir: pathlib.Path,
    model_cache: pathlib.Path | None = None,
    arms: tuple[str, ...] = ARMS,
) -> ab.ABReport:
    say(f"multi_instance[{setup.name}]: workdir {workdir}")
    model_dir = models.ensure_model(setup.model, model_cache)
    trace = traces.generate(setup.trace)
    blocks = cachesim.trace_blocks(trace, models.CPU_BLOCK_TOKENS)
    block_bytes = models.block_bytes(setup.model)
    budget = plan_budget(setup, blocks, block_bytes)
    say(
        f"trace {trace.summary()['fingerprint'][:12]}: {len(trace)} requests, "
        f"{budget['trace_distinct_blocks']} distinct blocks; B = {budget['shared_pool_bytes'] / MIB:.0f} MiB "
        f"({budget['shared_capacity_blocks']} blocks) shared vs {setup.num_instances} x "
        f"{budget['isolated_pool_bytes'] / MIB:.0f} MiB ({budget['isolated_capacity_blocks_each']} blocks); "
        f"LRU model block hit rate {budget['lru_model']['shared']['block_hit_rate']:.3f} vs "
        f"{budget['lru_model']['isolated']['block_hit_rate']:.3f}"
    )
    report = ab.ABReport.start("multi_instance", setup.to_dict(), model_dir, trace, budget)
    EXPERIMENT.run_arms(report, arms, lambda arm: run_arm(arm, setup, model_dir, trace, budget, workdir))
    return report


def derive(report: ab.ABReport) -> None:
    """Where the vLLM CPU time went (report["cpu_model"]), to say what bounds the throughput gain.

    Both arms serve the same requests; they differ in how many prompt tokens vLLM computes. With
    CPU seconds = requests x a + computed prompt tokens x b, the two arms give a (the fixed cost
    of a request: decoding, scheduling, HTTP) and b (prefill per token). A pool can only remove
    prefill, so the gain it can buy is bounded by the fixed share; `prefill_only_gain` is what
    the same hit rates would give if requests cost prefill alone (long prompts, large models)."""
    baseline = COMPARISON.baseline_in(report.arms)
    if "shared" not in report.arms or baseline is None:
        return
    rows = []
    for arm in (report.arms["shared"], report.arms[baseline]):
        s, cpu = arm.summary, arm.measured.get("cpu_seconds_during_trace") or {}
        if not cpu.get("vllm_total"):
            return
        rows.append((s.succeeded, s.prompt_tokens - s.cached_tokens, cpu["vllm_total"]))
    (n1, t1, c1), (n2, t2, c2) = rows
    det = n1 * t2 - n2 * t1
    if det == 0:
        return
    per_request = (c1 * t2 - c2 * t1) / det
    per_token = (n1 * c2 - n2 * c1) / det
    report.sections["cpu_model"] = {
        "vllm_cpu_s": {"shared": c1, baseline: c2},
        "computed_prompt_tokens": {"shared": t1, baseline: t2},
        "fixed_cpu_s_per_request": per_request,
        "prefill_cpu_s_per_token": per_token,
        "fixed_share_of_cpu": {"shared": n1 * per_request / c1, baseline: n2 * per_request / c2},
        "prefill_only_gain": (t2 / t1 - 1) if t1 else None,
    }


# Shared vs the embedded pools (or, when only they ran, one server of B/N per instance).
COMPARISON = ab.ArmComparison(
    treatment="shared",
    baselines=("isolated", "isolated-servers"),
    min_gap=REGRESSION_MIN_GAP,
    baseline_label="isolated_arm",
    treatment_says="shared",
    baseline_says="the isolated pools'",
    model_arms=("shared", "isolated"),
    pass_names=("shared", None),
    missing_arms="the regression needs the shared arm and an isolated arm",
)
EXPERIMENT = ab.ABExperiment("multi_instance", COMPARISON, plots.multi_instance_figure, derive)


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    ap.add_argument("--regression", action="store_true", help="the reduced 2-instance check")
    ap.add_argument(
        "--instances",
        default="auto",
        help="number of vLLM instances; auto: as many as free memory holds, 3..8 (regression: 2)",
    )
    common.add_trace_overrides(ap, budget_help="total pool budget B in MiB (default: from the trace)")
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma-separated layouts to run, from {', '.join(ALL_ARMS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--redraw", type=pathlib.Path, help="recompute the derived numbers and the figure of a saved JSON"
    )
    args = ap.parse_args(argv)
    if args.redraw is not None:
        EXPERIMENT.redraw(args.redraw)
        return 0

    setup = REGRESSION if args.regression else FULL
    if args.instances != "auto":
        try:
            setup = dataclasses.replace(setup, num_instances=int(args.instances))
        except ValueError:
            ap.error(f"--instances: a number or auto, got {args.instances!r}")
    elif not args.regression:
        setup = dataclasses.replace(setup, num_instances=instances_that_fit(setup))
    setup = common.apply_trace_overrides(setup, args)
    if setup.num_instances < 2:
        ap.error("--instances must be at least 2")
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if not arms or set(arms) - set(ALL_ARMS):
        ap.error(f"--arms: choose from {', '.join(ALL_ARMS)}, got {args.arms!r}")
    workdir = common.make_workdir(args.workdir, "mi")
    common.warn_if_memory_short(setup.num_instances * instance_footprint(setup) + MEMORY_HEADROOM)
    report = run(setup, workdir, args.model_cache, arms)
    return EXPERIMENT.finish(report, regression=args.regression, out=args.out or workdir)


if __name__ == "__main__":
    sys.exit(main())
