"""Peer transport benchmark: TCP pulls between two network namespaces against iperf3 in the same run.

    .venv/bin/python bench/peer_transport_bench.py          # bench/results/peer_transport_bench.{json,png}
    .venv/bin/python bench/peer_transport_bench.py --quick  # shorter run, same shape (root needed)

Two "hosts" (namespaces a and b, one veth pair, common/testing/netns.py). Node a serves 1 GiB of
blocks (4 MiB each) out of a memfd through the real serving side (server/peers/serve.py); node b
pulls them with the real TcpTransport into its own aligned slots. A *pull* is what the remote
source does per prefix: OpenTransfer (gRPC) + fetch (data plane, every block's XXH3-64 checked
on arrival) + CloseTransfer (sent without waiting); its effective throughput is bytes / wall
time of open + fetch. The baseline is ``iperf3 -R -P <streams>`` between the same namespaces in
the same direction (a -> b).

The machine is small and shared (2 cores, other jobs), so a number drifts by 2x within minutes.
The comparison is therefore made in *rounds*: each round runs iperf3 for a few seconds, then a
few 1 GiB pulls of every variant; a round's ratio is its pulls' mean GB/s over its iperf3 GB/s.
Reported per stream count (1, 2, 4) and variant: per-pull GB/s over all rounds (mean, P50, P99
= the 99th percentile of per-pull GB/s as in the seed's figure 5, peak, worst) and the median and
worst round ratio. The issue's target: pulls of >= 1 GiB at >= 80% of same-run iperf3.

Variants of the serving side (same requester): ``sendfile`` hashes each block just before
sending it (a store that keeps no checksums), ``sendfile+sums`` sends the checksum the store kept
at seal (no hashing on the sender), ``sendmsg+sums`` sends with one gathered ``sendmsg`` (a
kernel copy) instead of ``os.sendfile`` (page references). CPU time of both agents per GB moved,
iperf3's own (from its JSON), and single-core XXH3-64 / memcpy rates measured in this process
say what limits the number: sender, receiver and the kernel's copies share two cores.
Smaller pulls (16 .. 256 MiB, variant ``sendfile``) show the fixed cost of a pull.

``--nixl-site DIR`` adds NIXL (PyPI nixl-cu12, UCX backend over UCX's TCP transport, what vLLM's
NixlConnector uses) between the same namespaces: 1 GiB one-sided READs, next to iperf3 -P 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from pegaflow.bench.harness.results import machine_info, percentile, write_json
from pegaflow.common.testing.netns import NetnsLab, netns_unavailable_reason
from pegaflow.common.wire.checksum import checksum
from pegaflow.server.peers.testing import PeerAgent

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MIB = 1 << 20
GIB = 1 << 30
GB = 1e9
IPERF_PORT = 5201
# name -> serve agent flags
VARIANTS = {
    "sendfile": ["--send-mode", "sendfile"],
    "sendfile+sums": ["--send-mode", "sendfile", "--keep-checksums"],
    "sendmsg+sums": ["--send-mode", "sendmsg", "--keep-checksums"],
}


def rate_stats(rates: list[float]) -> dict:
    """GB/s samples -> mean, P50, P99, peak, worst."""
    return {
        "n": len(rates),
        "mean": statistics.fmean(rates),
        "p50": percentile(rates, 50),
        "p99": percentile(rates, 99),
        "peak": max(rates),
        "worst": min(rates),
    }


def microbench(size: int = 256 * MIB, rounds: int = 5) -> dict:
    """Single-thread XXH3-64 and numpy memcpy GB/s on this machine, now (best of ``rounds``)."""
    src = np.frombuffer(os.urandom(size), dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src
    hash_s, copy_s = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        checksum(src)
        hash_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(dst, src)
        copy_s.append(time.perf_counter() - t)
    return {"bytes": size, "xxh3_gbps": size / min(hash_s) / GB, "memcpy_gbps": size / min(copy_s) / GB}


def wait_quiet(max_wait_s: float, threshold: float) -> dict:
    """Waits (up to ``max_wait_s``) for the 1-minute load average to drop below ``threshold``."""
    start = time.monotonic()
    while os.getloadavg()[0] >= threshold and time.monotonic() - start < max_wait_s:
        time.sleep(5)
    return {"waited_s": round(time.monotonic() - start), "load1": os.getloadavg()[0], "threshold": threshold}


def _listening(node, port: int) -> bool:
    return bool(node.run(["ss", "-Hltn", f"sport = :{port}"]).stdout.strip())


def iperf3(a, b, streams: int, seconds: float) -> dict:
    """iperf3 a -> b (client in b, -R: the server in a sends), JSON; GB/s per 0.5 s interval."""
    server = a.popen(["iperf3", "-s", "-1", "-B", a.addr, "-p", str(IPERF_PORT)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _listening(a, IPERF_PORT):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the iperf3 server did not start")
            time.sleep(0.05)
        cmd = ["iperf3", "-c", a.addr, "-p", str(IPERF_PORT), "-R", "-P", str(streams)]
        proc = b.run([*cmd, "-t", str(seconds), "-i", "0.5", "-J"], timeout=seconds + 30, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"iperf3 failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    finally:
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    out = json.loads(proc.stdout)
    received = out["end"]["sum_received"]
    cpu = out["end"]["cpu_utilization_percent"]
    return {
        "gbps": received["bits_per_second"] / 8 / GB,
        "bytes": received["bytes"],
        "seconds": received["seconds"],
        "cpu_s": (cpu["host_total"] + cpu["remote_total"]) / 100 * received["seconds"],
    }


def pulls(requester: PeerAgent, server: PeerAgent, peer: str, size: int, block: int, repeats: int) -> dict:
    """``repeats`` timed pulls (after one warm-up) and both sides' CPU seconds over them."""
    before = server.call({"cmd": "stats"})
    command = {"cmd": "bench", "peer": peer, "count": size // block, "block_bytes": block, "repeats": repeats}
    r = requester.call(command, timeout_s=900)
    after = server.call({"cmd": "stats"})
    if not r.get("ok"):
        raise RuntimeError(f"pull of {size} bytes from {peer} failed: {r}")
    sent = after["serve"]["bytes_sent"] - before["serve"]["bytes_sent"]  # the warm-up's bytes too
    return {
        "rates": [run["bytes"] / run["pull_s"] / GB for run in r["runs"]],
        "fetch_rates": [run["bytes"] / run["fetch_s"] / GB for run in r["runs"]],
        "bytes": sum(run["bytes"] for run in r["runs"]),
        "receiver_cpu_s": r["cpu_s"],
        "sender_cpu_s_per_gb": (after["cpu_s"] - before["cpu_s"]) / (sent / GB),
    }


def run(args) -> dict:
    block = args.block_mib * MIB
    report: dict = {
        "what": "TCP peer pulls (open + fetch, checksummed) vs iperf3 -R, two netns, one veth pair",
        "machine": machine_info(),
        "block_bytes": block,
        "pull_bytes": GIB,
        "quiet": wait_quiet(args.wait_quiet, 3.0) if args.wait_quiet else None,
        "load1_start": os.getloadavg()[0],
        "microbench": microbench(),
        "by_streams": {},
    }
    with NetnsLab(prefix="pfbench") as lab:
        a, b = lab.add_node("a"), lab.add_node("b")
        link = lab.connect(a, b)
        for streams in args.streams:
            report["by_streams"][streams] = measure_streams(args, a, b, streams, block)
        if args.nixl_site:
            report["nixl"] = nixl_pulls(a, b, link, args.nixl_site, block, max(3, args.pulls_per_round * 2))
            print(
                f"nixl: {report['nixl']['pull']['mean']:.2f} GB/s vs iperf3 "
                f"{report['nixl']['iperf3_1_stream_gbps']:.2f}",
                flush=True,
            )
    report["load1_end"] = os.getloadavg()[0]
    return report


class VariantServer:
    """A serve agent of one variant, started for a measurement and stopped after it: one 1 GiB
    pool at a time on this shared machine."""

    def __init__(self, a, requester: PeerAgent, name: str, block: int):
        self.name = name
        self.agent = PeerAgent.start(
            a,
            ["serve", "--host", a.addr, "--blocks", str(GIB // block), "--block-bytes", str(block)]
            + VARIANTS[name],
            timeout_s=180,
        )
        if not requester.call({"cmd": "connect", "peer": self.agent.control, "name": name})["ok"]:
            self.agent.kill()
            raise RuntimeError(f"connect to {name} failed")

    def __enter__(self) -> PeerAgent:
        return self.agent

    def __exit__(self, *exc) -> None:
        self.agent.kill()


def measure_streams(args, a, b, streams: int, block: int) -> dict:
    requester = PeerAgent.start(b, ["requester", "--streams", str(streams)])
    try:
        rounds = []
        acc = {
            name: {"rates": [], "fetch_rates": [], "bytes": 0, "rcpu": 0.0, "scpu": []}
            for name in args.variants
        }
        iperf_rates, iperf_cpu = [], []
        for r in range(args.rounds):
            base = iperf3(a, b, streams, args.iperf_seconds)
            iperf_rates.append(base["gbps"])
            iperf_cpu.append(base["cpu_s"] / (base["bytes"] / GB))
            round_entry = {"iperf3_gbps": base["gbps"], "variants": {}}
            for name in args.variants:
                with VariantServer(a, requester, name, block) as server:
                    p = pulls(requester, server, name, GIB, block, args.pulls_per_round)
                v = acc[name]
                v["rates"] += p["rates"]
                v["fetch_rates"] += p["fetch_rates"]
                v["bytes"] += p["bytes"]
                v["rcpu"] += p["receiver_cpu_s"]
                v["scpu"].append(p["sender_cpu_s_per_gb"])
                mean = statistics.fmean(p["rates"])
                round_entry["variants"][name] = {"pull_gbps": mean, "ratio": mean / base["gbps"]}
            rounds.append(round_entry)
            print(
                f"streams={streams} round {r}: iperf3 {base['gbps']:.2f} GB/s; "
                + ", ".join(
                    f"{n} {v['pull_gbps']:.2f} ({v['ratio']:.0%})" for n, v in round_entry["variants"].items()
                ),
                flush=True,
            )
        variants = {}
        for name, v in acc.items():
            ratios = [rd["variants"][name]["ratio"] for rd in rounds]
            variants[name] = {
                "pull": rate_stats(v["rates"]),
                "fetch_only": rate_stats(v["fetch_rates"]),
                "ratio_median": statistics.median(ratios),
                "ratio_worst": min(ratios),
                "cpu_s_per_gb": {
                    "receiver (b)": v["rcpu"] / (v["bytes"] / GB),
                    "sender (a)": statistics.median(v["scpu"]),
                },
            }
        first = args.variants[0]
        sizes = []
        with VariantServer(a, requester, first, block) as server:
            for size_mib in args.sizes_mib:
                p = pulls(requester, server, first, size_mib * MIB, block, args.pulls_per_round * 2)
                sizes.append({"bytes": size_mib * MIB, "pull": rate_stats(p["rates"])})
        return {
            "iperf3": {**rate_stats(iperf_rates), "cpu_s_per_gb": statistics.median(iperf_cpu)},
            "variants": variants,
            "rounds": rounds,
            "sizes": sizes,
        }
    finally:
        requester.kill()


# NIXL's one-sided READ over UCX (what vLLM's NixlConnector uses), as the issue suggests measuring:
# a target agent in a registers 1 GiB of DRAM and prints its metadata and descriptors; an
# initiator agent in b READs all of it in 4 MiB descriptors, ``reps`` times, then checks the bytes.
NIXL_AGENT = r"""
import json, mmap, os, sys, time
import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config
size, block, role = int(sys.argv[2]), int(sys.argv[3]), sys.argv[1]
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
arr = np.frombuffer(buf, dtype=np.uint8)
agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
agent.register_memory([(arr.ctypes.data, size, 0, "")], "DRAM")
descs = agent.get_xfer_descs([(arr.ctypes.data + i * block, block, 0) for i in range(size // block)], "DRAM")
if role == "target":
    arr.view(np.uint64)[:] = np.arange(size // 8, dtype=np.uint64)
    hello = {"meta": agent.get_agent_metadata().hex(), "descs": agent.get_serialized_descs(descs).hex()}
    print("HELLO " + json.dumps(hello), flush=True)
    sys.stdin.read()
else:
    line = sys.stdin.readline()
    peer = json.loads(line[len("HELLO "):])
    name = agent.add_remote_agent(bytes.fromhex(peer["meta"]))
    remote = agent.deserialize_descs(bytes.fromhex(peer["descs"]))
    runs = []
    for _ in range(int(sys.argv[4])):
        t, cpu = time.perf_counter(), time.process_time()
        handle = agent.initialize_xfer("READ", descs, remote, name)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        runs.append({"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu, "state": state})
        agent.release_xfer_handle(handle)
    ok = bool((arr.view(np.uint64) == np.arange(size // 8, dtype=np.uint64)).all())
    print("RESULT " + json.dumps({"runs": runs, "verified": ok}), flush=True)
"""


def nixl_pulls(a, b, link, site: str, block: int, repeats: int) -> dict:
    """NIXL READs of 1 GiB a -> b over UCX's TCP transport, next to iperf3 -P 1 in the same run."""
    env = dict(os.environ, PYTHONPATH=site, UCX_TLS="tcp", UCX_TCP_SNDBUF="4M", UCX_TCP_RCVBUF="4M")
    base = iperf3(a, b, 1, 3.0)
    args = [str(GIB), str(block)]
    target = a.popen(
        [sys.executable, "-c", NIXL_AGENT, "target", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(env, UCX_NET_DEVICES=link.a.iface),
    )
    try:
        hello = target.stdout.readline()
        while hello and not hello.startswith("HELLO "):
            hello = target.stdout.readline()
        if not hello:
            raise RuntimeError("the NIXL target agent did not start")
        init = b.popen(
            [sys.executable, "-c", NIXL_AGENT, "initiator", *args, str(repeats)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(env, UCX_NET_DEVICES=link.b.iface),
        )
        out, _ = init.communicate(hello, timeout=900)
    finally:
        target.kill()
        target.wait(30)
    result = json.loads(
        next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]
    )
    rates = [GIB / r["s"] / GB for r in result["runs"] if r["state"] == "DONE"]
    return {
        "what": "nixl-cu12, UCX backend, UCX_TLS=tcp (4 MiB socket buffers), 1 GiB READ in 4 MiB descriptors",
        "verified": result["verified"],
        "pull": rate_stats(rates),
        "initiator_cpu_s_per_gb": statistics.median(r["cpu_s"] / (GIB / GB) for r in result["runs"]),
        "iperf3_1_stream_gbps": base["gbps"],
        "ratio_vs_iperf3": statistics.fmean(rates) / base["gbps"],
    }


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    streams = sorted(report["by_streams"], key=int)
    names = list(report["by_streams"][streams[0]]["variants"])
    width = 0.8 / (len(names) + 1)
    x = np.arange(len(streams))
    for k, name in enumerate(names):
        stats = [report["by_streams"][s]["variants"][name] for s in streams]
        mean = [v["pull"]["mean"] for v in stats]
        err = [
            [m - v["pull"]["worst"] for m, v in zip(mean, stats, strict=True)],
            [v["pull"]["peak"] - m for m, v in zip(mean, stats, strict=True)],
        ]
        pos = x - 0.4 + width * (k + 0.5)
        left.bar(pos, mean, width, yerr=err, capsize=3, label=f"pull 1 GiB, {name}")
        for i, v in enumerate(stats):
            left.plot([pos[i] - width / 2, pos[i] + width / 2], [v["pull"]["p99"]] * 2, "k--", lw=0.8)
            left.annotate(f"{v['ratio_median']:.0%}", (pos[i], mean[i]), ha="center", va="bottom", fontsize=7)
    iperf = [report["by_streams"][s]["iperf3"] for s in streams]
    left.bar(
        x - 0.4 + width * (len(names) + 0.5),
        [i["mean"] for i in iperf],
        width,
        color="grey",
        yerr=[[i["mean"] - i["worst"] for i in iperf], [i["peak"] - i["mean"] for i in iperf]],
        capsize=3,
        label="iperf3 -R, same streams, same rounds",
    )
    left.set_xticks(x, [f"{s} stream{'s' if int(s) > 1 else ''}" for s in streams])
    left.set_ylabel("GB/s: mean (bars), worst..peak (whiskers), P99 (dashed)")
    left.set_title("1 GiB pulls between two netns; label: median round ratio to iperf3", fontsize=10)
    left.set_ylim(0, left.get_ylim()[1] * 1.3)
    left.legend(fontsize=7, ncol=2, loc="upper left")
    for s in streams:
        sizes = report["by_streams"][s]["sizes"]
        big = report["by_streams"][s]["variants"][names[0]]["pull"]["mean"]
        xs = [p["bytes"] >> 20 for p in sizes] + [1024]
        right.plot(xs, [p["pull"]["mean"] for p in sizes] + [big], "o-", label=f"{s} streams ({names[0]})")
    right.set_xscale("log", base=2)
    right.set_xlabel("pull size (MiB)")
    right.set_ylabel("GB/s (mean, open + fetch)")
    right.set_title("Effective throughput by pull size")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds, shorter iperf3 runs")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256], help="smaller pulls (< 1 GiB)")
    p.add_argument("--block-mib", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pulls-per-round", type=int, default=3, help="1 GiB pulls per variant per round")
    p.add_argument("--iperf-seconds", type=float, default=3.0)
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many seconds for load1 < 3")
    p.add_argument(
        "--nixl-site",
        default="",
        help="also measure NIXL over UCX TCP: DIR from `pip install --no-deps --target DIR nixl-cu12`",
    )
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "peer_transport_bench.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.pulls_per_round, args.iperf_seconds = 2, 2, 2.0
    reason = netns_unavailable_reason()
    if reason:
        print(f"peer_transport_bench needs network namespaces: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the lab's namespaces and agents are torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    report["args"] = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    write_json(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    for s, e in report["by_streams"].items():
        for name, v in e["variants"].items():
            pull = v["pull"]
            print(
                f"streams={s} {name}: pull {pull['mean']:.2f} GB/s mean (P50 {pull['p50']:.2f}, P99 "
                f"{pull['p99']:.2f}, peak {pull['peak']:.2f}, worst {pull['worst']:.2f}); iperf3 "
                f"{e['iperf3']['mean']:.2f}; round ratios: median {v['ratio_median']:.0%}, "
                f"worst {v['ratio_worst']:.0%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
