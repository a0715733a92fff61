"""What a stream of saves costs the server in CPU: a real pegaflow-server with a full pool, and 1 or
2 client threads saving 16 MiB batches (64 x 256 KiB, every one evicting) through
client/save_pipeline.py for a fixed time. Reported per batch: the server process's CPU time
(its children included) and this client's, with the batches per second. On a 2-vCPU machine two
saving threads and the server share two cores, so the server's CPU per batch is what keeps the
two-in-flight saves below memcpy.

    .venv/bin/python bench/save_stream_cpu.py --seconds 8 --repeats 2 --out DIR [--label NAME]
    .venv/bin/python bench/save_stream_cpu.py --server-pythonpath DIR ...   # another commit's server
    .venv/bin/python bench/save_stream_cpu.py --compare A.json B.json --out DIR   # the two on one plot

The client is always this tree's; ``--server-pythonpath`` starts the server from another tree (a
directory holding a ``pegaflow`` link to a worktree of another commit): the before arm of an A/B of
a server change, like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.client.save_pipeline import save_batches
from pegaflow.server.testing import ServerProcess

BLOCK = 256 * 1024
BATCH = 64
STREAM = 8  # batches per save_batches call
POOL = "3gb"


def cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def run(threads: int, seconds: float, tmp: pathlib.Path, server_pythonpath: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": server_pythonpath} if server_pythonpath else None
    with ServerProcess(tmp / f"t{threads}", pool_size=POOL, http_addr=None, env=env) as srv:
        c = PegaClient(srv.addr, timeout_s=60.0, name="save-stream-cpu")
        c.connect()
        try:
            inst = c.register_instance(KvLayout(model_id="m", block_bytes=BLOCK, dtype="u8", block_tokens=16))
            c.wait_pool_populated(120)
            src = np.random.default_rng(0).integers(0, 256, size=(BATCH, BLOCK), dtype=np.uint8)

            def write(_i, batch) -> tuple:
                write_blocks(c.pool_view(batch.epoch), batch.allocations, src)
                return ()

            fill = [[f"fill-{i}-{j}".encode() for j in range(BATCH)] for i in range(3 * 1024 // 16 + 2)]
            save_batches(c, inst, fill, write)  # the pool full: every measured save evicts
            server, me = psutil.Process(srv.proc.pid), psutil.Process()
            s0, m0 = cpu_seconds(server), me.cpu_times()
            end = time.monotonic() + seconds
            done = [0] * threads

            def stream(k: int) -> None:
                rep = 0
                while time.monotonic() < end:
                    chunks = [[f"s{k}-{rep}-{i}-{j}".encode() for j in range(BATCH)] for i in range(STREAM)]
                    save_batches(c, inst, chunks, write)
                    done[k] += STREAM
                    rep += 1

            workers = [threading.Thread(target=stream, args=(k,)) for k in range(threads)]
            t0 = time.monotonic()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            elapsed = time.monotonic() - t0
            s1, m1 = cpu_seconds(server), me.cpu_times()
        finally:
            c.close()
    n = sum(done)
    return {
        "threads": threads,
        "batches": n,
        "batches_per_s": n / elapsed,
        "gbps": n * BATCH * BLOCK / elapsed / 1e9,
        "server_cpu_ms_per_batch": (s1 - s0) / n * 1e3,
        "client_cpu_ms_per_batch": ((m1.user - m0.user) + (m1.system - m0.system)) / n * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--server-pythonpath", default=None)
    ap.add_argument("--compare", type=pathlib.Path, nargs="+", default=None)
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare, args.out)
    rows = []
    with tempfile.TemporaryDirectory(prefix="save-stream-cpu-") as d:
        for _ in range(args.repeats):
            for threads in (1, 2):
                row = run(threads, args.seconds, pathlib.Path(d), args.server_pythonpath)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for threads in (1, 2):
        mine = [r for r in rows if r["threads"] == threads]
        summary[threads] = {
            key: {"median": statistics.median(r[key] for r in mine), "worst": max(r[key] for r in mine)}
            for key in ("server_cpu_ms_per_batch", "client_cpu_ms_per_batch")
        } | {"batches_per_s": {"median": statistics.median(r["batches_per_s"] for r in mine),
                               "worst": min(r["batches_per_s"] for r in mine)}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "label": args.label,
        "server_pythonpath": args.server_pythonpath,
        "rows": rows,
        "summary": summary,
    }
    (args.out / "save_stream_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def compare(paths: list[pathlib.Path], out: pathlib.Path) -> int:
    """The arms' server CPU per batch and batches per second, side by side (median, worst as a tick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [json.loads(p.read_text()) for p in paths]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "server_cpu_ms_per_batch", "server CPU per 16 MiB batch (ms)"),
        (axes[1], "batches_per_s", "16 MiB batches saved per second"),
    ):
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs = [t + i * width for t in range(2)]
            med = [arm["summary"][str(t)][key]["median"] for t in (1, 2)]
            worst = [arm["summary"][str(t)][key]["worst"] for t in (1, 2)]
            ax.bar(xs, med, width, label=arm["label"])
            ax.scatter(xs, worst, color="black", marker="_", s=200)
        ax.set_xticks([t + 0.4 - width / 2 for t in range(2)], ["1 thread", "2 threads"])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("save stream through client/save_pipeline.py, pool full (bar: median, tick: worst)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "save_stream_cpu.png", dpi=110)
    merged = {arm["label"]: arm for arm in arms}
    (out / "save_stream_cpu.json").write_text(json.dumps(merged, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
