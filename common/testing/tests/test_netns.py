"""The network-namespace lab: real namespaces, real veth pairs, torn down afterwards."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pegaflow.common.testing.netns import NetnsLab, netns_unavailable_reason, require_netns

pytestmark = pytest.mark.timeout(60)

# A one-shot TCP echo: prints "ready" once listening, answers one connection, exits.
ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7100)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 7100), timeout=float(sys.argv[2]))
c.settimeout(float(sys.argv[2])); c.sendall(b"ping"); print(c.recv(100).decode())
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _start_echo(node) -> subprocess.Popen:
    proc = node.popen([sys.executable, "-c", ECHO_SERVER, node.addr], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_two_nodes_talk_over_veth_and_a_downed_link_partitions_them():
    require_netns()
    with NetnsLab() as lab:
        a, b = lab.add_node("a"), lab.add_node("b")
        link = lab.connect(a, b)
        assert a.addr != b.addr
        assert {a.netns, b.netns} <= _namespaces()

        _start_echo(a)
        assert b.run([sys.executable, "-c", CLIENT, a.addr, "5"]).stdout.strip() == "ping"

        _start_echo(a)
        link.set_down()
        start = time.monotonic()
        cut = b.run([sys.executable, "-c", CLIENT, a.addr, "0.5"], check=False)
        assert cut.returncode != 0 and time.monotonic() - start < 5
        link.set_up()
        # Carrier comes back at once, but poll rather than assume it.
        deadline = time.monotonic() + 10
        while True:
            ok = b.run([sys.executable, "-c", CLIENT, a.addr, "1"], check=False)
            if ok.returncode == 0 or time.monotonic() > deadline:
                break
        assert ok.stdout.strip() == "ping"
    assert not ({a.netns, b.netns} & _namespaces())


def test_close_kills_processes_and_deletes_every_namespace():
    require_netns()
    lab = NetnsLab()
    nodes = [lab.add_node(n) for n in ("a", "b", "c")]
    switch = lab.switch(nodes)
    assert len({n.addr for n in nodes}) == 3
    sleeper = nodes[2].popen([sys.executable, "-c", "import time; time.sleep(600)"])
    _start_echo(nodes[0])
    assert nodes[1].run([sys.executable, "-c", CLIENT, nodes[0].addr, "5"]).stdout.strip() == "ping"
    switch.port(nodes[1]).set_down()
    names = set(lab.namespaces)
    assert len(names) == 4  # three nodes and the switch
    lab.close()
    assert sleeper.poll() is not None
    assert not (names & _namespaces())
    lab.close()  # idempotent


def test_reason_is_given_when_unavailable():
    reason = netns_unavailable_reason()
    assert reason is None or isinstance(reason, str) and reason
