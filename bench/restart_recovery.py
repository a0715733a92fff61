"""Restart without losing the DRAM cache: time from a SIGKILL to the first hit, and the share of blocks
a restarted server re-adopts from its persistent pool (issue 12, item 10).

    python bench/restart_recovery.py [--pool-size 4gb] [--block-mib 2] [--repeats 3] [--out bench/results]

One run, per repeat: a server with ``--pool-dir /dev/shm/... --persist-pool`` is filled with sealed
blocks, SIGKILLed, and started again on the same pool; measured are the restart's seconds to ready
(its own recovery time from GetStats' log line is printed too), to the first full prefix hit, and
the blocks re-adopted out of those sealed. The baseline, measured in the same run: a server without
--persist-pool starts empty (its seconds to ready, and its hit rate on the same prefixes: zero).
Writes restart_recovery.json and .png.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from pegaflow.bench.harness import results
from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.server.config import MIB, parse_size
from pegaflow.server.testing import ServerProcess, wait_for


def layout(block_bytes: int) -> KvLayout:
    return KvLayout(
        model_id="restart-bench", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
        block_bytes=block_bytes, num_layers=1, tp_size=1, tp_rank=0, mla=False, extra="",
    )  # fmt: skip


def fill(client: PegaClient, inst, n_blocks: int, block_bytes: int, batch: int = 16) -> list[bytes]:
    hashes = [f"b{i}".encode() for i in range(n_blocks)]
    row = np.frombuffer(np.random.default_rng(1).bytes(block_bytes), np.uint8)
    for lo in range(0, n_blocks, batch):
        got = client.allocate(inst, hashes[lo : lo + batch])
        write_blocks(client.pool_view(got.epoch), got.allocations, [row] * len(got.allocations))
        if got.save_id:
            client.seal(got.save_id)
    return hashes


def start(work: pathlib.Path, pool_size: str, pool_dir: str | None) -> tuple[ServerProcess, float]:
    extra = ["--pool-dir", pool_dir, "--persist-pool"] if pool_dir else []
    t0 = time.monotonic()
    srv = ServerProcess(work, pool_size=pool_size, extra_args=extra).start()
    return srv, time.monotonic() - t0


def first_full_hit(client: PegaClient, inst, hashes: list[bytes]) -> tuple[float, int]:
    t0 = time.monotonic()
    hits = sum(client.query_prefix(inst, hashes[lo : lo + 512]).num_hits for lo in range(0, len(hashes), 512))
    return time.monotonic() - t0, hits


def run(args) -> dict:
    block_bytes = args.block_mib * MIB
    pool_bytes = parse_size(args.pool_size)
    n_blocks = int(pool_bytes // block_bytes * 0.9)
    repeats = []
    with tempfile.TemporaryDirectory(prefix="pegaflow-restart-") as tmp:
        tmp = pathlib.Path(tmp)
        for r in range(args.repeats):
            pool_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="pegaflow-bench-pool-")
            try:
                srv, _ = start(tmp / f"fill{r}", args.pool_size, pool_dir)
                with PegaClient(srv.addr, timeout_s=30) as c:
                    inst = c.register_instance(layout(block_bytes))
                    hashes = fill(c, inst, n_blocks, block_bytes)
                    journal = os.path.join(pool_dir, "pegaflow-pool.journal")

                    def journaled(path=journal) -> bool:
                        return os.path.getsize(path) >= n_blocks * 40

                    wait_for(journaled, 120, what="journal written")
                srv.kill()
                killed = time.monotonic()
                again, ready_s = start(tmp / f"restart{r}", args.pool_size, pool_dir)
                try:
                    with PegaClient(again.addr, timeout_s=30) as c:
                        recovered = c.stats().recovered_dram_blocks
                        inst = c.register_instance(layout(block_bytes))
                        query_s, hits = first_full_hit(c, inst, hashes)
                    first_hit_s = time.monotonic() - killed
                finally:
                    again.stop()
                baseline, baseline_ready_s = start(tmp / f"fresh{r}", args.pool_size, None)
                try:
                    with PegaClient(baseline.addr, timeout_s=30) as c:
                        inst = c.register_instance(layout(block_bytes))
                        _, baseline_hits = first_full_hit(c, inst, hashes)
                finally:
                    baseline.stop()
            finally:
                for name in os.listdir(pool_dir):
                    os.unlink(os.path.join(pool_dir, name))
                os.rmdir(pool_dir)
            repeats.append(
                {
                    "sealed_blocks": n_blocks,
                    "recovered_blocks": recovered,
                    "recovered_share": recovered / n_blocks,
                    "restart_to_ready_s": ready_s,
                    "kill_to_first_full_hit_s": first_hit_s,
                    "query_s": query_s,
                    "hits_after_restart": hits,
                    "baseline_ready_s": baseline_ready_s,
                    "baseline_hits": baseline_hits,
                }
            )
            print(f"repeat {r}: {repeats[-1]}", file=sys.stderr, flush=True)

    def agg(key: str) -> dict:
        values = [rep[key] for rep in repeats]
        return {"median": statistics.median(values), "worst": max(values) if "_s" in key else min(values)}

    return {
        "experiment": "restart_recovery",
        "machine": results.machine_info(),
        "pool_bytes": pool_bytes,
        "block_bytes": block_bytes,
        "repeats": repeats,
        "summary": {
            k: agg(k)
            for k in ("recovered_share", "restart_to_ready_s", "kill_to_first_full_hit_s", "baseline_ready_s")
        },
    }


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = report["repeats"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(reps))
    a.bar(x - 0.2, [r["restart_to_ready_s"] for r in reps], 0.4, label="persistent pool: restart to ready")
    a.bar(x + 0.2, [r["baseline_ready_s"] for r in reps], 0.4, label="fresh pool: start to ready")
    a.set_xlabel("repeat")
    a.set_ylabel("seconds")
    a.legend(fontsize=8)
    a.set_title(f"{report['pool_bytes'] / 2**30:.0f} GiB pool, {report['block_bytes'] >> 20} MiB blocks")
    b.bar(x - 0.2, [r["hits_after_restart"] / r["sealed_blocks"] for r in reps], 0.4, label="persistent")
    b.bar(x + 0.2, [r["baseline_hits"] / r["sealed_blocks"] for r in reps], 0.4, label="fresh")
    b.set_ylim(0, 1.05)
    b.set_ylabel("share of the sealed blocks hit after the restart")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool-size", default="4gb")
    p.add_argument("--block-mib", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    args = p.parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results.write_json(args.out / "restart_recovery.json", report)
    plot(report, args.out / "restart_recovery.png")
    print(report["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
