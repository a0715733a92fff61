"""Metaserver replicas elected through real etcd processes: failover under load, an etcd member lost.

Covers: one replica leads and the standby redirects (FAILED_PRECONDITION naming the
leader); the leader SIGKILLed while nodes publish and locate -> the standby takes
over, every node re-registers and re-publishes, Locate answers resume, with zero
wrong answers throughout (a Locate never names a node for a block it never held in
that namespace); one etcd member of three SIGKILLed -> the service goes on.
"""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.metaserver import errors
from pegaflow.metaserver.client import MetaClient
from pegaflow.metaserver.publisher import BlockPublisher, MetaServerTargets
from pegaflow.metaserver.testing import EtcdCluster, MetaServerProcess, etcd_available, wait_until
from pegaflow.metaserver.types import NamespaceDelta

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))

NS = "ns-replicas-bbbbbbbbbbb"
PREFIX_LEN = 64


def h(node: int, i: int) -> bytes:
    return node.to_bytes(4, "big") + i.to_bytes(28, "big")


class FakeNodeState:
    """What one simulated pegaflow-server holds (a set of hashes) and everything it ever held."""

    def __init__(self, k: int, blocks: int) -> None:
        self.k = k
        self.lock = threading.Lock()
        self.held = [h(k, i) for i in range(blocks)]
        self.ever = set(self.held)

    def snapshot(self):
        with self.lock:
            items = list(self.held)
        for start in range(0, len(items), 1000):
            yield NS, items[start : start + 1000]

    def grow(self, count: int) -> list[bytes]:
        with self.lock:
            new = [h(self.k, len(self.held) + i) for i in range(count)]
            self.held.extend(new)
            self.ever.update(new)
        return new


def wrong_answers(hits, prefix, states_by_id) -> list[str]:
    bad = []
    for hit in hits:
        state = states_by_id.get(hit.node_id)
        if state is None or not all(x in state.ever for x in prefix[: hit.num_blocks]):
            bad.append(f"{hit.node_id} claimed {hit.num_blocks} blocks")
    return bad


def leader_of(replicas: list[MetaServerProcess]) -> MetaServerProcess | None:
    for replica in replicas:
        if not replica.alive():
            continue
        try:
            with MetaClient(replica.addr, timeout_s=1.0) as c:
                if c.get_leader().is_leader:
                    return replica
        except errors.MetaServerError:
            pass
    return None


@pytest.fixture
def etcd1(tmp_path):
    with EtcdCluster(tmp_path, members=1) as cluster:
        yield cluster


def test_standby_redirects_to_the_leader(tmp_path, etcd1):
    with (
        MetaServerProcess(tmp_path, etcd1.endpoints) as a,
        MetaServerProcess(tmp_path, etcd1.endpoints) as b,
    ):
        leader = wait_until(lambda: leader_of([a, b]), 15, "a leader elected")
        standby = b if leader is a else a
        with MetaClient(standby.addr) as c:
            # The standby learns the leader at its next poll of the key (100 ms).
            info = wait_until(
                lambda: (i := c.get_leader()).leader_address == leader.addr and i, 5, "the standby names it"
            )
            assert not info.is_leader and info.leader_address == leader.addr and info.term > 0
            with pytest.raises(errors.NotLeader) as refused:
                c.register("n", "10.0.0.1:50055")
            assert refused.value.leader_address == leader.addr and refused.value.term == info.term
            with pytest.raises(errors.NotLeader):
                c.locate(NS, [h(0, 0)])
        with MetaClient(leader.addr) as c:
            reg = c.register("n", "10.0.0.1:50055")
            assert reg.term == info.term
            # Bad input is still INVALID_ARGUMENT on a replica (checked before the leadership).
            with pytest.raises(errors.InvalidArgument):
                c.publish_batch(reg.lease_id, [NamespaceDelta("", added=[b"x"])], 0, 1)


