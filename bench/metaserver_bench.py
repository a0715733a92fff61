"""pegaflow-metaserver benchmark: capacity of one leader, and failover between replicas on etcd.

    .venv/bin/python bench/metaserver_bench.py            # writes bench/results/metaserver_bench.{json,png}
    .venv/bin/python bench/metaserver_bench.py --quick    # 10^5 / 10^6 only, one failover run

1. Capacity (issue 14, item 5). A real ``pegaflow-metaserver`` process (no etcd: the
   same index and service a leader runs); this process plays 8 .. 64 nodes. For each
   size (10^5, 10^6, 10^7 entries) and node count: every node registers and publishes
   its own blocks (distinct 32-byte hashes, batches of 16384, two senders in flight).
   Requests are serialized before the clock starts, so the figure is what the leader
   ingests, not what this client can build. Then Locate of 64-hash prefixes (every one
   a prefix some node published: a hit), closed loop: one caller (latency p50 / p99)
   and four callers (throughput), idle and while a node keeps publishing. Every answer
   is checked: the node named must be the one that published that prefix. Memory per
   entry = (metaserver RSS after - before publishing) / entries. ``--max-entries`` is
   1.25 x the size, so the table is 80% full at the end.
   Baseline in the same run: the previous index (``OrderedDict`` keyed by
   ``(namespace, hash)``, read from git at ``--baseline-commit``) in-process, against
   the new one in-process, publish keys/s and bytes per entry at 10^5 and 10^6.
2. Failover (issue 14 targets). One etcd 3.4 member, two replicas, 8 nodes
   (``BlockPublisher``, the library pegaflow-server uses) holding 10^6 blocks in all.
   The leader is SIGKILLed; measured: until a publish is accepted again (a probe
   node registers and publishes at the standby every 10 ms), and until >= 95% of the
   live nodes' blocks are back in the new leader's index. The killed replica is
   restarted as the next standby; ``--failovers`` kills in a row, median and worst.

Targets: >= 500,000 published keys/s, Locate p99 <= 5 ms at 10^7 entries, <= 128 bytes
per entry; publishes accepted <= 3 s after the kill, >= 95% back <= 10 s after that.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

from pegaflow.metaserver.client import MetaClient
from pegaflow.metaserver.publisher import BlockPublisher, MetaServerTargets
from pegaflow.metaserver.testing import EtcdCluster, MetaServerProcess, wait_until
from pegaflow.metaserver.types import NamespaceDelta
from pegaflow.metaserver.validation import MAX_KEYS_PER_CALL, MAX_MESSAGE_BYTES
from pegaflow.proto import metaserver_pb2 as pb

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
NS = "ns-bench-0123456789abcdef"
PREFIX = 64
SENDERS = 2


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def node_hashes(node: int, count: int, seed: int = 0) -> np.ndarray:
    """(count, 32) uint8: node's block hashes (random, distinct across nodes by the first 4 bytes)."""
    rng = np.random.default_rng(seed * 1000 + node)
    out = rng.integers(0, 256, size=(count, 32), dtype=np.uint8)
    out[:, :4] = np.frombuffer(node.to_bytes(4, "big"), dtype=np.uint8)
    return out


