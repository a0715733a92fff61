"""The leader partitioned from etcd (a network namespace, its veth link taken down): it stops serving.

Topology (names unique per run, torn down even when the test fails):

    root namespace: etcd (on the root end of veth pair 0), replica B, the nodes (this test)
    namespace N:    replica A, reaching etcd over pair 0 and reached by nodes over pair 1

A leads first. Pair 0 goes down (A loses etcd, nodes still reach A over pair 1):
A must refuse writes before B can win, B must then serve, nodes move to B and
re-publish, and no answer is ever wrong. Pair 0 up again: A rejoins as a standby
that names B.
"""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.metaserver import errors
from pegaflow.metaserver.client import MetaClient
from pegaflow.metaserver.publisher import BlockPublisher, MetaServerTargets
from pegaflow.metaserver.testing import (
    EtcdCluster,
    MetaServerProcess,
    NetnsLink,
    etcd_available,
    netns_unavailable,
    wait_until,
)
from pegaflow.metaserver.types import NamespaceDelta

pytestmark = [
    pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available())),
    pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable())),
]

NS = "ns-partition-cccccccccc"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def serving(addr: str) -> bool | None:
    """True/False: the replica says it serves / does not; None: no answer."""
    try:
        with MetaClient(addr, timeout_s=0.3) as c:
            return c.get_leader().is_leader
    except errors.MetaServerError:
        return None


def test_a_leader_cut_off_from_etcd_stops_serving_before_another_wins(tmp_path):
    with NetnsLink(links=2) as net:
        with EtcdCluster(tmp_path, members=1, client_host=net.root_addr(0)) as etcd:
            a = MetaServerProcess(
                tmp_path, etcd.endpoints, host=net.ns_addr(1), launcher=net.exec_prefix, log_level="info"
            )
            b = MetaServerProcess(tmp_path, etcd.endpoints, log_level="info")
            held = [h(i) for i in range(2000)]
            pub = checker = None
            try:
                a.start()
                wait_until(lambda: serving(a.addr), 15, "A (in the namespace) leads")
                b.start()
                wait_until(lambda: serving(b.addr) is False, 15, "B stands by")
                targets = MetaServerTargets.parse(f"{a.addr},{b.addr}")
                pub = BlockPublisher(targets, "node-p", "10.0.4.1:50055", lambda: [(NS, held)]).start()
                checker = BlockPublisher(targets, "checker", "10.0.4.2:50055", lambda: []).start()
                wait_until(lambda: checker.locate(NS, held[:64], 1.0), 15, "published to A")

                # Watch both replicas every few ms: never may both serve at once.
                samples: list[tuple[float, bool | None, bool | None]] = []
                stop = threading.Event()

                def watch():
                    while not stop.is_set():
                        samples.append((time.monotonic(), serving(a.addr), serving(b.addr)))
                        time.sleep(0.01)

                watcher = threading.Thread(target=watch)
                watcher.start()
                with MetaClient(a.addr, timeout_s=1.0) as to_a:
                    reg = to_a.register("probe", "10.0.4.3:50055")
                    cut_at = time.monotonic()
                    net.set_link(0, up=False)

                    def a_refuses():
                        try:
                            to_a.publish_batch(reg.lease_id, [NamespaceDelta(NS, added=[h(99_999)])], 0, 0)
                        except errors.NotLeader:
                            return True
                        return False

                    wait_until(a_refuses, 10, "A refuses writes once cut off from etcd")
                    refused_after = time.monotonic() - cut_at
                wait_until(lambda: serving(b.addr), 15, "B took over")
                took_over_after = time.monotonic() - cut_at
                # The nodes reach A still (pair 1 is up), but follow B: re-registered, re-published.
                wait_until(lambda: pub.stats().leader_address == b.addr, 15, "the node moved to B")
                wait_until(
                    lambda: [x.num_blocks for x in checker.locate(NS, held[:64], 1.0)] == [64],
                    15,
                    "located through B",
                )
                stop.set()
                watcher.join(timeout=10)
                both = [s for s in samples if s[1] and s[2]]
                assert not both, f"both replicas served at {both[0][0] - cut_at:.3f}s after the cut"
                assert refused_after < 3.0, f"A served {refused_after:.2f}s after losing etcd (TTL 2s)"
                assert refused_after < took_over_after
                # Every answer named the only node that holds those blocks.
                assert all(x.node_id == "node-p" for x in checker.locate(NS, held[:64], 1.0))

                # Healed: A comes back as a standby naming B; B keeps serving.
                net.set_link(0, up=True)
                wait_until(
                    lambda: MetaClient(a.addr, timeout_s=1.0).get_leader().leader_address == b.addr,
                    15,
                    "A names B as the leader",
                )
                assert serving(a.addr) is False and serving(b.addr) is True
            finally:
                for p in (pub, checker):
                    if p is not None:
                        p.close()
                a.kill()
                b.kill()