def test_leader_killed_under_load_standby_takes_over_and_nodes_republish(tmp_path, etcd1):
    a = MetaServerProcess(tmp_path, etcd1.endpoints, log_level="warning").start()
    b = MetaServerProcess(tmp_path, etcd1.endpoints, log_level="warning").start()
    states = [FakeNodeState(k, 3000) for k in range(4)]
    by_id = {f"node-{s.k}": s for s in states}
    targets = MetaServerTargets.parse(f"{a.addr},{b.addr}")
    pubs = [
        BlockPublisher(targets, f"node-{s.k}", f"10.0.2.{s.k + 1}:50055", s.snapshot, lease_ttl_s=5.0)
        for s in states
    ]
    stop = threading.Event()
    wrong: list[str] = []
    answered: list[tuple[float, int]] = []  # (time, best leading count) of the checker's locates

    def load():
        # Node 0 keeps sealing blocks and node 1 keeps locating node 2's prefix, checking every answer.
        probe = [h(2, i) for i in range(PREFIX_LEN)]
        while not stop.is_set():
            pubs[0].blocks_added(NS, states[0].grow(50))
            hits = pubs[1].locate(NS, probe, timeout_s=0.5)
            wrong.extend(wrong_answers(hits, probe, by_id))
            answered.append((time.monotonic(), max((x.num_blocks for x in hits), default=0)))
            time.sleep(0.01)

    try:
        leader = wait_until(lambda: leader_of([a, b]), 15, "a leader elected")
        for pub in pubs:
            pub.start()
        with MetaClient(leader.addr) as c:
            wait_until(lambda: c.stats().entries >= 4 * 3000, 15, "every node published")
        worker = threading.Thread(target=load)
        worker.start()
        wait_until(lambda: answered and answered[-1][1] == PREFIX_LEN, 10, "locates answered")
        killed_at = time.monotonic()
        leader.kill()
        standby = b if leader is a else a
        wait_until(lambda: leader_of([standby]), 15, "the standby took over")
        # Every node re-registered with the new leader and re-published all it holds.
        with MetaClient(standby.addr) as c:
            wait_until(
                lambda: {n.node_id for n in c.stats().nodes} == set(by_id), 15, "every node registered again"
            )
            wait_until(
                lambda: c.stats().entries >= sum(len(s.held) for s in states) - 50,
                15,
                "the index rebuilt from re-publishing",
            )
        wait_until(lambda: any(t > killed_at and n == PREFIX_LEN for t, n in answered), 10, "locates resumed")
        resumed = min(t for t, n in answered if t > killed_at and n == PREFIX_LEN) - killed_at
        stop.set()
        worker.join(timeout=10)
        assert not wrong, wrong[:5]
        assert resumed < 10, f"locate answers resumed {resumed:.1f}s after the kill"
        for pub in pubs:
            stats = pub.stats()
            assert stats.leader_changes >= 1 and stats.republishes >= 1, stats
            assert stats.connected and stats.leader_address == standby.addr
        # The sealer's deltas made during the failover landed too (they were in the snapshot).
        newest = states[0].held[-PREFIX_LEN:]
        wait_until(
            lambda: [x.num_blocks for x in pubs[1].locate(NS, newest, 1.0)] == [PREFIX_LEN],
            10,
            "the sealer's newest blocks located",
        )
    finally:
        stop.set()
        for pub in pubs:
            pub.close()
        a.kill()
        b.kill()


def test_one_etcd_member_of_three_killed_and_the_service_goes_on(tmp_path):
    with EtcdCluster(tmp_path, members=3) as etcd:
        a = MetaServerProcess(tmp_path, etcd.endpoints, log_level="warning").start()
        b = MetaServerProcess(tmp_path, etcd.endpoints, log_level="warning").start()
        state = FakeNodeState(7, 500)
        pub = BlockPublisher(
            MetaServerTargets.parse(f"{a.addr},{b.addr}"), "node-7", "10.0.3.1:50055", state.snapshot
        )
        checker = BlockPublisher(
            MetaServerTargets.parse(f"{a.addr},{b.addr}"), "checker", "10.0.3.2:50055", lambda: []
        )
        try:
            wait_until(lambda: leader_of([a, b]), 15, "a leader elected")
            pub.start()
            checker.start()
            probe = state.held[:PREFIX_LEN]
            wait_until(lambda: checker.locate(NS, probe, 1.0), 15, "published")
            # The member every replica talks to first (endpoints[0]) dies, as a crash.
            etcd.kill_member(0)
            deadline = time.monotonic() + 8
            worst_gap = 0.0
            last_ok = time.monotonic()
            while time.monotonic() < deadline:
                new = state.grow(10)
                assert pub.blocks_added(NS, new)
                hits = checker.locate(NS, probe, timeout_s=0.5)
                assert not wrong_answers(hits, probe, {"node-7": state})
                now = time.monotonic()
                if hits:
                    worst_gap = max(worst_gap, now - last_ok)
                    last_ok = now
                time.sleep(0.02)
            # Located the whole time but for (at most) one leader change.
            assert time.monotonic() - last_ok < 1.0 and worst_gap < 6.0, worst_gap
            assert leader_of([a, b]) is not None
            wait_until(
                lambda: (
                    [x.num_blocks for x in checker.locate(NS, state.held[-PREFIX_LEN:], 1.0)] == [PREFIX_LEN]
                ),
                10,
                "publishes kept landing",
            )
        finally:
            pub.close()
            checker.close()
            a.kill()
            b.kill()


def test_a_node_configured_with_etcd_finds_the_leader_there(tmp_path, etcd1):
    with (
        MetaServerProcess(tmp_path, etcd1.endpoints, log_level="warning") as a,
        MetaServerProcess(tmp_path, etcd1.endpoints, log_level="warning") as b,
    ):
        leader = wait_until(lambda: leader_of([a, b]), 15, "a leader elected")
        state = FakeNodeState(9, 100)
        pub = BlockPublisher(
            MetaServerTargets.parse(f"etcd://{etcd1.endpoints[0]}"),
            "node-9",
            "10.0.5.1:50055",
            state.snapshot,
        )
        with pub:
            wait_until(lambda: pub.stats().connected, 15, "registered through etcd discovery")
            assert pub.stats().leader_address == leader.addr
            with MetaClient(leader.addr) as c:
                wait_until(lambda: c.stats().entries == 100, 10, "published")
