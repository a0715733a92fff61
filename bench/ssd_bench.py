"""SSD tier benchmark: the tier's write / read GB/s with each I/O engine against fio on the same
file system, block size and queue depth in the same run; recovery seconds per GiB; CPU seconds
per GB moved.

    .venv/bin/python bench/ssd_bench.py                 # writes bench/results/ssd_bench.{json,png}
    .venv/bin/python bench/ssd_bench.py --quick         # smaller, same shape
    .venv/bin/python bench/ssd_bench.py --dir /mnt/nvme --wait-quiet 600

1. Throughput, per block size (1 MiB and 2 MiB) and run (``--runs``, interleaved so a load swing
   hits every method alike, the order rotated per run): fio (``ioengine=io_uring``, O_DIRECT,
   ``iodepth`` = the tier's queue depth, one job, its own file in the same folder) writes then
   reads ``--gib``; the tier (one SsdTier per engine, its own files in the same folder, same
   queue depth) writes the same number of blocks from a page-aligned DRAM arena, then reads them
   back into another arena with full verification (header + XXH3 of every payload; a CORRUPT
   answer fails the bench). A warm-up pass per method first, so every measured pass overwrites
   space that was written before (no first-write extent conversion on any side).
   Reported: median and worst GB/s, the tier / fio ratio of medians and the worst per-run ratio,
   CPU seconds per GB (this process's user + sys, all threads; fio's own usr + sys).
2. Recovery: a writer child fills ``--recovery-gib`` into a tier (default engine), waits until its
   sealed segments' summaries are on disk and is SIGKILLed (the segment each path was filling
   has no summary: it is scanned). A fresh child then opens the tier and recovers (timed, each
   ``verify`` mode); a final one after a clean close. Seconds per GiB of recovered data.
3. Checksum cost: XXH3-64 over a 2 MiB buffer, GB/s of one thread (what verification on read
   and the header on write cost in CPU).

The machine's load average is sampled through the run (the dev VM is 2 shared cores and a
shared virtual disk); --wait-quiet waits for a quiet minute first.
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from pegaflow.server.tiers.base import io_bytes

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB, GIB = 1 << 20, 1 << 30
ENGINES = ("threads", "io_uring")
BATCH = 32  # requests per write()/read() call, as the tier mover would batch


# -- helpers ------------------------------------------------------------------------------------


def _aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, nbytes)
    return m, np.frombuffer(m, dtype=np.uint8)


def _source(blocks: int, bs: int) -> tuple[mmap.mmap, np.ndarray]:
    """``blocks`` blocks of data no two 4 KiB pages of which are equal (the virtual disk may
    treat repeated content differently: fio scrambles its buffers for the same reason)."""
    m, a = _aligned(blocks * io_bytes(bs))
    base = np.random.default_rng(blocks).integers(0, 256, min(a.size, 128 * MIB), dtype=np.uint8)
    for off in range(0, a.size, base.size):
        n = min(base.size, a.size - off)
        a[off : off + n] = base[:n]
    pages = a.view(np.uint64)[:: 4096 // 8]
    pages[:] = np.arange(pages.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return m, a


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _fio(path: pathlib.Path, rw: str, bs: int, gib: float, qd: int) -> dict:
    cmd = [
        "fio", "--name=ssd", f"--filename={path}", f"--size={int(gib * GIB)}", f"--bs={bs}",
        f"--iodepth={qd}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}", "--numjobs=1",
        "--output-format=json",
    ]  # fmt: skip
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    job = out["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    seconds = side["runtime"] / 1000
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    moved = side["io_bytes"]
    return {"gbps": moved / seconds / 1e9, "cpu_s_per_gb": cpu_s / (moved / 1e9), "seconds": seconds}


class TierRunner:
    """One SsdTier (one engine) over its own folder, driven like the tier mover drives it."""

    def __init__(self, folder: pathlib.Path, engine: str, capacity: int, qd: int, segment: int):
        from pegaflow.server.tiers.ssd import SsdTier, SsdTierOptions

        folder.mkdir(parents=True, exist_ok=True)
        opts = SsdTierOptions(
            paths=(str(folder),),
            capacity_bytes=capacity,
            segment_bytes=segment,
            io_engine=engine,
            queue_depth=qd,
        )
        self.tier = SsdTier(opts)
        list(self.tier.recover(lambda where, why: None))
        self.engine = self.tier.engine_name
        if self.engine != engine:
            raise SystemExit(f"asked for engine {engine}, the tier runs {self.engine}")

    def _drive(self, fn, reqs, window: int) -> list:
        """Submits ``reqs`` in BATCH-sized calls, at most ``window`` requests outstanding."""
        statuses = []
        pending: collections.deque = collections.deque()
        outstanding = 0
        for i in range(0, len(reqs), BATCH):
            chunk = reqs[i : i + BATCH]
            while pending and outstanding + len(chunk) > window:
                fut, n = pending.popleft()
                statuses += fut.result(120)
                outstanding -= n
            pending.append((fn(chunk), len(chunk)))
            outstanding += len(chunk)
        for fut, _ in pending:
            statuses += fut.result(120)
        return statuses

    def run(self, bs: int, gib: float, src, dst, window: int) -> dict:
        """Writes ``gib`` of blocks from ``src`` (one distinct slot per block, like fio's own
        always-different buffers), then reads them back into ``dst`` (``window`` slots: at most
        ``window`` requests outstanding, so no two in-flight reads share a slot)."""
        from pegaflow.server.tiers.base import IoStatus, ReadRequest, WriteRequest

        tier = self.tier
        n = int(gib * GIB) // bs
        extents = []
        while len(extents) < n:
            got = tier.allocate(bs, n - len(extents))
            if not got:
                raise SystemExit("tier capacity too small for the run")
            extents += got
        stride = io_bytes(bs)
        sv, dv = memoryview(src[0]), memoryview(dst[0])
        tags = [b"bench/%d" % i for i in range(n)]
        w = [
            WriteRequest(e, t, sv[i * stride : (i + 1) * stride])
            for i, (e, t) in enumerate(zip(extents, tags, strict=True))
        ]
        r = [
            ReadRequest(e, t, dv[(i % window) * stride : (i % window + 1) * stride])
            for i, (e, t) in enumerate(zip(extents, tags, strict=True))
        ]
        out = {}
        for name, fn, reqs in (("write", tier.write, w), ("read", tier.read, r)):
            c0, t0 = _cpu(), time.perf_counter()
            statuses = self._drive(fn, reqs, window)
            seconds = time.perf_counter() - t0
            cpu = _cpu() - c0
            bad = [s for s in statuses if s != IoStatus.OK]
            if bad:
                raise SystemExit(f"{self.engine} {name}: {len(bad)} requests not OK: {set(bad)}")
            moved = n * bs
            out[name] = {
                "gbps": moved / seconds / 1e9,
                "cpu_s_per_gb": cpu / (moved / 1e9),
                "seconds": seconds,
            }
        tier.free(extents)
        return out

    def close(self) -> None:
        self.tier.close()


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "worst": min(values), "best": max(values), "runs": values}


# -- part 1 -------------------------------------------------------------------------------------


def throughput(
    folder: pathlib.Path, block_sizes: list[int], gib: float, runs: int, qd: int, segment: int
) -> dict:
    window = 4 * qd
    capacity = int(gib * GIB * 1.1) + 4 * segment
    runners = {e: TierRunner(folder / e, e, capacity, qd, segment) for e in ENGINES}
    fio_file = folder / "fio" / "fio.data"
    fio_file.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    try:
        for bs in block_sizes:
            src = _source(int(gib * GIB) // bs, bs)
            dst = _aligned(window * bs)
            rows: dict = {"fio": [], **{e: [] for e in ENGINES}}
            methods = ["fio", *ENGINES]
            for r in range(runs + 1):  # run 0 is the warm-up
                order = methods[r % len(methods) :] + methods[: r % len(methods)]
                for m in order:
                    if m == "fio":
                        row = {
                            "write": _fio(fio_file, "write", bs, gib, qd),
                            "read": _fio(fio_file, "read", bs, gib, qd),
                        }
                    else:
                        row = runners[m].run(bs, gib, src, dst, window)
                    if r:
                        rows[m].append(row)
                    print(
                        f"  bs {bs >> 20} MiB run {r}{' (warm-up)' if not r else ''} {m:9s} "
                        f"write {row['write']['gbps']:.2f} GB/s  read {row['read']['gbps']:.2f} GB/s",
                        flush=True,
                    )
            out = {}
            for m, rs in rows.items():
                out[m] = {
                    side: {
                        "gbps": _summary([x[side]["gbps"] for x in rs]),
                        "cpu_s_per_gb": statistics.median(x[side]["cpu_s_per_gb"] for x in rs),
                    }
                    for side in ("write", "read")
                }
            for e in ENGINES:
                for side in ("write", "read"):
                    paired = [
                        t[side]["gbps"] / f[side]["gbps"] for t, f in zip(rows[e], rows["fio"], strict=True)
                    ]
                    out[e][side]["ratio_to_fio"] = {
                        "of_medians": out[e][side]["gbps"]["median"] / out["fio"][side]["gbps"]["median"],
                        "paired_median": statistics.median(paired),
                        "paired_worst": min(paired),
                    }
            results[f"{bs >> 20}MiB"] = out
            del src, dst
    finally:
        for runner in runners.values():
            runner.close()
    return results


def segment_sweep(folder: pathlib.Path, sizes: list[int], gib: float, qd: int, engine: str) -> dict:
    """Write and read GB/s of the tier vs segment size (one run each; 2 MiB blocks)."""
    bs, window = 2 * MIB, 4 * qd
    src, dst = _source(int(gib * GIB) // bs, bs), _aligned(window * bs)
    out = {}
    for seg in sizes:
        sub = folder / f"seg{seg >> 20}"
        runner = TierRunner(sub, engine, int(gib * GIB * 1.1) + 4 * seg, qd, seg)
        try:
            runner.run(bs, gib, src, dst, window)  # warm-up
            row = runner.run(bs, gib, src, dst, window)
        finally:
            runner.close()
        shutil.rmtree(sub, ignore_errors=True)
        out[f"{seg >> 20}MiB"] = {k: v["gbps"] for k, v in row.items()}
        wr, rd = row["write"]["gbps"], row["read"]["gbps"]
        print(f"  segment {seg >> 20} MiB: write {wr:.2f}, read {rd:.2f} GB/s", flush=True)
    return out


def fio_queue_depths(folder: pathlib.Path, depths: list[int], gib: float) -> dict:
    """fio alone at several queue depths (2 MiB blocks): what the tier's default depth is chosen by."""
    path = folder / "fio" / "fio.data"
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {}
    for qd in depths:
        w, r = _fio(path, "write", 2 * MIB, gib, qd), _fio(path, "read", 2 * MIB, gib, qd)
        out[str(qd)] = {"write_gbps": w["gbps"], "read_gbps": r["gbps"]}
        print(f"  fio 2 MiB QD {qd}: write {w['gbps']:.2f}, read {r['gbps']:.2f} GB/s", flush=True)
    return out


