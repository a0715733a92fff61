"""GPU requests in flight two at a time, without a GPU: the client library and the doorbell alone.

    .venv/bin/python bench/doorbell_streams.py [--reps 3] [--ops 6] [--out DIR]

`gpu_bench.py --stream-inflight 1,2` on the lent H100 host (server/gpu/README.md, 2026-12-07) saw
requests of two-in-flight streams take 2-10x their share while the server's own timing showed every
data path under 30 ms. This runs the same streams (N threads of one client process, one untimed
request each, then ``--ops`` SaveFromDevice or LoadToDevice requests of 256 hashes back to back,
timed from the first timed request to the last answer) through the real client (client/doorbell.py,
its native answer wait, a frozen heap as in gpu_bench) and a real doorbell server in a process of its
own (server/endpoints/doorbell.py, the serving process's tuning), whose data path stands in for the
GPU: ``--fixed-ms`` of work per request, then ``--copy-ms`` holding one lock (the copy engine, which
serialises two requests' bytes). What the GPU host adds is then what differs from these numbers.

Writes doorbell_streams.json (per rep and N: wall time, the copy-bound ideal, every request's ms) and
doorbell_streams.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
HASHES = 256


def serve(path: str, fixed_s: float, copy_s: float) -> None:
    """The doorbell over a data path that sleeps: ``fixed_s``, then ``copy_s`` under one lock."""
    from pegaflow.server import runtime
    from pegaflow.server.config import ServerConfig
    from pegaflow.server.endpoints.doorbell import DoorbellServer
    from pegaflow.server.endpoints.tests.support import Loaded, Saved, StandInGpu

    copy_engine = threading.Lock()

    class SleepingGpu(StandInGpu):
        def _copy(self) -> None:
            time.sleep(fixed_s)
            with copy_engine:
                time.sleep(copy_s)

        def save(self, session_id, reg_id, hashes, block_ids, deadline):
            self._copy()
            return Saved([1] * len(hashes), len(hashes))

        def load(self, session_id, reg_id, hashes, block_ids, deadline, purpose):
            self._copy()
            return Loaded(len(hashes))

    runtime.tune_serving_process()
    server = DoorbellServer(path, SleepingGpu(), "bench", ServerConfig(pool_size_bytes=64 << 20))
    server.start()
    print("ready", flush=True)
    signal.sigwait([signal.SIGTERM])
    server.stop(grace_s=0)


def stream(bell, op: int, inflight: int, ops: int) -> tuple[float, list[float]]:
    hashes = [f"h{i:04d}".encode() for i in range(HASHES)]
    ids = list(range(HASHES))
    spans: list[tuple[float, float]] = []
    together = threading.Barrier(inflight)  # the timed requests of all threads start together

    def body() -> None:
        for j in range(ops + 1):  # j = 0: the connection's first call, untimed
            t0 = time.perf_counter()
            bell.call(op, "bench", "g-any-bench", hashes, ids, time.monotonic() + 10)
            if j:
                spans.append((t0, time.perf_counter()))
            else:
                together.wait(timeout=120)  # a thread that failed never comes: the rest give up

    threads = [threading.Thread(target=body) for _ in range(inflight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(end for _, end in spans) - min(begin for begin, _ in spans)
    return wall, [round((end - begin) * 1e3, 2) for begin, end in spans]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ops", type=int, default=6, help="timed requests per thread")
    ap.add_argument("--fixed-ms", type=float, default=1.0)
    ap.add_argument("--copy-ms", type=float, default=11.0)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], float(args.serve[1]), float(args.serve[2]))
        return
    from pegaflow.client.doorbell import OP_LOAD, OP_SAVE, DoorbellClient
    from pegaflow.client.native import frame_wait

    path = os.path.join(tempfile.mkdtemp(prefix="pgf-ds-", dir="/tmp"), "bell.sock")
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", path, str(args.fixed_ms / 1e3), str(args.copy_ms / 1e3)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the doorbell server did not start")
        bell = DoorbellClient(path, "bench")
        frame_wait.start()
        native = frame_wait.NATIVE.wait_until_ready(60.0)
        gc.collect()
        gc.freeze()
        rows = []
        for rep in range(args.reps):
            for inflight in (1, 2):
                for op, name in ((OP_SAVE, "save"), (OP_LOAD, "load")):
                    wall, ms = stream(bell, op, inflight, args.ops)
                    ideal = inflight * args.ops * args.copy_ms + args.fixed_ms
                    rows.append(
                        {
                            "rep": rep,
                            "inflight": inflight,
                            "op": name,
                            "wall_ms": round(wall * 1e3, 2),
                            "copy_bound_ms": ideal,
                            "op_ms": ms,
                        }
                    )
                    print(
                        f"rep {rep} x{inflight} {name}: {wall * 1e3:.1f} ms (copy-bound {ideal:.0f}); "
                        f"slowest request {max(ms)} ms",
                        flush=True,
                    )
    finally:
        server.terminate()
        server.wait(10)
    summary = {}
    for inflight in (1, 2):
        sel = [r for r in rows if r["inflight"] == inflight]
        ratios = [r["wall_ms"] / r["copy_bound_ms"] for r in sel]
        summary[f"x{inflight}"] = {
            "wall_over_copy_bound_median": round(statistics.median(ratios), 3),
            "wall_over_copy_bound_worst": round(max(ratios), 3),
            "slowest_request_ms": max(max(r["op_ms"]) for r in sel),
        }
    report = {
        "what": __doc__.splitlines()[0],
        "command": " ".join(["bench/doorbell_streams.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "client_wait": "native" if native else f"python ({frame_wait.EXTENSION.probe()})",
        "args": {"ops": args.ops, "fixed_ms": args.fixed_ms, "copy_ms": args.copy_ms, "reps": args.reps},
        "summary": summary,
        "rows": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "doorbell_streams.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "doorbell_streams.png")
    print(json.dumps(summary))


def plot(report: dict, path: pathlib.Path) -> None:
    """Every request's time, per stream (rep, N, op), against the copy engine's share per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    copy_ms = report["args"]["copy_ms"]
    for k, row in enumerate(report["rows"]):
        color = "#1f77b4" if row["inflight"] == 1 else "#ff7f0e"
        ax.scatter([k] * len(row["op_ms"]), row["op_ms"], s=10, color=color)
    for n, color in ((1, "#1f77b4"), (2, "#ff7f0e")):
        ax.axhline(n * copy_ms, color=color, ls="--", lw=0.8, label=f"{n} x copy share ({n} in flight)")
    ax.set_xticks(
        range(len(report["rows"])),
        [f"r{r['rep']} x{r['inflight']}\n{r['op']}" for r in report["rows"]],
        fontsize=7,
    )
    ax.set_ylabel("request ms (client side)")
    ax.set_title(
        "doorbell requests in streams, a sleeping data path (no GPU)\nwall / copy-bound, median (worst): "
        + ", ".join(
            f"{n} {v['wall_over_copy_bound_median']} ({v['wall_over_copy_bound_worst']})"
            for n, v in report["summary"].items()
        ),
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
