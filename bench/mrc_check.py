"""The server's online miss-ratio curve against real runs at 0.25x, 0.5x, 1x, 2x and 4x the pool.

    .venv/bin/python -m pegaflow.bench.mrc_check [--requests 600] [--seeds 0,1] [--base-pool-mib 64]

For each seed, a chat trace of the bench harness (bench/harness/traces.py: shared system prompts,
multi-turn sessions, one-off scans) is cut into blocks of 16 tokens (cachesim.block_keys) and
replayed, one request at a time, against five real `pegaflow-server` processes whose pools are
0.25x .. 4x a base size. Realistic on purpose:

* two models share the pool (requests alternate by route), with 8 KiB and 20 KiB blocks: two
  size classes of slabs, slabs moving between them, slot tails, all as the allocator does it;
* a request looks its chain up with a lease (QueryPrefix, LOOKUP, lease=True: the hits are
  pinned), saves the whole chain (AllocateBlocks: the hits come back EXISTS, the rest GRANTED),
  writes the granted blocks' bytes into the mapped pool, seals, and only then releases the lease,
  as the connector keeps a loaded prefix pinned while the continuation is saved.

The measured block hit rate of each run is the server's own counters (pegaflow_block_hits_total /
(hits + misses)). The prediction is what the 1x server exported during its run,
pegaflow_mrc_predicted_hit_rate{pool_factor, window="15m"} (the run lasts well under a window),
read from its /metrics. Target: |predicted - measured| <= 0.05 at every size. An exact offline LRU
of the same block stream (bytes, mixed sizes, no sampling) is reported beside both, to separate
the sampling error (server vs exact) from the model error (exact LRU vs the real server: prefix
rule, slabs, pins).

Also measured in the same run: the feeder's per-block cost of the MRC (MissRatioCurve.add) next
to the HLL ceiling's (HitRateCeiling.add) on the same lookups, median and worst of 5 repetitions,
and the MRC's memory. Writes bench/results/mrc_check.json and .png.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import time
import tracemalloc
import urllib.request

import numpy as np

from pegaflow.bench.harness.cachesim import block_keys
from pegaflow.bench.harness.results import machine_info, write_json
from pegaflow.bench.harness.traces import TraceSpec, generate
from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.server.metrics.hll_ceiling import HitRateCeiling
from pegaflow.server.metrics.miss_ratio_curve import EDGE_FACTORS, POOL_FACTORS, MissRatioCurve
from pegaflow.server.testing import ServerProcess

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MIB = 1 << 20
BLOCK_TOKENS = 16
MODELS = (("mrc-a", 8 * 1024), ("mrc-b", 20 * 1024))  # (model id, block bytes)
WINDOW = "15m"
TARGET_POINTS = 0.05
WINDOWS = {"15m": 900.0, "1h": 3600.0, "24h": 86400.0}


def trace_lookups(seed: int, requests: int) -> list[tuple[int, list[bytes]]]:
    """(model index, block hashes) per request, in trace order."""
    trace = generate(TraceSpec(seed=seed, num_requests=requests))
    return [(r.route % len(MODELS), block_keys(r.prompt, BLOCK_TOKENS)) for r in trace]


def engine_keys(lookups) -> tuple[list[bytes], list[int]]:
    """The block stream as the server's MRC sees it: namespace-prefixed keys, each lookup tail first."""
    keys, sizes = [], []
    for model, hashes in lookups:
        prefix = model.to_bytes(4, "little")
        keys.extend(prefix + h for h in reversed(hashes))
        sizes.extend([MODELS[model][1]] * len(hashes))
    return keys, sizes


def exact_lru(keys: list[bytes], sizes: list[int], capacity: int) -> float:
    """Byte-capacity LRU over mixed block sizes, every request an access (a miss inserts)."""
    resident: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    used = hits = 0
    for key, size in zip(keys, sizes, strict=True):
        if key in resident:
            resident.move_to_end(key)
            hits += 1
            continue
        while used + size > capacity:
            used -= resident.popitem(last=False)[1]
        resident[key] = size
        used += size
    return hits / len(keys)


