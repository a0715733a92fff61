"""Other hosts for tests and benchmarks: Linux network namespaces joined by veth pairs or a bridge.

Each ``NetnsLab`` is one throw-away network: its namespaces, links and the processes started in
them carry a fresh run id in their names (several labs, test runs or engineers on one machine
never collide), and ``close()`` (or leaving the ``with`` block, or interpreter exit) kills every
process it started and deletes every namespace, which takes the veth ends inside them along::

    from pegaflow.common.testing.netns import NetnsLab, require_netns

    require_netns()                          # in a test: pytest.skip(<why>) when this cannot work
    with NetnsLab() as lab:
        a, b = lab.add_node("a"), lab.add_node("b")
        link = lab.connect(a, b)             # one veth pair: a.addr 10.R.K.1, b.addr 10.R.K.2 (/24)
        server = a.popen([sys.executable, "-m", "pegaflow.server", ...], stdout=subprocess.PIPE)
        b.run(["iperf3", "-c", a.addr, "-t", "1"])
        link.set_down()                      # a partition: packets stop, sockets see no RST
        link.set_up()
        link.a.limit_rate("100mbit")         # a slow link (tc tbf on what leaves a)

    # three nodes on one switch (a bridge in a namespace of its own)
    with NetnsLab() as lab:
        nodes = [lab.add_node(n) for n in ("a", "b", "c")]
        switch = lab.switch(nodes)           # node.addr on 10.R.0.0/24
        switch.port(nodes[1]).set_down()     # cut b off the switch

Recipe and numbers: shared/recipes/toolchain.md section 9 (veth B->A: iperf3 16.6-16.9 Gbit/s one
stream; the kernel has no sch_netem, so there is no delay or loss emulation; ``tbf`` rate limits
work). A partition is ``ip link set DEV down``: the local end's carrier drops, the other end sees
nothing, so a peer's socket just stops receiving (no RST): exactly a pulled cable.

Needs root in the initial user namespace (``ip netns add`` bind-mounts under /run/netns). Tests
call ``require_netns()``, which skips with the reason ``netns_unavailable_reason()`` gives (not
root, no ``ip`` binary, or a probe namespace could not be created) and never fails for it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence

IP = "ip"
# Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
_IFNAME_MAX = 15
_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has the command and its stderr."""


