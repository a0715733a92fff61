"""Startup: vLLM's time to ready when a host KV pool of P GiB is owned by the vLLM worker itself
(the connector's embedded mode: allocated and pre-faulted during worker start-up) versus when a
running pegaflow-server already owns it (the worker only maps it).

    python -m pegaflow.bench.experiments.startup --out bench/results            # P = 4, 8, 16 GiB
    python -m pegaflow.bench.experiments.startup --sizes-gib 8 --runs 2         # shorter

Per pool size: pegaflow-server is started once (its own start, pool pre-fault included, is
recorded but is not on vLLM's path), then vLLM is started `--runs` times against it; then vLLM is
started `--runs` times with an embedded pool of the same size. Plain vLLM without a connector is
timed too, as the floor. Time to ready is launch -> /v1/models answers 200; every run is checked
with one completion. Medians are reported. The largest P is what this machine's free memory
allows: vLLM itself needs ~2.5 GiB, the pool P (embedded or in the server, never both at once),
plus a margin; the run refuses sizes that do not fit instead of swapping.

The pool's pre-fault time is recorded for both owners (the server's ready line; the embedded
engine's pegaflow_pool_prefault_seconds, read from its /metrics): it is what the embedded mode
adds to vLLM's start, and on this VM first touch of fresh memory ranges from ~0.5 to ~20 s/GiB
depending on what the host has already backed (8 GiB once took 166 s), so it explains the spread.

What the embedded mode costs grows with P while the server-owned start does not, so the ratio
depends on P. `derive` reports the embedded start's extra seconds per GiB at each size and, at the
lowest of those rates, the pool size at which the seed's 2.15x would be reached and the ratio at the
seed's 500 GiB: the limit on this machine is how much memory it has, not the mechanism.

    python -m pegaflow.bench.experiments.startup --redraw bench/results/startup.json
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import statistics
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from pegaflow.bench.experiments import common
from pegaflow.bench.experiments.common import GIB, MIB, say
from pegaflow.bench.harness import connector_config, loadgen, models, plots, results
from pegaflow.bench.harness.pegaflow_proc import PegaflowServerProcess
from pegaflow.bench.harness.procs import mem_available_bytes
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig, VllmFleet
from pegaflow.tools.vllm_cpu.launcher import VllmServer

MODES = ("server", "embedded")
# PSS of one tiny-model vLLM tree with a 256 MiB KV cache is ~1.7 GiB (recipes/vllm-cpu.md); the
# rest is headroom for page cache and the other processes of the machine.
VLLM_FOOTPRINT_BYTES = 3 * GIB
SEED_RATIO = 71.4 / 33.2  # the seed's figure 2: 2.15x, with a pool of ~500 GiB
SEED_POOL_GIB = 500


@dataclasses.dataclass(frozen=True)
class Setup:
    sizes_bytes: tuple[int, ...] = (4 * GIB, 8 * GIB, 16 * GIB)
    runs: int = 3
    baseline: bool = True
    vllm_kv_cache_bytes: int = 256 * MIB
    max_model_len: int = 4096
    placement: CpuPlacement = CpuPlacement()
    ready_timeout_s: float = 600.0
    server_args: tuple[str, ...] = ()
    modes: tuple[str, ...] = ("server", "embedded")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def stats_of(values: list[float]) -> dict:
    return {
        "runs": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def check_memory(setup: Setup) -> dict:
    available = mem_available_bytes()
    need = max(setup.sizes_bytes) + VLLM_FOOTPRINT_BYTES
    if need > available:
        fit = (available - VLLM_FOOTPRINT_BYTES) // GIB
        raise SystemExit(
            f"startup: a {max(setup.sizes_bytes) / GIB:.0f} GiB pool needs ~{need / GIB:.1f} GiB free "
            "with vLLM, "
            f"{available / GIB:.1f} GiB are available: the largest size that fits now is ~{fit} GiB "
            "(stop other memory users, or pass --sizes-gib)"
        )
    return {"mem_available_bytes": available, "needed_bytes": need}


def time_vllm(
    config: VllmConfig,
    run_dir: pathlib.Path,
    timeout_s: float,
    pool_metrics: Callable[[VllmServer], str] | None = None,
) -> dict:
    """One cold start of one vLLM: seconds to ready, memory at ready, one completion as proof, and
    (embedded mode, `pool_metrics(vllm)` = its /metrics address once ready) how long the worker's
    pool pre-fault took."""
    with VllmFleet([config], run_dir) as fleet:
        (ready_s,) = fleet.start(timeout_s)
        metrics_addr = pool_metrics(fleet.servers[0]) if pool_metrics else None
        memory = fleet.memory()[0]
        prefault_s = embedded_prefault_s(metrics_addr) if metrics_addr else None
        loadgen.run_warmup(fleet.endpoints, config.served_model_name)
    return {"ready_s": ready_s, "memory_at_ready": memory, "pool_prefault_s": prefault_s}


def time_embedded_vllm(base: VllmConfig, size: int, run_dir: pathlib.Path, timeout_s: float) -> dict:
    """One cold start of vLLM with an embedded pool of `size` bytes (time_vllm's numbers), its
    server's gRPC and metrics ports bound at 0 and read where it published them."""
    engine_id = f"pegaflow-startup-{uuid.uuid4().hex[:12]}"
    kv = connector_config.embedded_pool(size, metrics_addr="127.0.0.1:0", engine_id=engine_id)
    config = dataclasses.replace(base, kv_transfer_config=kv)
    metrics_addr = functools.partial(connector_config.embedded_address, engine_id, metrics=True)
    return time_vllm(config, run_dir, timeout_s, metrics_addr)


def embedded_prefault_s(metrics_addr: str) -> float | None:
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "pegaflow_pool_prefault_seconds" and family.samples:
            return float(family.samples[0].value)
    return None


def server_owned_runs(setup: Setup, base: VllmConfig, size: int, workdir: pathlib.Path) -> tuple[dict, dict]:
    """pegaflow-server started once with the pool; then vLLM cold-started `runs` times against it."""
    gib = size / GIB
    server = PegaflowServerProcess(
        size,
        workdir / f"server-{gib:.0f}g",
        extra_args=setup.server_args,
        ready_timeout_s=setup.ready_timeout_s,
    )
    try:
        server_ready = server.start()
        say(f"P={gib:.0f} GiB: pegaflow-server ready in {server_ready:.1f} s (pool pre-faulted)")
        shared = dataclasses.replace(base, kv_transfer_config=connector_config.shared_pool(server.addr))
        runs = []
        for r in range(setup.runs):
            runs.append(time_vllm(shared, workdir / f"server-{gib:.0f}g-{r}", setup.ready_timeout_s))
            say(f"P={gib:.0f} GiB server-owned run {r}: vLLM ready in {runs[-1]['ready_s']:.1f} s")
    finally:
        server.stop()
    start = {"ready_s": server_ready, "ready_line": server.ready_info}
    return {"runs": runs, "ready_s_stats": stats_of([x["ready_s"] for x in runs])}, start


def embedded_runs(setup: Setup, base: VllmConfig, size: int, workdir: pathlib.Path) -> dict:
    """vLLM cold-started `runs` times, its worker allocating and pre-faulting the pool itself."""
    gib = size / GIB
    runs = []
    for r in range(setup.runs):
        runs.append(
            time_embedded_vllm(base, size, workdir / f"embedded-{gib:.0f}g-{r}", setup.ready_timeout_s)
        )
        say(
            f"P={gib:.0f} GiB embedded run {r}: vLLM ready in {runs[-1]['ready_s']:.1f} s "
            f"(the worker's pool pre-fault: {runs[-1]['pool_prefault_s']} s of it)"
        )
    stats = {"runs": runs, "ready_s_stats": stats_of([x["ready_s"] for x in runs])}
    prefaults = [x["pool_prefault_s"] for x in runs if x["pool_prefault_s"] is not None]
    if prefaults:
        stats["pool_prefault_s_stats"] = stats_of(prefaults)
    return stats


def run(setup: Setup, workdir: pathlib.Path, model_cache: pathlib.Path | None = None) -> dict:
    memory_check = check_memory(setup)
    model_dir = str(models.ensure_model(models.BENCH_MODEL, model_cache))
    base = VllmConfig(
        model=model_dir,
        max_model_len=setup.max_model_len,
        kv_cache_bytes=setup.vllm_kv_cache_bytes,
        placement=setup.placement,
    )
    report = {
        "experiment": "startup",
        "setup": setup.to_dict(),
        "machine": results.machine_info(),
        "memory_check": memory_check,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pool_sizes_bytes": list(setup.sizes_bytes),
        "modes": {"embedded": {}, "server": {}},
        "server_start": {},
        "ratio_by_size": {},
    }
    if setup.baseline:
        runs = []
        for r in range(setup.runs):
            runs.append(time_vllm(base, workdir / f"baseline-{r}", setup.ready_timeout_s))
            say(f"baseline run {r}: ready in {runs[-1]['ready_s']:.1f} s")
        report["baseline_runs"] = runs
        report["baseline_ready_s_stats"] = stats_of([x["ready_s"] for x in runs])

    for size in setup.sizes_bytes:
        key = str(size)
        if "server" in setup.modes:
            report["modes"]["server"][key], report["server_start"][key] = server_owned_runs(
                setup, base, size, workdir
            )
        if "embedded" in setup.modes:
            report["modes"]["embedded"][key] = embedded_runs(setup, base, size, workdir)
        if set(MODES) <= set(setup.modes):
            emb = report["modes"]["embedded"][key]["ready_s_stats"]["median"]
            srv = report["modes"]["server"][key]["ready_s_stats"]["median"]
            report["ratio_by_size"][key] = emb / srv
            say(f"P={size / GIB:.0f} GiB: embedded {emb:.1f} s vs server-owned {srv:.1f} s: {emb / srv:.2f}x")
    return report


def derive(report: dict) -> None:
    """What the embedded start costs per GiB of pool at each size measured, and what the lowest
    of those rates implies for larger pools (a conservative extrapolation: the rate here grows
    with P once the VM's host has to back fresh memory): report["scaling"]."""
    sizes = [int(k) for k in report["ratio_by_size"]]
    if not sizes:
        return
    server = statistics.median(
        report["modes"]["server"][str(size)]["ready_s_stats"]["median"] for size in sizes
    )
    per_gib = {}
    for size in sizes:
        extra = (
            report["modes"]["embedded"][str(size)]["ready_s_stats"]["median"]
            - report["modes"]["server"][str(size)]["ready_s_stats"]["median"]
        )
        prefault = report["modes"]["embedded"][str(size)].get("pool_prefault_s_stats", {}).get("median")
        per_gib[str(size >> 30)] = {
            "embedded_extra_s_per_gib": extra / (size / GIB),
            "prefault_s_per_gib": None if prefault is None else prefault / (size / GIB),
        }
    rate = min(v["embedded_extra_s_per_gib"] for v in per_gib.values())
    scaling = {
        "server_owned_ready_s_median": server,
        "by_pool_gib": per_gib,
        "lowest_extra_s_per_gib": rate,
        "largest_pool_gib": max(sizes) / GIB,
    }
    if rate > 0:
        scaling["pool_gib_for_seed_ratio"] = server * (SEED_RATIO - 1) / rate
        scaling["predicted_ratio_at_seed_pool"] = 1 + rate * SEED_POOL_GIB / server
    report["scaling"] = scaling


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    ap.add_argument(
        "--out", type=pathlib.Path, help="where startup.json and startup.png go (default: the workdir)"
    )
    ap.add_argument("--workdir", help="logs (default: a fresh temp folder)")
    ap.add_argument("--model-cache", type=pathlib.Path, help="tiny model cache folder")
    ap.add_argument(
        "--sizes-gib", default="4,8,16", help="comma-separated pool sizes in GiB (default 4,8,16)"
    )
    ap.add_argument("--runs", type=int, default=3, help="cold starts per mode and size (default 3)")
    ap.add_argument("--no-baseline", action="store_true", help="skip timing vLLM without a connector")
    ap.add_argument("--modes", default=",".join(MODES), help="pool owners to time (default: %(default)s)")
    ap.add_argument(
        "--redraw", type=pathlib.Path, help="recompute the derived numbers and the figure of a saved JSON"
    )
    args = ap.parse_args(argv)
    if args.redraw is not None:
        common.redraw(args.redraw, derive, plots.startup_figure)
        return 0
    try:
        sizes = tuple(int(float(x) * GIB) for x in args.sizes_gib.split(",") if x.strip())
    except ValueError:
        ap.error(f"--sizes-gib: expected numbers like 4,8,16, got {args.sizes_gib!r}")
    if not sizes or min(sizes) <= 0 or args.runs < 1:
        ap.error("--sizes-gib needs positive sizes and --runs must be >= 1")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: choose from {', '.join(MODES)}, got {args.modes!r}")
    setup = Setup(
        sizes_bytes=sizes,
        runs=args.runs,
        baseline=not args.no_baseline,
        modes=modes,
    )
    workdir = common.make_workdir(args.workdir, "startup")
    out = args.out or workdir
    report = run(setup, workdir, args.model_cache)
    derive(report)
    results.write_json(out / "startup.json", report)
    if report["ratio_by_size"]:
        plots.startup_figure(report, out / "startup.png")
    say(f"wrote {out / 'startup.json'}" + (" and startup.png" if report["ratio_by_size"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
