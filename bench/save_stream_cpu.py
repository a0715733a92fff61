"""What a stream of saves costs the server in CPU: a real pegaflow-server with a full pool, and 1 or
2 client threads saving 16 MiB batches (64 x 256 KiB, every one evicting) through
client/save_pipeline.py for a fixed time. Reported per batch: the server process's CPU time
(its children included) and this client's, with the batches per second. On a 2-vCPU machine two
saving threads and the server share two cores, so the server's CPU per batch is what keeps the
two-in-flight saves below memcpy.

Each run alternates ``--windows`` windows of the save stream with windows of a plain memcpy of the
same 16 MiB batches by the same threads (numpy copies into pre-touched arrays well beyond the caches,
as bench/server_bench.py's reference): the stream's GB/s over the memcpy's in each pair of windows is
issue 16's ratio for a sustained stream (the connector's saves), reported per window, median and
worst. The CPU per batch counts the save windows only.

    .venv/bin/python bench/save_stream_cpu.py --seconds 8 --repeats 2 --out DIR [--label NAME]
    .venv/bin/python bench/save_stream_cpu.py --server-pythonpath DIR ...   # another commit's server
    .venv/bin/python bench/save_stream_cpu.py --compare A.json B.json --out DIR   # the two on one plot
    .venv/bin/python bench/save_stream_cpu.py --no-copy ...   # the protocol and the server alone
    .venv/bin/python bench/save_stream_cpu.py --server-arg=--free-reserve=0 ...   # a server setting

``--no-copy``: the same stream with the client's copy left out (each batch allocated and sealed, its
slots keeping the fill's bytes: nobody reads them here), so its GB/s is the most the RPCs and the
server's bookkeeping let through, whatever the copy costs: the ceiling of the save path on this
machine, against the same memcpy windows.

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


def cpu_seconds(proc: psutil.Process) -> tuple[float, float]:
    """(user, system) CPU seconds of ``proc`` and its children: the system share is the sockets'
    and the thread wake-ups' kernel time."""
    user = system = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        user, system = user + t.user, system + t.system
    return user, system


RING = 32  # batches per thread in the memcpy reference's destination: 512 MiB, beyond the caches