def _ip(*args: str, check: bool = True, timeout: float = _TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _tc(netns: str, *args: str, check: bool = True) -> None:
    proc = subprocess.run(
        [IP, "netns", "exec", netns, "tc", *args], capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    if check and proc.returncode != 0:
        raise NetnsError(
            f"`tc {' '.join(args)}` in {netns} failed ({proc.returncode}): {proc.stderr.strip()}"
        )


@functools.cache
def netns_unavailable_reason() -> str | None:
    """None when network namespaces can be made here; otherwise why not, in words (cached)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add); this process runs as uid {os.geteuid()}"
    if shutil.which(IP) is None:
        return "iproute2's `ip` is not on PATH (apt-get install iproute2)"
    probe = f"pfprobe-{secrets.token_hex(4)}"
    try:
        proc = _ip("netns", "add", probe, check=False)
        if proc.returncode != 0:
            return f"`ip netns add` failed here: {proc.stderr.strip()}"
        proc = _ip(
            "-n", probe, "link", "add", "pfprobe0", "type", "veth", "peer", "name", "pfprobe1", check=False
        )
        if proc.returncode != 0:
            return f"cannot create a veth pair inside a namespace: {proc.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip` could not run: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """In a test: skip it (pytest.skip) with the reason when namespaces cannot be made here."""
    reason = netns_unavailable_reason()
    if reason is not None:
        import pytest  # only tests call this

        pytest.skip(reason)


@dataclasses.dataclass
class Node:
    """One "host": a network namespace with loopback up and the addresses of its links."""

    lab: NetnsLab
    name: str  # the caller's name ("a")
    netns: str  # the namespace's unique name
    addresses: list[str] = dataclasses.field(default_factory=list)  # in the order its links were made

    @property
    def addr(self) -> str:
        """The node's first address (its first link's or its switch port's)."""
        if not self.addresses:
            raise NetnsError(f"node {self.name} has no link yet")
        return self.addresses[0]

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this namespace (``ip netns exec``)."""
        return [IP, "netns", "exec", self.netns, *args]

    def popen(self, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts ``args`` inside the namespace in a process group of its own; the lab kills it
        (SIGKILL to the group) at close unless it ended before."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(args), **kwargs)
        self.lab._track(proc)
        return proc

    def run(self, args: Sequence[str], timeout: float = 60.0, check: bool = True, **kwargs):
        """Runs ``args`` inside the namespace to completion (text output captured by default)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        proc = subprocess.run(self.command(args), timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(args)} in {self.name} failed ({proc.returncode}): {proc.stderr}")
        return proc


@dataclasses.dataclass
class LinkEnd:
    """One end of a veth pair: the interface ``iface`` in namespace ``netns``."""

    netns: str
    iface: str
    address: str = ""  # empty for a bridge port

    def set_down(self) -> None:
        _ip("-n", self.netns, "link", "set", "dev", self.iface, "down")

    def set_up(self) -> None:
        _ip("-n", self.netns, "link", "set", "dev", self.iface, "up")

    def limit_rate(self, rate: str, burst: str = "64kb", latency: str = "500ms") -> None:
        """Shapes what leaves this end (``tc tbf``, e.g. ``rate="100mbit"``): a slow link, so a
        transfer lasts long enough to be cut mid-way. (No netem here: no delay or loss.)"""
        _tc(
            self.netns,
            "qdisc",
            "replace",
            "dev",
            self.iface,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )

    def unlimit(self) -> None:
        _tc(self.netns, "qdisc", "del", "dev", self.iface, "root", check=False)


@dataclasses.dataclass
class Link:
    """A veth pair between two nodes (``a`` and ``b`` ends)."""

    a: LinkEnd
    b: LinkEnd

    def set_down(self) -> None:
        """A partition: the ``a`` end goes down (its carrier drops; ``b`` sees silence, no RST)."""
        self.a.set_down()

    def set_up(self) -> None:
        self.a.set_up()
        self.b.set_up()


@dataclasses.dataclass
class Switch:
    """A Linux bridge in a namespace of its own; each attached node has one port (a veth pair)."""

    netns: str
    bridge: str
    ports: dict[str, tuple[LinkEnd, LinkEnd]]  # node name -> (node end, bridge end)

    def port(self, node: Node) -> LinkEnd:
        """The node's end of its port: ``.set_down()`` cuts the node off every other node."""
        return self.ports[node.name][0]


_LABS: weakref.WeakSet[NetnsLab] = weakref.WeakSet()


@atexit.register
def _close_all_labs() -> None:  # a test process that dies of an exception still cleans up
    for lab in list(_LABS):
        lab.close()


class NetnsLab:
    """A set of namespaces, links and processes torn down together; see the module docstring."""

    def __init__(self, prefix: str = "pf"):
        self.run_id = secrets.token_hex(3)  # 6 hex digits: 16M runs before a collision is likely
        self.prefix = prefix
        # Addresses exist only inside this lab's namespaces; a random second octet still keeps two
        # labs' captures and logs apart.
        self._octet = 16 + secrets.randbelow(200)
        self._nodes: dict[str, Node] = {}
        self._extra_netns: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._links = 0
        self._lock = threading.Lock()
        self._closed = False
        _LABS.add(self)

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ building

    def add_node(self, name: str) -> Node:
        if name in self._nodes:
            raise ValueError(f"node {name!r} exists")
        netns = f"{self.prefix}-{self.run_id}-{name}"
        _ip("netns", "add", netns)
        node = Node(self, name, netns)
        self._nodes[name] = node
        _ip("-n", netns, "link", "set", "lo", "up")
        return node

    def _ifnames(self) -> tuple[str, str]:
        self._links += 1
        a, b = f"v{self.run_id}{self._links}a", f"v{self.run_id}{self._links}b"
        assert len(a) <= _IFNAME_MAX, a
        return a, b

    def connect(self, a: Node, b: Node, mtu: int | None = None) -> Link:
        """One veth pair between ``a`` and ``b`` on a /24 of its own (``.1`` on a, ``.2`` on b)."""
        ia, ib = self._ifnames()
        net = ipaddress.ip_network(f"10.{self._octet}.{self._links}.0/24")
        addr_a, addr_b = str(net[1]), str(net[2])
        _ip("-n", a.netns, "link", "add", ia, "type", "veth", "peer", "name", ib, "netns", b.netns)
        for node, iface, addr in ((a, ia, addr_a), (b, ib, addr_b)):
            _ip("-n", node.netns, "addr", "add", f"{addr}/24", "dev", iface)
            if mtu:
                _ip("-n", node.netns, "link", "set", "dev", iface, "mtu", str(mtu))
            _ip("-n", node.netns, "link", "set", "dev", iface, "up")
            node.addresses.append(addr)
        return Link(LinkEnd(a.netns, ia, addr_a), LinkEnd(b.netns, ib, addr_b))

    def switch(self, nodes: Sequence[Node]) -> Switch:
        """A bridge in its own namespace with every node attached, on 10.R.0.0/24 (node i: .i+1)."""
        netns = f"{self.prefix}-{self.run_id}-sw"
        _ip("netns", "add", netns)
        self._extra_netns.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        bridge = "br0"
        _ip("-n", netns, "link", "add", bridge, "type", "bridge")
        _ip("-n", netns, "link", "set", bridge, "up")
        net = ipaddress.ip_network(f"10.{self._octet}.0.0/24")
        ports = {}
        for i, node in enumerate(nodes):
            inode, ibr = self._ifnames()
            addr = str(net[i + 1])
            _ip("-n", node.netns, "link", "add", inode, "type", "veth", "peer", "name", ibr, "netns", netns)
            _ip("-n", netns, "link", "set", ibr, "master", bridge)
            _ip("-n", netns, "link", "set", ibr, "up")
            _ip("-n", node.netns, "addr", "add", f"{addr}/24", "dev", inode)
            _ip("-n", node.netns, "link", "set", inode, "up")
            node.addresses.append(addr)
            ports[node.name] = (LinkEnd(node.netns, inode, addr), LinkEnd(netns, ibr))
        return Switch(netns, bridge, ports)

    # ------------------------------------------------------------------ processes

    def _track(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self._closed:
                _kill(proc)
                raise NetnsError("the lab is closed")
            self._procs.append(proc)

    @property
    def namespaces(self) -> list[str]:
        return [n.netns for n in self._nodes.values()] + list(self._extra_netns)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kills every process started through the lab (and any other process left inside its
        namespaces: only this lab's runs can be there), then deletes the namespaces. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        for proc in procs:
            _kill(proc)
        for netns in self.namespaces:
            with contextlib.suppress(Exception):
                for pid in _ip("netns", "pids", netns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
        for netns in self.namespaces:
            deadline = time.monotonic() + 5.0
            while True:  # EBUSY while a killed process is still exiting
                proc = _ip("netns", "del", netns, check=False)
                if proc.returncode == 0 or "No such file" in proc.stderr or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        _LABS.discard(self)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # popen() starts each in its own group
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
