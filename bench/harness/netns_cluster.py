"""Two pegaflow nodes on one machine for the cross-node experiments: network namespaces "a" and "b"
joined by one veth pair (common/testing/netns.py), a pegaflow-metaserver in a's namespace, one
pegaflow-server per node publishing to it and pulling from the other, and what runs beside them:
a client agent per node (bench/harness/node_agent.py), iperf3 between the same namespaces, and vLLM
engines inside a node's namespace.

    with NetnsCluster(workdir, pool_bytes={"a": 3 << 30, "b": 2 << 30}, streams=4) as cluster:
        cluster.agent("a").call({...})           # a client inside node a
        cluster.iperf3(streams=4, seconds=3)     # a -> b, the direction of b's pulls
        cluster.server_cpu_s()                   # {"a": ..., "b": ...}: CPU seconds of each server
        base_url = cluster.http_address("b")     # where a vLLM in b listens (see below)

Why the engines get a second link. The namespaces' addresses exist only inside them, so nothing in
the orchestrator's namespace (health checks, /metrics, the locust load generator) could reach an
engine inside one. `http_address(node)` adds a veth pair between the orchestrator's namespace and
the node, a /30 of its own (the "front-end network" of a real cluster); an engine listens there,
while its connector, its server and every byte a pull moves stay on the node's own link. Deleting
the node's namespace deletes the pair.

Needs root (network namespaces); `unavailable_reason()` says why not, in words.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence

from pegaflow.bench.harness.node_agent import NodeAgent
from pegaflow.bench.harness.procs import tree_cpu_seconds
from pegaflow.common.testing.netns import NetnsLab, netns_unavailable_reason
from pegaflow.metaserver.testing import MetaServerProcess
from pegaflow.server.testing import ServerProcess

GB = 1e9
SERVER_PORT = 50055
IPERF_PORT = 5201
NODES = ("a", "b")


def unavailable_reason() -> str | None:
    """None when the cluster can be built here; else why not, in words (no root, no `ip`)."""
    return netns_unavailable_reason()


def iperf3_missing() -> str | None:
    """None when iperf3 (the throughput baseline) is installed; else the reason."""
    return None if shutil.which("iperf3") else "iperf3 is not installed (Debian package iperf3)"


class NetnsCluster:
    """See the module doc. ``server_args``: extra pegaflow-server flags for both nodes."""

    def __init__(
        self,
        workdir: pathlib.Path,
        pool_bytes: dict[str, int],
        streams: int = 4,
        fetch_deadline_s: float = 10.0,
        server_args: Sequence[str] = (),
        ready_timeout_s: float = 120.0,
    ):
        self.workdir = pathlib.Path(workdir)
        self.pool_bytes = dict(pool_bytes)
        self.streams = streams
        self.fetch_deadline_s = fetch_deadline_s
        self.server_args = list(server_args)
        self.ready_timeout_s = ready_timeout_s
        self.lab: NetnsLab | None = None
        self.nodes: dict = {}
        self.link = None
        self.meta: MetaServerProcess | None = None
        self.servers: dict[str, ServerProcess] = {}
        self.server_ready_s: dict[str, float] = {}
        self._agents: dict[tuple[str, str], NodeAgent] = {}
        self._http: dict[str, str] = {}
        self._host_octet = 224 + secrets.randbelow(30)  # 10.224-253.R.x: the front-end /30s
        self._host_third = secrets.randbelow(256)

    # ------------------------------------------------------------------ lifetime

    def start(self) -> NetnsCluster:
        try:
            self.lab = NetnsLab(prefix="pfrr")
            self.nodes = {name: self.lab.add_node(name) for name in NODES}
            self.link = self.lab.connect(self.nodes["a"], self.nodes["b"])
            a = self.nodes["a"]
            self.meta = MetaServerProcess(self.workdir / "meta", host=a.addr, launcher=a.command([])).start()
            for name in NODES:
                self.start_server(name)
        except BaseException:
            self.close()
            raise
        return self

    def server_flags(self) -> list[str]:
        deadline = self.fetch_deadline_s
        return [
            "--metaserver-addr",
            self.meta.addr,
            "--peer-streams",
            str(self.streams),
            "--peer-fetch-deadline",
            f"{deadline:g}",
            "--peer-transfer-ttl",
            f"{max(2 * deadline, deadline + 20):g}",
            *self.server_args,
        ]

    def start_server(self, name: str) -> ServerProcess:
        """(Re)starts node ``name``'s pegaflow-server on its fixed address."""
        node = self.nodes[name]
        server = ServerProcess(
            self.workdir / f"server-{name}",
            pool_size=f"{self.pool_bytes[name]}b",
            addr=f"{node.addr}:{SERVER_PORT}",
            http_addr=f"{node.addr}:0",
            launcher=node.command([]),
            extra_args=self.server_flags(),
            start_timeout_s=self.ready_timeout_s,
        )
        t0 = time.monotonic()
        server.start()
        self.server_ready_s[name] = time.monotonic() - t0
        self.servers[name] = server
        return server

    def close(self) -> None:
        for agent in self._agents.values():
            with contextlib.suppress(Exception):
                agent.close()
        self._agents.clear()
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.stop()
        if self.meta is not None:
            self.meta.kill()
        if self.lab is not None:
            self.lab.close()  # kills what is left inside, deletes the namespaces and every veth in them

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ what runs on the nodes

    def addr(self, name: str) -> str:
        """Node ``name``'s pegaflow-server (gRPC host:port, on the node's link)."""
        return self.servers[name].addr

    def agent(self, name: str, key: str = "") -> NodeAgent:
        """Node ``name``'s client agent (started on first use); another ``key``, another agent on
        that node (one can read stats while the other waits for a pull)."""
        if (name, key) not in self._agents:
            self._agents[(name, key)] = NodeAgent.start(self.nodes[name])
        return self._agents[(name, key)]

    def server_cpu_s(self) -> dict[str, float]:
        """User + system CPU seconds of each node's server process so far (psutil; `ip netns exec`
        execs the server, so the process is the server itself)."""
        return {n: tree_cpu_seconds(s.proc.pid) if s.alive() else 0.0 for n, s in self.servers.items()}

    def stats(self, name: str) -> dict:
        """GetStats of node ``name``'s server, asked from inside that node."""
        return self.agent(name, "ctl").call({"cmd": "stats", "addr": self.addr(name)})

    def peer_metrics(self, name: str) -> dict[str, float]:
        """Node ``name``'s pulls from peers so far, from its /metrics: chains looked up on other nodes
        by outcome (``pulls_<outcome>``: located, not_located, stale, dropped, joined), and the
        fetches with their summed seconds (``fetches``, ``fetch_s``: the transport's part of a pull)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://{self.servers[name].http_addr}/metrics"
        text = self.agent(name, "ctl").call({"cmd": "http_get", "url": url})["text"]
        out = {"fetches": 0.0, "fetch_s": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.name == "pegaflow_peer_fetch_seconds" and sample.name.endswith("_count"):
                    out["fetches"] += sample.value
                elif family.name == "pegaflow_peer_fetch_seconds" and sample.name.endswith("_sum"):
                    out["fetch_s"] += sample.value
                elif family.name == "pegaflow_remote_pulls":
                    key = f"pulls_{sample.labels.get('outcome')}"
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def meta_stats(self) -> dict:
        return self.agent("a", "ctl").call({"cmd": "meta_stats", "addr": self.meta.addr})

    def wait_published(self, name: str, blocks: int, timeout_s: float = 60.0) -> float:
        """Waits until the metaserver's index holds at least ``blocks`` entries of node ``name`` (its
        publisher batches off the request path); returns the seconds waited."""
        t0 = time.monotonic()
        node_id = self.addr(name)
        while True:
            held = self.meta_stats()["nodes"].get(node_id, 0)
            if held >= blocks:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the metaserver lists {held} blocks of node {name}, wanted {blocks}")
            time.sleep(0.1)

    def wait_located(
        self, name: str, namespace_id: str, prefix: str, blocks: int, timeout_s: float = 60.0
    ) -> float:
        """Waits until the metaserver names node ``name`` for every block of ``prefix``
        (node_agent.prefix_hashes) in ``namespace_id``; returns the seconds waited. Unlike a count of
        entries, this cannot be satisfied by what a dead incarnation of the node published."""
        t0 = time.monotonic()
        node_id = self.addr(name)
        cmd = {
            "cmd": "locate",
            "addr": self.meta.addr,
            "namespace_id": namespace_id,
            "prefix": prefix,
            "blocks": blocks,
        }
        while True:
            held = self.agent("b", "ctl").call(cmd)["nodes"].get(node_id, 0)
            if held >= blocks:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(
                    f"the metaserver names node {name} for {held} of {blocks} blocks of {prefix}"
                )
            time.sleep(0.1)

    def http_address(self, name: str) -> str:
        """An address of node ``name`` that this namespace reaches (see the module doc), made once."""
        if name in self._http:
            return self._http[name]
        k = len(self._http) + 1
        node = self.nodes[name]
        host_if, node_if = f"h{self.lab.run_id}{k}", f"h{self.lab.run_id}{k}n"
        # a /30 of 10.O.R.0/24 (O, R random: two runs on one machine do not collide)
        prefix, base = f"10.{self._host_octet}.{self._host_third}", 4 * k
        host_addr, node_addr = f"{prefix}.{base + 1}", f"{prefix}.{base + 2}"
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if, "netns", node.netns])
        try:
            _run(["ip", "addr", "add", f"{host_addr}/30", "dev", host_if])
            _run(["ip", "link", "set", host_if, "up"])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node_addr}/30", "dev", node_if])
            _run(["ip", "-n", node.netns, "link", "set", node_if, "up"])
        except BaseException:
            subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=20)
            raise
        self._http[name] = node_addr
        return node_addr

    # ------------------------------------------------------------------ the baseline

    def iperf3(self, streams: int, seconds: float) -> dict:
        """iperf3 from a to b with ``streams`` parallel streams (client in b, ``-R``: the server in a
        sends, the direction of b's pulls); GB/s received, and both ends' CPU seconds per GB."""
        a, b = self.nodes["a"], self.nodes["b"]
        server = a.popen(
            ["iperf3", "-s", "-1", "-B", a.addr, "-p", str(IPERF_PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not a.run(["ss", "-Hltn", f"sport = :{IPERF_PORT}"]).stdout.strip():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the iperf3 server did not start")
                time.sleep(0.05)
            cmd = ["iperf3", "-c", a.addr, "-p", str(IPERF_PORT), "-R", "-P", str(streams)]
            proc = b.run([*cmd, "-t", f"{seconds:g}", "-J"], timeout=seconds + 30, check=False)
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
        gb = received["bytes"] / GB
        return {
            "streams": streams,
            # iperf3 before 3.16 runs every stream of one end in one thread (Debian 12: 3.12)
            "version": out.get("start", {}).get("version"),
            "gbps": received["bits_per_second"] / 8 / GB,
            "bytes": received["bytes"],
            "seconds": received["seconds"],
            # -R: the local end (b) receives, the remote end (a) sends
            "cpu_s_per_gb": {
                "receiver (b)": cpu["host_total"] / 100 * received["seconds"] / gb,
                "sender (a)": cpu["remote_total"] / 100 * received["seconds"] / gb,
            },
        }


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def load_average() -> dict:
    """The 1/5/15-minute load averages now, and the CPUs they compare with."""
    one, five, fifteen = os.getloadavg()
    return {"load1": one, "load5": five, "load15": fifteen, "cpus": os.cpu_count(), "at": time.time()}
