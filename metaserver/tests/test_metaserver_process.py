"""A real pegaflow-metaserver process and several node processes talking to it over gRPC.

Covers: publish/locate across processes, lease expiry of a killed node (and
survival of heartbeating ones), re-registration with republish, the entry cap,
bad input (INVALID_ARGUMENT / NOT_FOUND, garbage bytes) with the server staying
up, deadlines, and the health and metrics endpoints.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.metaserver import errors
from pegaflow.metaserver.client import MetaClient, NamespaceDelta
from pegaflow.proto import metaserver_pb2 as pb
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

HERE = pathlib.Path(__file__).resolve().parent
NS = "ns-aaaaaaaaaaaaaaaaaaaa"
LEASE_TTL_S = 1.5


def block_hash(i: int) -> bytes:
    return i.to_bytes(8, "big")


def read_json_line(proc: subprocess.Popen, timeout_s: float = 30.0) -> dict:
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
    raise AssertionError(
        f"no JSON line from pid {proc.pid} (exit {proc.poll()}): {proc.stderr.read()[-2000:]}"
    )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def start_metaserver(*extra: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pegaflow.metaserver", "--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"]
        + list(extra),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        ready = read_json_line(proc)
    except BaseException:
        kill_group(proc)
        raise
    assert ready["event"] == "ready"
    return proc, ready


@pytest.fixture(scope="module")
def metaserver():
    proc, ready = start_metaserver("--lease-ttl", str(LEASE_TTL_S), "--log-level", "warning")
    try:
        yield ready
    finally:
        kill_group(proc)


@pytest.fixture
def client(metaserver):
    with MetaClient(metaserver["addr"], timeout_s=5.0) as c:
        yield c


class Node:
    """A node_worker.py process."""

    def __init__(self, addr: str, node_id: str, blocks: int, namespace: str = NS, offset: int = 0):
        spec = {
            "addr": addr,
            "node_id": node_id,
            "address": f"10.0.0.{abs(hash(node_id)) % 250 + 1}:50055",
            "namespace": namespace,
            "blocks": blocks,
            "offset": offset,
            "lease_ttl_s": LEASE_TTL_S,
        }
        self.node_id = node_id
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "node_worker.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait_published(self) -> dict:
        event = read_json_line(self.proc)
        assert event["event"] == "published"
        return event

    def stop_cleanly(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.close()
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        kill_group(self.proc)


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        # A clean stop unregisters at once, so the next test does not see this node while its lease runs out.
        try:
            node.stop_cleanly()
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        node.kill()


def located(client: MetaClient, count: int, exclude: str = "", namespace: str = NS) -> list[tuple[str, int]]:
    hashes = [block_hash(i) for i in range(count)]
    return [(h.node_id, h.num_blocks) for h in client.locate(namespace, hashes, exclude)]


def test_publish_and_locate_across_processes(metaserver, client, nodes):
    for i in range(3):
        nodes.append(Node(metaserver["addr"], f"node-{i}", blocks=10 * (i + 1)))
    for node in nodes:
        node.wait_published()
    assert located(client, 40) == [("node-2", 30), ("node-1", 20), ("node-0", 10)]
    assert located(client, 40, exclude="node-2") == [("node-1", 20), ("node-0", 10)]
    assert client.locate("ns-unknown", [block_hash(0)]) == []
    # A prefix starting beyond node-0's blocks.
    hits = client.locate(NS, [block_hash(i) for i in range(15, 40)])
    assert [(h.node_id, h.num_blocks) for h in hits] == [("node-2", 15), ("node-1", 5)]
    assert {n.node_id: n.entries for n in client.stats().nodes} == {"node-0": 10, "node-1": 20, "node-2": 30}
    # A clean exit unregisters at once.
    assert nodes[0].stop_cleanly() == 0
    assert located(client, 40) == [("node-2", 30), ("node-1", 20)]


def test_a_killed_node_expires_and_heartbeating_nodes_stay(metaserver, client, nodes):
    ns = "ns-expiry-dddddddddddd"
    nodes.append(Node(metaserver["addr"], "live", blocks=5, namespace=ns))
    nodes.append(Node(metaserver["addr"], "doomed", blocks=8, namespace=ns))
    for node in nodes:
        node.wait_published()
    assert located(client, 8, namespace=ns) == [("doomed", 8), ("live", 5)]
    expired_before = client.stats().expired_nodes
    nodes[1].kill()
    wait_for(lambda: located(client, 8, namespace=ns) == [("live", 5)], timeout_s=20)
    stats = client.stats()
    assert stats.expired_nodes == expired_before + 1
    assert "doomed" not in {n.node_id for n in stats.nodes}
    # Several TTLs later the heartbeating node is still there.
    time.sleep(3 * LEASE_TTL_S)
    assert located(client, 8, namespace=ns) == [("live", 5)]


def test_a_node_whose_lease_is_lost_registers_again_and_republishes(metaserver, client, nodes):
    node = Node(metaserver["addr"], "phoenix", blocks=6, offset=1000)
    nodes.append(node)
    lease_id = node.wait_published()["lease_id"]
    prefix = [block_hash(1000 + i) for i in range(6)]
    client.unregister(lease_id)  # the metaserver forgets it (as after a metaserver restart)
    assert client.locate(NS, prefix) == []
    event = read_json_line(node.proc)
    assert event["event"] == "republished" and event["lease_id"] != lease_id
    assert [(h.node_id, h.num_blocks) for h in client.locate(NS, prefix)] == [("phoenix", 6)]


def metric_value(http_addr: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://{http_addr}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + (labels if labels else " ")) or line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_entry_cap_bounds_the_table_and_counts_evictions_in_metrics():
    # --max-entries 16: two buckets of 8 slots, both open to every key.
    proc, ready = start_metaserver("--max-entries", "16", "--log-level", "warning")
    try:
        with MetaClient(ready["addr"]) as c:
            reg = c.register("capped", "10.9.9.9:50055")
            r1 = c.publish(reg.lease_id, NS, added=[block_hash(i) for i in range(12)])
            r2 = c.publish(reg.lease_id, NS, added=[block_hash(i) for i in range(12, 20)])
            assert (r1.evicted, r2.evicted) == (0, 4)
            stats = c.stats()
            assert stats.entries == 16 and stats.max_entries == 16 and stats.evicted_entries == 4
            assert c.heartbeat(reg.lease_id) == 16
            # The oldest publish lost 4 keys; the newest is whole.
            assert sum(1 for i in range(12) if c.locate(NS, [block_hash(i)])) == 8
            hits = c.locate(NS, [block_hash(i) for i in range(12, 20)])
            assert [(h.node_id, h.num_blocks) for h in hits] == [("capped", 8)]
            assert metric_value(ready["http_addr"], "pegaflow_meta_evicted_entries_total") == 4
            assert metric_value(ready["http_addr"], "pegaflow_meta_entries") == 16
    finally:
        kill_group(proc)


def raw_stub(addr: str):
    channel = grpc.insecure_channel(addr)
    return channel, pb_grpc.MetaServerStub(channel)


def code_of(fn, request) -> grpc.StatusCode:
    try:
        fn(request, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_bad_input_is_rejected_and_the_server_stays_up(metaserver, client):
    channel, stub = raw_stub(metaserver["addr"])
    reg = client.register("validator", "10.1.1.1:50055")
    lease = reg.lease_id
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (stub.RegisterNode, pb.RegisterNodeRequest(node_id="", address="h:1"), invalid),
        (stub.RegisterNode, pb.RegisterNodeRequest(node_id="x" * 129, address="h:1"), invalid),
        (stub.RegisterNode, pb.RegisterNodeRequest(node_id="bad\nid", address="h:1"), invalid),
        (stub.RegisterNode, pb.RegisterNodeRequest(node_id="n", address="no-port"), invalid),
        (stub.RegisterNode, pb.RegisterNodeRequest(node_id="n", address="h:99999"), invalid),
        (stub.Heartbeat, pb.HeartbeatRequest(lease_id=""), invalid),
        (stub.Heartbeat, pb.HeartbeatRequest(lease_id="0" * 32), grpc.StatusCode.NOT_FOUND),
        (stub.UnregisterNode, pb.UnregisterNodeRequest(lease_id="f" * 32), grpc.StatusCode.NOT_FOUND),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(
                lease_id="f" * 32, deltas=[pb.NamespaceDelta(namespace=NS, added=[b"x"])]
            ),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(lease_id=lease, deltas=[pb.NamespaceDelta(namespace="", added=[b"x"])]),
            invalid,
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(
                lease_id=lease, deltas=[pb.NamespaceDelta(namespace=NS, added=[b"y" * 65])]
            ),
            invalid,
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(lease_id=lease, deltas=[pb.NamespaceDelta(namespace=NS, removed=[b""])]),
            invalid,
        ),
        (
            stub.PublishBlocks,
            pb.PublishBlocksRequest(
                lease_id=lease,
                deltas=[pb.NamespaceDelta(namespace=NS, added=[block_hash(i) for i in range(9000)])] * 2,
            ),
            invalid,
        ),
        (stub.Locate, pb.LocateRequest(namespace=NS, block_hashes=[]), invalid),
        (stub.Locate, pb.LocateRequest(namespace="", block_hashes=[b"x"]), invalid),
        (stub.Locate, pb.LocateRequest(namespace=NS, block_hashes=[b"z" * 100]), invalid),
        (
            stub.Locate,
            pb.LocateRequest(namespace=NS, block_hashes=[block_hash(i) for i in range(16_385)]),
            invalid,
        ),
    ]
    try:
        for method, request, expected in cases:
            assert code_of(method, request) == expected, request
        # Nothing half-applied: the rejected publishes left no entries.
        assert client.heartbeat(lease) == 0
        # Garbage bytes where a protobuf should be, and raw garbage on the TCP port.
        garbage = channel.unary_unary(
            "/pegaflow.meta.v1.MetaServer/Locate", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as info:
            garbage(b"\xff\xfe\x00garbage\x99" * 10, timeout=5)
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        host, port = metaserver["addr"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(4096))
        # The client's own checks give the same errors before sending.
        with pytest.raises(errors.InvalidArgument):
            client.register("", "h:1")
        with pytest.raises(errors.InvalidArgument):
            client.publish(lease, NS, added=[b""])
        with pytest.raises(errors.LeaseLost):
            client.heartbeat("0" * 32)
        # Still serving.
        client.publish(lease, NS, added=[block_hash(77_777)])
        assert [(h.node_id, h.num_blocks) for h in client.locate(NS, [block_hash(77_777)])] == [
            ("validator", 1)
        ]
    finally:
        client.unregister(lease)
        channel.close()


def test_deadlines_are_honoured(metaserver, client):
    # A deadline too short to make it: DEADLINE_EXCEEDED, promptly, and the client stays usable.
    with pytest.raises(errors.DeadlineExceeded):
        client.locate(NS, [block_hash(i) for i in range(16_384)], timeout_s=1e-4)
    client.stats()
    # A peer that accepts connections but never answers: the call still ends at its deadline.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with MetaClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5) as stuck:
            started = time.monotonic()
            with pytest.raises(errors.MetaServerUnavailable):
                stuck.stats()
            assert time.monotonic() - started < 10
    # Nothing listening at all.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    with MetaClient(f"127.0.0.1:{dead_port}", timeout_s=0.5) as nobody:
        with pytest.raises(errors.MetaServerUnavailable):
            nobody.locate(NS, [block_hash(0)])


def test_health_and_metrics_endpoints(metaserver, client):
    channel = grpc.insecure_channel(metaserver["addr"])
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pegaflow.meta.v1.MetaServer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
    with urllib.request.urlopen(f"http://{metaserver['http_addr']}/health", timeout=10) as response:
        assert response.status == 200
        assert json.loads(response.read())["status"] == "ok"
    client.locate(NS, [block_hash(0)])
    for name in ("pegaflow_meta_nodes", "pegaflow_meta_entries", "pegaflow_meta_expired_nodes_total"):
        metric_value(metaserver["http_addr"], name)
    assert (
        metric_value(metaserver["http_addr"], "pegaflow_meta_rpc_total", '{code="OK",method="Locate"}') >= 1
    )


def test_cli_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "pegaflow.metaserver", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--addr",
        "--http-addr",
        "--max-entries",
        "--max-nodes",
        "--lease-ttl",
        "--log-level",
        "--etcd-endpoints",
        "--etcd-prefix",
        "--leader-ttl",
        "--advertise-addr",
    ):
        assert flag in out
    bad = subprocess.run(
        [sys.executable, "-m", "pegaflow.metaserver", "--max-entries", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr


def test_publish_deltas_splits_large_batches(metaserver, client):
    reg = client.register("bulk", "10.2.2.2:50055")
    try:
        many = [block_hash(500_000 + i) for i in range(40_000)]
        result = client.publish_deltas(
            reg.lease_id,
            [NamespaceDelta(NS, added=many), NamespaceDelta("ns-bbbbbbbbbbbbbbbbbbbb", added=many[:10])],
        )
        assert result.added == 40_010
        hits = client.locate(NS, many[:20_000])
        assert [(h.node_id, h.num_blocks) for h in hits] == [("bulk", 16_384)]  # cut to the per-call limit
    finally:
        client.unregister(reg.lease_id)
