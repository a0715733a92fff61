"""Saves into a full pool with and without the free-slot reserve (server/store/free_reserve.py), same run.

    .venv/bin/python bench/free_reserve_ab.py [--seconds 5] [--reps 3] [--out JSON]   # ~6 min

Per case (block size x blocks per batch x batches in flight x models) and repetition, two fresh
servers in turn, the arms' order alternating: pegaflow-server as shipped (the reserve on, its default
size) and the same with ``--free-reserve 0`` (every save evicts its own victims inside AllocateBlocks,
and zeroes there the slots another namespace held). Each server's 3 GiB pool is first filled with the
measured layouts' blocks and a batch more, so a save that had to evict has happened and every measured
save meets a full pool: the steady state of one model, or of two sharing the pool (see CASES). Then
each client thread saves back to back for ``--seconds`` (AllocateBlocks -> numpy copies into the
granted slots -> SealBlocks) and the phases are timed. Reported per case and arm: save GB/s (median
and worst repetition), the median AllocateBlocks / copy / SealBlocks milliseconds, and default / off
per repetition. bench/server_bench.py measures the same path against memcpy; this one isolates what
the reserve changes. A plot beside the JSON. A command, not a test.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from pegaflow.bench.harness.results import machine_info, write_json
from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.server.config import parse_size
from pegaflow.server.testing import ServerProcess

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
KIB = 1 << 10
POOL = "3gb"
# (block bytes, blocks per batch, batches in flight, models). models 1: one layout filled the pool and
# saves. 2: each client thread's saves alternate between two layouts of the same block size (two
# namespaces sharing the pool). "switch": another layout filled the pool, then one layout saves the
# pool's size once (a model replacing another), so every slot it gets was another namespace's: the
# server zeroes them before granting them (issue 12's F2), on the request path or, once one namespace
# saves alone, ahead of it in the reserve.
CASES = [
    (256 * KIB, 64, 1, 1),
    (256 * KIB, 64, 2, 1),
    (2048 * KIB, 256, 1, 1),
    (2048 * KIB, 256, 2, 1),
    (256 * KIB, 64, 1, 2),
    (256 * KIB, 64, 2, 2),
    (256 * KIB, 64, 1, "switch"),
]
ARMS = {"default": [], "off": ["--free-reserve", "0"]}


def one_arm(
    tmp: pathlib.Path, arm: str, block: int, blocks: int, inflight: int, models: int | str, seconds: float
) -> dict:
    switch = models == "switch"
    models = 2 if switch else int(models)
    with ServerProcess(tmp / arm, pool_size=POOL, http_addr=None, extra_args=ARMS[arm]) as srv:
        c = PegaClient(srv.addr, timeout_s=60, name="free-reserve-ab")
        c.connect()
        try:
            insts = [
                c.register_instance(
                    KvLayout(model_id=f"ab-{m}", block_bytes=block, dtype="bfloat16", block_tokens=16)
                )
                for m in range(models)
            ]
            c.wait_pool_populated(120)
            pages = c.pool_view()[::4096]
            pages[:] = pages.copy()  # first-touch of the client's mapping, as server_bench.py does
            src = [
                np.random.default_rng(k).integers(0, 256, (blocks, block), dtype=np.uint8)
                for k in range(inflight)
            ]
            pool_batches = parse_size(POOL) // (blocks * block)
            for i in range(pool_batches + 2):
                filler = insts[1] if switch else insts[i % models]
                batch = c.allocate(filler, [f"fill-{i}-{j}".encode() for j in range(blocks)])
                write_blocks(c.pool_view(batch.epoch), batch.allocations, src[0])
                c.seal(batch.save_id)
            phases: dict[str, list[float]] = {"allocate_ms": [], "copy_ms": [], "seal_ms": []}
            saved = [0] * inflight
            busy = [0.0] * inflight
            stop = time.monotonic() + seconds

            def saver(k: int) -> None:
                i = 0
                while time.monotonic() < stop and not (switch and i >= pool_batches // inflight):
                    t0 = time.perf_counter()
                    inst = insts[0] if switch else insts[i % models]
                    batch = c.allocate(inst, [f"{k}-{i}-{j}".encode() for j in range(blocks)])
                    t1 = time.perf_counter()
                    write_blocks(c.pool_view(batch.epoch), batch.allocations, src[k])
                    t2 = time.perf_counter()
                    c.seal(batch.save_id)
                    t3 = time.perf_counter()
                    if not all(a.granted for a in batch.allocations):
                        raise RuntimeError("a measured batch was not fully granted")
                    for name, d in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                        phases[name].append(d * 1e3)
                    saved[k] += blocks * block
                    busy[k] += t3 - t0
                    i += 1

            threads = [threading.Thread(target=saver, args=(k,)) for k in range(inflight)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stats = c.stats()
        finally:
            c.close()
    return {
        "save_gbps": sum(saved[k] / busy[k] for k in range(inflight)) / 1e9,
        **{name: statistics.median(values) for name, values in phases.items()},
        "batches": len(phases["allocate_ms"]),
        "reserve_evictions": stats.reserve_evictions,
        "reserve_zeroed_blocks": stats.reserve_zeroed_blocks,
        "evictions": stats.evictions,
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(cases))
    labels = [
        f"{c['block_bytes'] // KIB}K x{c['batch_blocks']}\n{c['inflight']} in flight"
        + {1: "", 2: "\n2 models", "switch": "\nmodel switch"}[c["models"]]
        for c in cases
    ]
    for i, (arm, color) in enumerate((("default", "#1f77b4"), ("off", "#999999"))):
        med = [c[arm]["save_gbps_median"] for c in cases]
        worst = [c[arm]["save_gbps_worst"] for c in cases]
        pos = x + (i - 0.5) * 0.38
        ax.bar(pos, med, 0.38, color=color, label=f"{arm} (median; tick: worst rep)")
        ax.scatter(pos, worst, marker="_", s=200, color="black", zorder=3)
        ax2.bar(pos, [c[arm]["allocate_ms_median"] for c in cases], 0.38, color=color, label=f"{arm}")
    for xi, c in zip(x, cases, strict=True):
        ax.text(
            xi,
            c["default"]["save_gbps_median"],
            f"{c['default_over_off_median']:.2f}x",
            ha="center",
            va="bottom",
        )
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("save GB/s into a full pool")
    ax.set_title("reserve on (default) vs --free-reserve 0, same run", fontsize=10)
    ax.legend(fontsize=8)
    ax2.set_xticks(x, labels, fontsize=8)
    ax2.set_ylabel("AllocateBlocks ms (median)")
    ax2.set_title("the call the reserve shortens", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="saving time per arm and repetition")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per case (arms alternate their order)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "free_reserve_ab.json")
    args = ap.parse_args(argv)
    result: dict = {"command": " ".join(sys.argv), "machine": machine_info(), "pool": POOL, "cases": []}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = pathlib.Path(tmpdir)
        for block, blocks, inflight, models in CASES:
            runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
            for rep in range(args.reps):
                for arm in list(ARMS) if rep % 2 == 0 else list(ARMS)[::-1]:
                    runs[arm].append(
                        one_arm(tmp / f"{rep}", arm, block, blocks, inflight, models, args.seconds)
                    )
            case = {
                "block_bytes": block,
                "batch_blocks": blocks,
                "inflight": inflight,
                "models": models,
                "runs": runs,
            }
            for arm, rows in runs.items():
                gbps = [r["save_gbps"] for r in rows]
                case[arm] = {
                    "save_gbps_median": statistics.median(gbps),
                    "save_gbps_worst": min(gbps),
                    **{
                        f"{k}_median": statistics.median(r[k] for r in rows)
                        for k in ("allocate_ms", "copy_ms", "seal_ms")
                    },
                }
            ratios = [
                d["save_gbps"] / o["save_gbps"] for d, o in zip(runs["default"], runs["off"], strict=True)
            ]
            case["default_over_off_per_rep"] = ratios
            case["default_over_off_median"] = statistics.median(ratios)
            case["default_over_off_worst"] = min(ratios)
            result["cases"].append(case)
            d, o = case["default"], case["off"]
            arms = ", ".join(
                f"{arm} {r['save_gbps_median']:.2f} GB/s (alloc {r['allocate_ms_median']:.2f} ms)"
                for arm, r in (("default", d), ("off", o))
            )
            med, worst = case["default_over_off_median"], case["default_over_off_worst"]
            ratio = f"default/off median {med:.2f}x, worst {worst:.2f}x"
            what = f"{block // KIB} KiB x {blocks}, {inflight} in flight, {models} model(s)"
            print(f"{what}: {arms}; {ratio}", flush=True)
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
