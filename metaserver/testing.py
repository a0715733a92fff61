"""Real etcd processes, metaserver replica processes and network namespaces for tests and benchmarks.

    with EtcdCluster(tmp_path, members=3) as etcd:          # real `etcd` (Debian etcd-server 3.4)
        with MetaServerProcess(tmp_path, etcd_endpoints=etcd.endpoints) as replica:
            ...
    etcd.kill_member(1)                                       # SIGKILL one member

Every etcd member has its own data directory under the given folder, listens on
free loopback ports (or on addresses the caller names, e.g. the root-side end of
a veth pair) and is killed with its process group on exit. ``NetnsLink`` makes a
network namespace joined to the root namespace by veth pairs, with names unique
to this process and run, and deletes it on exit even when the test failed.
Nothing here is a stand-in: these are the processes the product talks to.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ETCD_BINARY = "etcd"


def etcd_available() -> str | None:
    """None when the etcd binary is installed, else the reason (for pytest.skip)."""
    if shutil.which(ETCD_BINARY) is None:
        return "etcd is not installed (Debian package etcd-server; ci/apt-packages.txt lists it)"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Polls ``predicate`` until it is truthy; at the deadline, AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:.1f}s")
        time.sleep(interval_s)


def _kill_group(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class EtcdMember:
    """One etcd process of a cluster (started by EtcdCluster)."""

    def __init__(self, name: str, data_dir: pathlib.Path, client_host: str, peer_host: str) -> None:
        self.name = name
        self.data_dir = data_dir
        self.client_url = f"http://{client_host}:{free_port(client_host)}"
        self.peer_url = f"http://{peer_host}:{free_port(peer_host)}"
        self.log_path = data_dir.parent / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return self.client_url.removeprefix("http://")

    def start(self, initial_cluster: str, token: str, state: str = "new") -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            ETCD_BINARY,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-token", token,
            "--initial-cluster-state", state,
            # etcd's defaults (100 ms heartbeat, 1000 ms election timeout): what a deployment runs.
            "--heartbeat-interval", "100",
            "--election-timeout", "1000",
            "--log-level", "warn",
            "--logger", "zap",
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        _kill_group(self.proc)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class EtcdCluster:
    """``members`` real etcd processes forming one cluster; a context manager that kills them all."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        members: int = 1,
        client_host: str = "127.0.0.1",
        peer_host: str = "127.0.0.1",
        start_timeout_s: float = 30.0,
    ) -> None:
        reason = etcd_available()
        if reason:
            raise RuntimeError(reason)
        self.workdir = pathlib.Path(workdir) / f"etcd-{os.getpid()}-{time.monotonic_ns()}"
        self.members = [
            EtcdMember(f"m{i}", self.workdir / f"m{i}.data", client_host, peer_host) for i in range(members)
        ]
        self.token = self.workdir.name
        self.start_timeout_s = start_timeout_s

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self) -> EtcdCluster:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        try:
            for member in self.members:
                member.start(initial, self.token)
            for member in self.members:
                wait_until(member.healthy, self.start_timeout_s, f"etcd member {member.name} healthy")
        except BaseException as exc:
            logs = "\n".join(f"--- {m.name} ---\n{m.log_tail()}" for m in self.members)
            self.stop()
            raise RuntimeError(f"etcd cluster did not start: {exc}\n{logs}") from exc
        return self

    def kill_member(self, i: int) -> None:
        self.members[i].kill()

    def stop(self) -> None:
        for member in self.members:
            member.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def read_json_line(proc: subprocess.Popen, timeout_s: float = 30.0) -> dict:
    """The next JSON line a child prints on stdout (its "ready" line), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            return json.loads(line)
        if proc.poll() is not None:
            break
    raise AssertionError(f"no JSON line from pid {proc.pid} (exit {proc.poll()})")


class MetaServerProcess:
    """A real ``pegaflow-metaserver`` process on free ports; ``kill()`` is SIGKILL."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        etcd_endpoints: list[str] | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        host: str = "127.0.0.1",
        launcher: list[str] | tuple[str, ...] = (),
        log_level: str = "info",
        port: int | None = None,
    ) -> None:
        """``launcher`` prefixes the command (e.g. ``ip netns exec NAME``); ``host``:``port`` is where it
        listens (a free port by default; a fixed one survives a restart)."""
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = [*launcher, sys.executable, "-m", "pegaflow.metaserver"]
        if port is None:
            # Port 0 is read back from the child's ready line. Under a launcher (a fresh network
            # namespace, where nothing else listens) the host may not exist here to bind a probe.
            port = random.randint(20000, 60999) if launcher else 0
        self.args += ["--addr", f"{host}:{port}"]
        self.args += ["--http-addr", f"{host}:0", "--log-level", log_level]
        if etcd_endpoints:
            self.args += ["--etcd-endpoints", ",".join(etcd_endpoints)]
        self.args += list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self.log_path = self.workdir / f"metaserver-{os.getpid()}-{time.monotonic_ns()}.log"

    @property
    def addr(self) -> str:
        return self.ready["addr"]

    def start(self, timeout_s: float = 30.0) -> MetaServerProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self.ready = read_json_line(self.proc, timeout_s)
        except BaseException as exc:
            self.kill()
            raise RuntimeError(f"metaserver did not start: {exc}\n{self.log_tail()}") from exc
        return self

    def kill(self) -> None:
        _kill_group(self.proc)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> MetaServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def netns_unavailable() -> str | None:
    """None when this process may create network namespaces, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


class NetnsLink:
    """A network namespace joined to the root namespace by ``links`` veth pairs, one /30 subnet each.

    Pair ``i`` has the root-side address ``root_addr(i)`` and the namespace-side
    address ``ns_addr(i)``; ``set_link(i, up=False)`` takes the namespace end
    down (a partition of that path only). Names carry the pid and a counter, so
    parallel runs never collide; ``close()`` (also on exit) deletes the namespace,
    which deletes its veth ends and so their root-side peers.
    """

    _counter = 0

    def __init__(self, links: int = 1) -> None:
        reason = netns_unavailable()
        if reason:
            raise RuntimeError(reason)
        NetnsLink._counter += 1
        tag = f"{os.getpid() % 100000}{NetnsLink._counter}"
        self.name = f"pgms{tag}"
        # 10.(200+k).x.y/30 per pair: addresses that exist only inside this namespace pair.
        base = (os.getpid() * 7 + NetnsLink._counter) % 250
        self._pairs = [
            (f"pr{tag}{i}"[:15], f"pn{tag}{i}"[:15], f"10.{200 + i}.{base}.1", f"10.{200 + i}.{base}.2")
            for i in range(links)
        ]
        self._created = False

    def root_addr(self, i: int = 0) -> str:
        return self._pairs[i][2]

    def ns_addr(self, i: int = 0) -> str:
        return self._pairs[i][3]

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def _ip(self, *args: str, ns: bool = False) -> None:
        cmd = (["ip", "netns", "exec", self.name] if ns else []) + ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=20)

    def start(self) -> NetnsLink:
        try:
            self._ip("netns", "add", self.name)
            self._created = True
            self._ip("link", "set", "lo", "up", ns=True)
            for root_if, ns_if, root_addr, ns_addr in self._pairs:
                self._ip("link", "add", root_if, "type", "veth", "peer", "name", ns_if)
                self._ip("link", "set", ns_if, "netns", self.name)
                self._ip("addr", "add", f"{root_addr}/30", "dev", root_if)
                self._ip("link", "set", root_if, "up")
                self._ip("addr", "add", f"{ns_addr}/30", "dev", ns_if, ns=True)
                self._ip("link", "set", ns_if, "up", ns=True)
        except BaseException:
            self.close()
            raise
        return self

    def set_link(self, i: int, up: bool) -> None:
        self._ip("link", "set", self._pairs[i][1], "up" if up else "down", ns=True)

    def close(self) -> None:
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=20)
            self._created = False
        for root_if, *_ in self._pairs:
            subprocess.run(["ip", "link", "del", root_if], capture_output=True, timeout=20)

    def __enter__(self) -> NetnsLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