def run(
    threads: int,
    seconds: float,
    tmp: pathlib.Path,
    server_pythonpath: str | None,
    windows: int,
    copy: bool = True,
    server_args: tuple[str, ...] = (),
) -> dict:
    env = {**os.environ, "PYTHONPATH": server_pythonpath} if server_pythonpath else None
    with ServerProcess(
        tmp / f"t{threads}", pool_size=POOL, http_addr=None, env=env, extra_args=server_args
    ) as srv:
        c = PegaClient(srv.addr, timeout_s=60.0, name="save-stream-cpu")
        c.connect()
        try:
            inst = c.register_instance(KvLayout(model_id="m", block_bytes=BLOCK, dtype="u8", block_tokens=16))
            c.wait_pool_populated(120)
            src = np.random.default_rng(0).integers(0, 256, size=(BATCH, BLOCK), dtype=np.uint8)

            def write(_i, batch) -> tuple:
                write_blocks(c.pool_view(batch.epoch), batch.allocations, src)
                return ()

            def leave(_i, _batch) -> tuple:  # --no-copy: sealed as granted, never read
                return ()

            fill = [[f"fill-{i}-{j}".encode() for j in range(BATCH)] for i in range(3 * 1024 // 16 + 2)]
            save_batches(c, inst, fill, write)  # the pool full: every measured save evicts
            server, me = psutil.Process(srv.proc.pid), psutil.Process()
            rings = [np.ones((RING, BATCH, BLOCK), dtype=np.uint8) for _ in range(threads)]  # pre-touched
            reps = [0] * threads

            def stream(k: int, end: float, done: list[int]) -> None:
                while time.monotonic() < end:
                    rep = reps[k] = reps[k] + 1
                    chunks = [[f"s{k}-{rep}-{i}-{j}".encode() for j in range(BATCH)] for i in range(STREAM)]
                    save_batches(c, inst, chunks, write if copy else leave)
                    done[k] += STREAM

            def memcpy(k: int, end: float, done: list[int]) -> None:
                while time.monotonic() < end:
                    for _ in range(STREAM):
                        np.copyto(rings[k][done[k] % RING], src)
                        done[k] += 1

            def window(body, span: float) -> tuple[int, float]:
                done = [0] * threads
                end = time.monotonic() + span
                workers = [threading.Thread(target=body, args=(k, end, done)) for k in range(threads)]
                t0 = time.monotonic()
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                return sum(done), time.monotonic() - t0

            span = seconds / windows
            n = 0
            elapsed = server_cpu = server_sys = client_cpu = client_sys = 0.0
            save_gbps, memcpy_gbps = [], []
            for _ in range(windows):
                s0, m0 = cpu_seconds(server), me.cpu_times()
                batches, took = window(stream, span)
                s1, m1 = cpu_seconds(server), me.cpu_times()
                n, elapsed = n + batches, elapsed + took
                server_cpu += sum(s1) - sum(s0)
                server_sys += s1[1] - s0[1]
                client_cpu += (m1.user - m0.user) + (m1.system - m0.system)
                client_sys += m1.system - m0.system
                save_gbps.append(batches * BATCH * BLOCK / took / 1e9)
                copied, took = window(memcpy, span)
                memcpy_gbps.append(copied * BATCH * BLOCK / took / 1e9)
        finally:
            c.close()
    ratios = [a / b for a, b in zip(save_gbps, memcpy_gbps, strict=True)]
    return {
        "threads": threads,
        "copy": copy,
        "batches": n,
        "batches_per_s": n / elapsed,
        "gbps": n * BATCH * BLOCK / elapsed / 1e9,
        "server_cpu_ms_per_batch": server_cpu / n * 1e3,
        "client_cpu_ms_per_batch": client_cpu / n * 1e3,
        "server_sys_ms_per_batch": server_sys / n * 1e3,
        "client_sys_ms_per_batch": client_sys / n * 1e3,
        "server_args": list(server_args),
        "memcpy_gbps": statistics.median(memcpy_gbps),
        "save_vs_memcpy": statistics.median(ratios),
        "save_vs_memcpy_worst": min(ratios),
        "windows": {"save_gbps": save_gbps, "memcpy_gbps": memcpy_gbps, "save_vs_memcpy": ratios},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--server-pythonpath", default=None)
    ap.add_argument("--compare", type=pathlib.Path, nargs="+", default=None)
    ap.add_argument("--windows", type=int, default=4, help="save / memcpy window pairs per run")
    ap.add_argument("--no-copy", action="store_true", help="leave the client's copy out (docstring)")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to the server (repeat)")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare, args.out)
    rows = []
    with tempfile.TemporaryDirectory(prefix="save-stream-cpu-") as d:
        for _ in range(args.repeats):
            for threads in (1, 2):
                copy = not args.no_copy
                row = run(
                    threads, args.seconds, pathlib.Path(d), args.server_pythonpath, args.windows, copy,
                    tuple(args.server_arg),
                )  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = summarize(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "label": args.label,
        "server_pythonpath": args.server_pythonpath,
        "server_args": args.server_arg,
        "copy": not args.no_copy,
        "rows": rows,
        "summary": summary,
    }
    (args.out / "save_stream_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot([json.loads((args.out / "save_stream_cpu.json").read_text())], args.out / "save_stream_cpu.png")
    return 0


def summarize(rows: list[dict]) -> dict:
    """Per thread count: the median and worst of the rows' CPU per batch and batches per second, and
    of every window's save / memcpy ratio."""
    summary = {}
    for threads in (1, 2):
        mine = [r for r in rows if r["threads"] == threads]
        summary[threads] = {
            key: {"median": statistics.median(r[key] for r in mine), "worst": max(r[key] for r in mine)}
            for key in ("server_cpu_ms_per_batch", "client_cpu_ms_per_batch")
        } | {"batches_per_s": {"median": statistics.median(r["batches_per_s"] for r in mine),
                               "worst": min(r["batches_per_s"] for r in mine)}}  # fmt: skip
        windows = [x for r in mine if "windows" in r for x in r["windows"]["save_vs_memcpy"]]
        if windows:  # the ratio over every window of this thread count (reports before 2026-12-07: none)
            summary[threads]["save_vs_memcpy"] = {"median": statistics.median(windows), "worst": min(windows)}
    return summary


def compare(paths: list[pathlib.Path], out: pathlib.Path) -> int:
    """The arms side by side in one plot, and their reports merged in one JSON. Reports with the same
    label (runs of one arm alternated with another's) become one arm: their rows together, summarized
    again."""
    arms: dict[str, dict] = {}
    for path in paths:
        report = json.loads(path.read_text())
        arm = arms.get(report["label"])
        if arm is None:
            arms[report["label"]] = report | {"reports": [str(path)]}
        else:
            arm["rows"] = arm["rows"] + report["rows"]
            arm["reports"].append(str(path))
    for arm in arms.values():
        if len(arm["reports"]) > 1:
            arm["summary"] = {str(k): v for k, v in summarize(arm["rows"]).items()}
    out.mkdir(parents=True, exist_ok=True)
    plot(list(arms.values()), out / "save_stream_cpu.png")
    (out / "save_stream_cpu.json").write_text(json.dumps(arms, indent=2) + "\n")
    return 0


def plot(arms: list[dict], png: pathlib.Path) -> None:
    """Server CPU per batch, batches per second and (where measured) the stream over memcpy, per
    thread count and arm (bar: median, tick: worst)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("server_cpu_ms_per_batch", "server CPU per 16 MiB batch (ms)"),
        ("batches_per_s", "16 MiB batches saved per second"),
    ]
    if all("save_vs_memcpy" in arm["summary"]["1"] for arm in arms):
        panels.append(("save_vs_memcpy", "save stream / memcpy, same run"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, title) in zip(axes, panels, strict=True):
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs = [t + i * width for t in range(2)]
            med = [arm["summary"][str(t)][key]["median"] for t in (1, 2)]
            worst = [arm["summary"][str(t)][key]["worst"] for t in (1, 2)]
            ax.bar(xs, med, width, label=arm["label"])
            ax.scatter(xs, worst, color="black", marker="_", s=200)
        if key == "save_vs_memcpy":
            ax.axhline(0.8, color="gray", linestyle="--", linewidth=1, label="issue 16's 80 %")
        ax.set_xticks([t + 0.4 - width / 2 for t in range(2)], ["1 thread", "2 threads"])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("save stream through client/save_pipeline.py, pool full (bar: median, tick: worst)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
