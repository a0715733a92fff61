"""The SSD tier through pegaflow-server: write and read GB/s against fio on the same file system in the
same run, promotion latency of 64 MiB and 1 GiB prefixes, recovery seconds per GiB, and server CPU
seconds per GB moved (issue 11, item 11). The tier alone against fio: bench/ssd_bench.py.

    python bench/ssd_server_bench.py [--dir /var/tmp] [--gib 4] [--runs 3] [--block-mib 2] [--out DIR]

Per run:
  write    a client saves ``--gib`` GiB of blocks into a server with ``--ssd-write-policy on-reuse``
           (nothing is written yet), then looks them up a chunk at a time, so the server writes
           each block at its first DRAM hit; timed from the first lookup until the SSD tier wrote
           every block (GetStats: nothing demoting): the server's demotion rate, DRAM -> SSD, with
           no client copy in the timed span (the first version timed the saves too, which measured
           the client's memcpy on a fast disk);
  restart  the server is stopped and a new one started on the same files: DRAM is empty, every block
           is on SSD; its recovery seconds (tier and index) per GiB of data;
  read     prefixes of 64 MiB and of 1 GiB are looked up (QueryPrefix(lease), then LoadBlocks waits)
           one at a time: promotion latency per prefix (p50 / p99) and the read rate SSD -> DRAM;
  fio      fio with O_DIRECT on the same folder, same block size and queue depth, write then read.
Server CPU is the server process's utime + stime over each phase. Writes ssd_server_bench.json/.png.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from pegaflow.bench.harness import results
from pegaflow.bench.ssd_bench import _fio
from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.server.config import parse_size
from pegaflow.server.testing import ServerProcess, wait_for

MIB, GIB = 1 << 20, 1 << 30


def layout(block_bytes: int) -> KvLayout:
    return KvLayout(
        model_id="ssd-server-bench", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
        block_bytes=block_bytes, num_layers=1, tp_size=1, tp_rank=0, mla=False, extra="",
    )  # fmt: skip


def proc_cpu(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ssd_stats(client: PegaClient):
    stats = client.stats()
    return stats, next(t for t in stats.tiers if t.name == "ssd")


def start(work, ssd_dir, args, policy: str) -> ServerProcess:
    return ServerProcess(
        work,
        pool_size=args.pool_size,
        extra_args=[
            "--ssd-cache-path",
            str(ssd_dir),
            "--ssd-cache-capacity",
            f"{args.capacity_gib}gb",
            "--ssd-write-policy",
            policy,
            "--demote-inflight",
            args.demote_inflight,
            "--promote-inflight",
            "2gb",
        ],  # fmt: skip
        start_timeout_s=300,
    ).start()


def write_phase(client, inst, srv, n_blocks: int, block_bytes: int, limit: int) -> dict:
    """The server's demotion rate, DRAM -> SSD, with the client out of the way: the blocks are
    saved first (untimed; under on-reuse nothing is written at seal), then lookups hit them in DRAM
    a chunk at a time, each hit a second sighting that the server writes to SSD. The client only
    keeps the server's in-flight bound fed (beyond it the server drops a write rather than wait)."""
    row = np.frombuffer(np.random.default_rng(7).bytes(block_bytes), np.uint8)
    hashes = [f"w{i:07d}".encode() for i in range(n_blocks)]
    saved = []
    for lo in range(0, n_blocks, 16):
        got = client.allocate(inst, hashes[lo : lo + 16])
        write_blocks(client.pool_view(got.epoch), got.allocations, [row] * len(got.allocations))
        if got.save_id:
            client.seal(got.save_id)
        saved += [h for h, a in zip(hashes[lo : lo + 16], got.allocations, strict=True) if a.granted]
    if client.stats().demotions_started:
        raise RuntimeError("blocks were written at seal: the write phase needs --ssd-write-policy on-reuse")
    chunk = max(1, (limit // 4) // block_bytes)
    cpu0, t0 = proc_cpu(srv.proc.pid), time.monotonic()
    for lo in range(0, len(saved), chunk):
        while client.stats().demoting_bytes > limit - chunk * block_bytes:
            time.sleep(0.001)
        hit = client.query_prefix(inst, saved[lo : lo + chunk])
        if hit.num_hits != len(saved[lo : lo + chunk]):
            raise RuntimeError(
                f"write phase: {hit.num_hits} of {len(saved[lo : lo + chunk])} blocks hit in DRAM"
            )

    def written() -> bool:
        stats, _ = ssd_stats(client)
        return (
            stats.demoting_bytes == 0
            and stats.demotions_started == stats.demoted_blocks + stats.demotion_failures
        )

    wait_for(written, 600, interval_s=0.005, what="every block written to SSD")
    seconds = time.monotonic() - t0
    stats, tier = ssd_stats(client)
    nbytes = stats.demoted_bytes
    return {
        "blocks": n_blocks,
        "demoted_blocks": stats.demoted_blocks,
        "dropped_blocks": stats.demotions_dropped,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "server_cpu_s_per_gb": (proc_cpu(srv.proc.pid) - cpu0) / (nbytes / 1e9),
        "hashes": saved,
    }


def promote_phase(
    client, inst, srv, hashes: list[bytes], block_bytes: int, prefix_bytes: int, limit: int
) -> dict:
    per = max(prefix_bytes // block_bytes, 1)
    latencies, moved = [], 0
    cpu0, t_all = proc_cpu(srv.proc.pid), 0.0
    for k in range(min(limit, len(hashes) // per)):
        chain = hashes[k * per : (k + 1) * per]
        t0 = time.monotonic()
        hit = client.query_prefix(inst, chain, lease=True, timeout_s=60)
        found = len(client.load_blocks(inst, hit.lease_id, timeout_s=60)) if hit.lease_id else 0
        dt = time.monotonic() - t0
        if hit.lease_id:
            client.release(hit.lease_id)
        latencies.append(dt)
        t_all += dt
        moved += found * block_bytes
        if found != per:
            print(f"  prefix {k}: {found} of {per} blocks came back", file=sys.stderr)
    cpu = proc_cpu(srv.proc.pid) - cpu0
    return {
        "prefix_bytes": per * block_bytes,
        "prefixes": len(latencies),
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": float(np.percentile(latencies, 99)),
        "latency_max_s": max(latencies),
        "gbps": moved / t_all / 1e9 if t_all else 0.0,
        "server_cpu_s_per_gb": cpu / (moved / 1e9) if moved else None,
    }


def one_run(args, root: pathlib.Path, r: int) -> dict:
    block_bytes = args.block_mib * MIB
    n_blocks = int(args.gib * GIB) // block_bytes
    ssd_dir = root / f"ssd{r}"
    ssd_dir.mkdir()
    out: dict = {}
    srv = start(root / f"srv{r}a", ssd_dir, args, "on-reuse")
    try:
        with PegaClient(srv.addr, timeout_s=60) as c:
            inst = c.register_instance(layout(block_bytes))
            w = write_phase(c, inst, srv, n_blocks, block_bytes, parse_size(args.demote_inflight))
            hashes = w.pop("hashes")
            out["write"] = w
    finally:
        srv.stop()
    t0 = time.monotonic()
    srv = start(root / f"srv{r}b", ssd_dir, args, "off")
    try:
        ready_s = time.monotonic() - t0
        with PegaClient(srv.addr, timeout_s=60) as c:
            stats, tier = ssd_stats(c)
            data_gib = stats.recovered_blocks * block_bytes / GIB
            out["recovery"] = {
                "recovered_blocks": stats.recovered_blocks,
                "data_gib": data_gib,
                "tier_recovery_s": tier.recovery_seconds,
                "restart_to_ready_s": ready_s,
                "tier_s_per_10gib": tier.recovery_seconds / data_gib * 10 if data_gib else None,
            }
            inst = c.register_instance(layout(block_bytes))
            out["promote_64mib"] = promote_phase(
                c, inst, srv, hashes, block_bytes, 64 * MIB, args.small_prefixes
            )
            rest = hashes[args.small_prefixes * (64 * MIB // block_bytes) :]
            out["promote_1gib"] = promote_phase(c, inst, srv, rest, block_bytes, GIB, args.large_prefixes)
    finally:
        srv.stop()
    shutil.rmtree(ssd_dir, ignore_errors=True)
    fio_dir = root / f"fio{r}"
    fio_dir.mkdir()
    out["fio_write"] = _fio(fio_dir / "f", "write", block_bytes, args.gib, args.queue_depth)
    out["fio_read"] = _fio(fio_dir / "f", "read", block_bytes, args.gib, args.queue_depth)
    shutil.rmtree(fio_dir, ignore_errors=True)
    w, rd = out["write"]["gbps"], out["promote_1gib"]["gbps"]
    out["write_vs_fio"] = w / out["fio_write"]["gbps"]
    out["read_vs_fio"] = rd / out["fio_read"]["gbps"]
    big, rec = out["promote_1gib"], out["recovery"]
    print(f"run {r}: write {w:.2f} GB/s ({out['write_vs_fio']:.0%} of fio), 1 GiB promotions "
          f"{rd:.2f} GB/s ({out['read_vs_fio']:.0%} of fio), p50 {big['latency_p50_s']:.2f} s, "
          f"recovery {rec['tier_recovery_s']:.2f} s for {rec['data_gib']:.1f} GiB",
          file=sys.stderr, flush=True)  # fmt: skip
    return out


def summary(runs: list[dict]) -> dict:
    def both(path: tuple[str, ...], worst=min) -> dict:
        values = []
        for run in runs:
            v = run
            for k in path:
                v = v[k]
            values.append(v)
        return {"median": statistics.median(values), "worst": worst(values)}

    return {
        "write_gbps": both(("write", "gbps")),
        "fio_write_gbps": both(("fio_write", "gbps")),
        "write_vs_fio": both(("write_vs_fio",)),
        "promote_1gib_gbps": both(("promote_1gib", "gbps")),
        "fio_read_gbps": both(("fio_read", "gbps")),
        "read_vs_fio": both(("read_vs_fio",)),
        "promote_64mib_p50_s": both(("promote_64mib", "latency_p50_s"), max),
        "promote_64mib_p99_s": both(("promote_64mib", "latency_p99_s"), max),
        "promote_1gib_p50_s": both(("promote_1gib", "latency_p50_s"), max),
        "promote_1gib_p99_s": both(("promote_1gib", "latency_p99_s"), max),
        "recovery_s_per_10gib": both(("recovery", "tier_s_per_10gib"), max),
        "write_server_cpu_s_per_gb": both(("write", "server_cpu_s_per_gb"), max),
        "read_server_cpu_s_per_gb": both(("promote_1gib", "server_cpu_s_per_gb"), max),
    }


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(runs))
    a.bar(x - 0.3, [r["write"]["gbps"] for r in runs], 0.2, label="server: DRAM -> SSD (demotion)")
    a.bar(x - 0.1, [r["fio_write"]["gbps"] for r in runs], 0.2, label="fio write")
    a.bar(
        x + 0.1, [r["promote_1gib"]["gbps"] for r in runs], 0.2, label="server: SSD -> DRAM (1 GiB prefixes)"
    )
    a.bar(x + 0.3, [r["fio_read"]["gbps"] for r in runs], 0.2, label="fio read")
    a.set_xlabel("run")
    a.set_ylabel("GB/s")
    a.set_title(f"{report['block_mib']} MiB blocks, QD {report['queue_depth']}, {report['fs']}")
    a.legend(fontsize=7)
    for key, label in (("promote_64mib", "64 MiB prefix"), ("promote_1gib", "1 GiB prefix")):
        b.plot(x, [r[key]["latency_p50_s"] * 1e3 for r in runs], "o-", label=f"{label} p50")
        b.plot(x, [r[key]["latency_p99_s"] * 1e3 for r in runs], "s--", label=f"{label} p99")
    b.set_yscale("log")
    b.set_ylabel("promotion latency (ms)")
    b.set_xlabel("run")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp", help="a folder on the file system to measure")
    p.add_argument("--gib", type=float, default=4.0, help="data written per run")
    p.add_argument("--capacity-gib", type=int, default=8)
    p.add_argument("--pool-size", default="2gb")
    p.add_argument("--demote-inflight", default="512mb", help="the server's bound (below the pool size)")
    p.add_argument("--block-mib", type=int, default=2)
    p.add_argument("--queue-depth", type=int, default=32, help="fio's; the tier's default is 32")
    p.add_argument("--small-prefixes", type=int, default=16)
    p.add_argument("--large-prefixes", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    args = p.parse_args(argv)
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio)")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pegaflow-ssd-server-bench-") as tmp:
        root = pathlib.Path(tmp)
        load = [os.getloadavg()[0]]
        runs = []
        for r in range(args.runs):
            runs.append(one_run(args, root, r))
            load.append(os.getloadavg()[0])
        fs = os.popen(f"stat -f -c %T {root}").read().strip()
    report = {
        "experiment": "ssd_server_bench",
        "command": " ".join(["bench/ssd_server_bench.py", *(argv or sys.argv[1:])]),
        "machine": results.machine_info(),
        "load_1min": load,
        "fs": fs,
        "block_mib": args.block_mib,
        "queue_depth": args.queue_depth,
        "gib_per_run": args.gib,
        "runs": runs,
        "summary": summary(runs),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results.write_json(args.out / "ssd_server_bench.json", report)
    plot(report, args.out / "ssd_server_bench.png")
    for k, v in report["summary"].items():
        print(f"{k}: median {v['median']:.3f}, worst {v['worst']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
