"""The scheduler's lookup with the interpreter lock held vs released, beside busy Python threads.

    .venv/bin/python -m pegaflow.bench.held_lookup_bench [--calls 1000] [--rounds 3] [--out DIR]

vLLM's scheduler looks a prompt up inside ``schedule()``, which the whole engine waits for, while
other threads of EngineCore (its input thread hashing a new prompt's blocks, its output thread) run
Python. A call whose send and wait release the interpreter lock must win it back after each, and a
busy thread gives it up only at its switch interval (5 ms). ``query_prefix(hold_lock_s=...)`` sends
the request and waits for the read lane's answer up to that long with the lock kept
(client/frame_link.py, client/native/frame_wait.c); the connector's lookups do so for 2 ms
(connector/scheduler.py, LOOKUP_HOLD_LOCK_S).

One real pegaflow-server; one client process; 78 stored blocks (a 10K-token prompt of the TTFT
benchmark); the scheduler's query (78 hashes, no lease) back to back with 1 ms of pure-Python work
between calls (as the scheduler's own), ``--calls`` per arm and round. Arms, interleaved per round:
``released`` / ``held`` (``hold_lock_s`` 0 / 2 ms) with 0 or 1 busy Python threads in the client
process. Per arm: p50 / p90 / p99 / max in microseconds, median and worst round. JSON + PNG.
A command, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import threading
import time

import numpy as np

from pegaflow.bench.harness import results
from pegaflow.client import KvLayout, PegaClient
from pegaflow.connector.scheduler import LOOKUP_HOLD_LOCK_S
from pegaflow.server.testing import ServerProcess

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BLOCKS, BLOCK_BYTES = 78, 64 << 10


def busy_python(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(200):
            x += i


def python_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(client, inst, hashes, calls: int, hold_s: float, busy: int) -> list[float]:
    stop = threading.Event()
    threads = [threading.Thread(target=busy_python, args=(stop,), daemon=True) for _ in range(busy)]
    for t in threads:
        t.start()
    lat = []
    try:
        for _ in range(calls):
            python_work(0.001)
            t0 = time.perf_counter()
            hit = client.query_prefix(inst, hashes, lease=False, timeout_s=1.0, hold_lock_s=hold_s)
            lat.append((time.perf_counter() - t0) * 1e6)
            if hit.num_hits != len(hashes):
                raise RuntimeError(f"expected {len(hashes)} hits, got {hit.num_hits}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    return lat


def run(calls: int, rounds: int) -> dict:
    arms = [
        (name, hold, busy)
        for busy in (0, 1)
        for name, hold in (("released", 0.0), ("held", LOOKUP_HOLD_LOCK_S))
    ]
    per_arm: dict[str, list[dict]] = {f"{name}, {busy} busy": [] for name, _, busy in arms}
    with (
        tempfile.TemporaryDirectory(prefix="pf-held-") as tmp,
        ServerProcess(pathlib.Path(tmp) / "server", pool_size="64mb") as srv,
    ):
        client = PegaClient(srv.addr, timeout_s=5.0, name="bench-held-lookup")
        client.connect()
        try:
            inst = client.register_instance(
                KvLayout(model_id="bench-held", block_bytes=BLOCK_BYTES, dtype="bfloat16", block_tokens=128)
            )
            hashes = [f"held-{i}".encode() for i in range(BLOCKS)]
            batch = client.allocate(inst, hashes)
            client.seal(batch.save_id)
            served_before = client.stats().hits
            for r in range(rounds):
                order = arms if r % 2 == 0 else arms[::-1]
                for name, hold, busy in order:
                    lat = measure(client, inst, hashes, calls, hold, busy)
                    a = np.asarray(lat)
                    per_arm[f"{name}, {busy} busy"].append(
                        {q: float(np.percentile(a, p)) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
                        | {"max": float(a.max())}
                    )
            hits = client.stats().hits - served_before
        finally:
            client.close()
    summary = {
        arm: {
            f"{q}_us": {"median": statistics.median(r[q] for r in rows), "worst": max(r[q] for r in rows)}
            for q in ("p50", "p90", "p99", "max")
        }
        for arm, rows in per_arm.items()
    }
    return {"per_round": per_arm, "summary": summary, "server_hits_counted": hits}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(report["summary"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for j, q in enumerate(("p50", "p90", "p99")):
        vals = [report["summary"][a][f"{q}_us"]["median"] for a in arms]
        worst = [report["summary"][a][f"{q}_us"]["worst"] for a in arms]
        xs = [i + (j - 1) * 0.27 for i in range(len(arms))]
        ax.bar(xs, vals, width=0.25, label=f"{q} (median of rounds)")
        ax.scatter(xs, worst, color="black", marker="_", s=120, zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(arms)), arms, fontsize=8)
    ax.set_ylabel("us per lookup (tick: worst round)")
    ax.set_title(
        f"scheduler lookup of {BLOCKS} hashes, lock released vs held {LOOKUP_HOLD_LOCK_S * 1e3:.0f} ms, "
        f"{report['rounds']} rounds x {report['calls']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
    ap.add_argument("--name", default="held_lookup")
    args = ap.parse_args(argv)
    report = {
        "command": f"python -m pegaflow.bench.held_lookup_bench --calls {args.calls} --rounds {args.rounds}",
        "machine": results.machine_info(),
        "calls": args.calls,
        "rounds": args.rounds,
        "hold_lock_s": LOOKUP_HOLD_LOCK_S,
        **run(args.calls, args.rounds),
    }
    results.write_json(args.out / f"{args.name}.json", report)
    plot(report, args.out / f"{args.name}.png")
    for arm, s in report["summary"].items():
        print(
            f"{arm:>20}: "
            + ", ".join(
                f"{q} {s[f'{q}_us']['median']:.0f} (worst {s[f'{q}_us']['worst']:.0f})"
                for q in ("p50", "p90", "p99", "max")
            )
            + " us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