def scrape(http_addr: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{http_addr}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def replay(lookups, pool_bytes: int, workdir: pathlib.Path) -> dict:
    """One real server run; returns its measured hit rate and, at the end, its MRC prediction."""
    rows = {bb: np.full((512, bb), 0x5A, dtype=np.uint8) for _, bb in MODELS}
    start = time.monotonic()
    with ServerProcess(workdir, pool_size=f"{pool_bytes // MIB}mb") as srv:
        with PegaClient(srv.addr, timeout_s=30.0, name="mrc-check") as client:
            instances = [
                client.register_instance(KvLayout(model_id=m, block_bytes=bb, block_tokens=BLOCK_TOKENS))
                for m, bb in MODELS
            ]
            client_hits = client_lookups = 0
            for model, hashes in lookups:
                inst, bb = instances[model], MODELS[model][1]
                hit = client.query_prefix(inst, hashes, lease=True)
                client_hits += hit.num_hits
                client_lookups += len(hashes)
                batch = client.allocate(inst, hashes)
                write_blocks(client.pool_view(batch.epoch), batch.allocations, rows[bb][: len(hashes)])
                if batch.save_id:
                    client.seal(batch.save_id)
                if hit.lease_id:
                    client.release(hit.lease_id)
        replay_s = time.monotonic() - start
        metrics = wait_fed(srv.http_addr, client_lookups)
    hits = metrics['pegaflow_block_hits_total{tier="dram"}']
    misses = metrics["pegaflow_block_misses_total"]
    predicted = {
        f: metrics[f'pegaflow_mrc_predicted_hit_rate{{pool_factor="{f:g}",window="{WINDOW}"}}']
        for f in POOL_FACTORS
    }
    return {
        "pool_bytes": pool_bytes,
        "replay_s": replay_s,
        "block_lookups": client_lookups,
        "measured_hit_rate": hits / (hits + misses),
        "client_hit_rate": client_hits / client_lookups,
        "server_windowed_hit_rate": metrics[f'pegaflow_measured_hit_rate{{window="{WINDOW}"}}'],
        "evictions": metrics["pegaflow_evictions_total"],
        "slab_moves": metrics["pegaflow_pool_slab_moves_total"],
        "no_space_blocks": metrics["pegaflow_no_space_blocks_total"],
        "mrc_predicted": predicted,
        "mrc_sampling_rate": metrics["pegaflow_mrc_sampling_rate"],
        "mrc_tracked_keys": metrics["pegaflow_mrc_tracked_keys"],
        "mrc_sampled_requests": metrics["pegaflow_mrc_sampled_requests_total"],
        "mrc_memory_bytes": metrics["pegaflow_mrc_memory_bytes"],
    }


def wait_fed(http_addr: str, lookups: int, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrapes until the metrics feeder has accounted every lookup (the windowed counts agree with
    the engine's counters) and the MRC's sample count stopped moving."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        m = scrape(http_addr)
        hits, misses = m['pegaflow_block_hits_total{tier="dram"}'], m["pegaflow_block_misses_total"]
        windowed = m.get(f'pegaflow_measured_hit_rate{{window="{WINDOW}"}}')
        sampled = m.get("pegaflow_mrc_sampled_requests_total")
        done = hits + misses == lookups and windowed is not None and abs(windowed - hits / lookups) < 1e-9
        if done and sampled == previous:
            return m
        previous = sampled if done else None
        if time.monotonic() > deadline:
            raise TimeoutError(f"metrics feeder did not catch up: {hits + misses} of {lookups} lookups")
        time.sleep(0.3)


def feeder_cost(lookups, capacity: int, repeats: int = 5) -> dict:
    """µs per looked-up block of the MRC and of the HLL ceiling (the baseline) on the same batches."""
    keys, sizes = engine_keys(lookups)
    batches = [(keys[i : i + 16384], sizes[i : i + 16384]) for i in range(0, len(keys), 16384)]
    mrc_us, hll_us = [], []
    for _ in range(repeats):
        hll = HitRateCeiling(WINDOWS)
        t = time.perf_counter()
        for k, _s in batches:
            hll.add(k)
        hll_us.append((time.perf_counter() - t) / len(keys) * 1e6)
        mrc = MissRatioCurve(capacity, WINDOWS)
        t = time.perf_counter()
        for k, s in batches:
            mrc.add(k, s)
        mrc_us.append((time.perf_counter() - t) / len(keys) * 1e6)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    mrc = MissRatioCurve(capacity, WINDOWS)
    for k, s in batches:
        mrc.add(k, s)
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {
        "blocks": len(keys),
        "mrc_us_per_block": {"median": statistics.median(mrc_us), "worst": max(mrc_us), "runs": mrc_us},
        "hll_us_per_block": {"median": statistics.median(hll_us), "worst": max(hll_us), "runs": hll_us},
        "mrc_sampling_rate": mrc.rate,
        "mrc_sampled_share": mrc.sampled_requests / len(keys),
        "mrc_tracked_keys": mrc.tracked_keys,
        "mrc_memory_bytes_estimate": mrc.memory_bytes(),
        "mrc_memory_bytes_traced": traced,
    }


def check_seed(seed: int, requests: int, base_bytes: int, workdir: pathlib.Path) -> dict:
    lookups = trace_lookups(seed, requests)
    keys, sizes = engine_keys(lookups)
    distinct = dict(zip(keys, sizes, strict=True))
    runs = {}
    for factor in POOL_FACTORS:
        pool = int(factor * base_bytes)
        print(f"seed {seed}: {factor:g}x pool ({pool // MIB} MiB) ...", file=sys.stderr, flush=True)
        runs[factor] = replay(lookups, pool, workdir / f"seed{seed}-{factor:g}x")
        runs[factor]["exact_lru_hit_rate"] = exact_lru(keys, sizes, pool)
    predicted = runs[1.0]["mrc_predicted"]
    errors = {f: predicted[f] - runs[f]["measured_hit_rate"] for f in POOL_FACTORS}
    curve = MissRatioCurve(base_bytes, {WINDOW: 900.0}, max_rate=1.0, max_keys=1 << 22)
    curve.add(keys, sizes)
    return {
        "seed": seed,
        "requests": requests,
        "block_lookups": len(keys),
        "distinct_blocks": len(distinct),
        "distinct_bytes": sum(distinct.values()),
        "hll_ceiling_exact": 1 - len(distinct) / len(keys),
        "runs": {f"{f:g}": r for f, r in runs.items()},
        "prediction_from_1x_run": {f"{f:g}": v for f, v in predicted.items()},
        "error_points": {f"{f:g}": e for f, e in errors.items()},
        "max_abs_error_points": max(abs(e) for e in errors.values()),
        "exact_lru_curve": [(f, r) for f, r in curve.curve(WINDOW)],
    }


SWEEP_CONFIGS = ((0.1, 8192), (0.25, 16384), (1.0, 2048), (1.0, 8192), (1.0, 16384))  # (max_rate, max_keys)


def zipf_stream(n: int = 200_000, distinct: int = 40_000, skew: float = 1.1) -> tuple[list[bytes], list[int]]:
    """A Zipf block stream with 4 KiB and 12 KiB blocks (the unit tests' synthetic workload)."""
    rng = np.random.default_rng(2)
    ranks = (rng.zipf(skew, size=n) - 1) % distinct
    keys = [(int(r) % 3).to_bytes(4, "little") + int(r).to_bytes(16, "big") for r in ranks]
    return keys, [4096 if k[0] else 12288 for k in keys]


def estimator_sweep(seeds: list[int], requests: int, base_bytes: int, salts: int = 6) -> dict:
    """Offline: SHARDS_adj vs the plain ratio estimator against an exact byte-LRU, per sampling
    setting, over the chat traces x hash salts and over a Zipf(1.1) stream x hash salts (max |error|
    over 0.25x..4x, in points; mean and worst)."""
    streams = {}
    for seed in seeds:
        keys, sizes = engine_keys(trace_lookups(seed, requests))
        streams[f"chat seed {seed}"] = ("chat", keys, sizes, base_bytes)
    keys, sizes = zipf_stream()
    streams["zipf"] = ("zipf", keys, sizes, sum(dict(zip(keys, sizes, strict=True)).values()) // 8)
    exact = {
        name: {f: exact_lru(keys, sizes, int(f * base)) for f in POOL_FACTORS}
        for name, (_, keys, sizes, base) in streams.items()
    }
    out: dict = {}
    for max_rate, max_keys in SWEEP_CONFIGS:
        errors: dict = {}
        for name, (kind, keys, sizes, base) in streams.items():
            for salt in range(salts):
                mrc = MissRatioCurve(
                    base, {WINDOW: 900.0}, max_keys=max_keys, max_rate=max_rate,
                    max_sampled_per_s=1e12, salt=0x9E3779B97F4A7C15 * (salt + 1),
                )  # fmt: skip
                for i in range(0, len(keys), 16384):
                    mrc.add(keys[i : i + 16384], sizes[i : i + 16384])
                adj = mrc.predicted_hit_rates(WINDOW)
                hist, _ = mrc.distance_histogram(WINDOW)
                misses_above = hist[::-1].cumsum()[::-1]
                ratio = {f: 1 - misses_above[mrc.edge_index(f) + 1] / hist.sum() for f in POOL_FACTORS}
                for estimator, predicted in (("adj", adj), ("ratio", ratio)):
                    error = max(abs(predicted[f] - exact[name][f]) for f in POOL_FACTORS)
                    errors.setdefault(f"{kind} {estimator}", []).append(100 * error)
        out[f"max_rate={max_rate:g} max_keys={max_keys}"] = {
            k: {"mean_points": statistics.mean(v), "worst_points": max(v)} for k, v in errors.items()
        }
    return out


def figure(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = report["seeds"]
    fig, axes = plt.subplots(1, len(seeds), figsize=(6.5 * len(seeds), 4.6), squeeze=False)
    for ax, s in zip(axes[0], seeds, strict=True):
        factors = [float(f) for f in s["runs"]]
        ax.plot(*zip(*s["exact_lru_curve"], strict=True), color="#a0aec0", lw=1.2, label="exact LRU, offline")
        ax.plot(factors, [s["runs"][f"{f:g}"]["measured_hit_rate"] for f in factors], "o-", color="#2b6cb0",
                label="measured: real server at that size")  # fmt: skip
        ax.plot(factors, [s["prediction_from_1x_run"][f"{f:g}"] for f in factors], "s--", color="#c05621",
                label="predicted by the 1x server (SHARDS)")  # fmt: skip
        ax.axhline(s["hll_ceiling_exact"], color="#718096", ls=":", label="ceiling (N - U) / N")
        ax.set_xscale("log", base=2)
        ax.set_xticks(factors, [f"{f:g}x" for f in factors])
        ax.set_xlim(factors[0] / 1.5, factors[-1] * 1.5)
        ax.set_ylim(0, 1)
        ax.set_xlabel(f"DRAM pool, x {report['base_pool_mib']} MiB")
        ax.set_ylabel("block hit rate")
        ax.set_title(
            f"seed {s['seed']}: {s['requests']} requests, max error {100 * s['max_abs_error_points']:.1f} pts"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--base-pool-mib", type=int, default=64)
    p.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/pegaflow-mrc-check"))
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "mrc_check.json")
    p.add_argument("--sweep", action="store_true", help="only the offline estimator comparison (no servers)")
    args = p.parse_args(argv)
    machine = machine_info()
    base = args.base_pool_mib * MIB
    if args.sweep:
        seeds = [int(s) for s in args.seeds.split(",")]
        sweep = estimator_sweep(seeds, args.requests, base)
        out = args.out.with_name("mrc_estimators.json")
        write_json(
            out, {"what": estimator_sweep.__doc__, "seeds": seeds, "machine": machine, "results": sweep}
        )
        for name, r in sweep.items():
            print(
                f"{name}: "
                + ", ".join(f"{k} {v['mean_points']:.1f} / {v['worst_points']:.1f}" for k, v in r.items())
            )
        return 0
    seeds = [check_seed(int(s), args.requests, base, args.workdir) for s in args.seeds.split(",")]
    cost = feeder_cost(trace_lookups(int(args.seeds.split(",")[0]), args.requests), base)
    worst = max(s["max_abs_error_points"] for s in seeds)
    report = {
        "what": "pegaflow_mrc_predicted_hit_rate of the 1x run vs the block hit rate real servers measured",
        "command": "python -m pegaflow.bench.mrc_check "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine,
        "base_pool_mib": args.base_pool_mib,
        "block_tokens": BLOCK_TOKENS,
        "models": [{"model": m, "block_bytes": bb} for m, bb in MODELS],
        "window": WINDOW,
        "target_points": TARGET_POINTS,
        "max_abs_error_points": worst,
        "within_target": worst <= TARGET_POINTS,
        "seeds": seeds,
        "feeder_cost": cost,
        "edges": list(EDGE_FACTORS),
    }
    write_json(args.out, report)
    figure(report, args.out.with_suffix(".png"))
    for s in seeds:
        runs, predicted = s["runs"], s["prediction_from_1x_run"]
        line = ", ".join(
            f"{f}x: measured {runs[f]['measured_hit_rate']:.3f} predicted {predicted[f]:.3f}" for f in runs
        )
        print(f"seed {s['seed']}: {line}")
    c = cost
    print(
        f"max |error| {100 * worst:.2f} points (target {100 * TARGET_POINTS:.0f}); MRC "
        f"{c['mrc_us_per_block']['median']:.2f} us/block (HLL {c['hll_us_per_block']['median']:.2f}), "
        f"{c['mrc_memory_bytes_traced'] / MIB:.1f} MiB; wrote {args.out}"
    )
    return 0 if worst <= TARGET_POINTS else 1


if __name__ == "__main__":
    sys.exit(main())
