"""The gRPC service in-process (real gRPC, local port): server-side deadlines, leases, membership."""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.metaserver import errors
from pegaflow.metaserver.client import MetaClient, NodeMembership
from pegaflow.metaserver.config import MetaServerConfig
from pegaflow.metaserver.runtime import start_metaserver

NS = "ns-cccccccccccccccccccc"


@pytest.fixture
def running():
    server = start_metaserver(
        MetaServerConfig(addr="127.0.0.1:0", http_addr=None, lease_ttl_s=2.0, maintenance_interval_s=0.05)
    )
    try:
        yield server
    finally:
        server.stop(grace_s=0)


def rpc_count(server, method: str, code: str) -> float:
    return (
        server.metrics.registry.get_sample_value("pegaflow_meta_rpc_total", {"method": method, "code": code})
        or 0
    )


def test_a_call_stuck_behind_a_busy_index_ends_at_its_deadline(running):
    with MetaClient(running.address, timeout_s=5.0) as client:
        reg = client.register("n", "10.0.0.1:1")
        running.index._lock.acquire()
        try:
            started = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded):
                client.heartbeat(reg.lease_id, timeout_s=0.3)
            assert time.monotonic() - started < 5
        finally:
            running.index._lock.release()
        # Once the index is free again the server serves as before.
        assert client.heartbeat(reg.lease_id) == 0


def test_server_side_deadline_is_reported_when_the_lock_wait_runs_out(running):
    # Hold the lock a little longer than the deadline, from a thread, so the handler's wait times out.
    with MetaClient(running.address, timeout_s=5.0) as client:
        reg = client.register("n", "10.0.0.1:1")
        released = threading.Event()

        def hold():
            with running.index._lock:
                released.wait(1.0)

        holder = threading.Thread(target=hold)
        holder.start()
        time.sleep(0.05)
        with pytest.raises(errors.DeadlineExceeded):
            client.heartbeat(reg.lease_id, timeout_s=0.3)
        holder.join()
        deadline = time.monotonic() + 5
        while rpc_count(running, "Heartbeat", "DEADLINE_EXCEEDED") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rpc_count(running, "Heartbeat", "DEADLINE_EXCEEDED") >= 1


def test_lease_expiry_is_enforced_by_the_maintenance_thread(running):
    with MetaClient(running.address) as client:
        reg = client.register("quiet", "10.0.0.2:1", lease_ttl_s=1.0)
        assert reg.lease_ttl_s == 1.0 and reg.heartbeat_interval_s == pytest.approx(1 / 3, abs=0.01)
        client.publish(reg.lease_id, NS, added=[b"a", b"b"])
        deadline = time.monotonic() + 10
        while client.stats().nodes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().nodes == []
        assert client.stats().expired_nodes == 1
        with pytest.raises(errors.LeaseLost):
            client.heartbeat(reg.lease_id)


def test_requested_ttls_are_clamped(running):
    with MetaClient(running.address) as client:
        assert client.register("a", "h:1").lease_ttl_s == 2.0  # the default
        assert client.register("b", "h:2", lease_ttl_s=0.01).lease_ttl_s == 1.0  # min
        assert client.register("c", "h:3", lease_ttl_s=10_000).lease_ttl_s == 300.0  # max


def test_membership_keeps_a_node_alive_and_recovers_a_lost_lease(running):
    republished = []
    with MetaClient(running.address, timeout_s=2.0) as client:

        def on_registered(member):
            member.publish(NS, added=[b"k1", b"k2"])
            republished.append(member.lease_id)

        with NodeMembership(
            client, "member", "10.0.0.3:1", lease_ttl_s=1.0, on_registered=on_registered
        ) as member:
            member.publish(NS, added=[b"k1", b"k2"])
            first = member.lease_id
            time.sleep(2.5)  # > 2 TTLs: only the heartbeats keep it
            assert [h.node_id for h in client.locate(NS, [b"k1", b"k2"])] == ["member"]
            client.unregister(first)
            deadline = time.monotonic() + 10
            while not republished and time.monotonic() < deadline:
                time.sleep(0.05)
            assert republished and republished[0] != first
            assert [(h.node_id, h.num_blocks) for h in client.locate(NS, [b"k1", b"k2"])] == [("member", 2)]
        # Leaving the block unregistered the node.
        assert client.stats().nodes == []


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        start_metaserver(MetaServerConfig(addr="127.0.0.1:0", http_addr=None, max_entries=0))
    with pytest.raises(ValueError):
        start_metaserver(MetaServerConfig(addr="nonsense", http_addr=None))