# -- part 2: recovery (child processes) ---------------------------------------------------------


def _role_writer(folder: str, capacity: int, gib: float, segment: int, engine: str) -> None:
    """Fills the tier FIFO (oldest freed first), waits for the summaries, says READY, hangs."""
    from pegaflow.server.tiers.base import IoStatus, WriteRequest
    from pegaflow.server.tiers.ssd import SsdTier, SsdTierOptions

    tier = SsdTier(
        SsdTierOptions(paths=(folder,), capacity_bytes=capacity, segment_bytes=segment, io_engine=engine)
    )
    live = collections.deque(b.extent for b in tier.recover(lambda w, y: None))
    bs = 2 * MIB
    m, _ = _aligned(64 * io_bytes(bs))
    view = memoryview(m)
    n, total = 0, int(gib * GIB) // bs
    while n < total:
        ext = tier.allocate(bs, min(64, total - n))
        while not ext and live:
            tier.free([live.popleft() for _ in range(min(64, len(live)))])
            ext = tier.allocate(bs, min(64, total - n))
        reqs = [
            WriteRequest(e, b"rec/%d/%d" % (os.getpid(), n + i), view[i * bs : (i + 1) * bs])
            for i, e in enumerate(ext)
        ]
        statuses = tier.write(reqs).result(120)
        assert all(s == IoStatus.OK for s in statuses), statuses
        live.extend(ext)
        n += len(ext)
    tier.flush(60)
    print("READY", flush=True)
    time.sleep(3600)


