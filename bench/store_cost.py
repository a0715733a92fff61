"""What the engine's save path costs per batch, in-process: AllocateBlocks + SealBlocks of 64 blocks
of 256 KiB into a full pool (every grant evicts 64), no RPC, no copy, no free-slot reserve.

    .venv/bin/python bench/store_cost.py [--batches 400] [--rounds 5] [--mixed] [--out FILE.json]
    .venv/bin/python bench/store_cost.py --plot A.json B.json ... --png FILE.png   # runs side by side

``--mixed``: the victims are another model's blocks of another size (64 KiB, four victims a grant),
as when one model's saves take the pool over from another's (the GPU stream's MLA saves after the
per-layer ones): the pool is filled with them before each round, and the grants are whole-write
(the server's GPU copy overwrites every byte, so the foreign slots are not zeroed: what is timed is
the bookkeeping).

Rounds of ``--batches`` each, after a fill and a warm-up; per round the median allocate and seal
times; the JSON has every round, the median and worst round. For an A/B against another tree, run
it again with ``PYTHONPATH`` naming a directory whose ``pegaflow`` is that tree.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

import pegaflow
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.store.namespace import KvLayout

BLOCK = 256 * 1024
BATCH = 64
POOL = 512 * MIB
OTHER_BLOCK = 64 * 1024  # --mixed: the size of the blocks evicted (four for each block granted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mixed", action="store_true", help="evict another model's 64 KiB blocks (docstring)")
    ap.add_argument("--out")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="draw these reports (one bar group each)")
    ap.add_argument("--png", help="with --plot: where to write the figure")
    args = ap.parse_args()
    if args.plot:
        plot(
            [json.loads(pathlib.Path(p).read_text()) for p in args.plot],
            [pathlib.Path(p).stem for p in args.plot],
            pathlib.Path(args.png or pathlib.Path(args.plot[0]).with_suffix(".png")),
        )
        return
    engine = KVEngine(ServerConfig(pool_size_bytes=POOL, http_addr=None))
    try:
        sid = engine.open_session("store-cost").session_id
        layout = KvLayout(model_id="m", block_bytes=BLOCK, dtype="bf16", tp_size=1, tp_rank=0)
        iid = engine.register_instance(sid, layout).instance_id
        other = KvLayout(model_id="other", block_bytes=OTHER_BLOCK, dtype="bf16", tp_size=1, tp_rank=0)
        other_iid = engine.register_instance(sid, other).instance_id if args.mixed else ""
        count = 0

        def batch(instance: str = iid) -> tuple[float, float]:
            nonlocal count
            hashes = [f"b{count}-{i}".encode() for i in range(BATCH)]
            count += 1
            t0 = time.perf_counter()
            res = engine.allocate_blocks(sid, instance, hashes, whole_write=args.mixed)
            t1 = time.perf_counter()
            engine.seal_blocks(sid, res.save_id)
            return t1 - t0, time.perf_counter() - t1

        def fill(instance: str, block_bytes: int) -> None:
            for _ in range(POOL // (BATCH * block_bytes) + 4):
                batch(instance)

        fill(iid, BLOCK)
        for _ in range(20):  # some evicting batches: the warm-up
            batch()
        rounds = []
        for _ in range(args.rounds):
            if args.mixed:
                fill(other_iid, OTHER_BLOCK)  # the pool is the other model's again
            # --mixed: as many batches as the other model's blocks make room for, no more.
            n = min(args.batches, POOL // (BATCH * BLOCK) - 2) if args.mixed else args.batches
            alloc, seal = zip(*(batch() for _ in range(n)), strict=True)
            rounds.append(
                {"allocate_ms": statistics.median(alloc) * 1e3, "seal_ms": statistics.median(seal) * 1e3}
            )
            rounds[-1]["total_ms"] = rounds[-1]["allocate_ms"] + rounds[-1]["seal_ms"]
        stats = engine.stats()
    finally:
        engine.close()
    totals = sorted(r["total_ms"] for r in rounds)
    report = {
        "benchmark": "store_cost",
        "shape": {"blocks_per_batch": BATCH, "block_bytes": BLOCK, "pool_bytes": POOL},
        "victims": (
            f"another model's {OTHER_BLOCK} B blocks, whole-write grants"
            if args.mixed
            else "the same model's"
        ),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "code": str(pathlib.Path(pegaflow.__file__).parent),  # which tree ran (an A/B names two)
        "evictions": stats.evictions,
        "rounds": rounds,
        "total_ms": {"median": statistics.median(totals), "worst": totals[-1]},
    }
    for r in rounds:
        print(
            f"allocate {r['allocate_ms']:.3f} ms + seal {r['seal_ms']:.3f} ms"
            f" = {r['total_ms']:.3f} ms per batch"
        )
    print(
        f"median {report['total_ms']['median']:.3f} ms, worst {report['total_ms']['worst']:.3f} ms"
        f" ({report['code']})"
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def plot(reports: list[dict], names: list[str], path: pathlib.Path) -> None:
    """Per report: its rounds' allocate + seal ms stacked, median round and worst round marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(reports)), 4))
    for i, report in enumerate(reports):
        rounds = sorted(report["rounds"], key=lambda r: r["total_ms"])
        median = rounds[len(rounds) // 2]
        ax.bar(i, median["allocate_ms"], color="#3182bd", label="allocate (median round)" if i == 0 else None)
        ax.bar(
            i,
            median["seal_ms"],
            bottom=median["allocate_ms"],
            color="#9ecae1",
            label="seal (median round)" if i == 0 else None,
        )
        ax.plot(
            [i - 0.3, i + 0.3],
            [rounds[-1]["total_ms"]] * 2,
            color="black",
            label="worst round" if i == 0 else None,
        )
        ax.text(i, rounds[-1]["total_ms"], f"{median['total_ms']:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(reports)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per 64-block batch (in-process)")
    ax.set_title("engine allocate + seal, full pool, every grant evicting", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