def rows(arr: np.ndarray) -> list[bytes]:
    buf = arr.tobytes()
    w = arr.shape[1]
    return [buf[i * w : (i + 1) * w] for i in range(arr.shape[0])]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class RawStub:
    """Unary calls with pre-serialized requests (bytes in, bytes out)."""

    def __init__(self, addr: str) -> None:
        self.channel = grpc.insecure_channel(
            addr,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self.publish = self.channel.unary_unary("/pegaflow.meta.v1.MetaServer/PublishBlocks")
        self.locate = self.channel.unary_unary("/pegaflow.meta.v1.MetaServer/Locate")

    def close(self) -> None:
        self.channel.close()


# --------------------------------------------------------------------------- capacity


def capacity_point(workdir: pathlib.Path, entries: int, nodes: int, locates: int) -> dict:
    per_node = entries // nodes
    ms = MetaServerProcess(
        workdir,
        extra_args=["--max-entries", str(int(entries * 1.25)), "--lease-ttl", "300"],
        log_level="warning",
    ).start()
    try:
        client = MetaClient(ms.addr, timeout_s=30)
        leases = [
            client.register(f"node-{k}", f"10.9.{k // 250}.{k % 250 + 1}:50055").lease_id
            for k in range(nodes)
        ]
        # Requests built and serialized before timing; hashes kept per node for the Locate checks.
        # Unsequenced (sequence 0): two senders in flight may reorder one node's batches; the
        # sequence check itself is a few integer compares per batch.
        per_node_requests: list[list[bytes]] = []
        prefixes: list[tuple[int, bytes]] = []  # (node, serialized LocateRequest)
        rng = np.random.default_rng(entries + nodes)
        for k in range(nodes):
            arr = node_hashes(k, per_node)
            mine = []
            for start in range(0, per_node, MAX_KEYS_PER_CALL):
                req = pb.PublishBlocksRequest(
                    lease_id=leases[k],
                    deltas=[
                        pb.NamespaceDelta(namespace=NS, added=rows(arr[start : start + MAX_KEYS_PER_CALL]))
                    ],
                )
                mine.append(req.SerializeToString())
            per_node_requests.append(mine)
            for start in rng.integers(0, max(1, per_node - PREFIX), size=max(1, locates // nodes)):
                prefixes.append(
                    (
                        k,
                        pb.LocateRequest(
                            namespace=NS, block_hashes=rows(arr[start : start + PREFIX])
                        ).SerializeToString(),
                    )
                )
            del arr
        # Interleaved across nodes, as a fleet sends.
        work = [req for batch in zip(*per_node_requests, strict=False) for req in batch]
        work += [req for mine in per_node_requests for req in mine[len(per_node_requests[-1]) :]]
        del per_node_requests
        gc.collect()
        rss_before = rss_bytes(ms.proc.pid)
        stub = RawStub(ms.addr)
        lock = threading.Lock()
        position = [0]
        failures = []

        def sender():
            while True:
                with lock:
                    if position[0] >= len(work):
                        return
                    data = work[position[0]]
                    position[0] += 1
                try:
                    stub.publish(data, timeout=60)
                except grpc.RpcError as exc:
                    failures.append(str(exc.code()))

        started = time.perf_counter()
        threads = [threading.Thread(target=sender) for _ in range(SENDERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        publish_s = time.perf_counter() - started
        stats = client.stats()
        rss_after = rss_bytes(ms.proc.pid)
        held = stats.entries
        work.clear()
        gc.collect()
        result = {
            "entries_target": entries,
            "nodes": nodes,
            "entries": held,
            "evicted": stats.evicted_entries,
            "publish_failures": len(failures),
            "publish_keys_per_s": per_node * nodes / publish_s,
            "publish_s": publish_s,
            "rss_delta_bytes": rss_after - rss_before,
            "bytes_per_entry": (rss_after - rss_before) / max(1, held),
            # Other jobs on this 2-core machine move every figure here: the 1-minute load average.
            "load_1min": os.getloadavg()[0],
        }
        result["locate_idle"] = locate_load(stub, prefixes, ms.addr, callers=1)
        result["locate_idle_4"] = locate_load(stub, prefixes, ms.addr, callers=4)
        result["locate_under_publish"] = locate_under_publish(stub, prefixes, ms.addr, client, nodes)
        stub.close()
        client.close()
        return result
    finally:
        ms.kill()


def locate_load(stub: RawStub, prefixes: list[tuple[int, bytes]], addr: str, callers: int) -> dict:
    latencies: list[float] = []
    wrong = [0]
    misses = [0]
    lock = threading.Lock()
    per_caller = max(200, len(prefixes) // callers)

    def caller(c: int):
        mine = []
        for i in range(per_caller):
            node, data = prefixes[(c * per_caller + i) % len(prefixes)]
            t = time.perf_counter()
            reply = pb.LocateResponse.FromString(stub.locate(data, timeout=10))
            mine.append(time.perf_counter() - t)
            if not reply.nodes:
                misses[0] += 1
            elif reply.nodes[0].node_id != f"node-{node}" or len(reply.nodes) != 1:
                wrong[0] += 1
        with lock:
            latencies.extend(mine)

    started = time.perf_counter()
    threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {
        "callers": callers,
        "calls": len(latencies),
        "per_s": len(latencies) / elapsed,
        "p50_ms": pct(latencies, 0.5) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "max_ms": max(latencies) * 1e3,
        "wrong": wrong[0],
        "misses": misses[0],
    }


def locate_under_publish(stub, prefixes, addr, client, nodes) -> dict:
    """Locate latency while one more node streams full batches of fresh keys (evicting the oldest)."""
    stop = threading.Event()
    lease = client.register("churner", "10.8.0.1:50055").lease_id
    arr = node_hashes(nodes + 1000, 8 * MAX_KEYS_PER_CALL, seed=7)
    batches = [
        pb.PublishBlocksRequest(
            lease_id=lease,
            deltas=[pb.NamespaceDelta(namespace=NS, added=rows(arr[s : s + MAX_KEYS_PER_CALL]))],
        ).SerializeToString()
        for s in range(0, len(arr), MAX_KEYS_PER_CALL)
    ]
    sent = [0]

    def churn():
        i = 0
        while not stop.is_set():
            stub.publish(batches[i % len(batches)], timeout=60)
            sent[0] += MAX_KEYS_PER_CALL
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        out = locate_load(stub, prefixes, addr, callers=1)
    finally:
        stop.set()
        t.join()
    out["background_keys_published"] = sent[0]
    return out


def baseline_indexes(sizes: list[int], commit: str) -> dict:
    """Old (OrderedDict) vs new index in-process: publish keys/s and bytes per entry."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:metaserver/index.py"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (subprocess.CalledProcessError, OSError) as exc:
        return {"error": f"baseline index not available at {commit}: {exc}"}
    out = {"commit": commit, "points": []}
    for size in sizes:
        for name in ("previous_ordereddict", "new_numpy"):
            code = (
                "import sys,time,json,resource\n"
                "import numpy as np\n"
                "from pegaflow.metaserver.types import NamespaceDelta\n"
                f"name={name!r}; size={size}\n"
                "if name == 'new_numpy':\n"
                "    from pegaflow.metaserver.index import GlobalIndex\n"
                "else:\n"
                "    ns = {}\n"
                "    exec(compile(sys.stdin.read(), 'old_index.py', 'exec'), ns)\n"
                "    GlobalIndex = ns['GlobalIndex']\n"
                "def rss():\n"
                "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
                "rng = np.random.default_rng(1)\n"
                "arr = rng.integers(0, 256, size=(size, 32), dtype=np.uint8).tobytes()\n"
                "keys = [arr[i*32:(i+1)*32] for i in range(size)]\n"
                "before = rss()\n"
                "index = GlobalIndex(max_entries=int(size * 1.25), max_nodes=64)\n"
                "lease = index.register('n', 'h:1', ttl_s=1e9).lease_id\n"
                "t = time.perf_counter()\n"
                "for s in range(0, size, 16384):\n"
                "    index.publish(lease, [NamespaceDelta('ns', added=keys[s:s+16384])])\n"
                "el = time.perf_counter() - t\n"
                "after = rss()\n"
                "lat = []\n"
                "for i in range(2000):\n"
                "    s = (i * 7919) % (size - 64)\n"
                "    t = time.perf_counter()\n"
                "    index.locate('ns', keys[s:s+64])\n"
                "    lat.append(time.perf_counter() - t)\n"
                "lat.sort()\n"
                "print(json.dumps({'keys_per_s': size / el,\n"
                "    'bytes_per_entry': (after - before) / len(index),\n"
                "    'locate_p50_ms': lat[len(lat)//2]*1e3,\n"
                "    'locate_p99_ms': lat[int(len(lat)*0.99)]*1e3}))\n"
            )
            proc = subprocess.run(
                [sys.executable, "-c", code], input=source, capture_output=True, text=True, timeout=1800
            )
            if proc.returncode != 0:
                out["points"].append({"index": name, "entries": size, "error": proc.stderr[-2000:]})
                continue
            point = json.loads(proc.stdout.strip().splitlines()[-1])
            point.update(index=name, entries=size)
            out["points"].append(point)
            print(f"  baseline {name} @ {size:.0e}: {point}", flush=True)
    return out


# --------------------------------------------------------------------------- failover


def _names_leader(addr: str, leader: str) -> bool:
    try:
        with MetaClient(addr, timeout_s=0.5) as c:
            return c.get_leader().leader_address == leader
    except Exception:
        return False


def failover(workdir: pathlib.Path, blocks: int, nodes: int, runs: int) -> dict:
    per_node = blocks // nodes
    held = {k: rows(node_hashes(k, per_node, seed=3)) for k in range(nodes)}
    with EtcdCluster(workdir, members=1) as etcd:
        replicas = [
            MetaServerProcess(
                workdir,
                etcd.endpoints,
                extra_args=["--max-entries", str(int(blocks * 1.5))],
                log_level="warning",
            ).start()
            for _ in range(2)
        ]
        addrs = [r.addr for r in replicas]
        targets = MetaServerTargets.parse(",".join(addrs))

        def leader() -> MetaServerProcess | None:
            for r in replicas:
                if r.alive():
                    try:
                        with MetaClient(r.addr, timeout_s=0.5) as c:
                            if c.get_leader().is_leader:
                                return r
                    except Exception:
                        pass
            return None

        wait_until(leader, 20, "a leader")
        pubs = [
            BlockPublisher(targets, f"node-{k}", f"10.7.0.{k + 1}:50055", lambda k=k: [(NS, held[k])])
            for k in range(nodes)
        ]
        for p in pubs:
            p.start()
        first = leader()
        with MetaClient(first.addr, timeout_s=5) as c:
            wait_until(lambda: c.stats().entries >= blocks, 120, "the first fill")
        results = []
        try:
            for run in range(runs):
                current = wait_until(leader, 20, "a leader")
                standby = next(r for r in replicas if r is not current)
                wait_until(
                    lambda s=standby, c=current: _names_leader(s.addr, c.addr),
                    20,
                    "standby ready",
                )
                probe = MetaClient(standby.addr, timeout_s=0.5)
                killed = time.monotonic()
                current.kill()
                accepted = None
                while time.monotonic() - killed < 30:
                    try:
                        reg = probe.register(f"probe-{run}", "10.7.9.9:50055")
                        probe.publish_batch(reg.lease_id, [NamespaceDelta(NS, added=[b"probe"])], 0, 1)
                        accepted = time.monotonic()
                        break
                    except Exception:
                        time.sleep(0.01)
                back95 = None
                while accepted is not None and time.monotonic() - accepted < 60:
                    try:
                        if probe.stats().entries >= 0.95 * blocks:
                            back95 = time.monotonic()
                            break
                    except Exception:
                        pass
                    time.sleep(0.05)
                while time.monotonic() - killed < 120:
                    try:
                        if probe.stats().entries >= blocks:
                            break
                    except Exception:
                        pass
                    time.sleep(0.1)
                full = time.monotonic()
                point = {
                    "run": run,
                    "accepted_after_kill_s": None if accepted is None else accepted - killed,
                    "95pct_after_accepted_s": None if back95 is None else back95 - accepted,
                    "100pct_after_kill_s": full - killed,
                    "leader_changes_seen_by_nodes": sum(p.stats().leader_changes for p in pubs),
                    "load_1min": os.getloadavg()[0],
                }
                print(f"  failover run {run}: {point}", flush=True)
                results.append(point)
                probe.close()
                # The killed replica comes back as the next standby.
                idx = replicas.index(current)
                replicas[idx] = MetaServerProcess(
                    workdir,
                    etcd.endpoints,
                    extra_args=["--max-entries", str(int(blocks * 1.5))],
                    log_level="warning",
                    port=int(current.addr.rsplit(":", 1)[1]),
                ).start()
        finally:
            for p in pubs:
                p.close()
            for r in replicas:
                r.kill()
    accepted = [r["accepted_after_kill_s"] for r in results if r["accepted_after_kill_s"] is not None]
    back = [r["95pct_after_accepted_s"] for r in results if r["95pct_after_accepted_s"] is not None]
    return {
        "blocks": blocks,
        "nodes": nodes,
        "leader_ttl_s": 2,
        "runs": results,
        "accepted_after_kill_s": {"median": statistics.median(accepted), "worst": max(accepted)}
        if accepted
        else None,
        "95pct_after_accepted_s": {"median": statistics.median(back), "worst": max(back)} if back else None,
    }


# --------------------------------------------------------------------------- etcd clients

_CLIENT_PROBE = r"""
import asyncio, json, sys, time
which, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def pct(xs):
    xs = sorted(xs)
    return {"p50_ms": xs[len(xs) // 2] * 1e3, "p99_ms": xs[int(len(xs) * 0.99)] * 1e3}
res = {}
if which == "etcd3":
    import etcd3  # 0.12.0: its generated protobuf modules predate protobuf 4
    cl = etcd3.client(host=host, port=port)
    lease = cl.lease(5)
    ops = [("put", lambda i: cl.put("/k", "v%d" % i)), ("get", lambda i: cl.get("/k")),
           ("keepalive", lambda i: list(lease.refresh())),
           ("txn_create", lambda i: cl.transaction(compare=[cl.transactions.create("/c%d" % i) == 0],
                                                   success=[cl.transactions.put("/c%d" % i, "x", lease)],
                                                   failure=[]))]
elif which == "etcd3gw":
    import etcd3gw
    cl = etcd3gw.client(host=host, port=port)
    lease = cl.lease(ttl=5)
    ops = [("put", lambda i: cl.put("/k", "v%d" % i)), ("get", lambda i: cl.get("/k")),
           ("keepalive", lambda i: lease.refresh()),
           ("txn_create", lambda i: cl.create("/c%d" % i, "x", lease=lease))]
if which in ("etcd3", "etcd3gw"):
    for name, fn in ops:
        ts = []
        for i in range(n):
            t = time.perf_counter(); fn(i); ts.append(time.perf_counter() - t)
        res[name] = pct(ts)
else:
    import aetcd
    async def main():
        async with aetcd.Client(host=host, port=port) as cl:
            lease = await cl.lease(5)
            async def put(i): await cl.put(b"/k", b"v%d" % i)
            async def get(i): await cl.get(b"/k")
            async def ka(i): await lease.refresh()
            async def txn(i):
                key = b"/c%d" % i
                await cl.transaction(compare=[cl.transactions.create(key) == 0],
                                     success=[cl.transactions.put(key, b"x", lease=lease)], failure=[])
            for name, fn in [("put", put), ("get", get), ("keepalive", ka), ("txn_create", txn)]:
                ts = []
                for i in range(n):
                    t = time.perf_counter(); await fn(i); ts.append(time.perf_counter() - t)
                res[name] = pct(ts)
    asyncio.run(main())
print(json.dumps(res))
"""


def etcd_clients(workdir: pathlib.Path, extra_path: str, calls: int = 300) -> dict:
    """Latency of the candidate Python etcd clients against one real etcd member, each in its own
    interpreter (``extra_path`` is prepended to PYTHONPATH: where candidates not in the venv live)."""
    out = {}
    with EtcdCluster(workdir, members=1) as etcd:
        host, port = etcd.endpoints[0].rsplit(":", 1)
        env = dict(os.environ)
        if extra_path:
            env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
        for which in ("aetcd", "etcd3gw", "etcd3"):
            proc = subprocess.run(
                [sys.executable, "-c", _CLIENT_PROBE, which, host, port, str(calls)],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
            )
            if proc.returncode == 0:
                out[which] = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                lines = proc.stderr.strip().splitlines() or ["failed"]
                raised = [line for line in lines if "Error" in line.split(":")[0]]
                out[which] = {"error": (raised or lines)[-1]}
            print(f"  etcd client {which}: {out[which]}", flush=True)
    return out


# --------------------------------------------------------------------------- output


def summarize(points: list[dict]) -> list[dict]:
    """Per (entries, nodes): median and worst over the repeats (worst = lowest rate, highest latency)."""
    out = []
    for key in sorted({(p["entries_target"], p["nodes"]) for p in points}):
        runs = [p for p in points if (p["entries_target"], p["nodes"]) == key]

        def both(values, worst):
            return {"median": statistics.median(values), "worst": worst(values)}

        out.append(
            {
                "entries": key[0],
                "nodes": key[1],
                "runs": len(runs),
                "publish_keys_per_s": both([p["publish_keys_per_s"] for p in runs], min),
                "bytes_per_entry": both([p["bytes_per_entry"] for p in runs], max),
                "locate_idle_p50_ms": both([p["locate_idle"]["p50_ms"] for p in runs], max),
                "locate_idle_p99_ms": both([p["locate_idle"]["p99_ms"] for p in runs], max),
                "locate_under_publish_p99_ms": both([p["locate_under_publish"]["p99_ms"] for p in runs], max),
                "locate_per_s_4_callers": both([p["locate_idle_4"]["per_s"] for p in runs], min),
                "wrong_answers": sum(p[k]["wrong"] for p in runs for k in ("locate_idle", "locate_idle_4")),
                "load_1min": [p.get("load_1min") for p in runs],
            }
        )
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    summary = result["capacity_summary"]
    for nodes in sorted({p["nodes"] for p in summary}):
        pts = [p for p in summary if p["nodes"] == nodes]
        x = [p["entries"] for p in pts]
        rate = [p["publish_keys_per_s"] for p in pts]
        line = axes[0].plot(x, [r["median"] / 1e3 for r in rate], marker="o", label=f"{nodes} nodes, median")
        axes[0].plot(x, [r["worst"] / 1e3 for r in rate], ls=":", color=line[0].get_color(), label="worst")
        for field, style, name in (
            ("locate_idle_p99_ms", "-", "p99 idle"),
            ("locate_under_publish_p99_ms", "--", "p99 under publish"),
            ("locate_idle_p50_ms", ":", "p50 idle"),
        ):
            axes[1].plot(
                x, [p[field]["median"] for p in pts], ls=style, marker="o", label=f"{name}, {nodes} (median)"
            )
    axes[0].axhline(500, color="red", lw=0.8, label="target 500k/s")
    axes[0].set(
        xscale="log",
        xlabel="entries",
        ylabel="published keys/s (thousands)",
        title="Publish (one leader, gRPC)",
    )
    axes[1].axhline(5, color="red", lw=0.8, label="target p99 5 ms")
    axes[1].set(xscale="log", xlabel="entries", ylabel="ms", title="Locate, 64-hash prefix")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fo = result.get("failover")
    if fo and fo.get("runs"):
        runs = fo["runs"]
        idx = np.arange(len(runs))
        axes[2].bar(
            idx - 0.2,
            [r["accepted_after_kill_s"] or 0 for r in runs],
            0.4,
            label="publishes accepted (s after kill)",
        )
        axes[2].bar(
            idx + 0.2,
            [r["95pct_after_accepted_s"] or 0 for r in runs],
            0.4,
            label=">=95% blocks back (s after accepted)",
        )
        axes[2].axhline(3, color="red", lw=0.8, ls="--")
        axes[2].axhline(10, color="orange", lw=0.8, ls="--")
        axes[2].set(
            xlabel="failover run",
            ylabel="s",
            title=f"SIGKILLed leader, {fo['blocks']:.0e} blocks / {fo['nodes']} nodes",
        )
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10^5 and 10^6 entries only, one failover")
    p.add_argument("--sizes", default=None, help="comma-separated entry counts (default 1e5,1e6,1e7)")
    p.add_argument("--nodes", default="8,64", help="comma-separated simulated node counts")
    p.add_argument("--locates", type=int, default=2000, help="Locate calls per measurement")
    p.add_argument("--failovers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="runs of every capacity point (median and worst)")
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--skip-failover", action="store_true")
    p.add_argument(
        "--etcd-clients",
        metavar="PYTHONPATH",
        default=None,
        help="only compare the etcd clients (aetcd, etcd3gw, etcd3); candidates outside the venv are "
        "looked up in this PYTHONPATH (e.g. pip install --target DIR etcd3gw pbr futurist etcd3==0.12.0); "
        "writes bench/results/metaserver_etcd_clients.json",
    )
    p.add_argument("--baseline-commit", default="48d38f8", help="git commit with the previous index")
    p.add_argument("--out", default=str(RESULTS / "metaserver_bench"))
    args = p.parse_args(argv)
    sizes = [int(float(x)) for x in (args.sizes or ("1e5,1e6" if args.quick else "1e5,1e6,1e7")).split(",")]
    node_counts = [int(x) for x in args.nodes.split(",")]
    runs = 1 if args.quick else args.failovers
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="metaserver-bench-"))
    if args.etcd_clients is not None:
        clients = {
            "command": " ".join(
                [pathlib.Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
            ),
            "etcd": subprocess.run(["etcd", "--version"], capture_output=True, text=True).stdout.split("\n")[
                0
            ],
            "calls_each": 300,
            "load_1min": os.getloadavg()[0],
            "clients": etcd_clients(workdir, args.etcd_clients),
        }
        path = RESULTS / "metaserver_etcd_clients.json"
        path.write_text(json.dumps(clients, indent=2) + "\n")
        print(f"wrote {path}")
        return 0
    result: dict = {
        "command": " ".join([pathlib.Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_start": os.getloadavg()},
        "capacity": [],
    }
    if not args.skip_capacity:
        result["baseline"] = baseline_indexes([s for s in sizes if s <= 1_000_000], args.baseline_commit)
        for repeat in range(1 if args.quick else args.repeats):
            for size in sizes:
                for nodes in node_counts:
                    point = capacity_point(workdir, size, nodes, args.locates)
                    point["repeat"] = repeat
                    idle, loaded = point["locate_idle"], point["locate_under_publish"]
                    print(
                        f"capacity {size:.0e} entries / {nodes} nodes: "
                        f"publish {point['publish_keys_per_s']:,.0f} keys/s, "
                        f"{point['bytes_per_entry']:.1f} B/entry, "
                        f"locate p50 {idle['p50_ms']:.2f} p99 {idle['p99_ms']:.2f} ms "
                        f"(under publish p99 {loaded['p99_ms']:.2f}), "
                        f"{point['locate_idle_4']['per_s']:,.0f}/s x4",
                        flush=True,
                    )
                    result["capacity"].append(point)
    result["capacity_summary"] = summarize(result["capacity"])
    if not args.skip_failover:
        result["failover"] = failover(workdir, 1_000_000, 8, runs)
    result["machine"]["load_end"] = os.getloadavg()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    if result["capacity"] or result.get("failover"):
        plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