def _role_recover(folder: str, capacity: int, segment: int, verify: str, engine: str) -> None:
    from pegaflow.server.tiers.ssd import SsdTier, SsdTierOptions

    opts = SsdTierOptions(
        paths=(folder,),
        capacity_bytes=capacity,
        segment_bytes=segment,
        io_engine=engine,
        recovery_verify=verify,
    )
    t0 = time.perf_counter()
    tier = SsdTier(opts)
    t1 = time.perf_counter()
    blocks = list(tier.recover(lambda w, y: None))
    t2 = time.perf_counter()
    r = tier.recovery
    print(
        json.dumps(
            {
                "open_s": t1 - t0,
                "recover_s": t2 - t1,
                "total_s": t2 - t0,
                "blocks": len(blocks),
                "data_gib": r.data_bytes / GIB if r else 0,
                "scanned_segments": r.scanned_segments if r else 0,
                "summary_segments": r.summary_segments if r else 0,
                "skipped": r.skipped if r else 0,
            }
        ),
        flush=True,
    )
    if os.environ.get("SSD_BENCH_CLEAN_CLOSE"):
        tier.close()
    os._exit(0)  # leave the files as they are (no close: the next child sees the same state)


def _child(role: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def recovery(folder: pathlib.Path, gib: float, segment: int, engine: str, runs: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    capacity = int(gib * GIB) + 2 * segment
    out: dict = {"data_gib_written": gib, "segment_mib": segment >> 20, "engine": engine, "crash": {}}
    for verify in ("summary", "headers", "full"):
        rows = []
        for _ in range(runs if verify == "summary" else 1):
            w = _child(
                "writer", folder, capacity, gib if not rows and verify == "summary" else 0.5, segment, engine
            )
            line = w.stdout.readline().strip()
            if line != "READY":
                raise SystemExit(f"recovery writer failed: {line!r}")
            w.send_signal(signal.SIGKILL)  # the crash
            w.wait()
            p = _child("recover", folder, capacity, segment, verify, engine)
            rows.append(json.loads(p.stdout.readline()))
            p.wait()
            print(f"  recovery after kill -9, verify={verify}: {rows[-1]}", flush=True)
        out["crash"][verify] = _recovery_summary(rows)
    env_clean = {**os.environ, "SSD_BENCH_CLEAN_CLOSE": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "recover",
            str(folder),
            str(capacity),
            str(segment),
            "summary",
            engine,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env_clean,
    )
    p.stdout.readline()
    p.wait()  # it recovered (scanning the open segments) and closed cleanly: summaries everywhere
    p = _child("recover", folder, capacity, segment, "summary", engine)
    clean = json.loads(p.stdout.readline())
    p.wait()
    print(f"  recovery after a clean close: {clean}", flush=True)
    out["clean"] = _recovery_summary([clean])
    return out


def _recovery_summary(rows: list[dict]) -> dict:
    per_gib = [r["total_s"] / max(r["data_gib"], 1e-9) for r in rows]
    return {
        # a time: its worst run is the longest (_summary is for rates)
        "total_s": {
            **_summary([r["total_s"] for r in rows]),
            "worst": max(r["total_s"] for r in rows),
            "best": min(r["total_s"] for r in rows),
        },
        "s_per_gib": {"median": statistics.median(per_gib), "worst": max(per_gib)},
        "s_per_10gib_median": statistics.median(per_gib) * 10,
        "runs": rows,
    }


# -- part 3 ---------------------------------------------------------------------------------------


def checksum_rate() -> dict:
    from pegaflow.common.wire.checksum import checksum

    _, buf = _aligned(2 * MIB)
    buf[:] = 7
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            checksum(buf)
        rates.append(200 * 2 * MIB / (time.perf_counter() - t0) / 1e9)
    med = statistics.median(rates)
    return {"xxh3_gbps_one_thread": med, "cpu_s_per_gb": 1 / med}


# -- main -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder on the file system to measure (default: under /tmp)")
    ap.add_argument("--gib", type=float, default=2.0, help="data per throughput pass")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--block-mib", default="1,2")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--segment-mib", type=int, default=128)
    ap.add_argument("--recovery-gib", type=float, default=10.0)
    ap.add_argument("--recovery-runs", type=int, default=3)
    ap.add_argument("--sweep-mib", default="32,128,512", help="segment sizes of the sweep ('' to skip)")
    ap.add_argument("--tmpfs-dir", default="/dev/shm", help="also compare on tmpfs ('' to skip)")
    ap.add_argument("--tmpfs-gib", type=float, default=0.5)
    ap.add_argument("--qd-sweep", default="4,8,16,32,64", help="fio queue depths to sweep ('' to skip)")
    ap.add_argument("--quick", action="store_true", help="0.5 GiB passes, 2 runs, 2 GiB recovery")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for load < 2")
    ap.add_argument("--keep", action="store_true", help="keep the data files")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("role_args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "writer":
        f, cap, gib, seg, eng = a.role_args
        _role_writer(f, int(cap), float(gib), int(seg), eng)
        return 0
    if a.role == "recover":
        f, cap, seg, verify, eng = a.role_args
        _role_recover(f, int(cap), int(seg), verify, eng)
        return 0
    if a.quick:
        a.gib, a.runs, a.recovery_gib, a.recovery_runs, a.tmpfs_gib = 0.5, 2, 2.0, 2, 0.25
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio)")

    from pegaflow.bench.server_bench import LoadSampler, wait_quiet
    from pegaflow.server.tiers.ssd.engines import AUTO_PREFERENCE

    folder = pathlib.Path(a.dir or "/tmp") / f"pegaflow-ssd-bench-{os.getpid()}"
    folder.mkdir(parents=True)
    results: dict = {
        "command": " ".join(["bench/ssd_bench.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": _cpu_model(),
            "kernel": os.uname().release,
            "file_system": _fs_of(folder),
        },
        "params": {
            "gib_per_pass": a.gib,
            "runs": a.runs,
            "queue_depth": a.queue_depth,
            "segment_mib": a.segment_mib,
            "batch": BATCH,
            "fio": "ioengine=io_uring direct=1 numjobs=1 iodepth=queue_depth",
        },
    }
    if a.wait_quiet:
        results["wait_quiet"] = wait_quiet(a.wait_quiet)
    results["load_average_at_start"] = os.getloadavg()
    block_sizes = [int(x) * MIB for x in a.block_mib.split(",")]
    seg = a.segment_mib * MIB
    try:
        with LoadSampler(2.0) as load:
            print("throughput ...", flush=True)
            results["throughput"] = throughput(folder, block_sizes, a.gib, a.runs, a.queue_depth, seg)
        results["throughput"]["load"] = load.summary()
        faster = _faster_engine(results["throughput"])
        results["faster_engine"] = faster
        results["auto_engine_in_code"] = AUTO_PREFERENCE
        if a.tmpfs_dir:
            # The same comparison on memory (tmpfs takes O_DIRECT here): no disk to hide behind,
            # so this shows what the tier's own work (headers, checksums, Python) costs.
            mem = pathlib.Path(a.tmpfs_dir) / f"pegaflow-ssd-bench-{os.getpid()}"
            mem.mkdir(parents=True)
            try:
                with LoadSampler(2.0) as load:
                    print(f"throughput on tmpfs ({a.tmpfs_dir}) ...", flush=True)
                    results["tmpfs_throughput"] = throughput(
                        mem, [2 * MIB], a.tmpfs_gib, max(3, a.runs // 2), a.queue_depth, seg
                    )
                results["tmpfs_throughput"]["load"] = load.summary()
                results["tmpfs_throughput"]["file_system"] = _fs_of(mem)
            finally:
                shutil.rmtree(mem, ignore_errors=True)
        if a.sweep_mib:
            with LoadSampler(2.0) as load:
                print("segment size sweep ...", flush=True)
                sizes = [int(x) * MIB for x in a.sweep_mib.split(",")]
                results["segment_sweep"] = segment_sweep(folder, sizes, a.gib, a.queue_depth, AUTO_PREFERENCE)
            results["segment_sweep"]["load"] = load.summary()
        if a.qd_sweep:
            with LoadSampler(2.0) as load:
                print("fio queue depth sweep ...", flush=True)
                depths = [int(x) for x in a.qd_sweep.split(",")]
                results["fio_queue_depth_sweep"] = fio_queue_depths(folder, depths, a.gib / 2)
            results["fio_queue_depth_sweep"]["load"] = load.summary()
        with LoadSampler(2.0) as load:
            print("recovery ...", flush=True)
            results["recovery"] = recovery(
                folder / "recovery", a.recovery_gib, seg, AUTO_PREFERENCE, a.recovery_runs
            )
        results["recovery"]["load"] = load.summary()
        results["checksum"] = checksum_rate()
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)
    results["load_average_at_end"] = os.getloadavg()
    results["targets"] = _targets(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ssd_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "ssd_bench.png")
    print(json.dumps(results["targets"], indent=2))
    return 0


def _faster_engine(tp: dict) -> dict:
    score = {e: [] for e in ENGINES}
    for key, by in tp.items():
        if key == "load":
            continue
        for e in ENGINES:
            score[e].append(by[e]["write"]["gbps"]["median"] + by[e]["read"]["gbps"]["median"])
    sums = {e: sum(v) for e, v in score.items()}
    return {"engine": max(sums, key=sums.get), "sum_of_median_gbps": sums}


def _targets(r: dict) -> dict:
    out = {}
    for key, by in r["throughput"].items():
        if key == "load":
            continue
        for e in ENGINES:
            for side in ("write", "read"):
                rt = by[e][side]["ratio_to_fio"]
                out[f"{e} {side} {key} / fio"] = {
                    "median_ratio": round(rt["of_medians"], 3),
                    "worst_paired_ratio": round(rt["paired_worst"], 3),
                    "target": 0.9,
                    "met": rt["of_medians"] >= 0.9,
                }
    for key, by in r.get("tmpfs_throughput", {}).items():
        if key in ("load", "file_system"):
            continue
        for e in ENGINES:
            for side in ("write", "read"):
                rt = by[e][side]["ratio_to_fio"]
                out[f"tmpfs: {e} {side} {key} / fio"] = {"median_ratio": round(rt["of_medians"], 3)}
    crash = r["recovery"]["crash"]["summary"]
    out["recovery s per 10 GiB (kill -9, default verify)"] = {
        "median": round(crash["s_per_10gib_median"], 3),
        "target": 2.0,
        "met": crash["s_per_10gib_median"] <= 2.0,
    }
    return out


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def _fs_of(path: pathlib.Path) -> str:
    best = ("", "?", "?")
    for line in pathlib.Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if str(path).startswith(mnt) and len(mnt) > len(best[0]):
            best = (mnt, fstype, dev)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


def _bars(ax, groups: list[tuple[str, dict]], title: str) -> None:
    """Median bars (worst run as a tick) of fio and each engine per group; tier bars say % of fio.
    ``groups``: (label, {method: that method's row for one block size and direction})."""
    colors = {"fio": "#7f7f7f", "threads": "#1f77b4", "io_uring": "#d62728"}
    x = np.arange(len(groups))
    width = 0.27
    for j, m in enumerate(("fio", *ENGINES)):
        med = [g[m]["gbps"]["median"] for _, g in groups]
        worst = [g[m]["gbps"]["worst"] for _, g in groups]
        bars = ax.bar(x + (j - 1) * width, med, width, label=f"{m} (median)", color=colors[m])
        ax.scatter(x + (j - 1) * width, worst, color="black", marker="_", s=200, zorder=3,
                   label="worst run" if j == 0 else None)  # fmt: skip
        if m != "fio":
            for b, (_, g) in zip(bars, groups, strict=True):
                ratio = g[m]["ratio_to_fio"]["of_medians"]
                ax.annotate(f"{ratio:.0%}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(x, [label for label, _ in groups])
    ax.set_ylabel("GB/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skip = ("load", "file_system")
    tp = {k: v for k, v in results["throughput"].items() if k not in skip}
    mem = {k: v for k, v in results.get("tmpfs_throughput", {}).items() if k not in skip}
    fig, axes = plt.subplots(1, 4 if mem else 3, figsize=(22 if mem else 17, 5))
    qd = results["params"]["queue_depth"]
    for ax, side in zip(axes[:2], ("write", "read"), strict=True):
        groups = [(f"{k} blocks", {m: by[m][side] for m in ("fio", *ENGINES)}) for k, by in tp.items()]
        _bars(ax, groups, f"SSD {side}: tier (% of fio) vs fio, QD {qd}, O_DIRECT, same disk")
    if mem:
        groups = [(f"{side} {k}", {m: by[m][side] for m in ("fio", *ENGINES)}) for k, by in mem.items()
                  for side in ("write", "read")]  # fmt: skip
        load = results["tmpfs_throughput"]["load"]["load1_median"]
        _bars(axes[2], groups, f"same on tmpfs (no disk: CPU-bound), load1 {load:.1f}")
    rec = results["recovery"]
    ax = axes[-1]
    labels, vals = [], []
    for verify, row in rec["crash"].items():
        labels.append(f"kill -9\nverify={verify}")
        vals.append(row["s_per_10gib_median"])
    labels.append("clean close")
    vals.append(rec["clean"]["s_per_10gib_median"])
    ax.bar(range(len(vals)), vals, color=["#2ca02c", "#bcbd22", "#ff7f0e", "#17becf"][: len(vals)])
    ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="target 2 s / 10 GiB")
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.set_ylabel("seconds per 10 GiB recovered (log)")
    ax.set_yscale("log")
    ax.set_title(f"Recovery ({rec['data_gib_written']:.0f} GiB written, {rec['segment_mib']} MiB segments)",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=7)
    load = results["throughput"]["load"]
    m = results["machine"]
    fig.suptitle(f"{m['cpu']}, {m['cpus']} CPUs, {m['file_system']}; load1 median {load['load1_median']:.1f} "
                 "(2 cores and the virtual disk shared with other work)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
