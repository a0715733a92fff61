"""The node-side publisher against a real metaserver (no etcd): ordering, the bounded queue, restarts.

Covers: batches carry incarnation + sequence and the metaserver drops replays,
stale incarnations and gaps (and refuses an older incarnation's registration);
a full publish queue drops and counts instead of blocking the caller, and the
node re-publishes so the index converges; a metaserver SIGKILLed and restarted
on the same port is found again and re-filled from the snapshot; locate never
raises into the caller and never names a node for a block it did not hold.
"""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.metaserver import errors
from pegaflow.metaserver.client import MetaClient
from pegaflow.metaserver.config import MetaServerConfig
from pegaflow.metaserver.publisher import BlockPublisher, MetaServerTargets
from pegaflow.metaserver.runtime import start_metaserver
from pegaflow.metaserver.testing import MetaServerProcess, free_port, wait_until
from pegaflow.metaserver.types import NamespaceDelta, PublishOutcome

NS = "ns-publisher-aaaaaaaaaa"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def running():
    server = start_metaserver(
        MetaServerConfig(addr="127.0.0.1:0", http_addr=None, lease_ttl_s=3.0, maintenance_interval_s=0.05)
    )
    try:
        yield server
    finally:
        server.stop(grace_s=0)


def test_targets_syntax():
    assert MetaServerTargets.parse("http://m:50056").addresses == ("m:50056",)
    assert MetaServerTargets.parse("a:1, b:2").addresses == ("a:1", "b:2")
    etcd = MetaServerTargets.parse("etcd://e1:2379,e2:2379/my/prefix/")
    assert etcd.etcd_endpoints == ("e1:2379", "e2:2379") and etcd.etcd_prefix == "/my/prefix"
    assert MetaServerTargets.parse("etcd://e1:2379").etcd_prefix == "/pegaflow/metaserver"
    for bad in ("", "nohost", "h:0", "h:99999", "a:1,,b:2", "etcd://"):
        with pytest.raises(ValueError):
            MetaServerTargets.parse(bad)


def test_stale_replayed_and_gapped_batches_are_dropped(running):
    with MetaClient(running.address) as c:
        reg = c.register("seq-node", "10.0.0.1:50055", incarnation=1000)
        one = [NamespaceDelta(NS, added=[h(1)])]
        r, term = c.publish_batch(reg.lease_id, one, incarnation=1000, sequence=1)
        assert (r.outcome, r.added, r.expected_sequence, term) == (PublishOutcome.APPLIED, 1, 2, 0)
        # The same batch again (a retry or a replay): dropped, said so, nothing changes.
        replay = [NamespaceDelta(NS, added=[h(1), h(2)])]
        r, _ = c.publish_batch(reg.lease_id, replay, incarnation=1000, sequence=1)
        assert (r.outcome, r.added) == (PublishOutcome.DUPLICATE, 0)
        # Another life of the node: stale.
        r, _ = c.publish_batch(reg.lease_id, replay, incarnation=999, sequence=2)
        assert r.outcome == PublishOutcome.STALE_INCARNATION
        # Batch 2 lost: 3 reveals the gap and is dropped too.
        r, _ = c.publish_batch(reg.lease_id, replay, incarnation=1000, sequence=3)
        assert (r.outcome, r.expected_sequence) == (PublishOutcome.SEQUENCE_GAP, 2)
        assert c.locate(NS, [h(1), h(2)]) and c.locate(NS, [h(2)]) == []
        stats = c.stats()
        assert (stats.duplicate_batches, stats.stale_batches, stats.sequence_gaps) == (1, 1, 1)
        # Batch 2 itself is still welcome; deltas apply in order (added, then removed).
        ordered = [NamespaceDelta(NS, added=[h(2), h(3)]), NamespaceDelta(NS, removed=[h(3)])]
        r, _ = c.publish_batch(reg.lease_id, ordered, incarnation=1000, sequence=2)
        assert (r.outcome, r.added, r.removed) == (PublishOutcome.APPLIED, 2, 1)
        assert [(x.node_id, x.num_blocks) for x in c.locate(NS, [h(1), h(2), h(3)])] == [("seq-node", 2)]
        # A zombie of an older start may not take the registration over (and erase the entries).
        with pytest.raises(errors.StaleIncarnation):
            c.register("seq-node", "10.0.0.1:50055", incarnation=999)
        assert c.heartbeat(reg.lease_id) == 2
        # A newer start replaces it: its entries go with the old lease.
        newer = c.register("seq-node", "10.0.0.1:50055", incarnation=2000)
        assert c.locate(NS, [h(1)]) == []
        r, _ = c.publish_batch(newer.lease_id, one, incarnation=2000, sequence=1)
        assert r.outcome == PublishOutcome.APPLIED


def test_a_full_queue_drops_and_counts_without_blocking_then_converges(running):
    held: dict[bytes, None] = {h(i): None for i in range(100)}
    lock = threading.Lock()

    def snapshot():
        with lock:
            return [(NS, list(held))]

    pub = BlockPublisher(
        MetaServerTargets.parse(running.address),
        "queue-node",
        "10.0.0.2:50055",
        snapshot,
        max_queued_keys=1000,
        batch_keys=100,
        resync_interval_s=0.0,
    ).start()
    try:
        with MetaClient(running.address) as c:
            wait_until(lambda: c.stats().entries == 100, 10, "snapshot published")
            # Stall the metaserver: the publisher thread blocks in a call, the queue fills up.
            running.index._lock.acquire()
            try:
                refused = 0
                slowest = 0.0
                for i in range(100, 3100, 10):
                    keys = [h(j) for j in range(i, i + 10)]
                    with lock:
                        held.update(dict.fromkeys(keys))
                    started = time.perf_counter()
                    if not pub.blocks_added(NS, keys):
                        refused += 1
                    slowest = max(slowest, time.perf_counter() - started)
                stats = pub.stats()
                assert refused > 0 and stats.dropped_keys == 10 * refused
                assert stats.queue_depth_keys <= stats.queue_limit_keys == 1000
                # Never waits for the stalled call (seconds); 0.5 s leaves room for a loaded CI machine.
                assert slowest < 0.5, f"blocks_added took {slowest * 1000:.1f} ms"
            finally:
                running.index._lock.release()
            # The drops make the node re-register and re-publish: the index converges to what it holds.
            wait_until(lambda: c.stats().entries == 3100, 20, "index converged after the drops")
            hits = c.locate(NS, [h(i) for i in range(3100)])
            assert [(x.node_id, x.num_blocks) for x in hits] == [("queue-node", 3100)]
            assert pub.stats().republishes >= 1
    finally:
        pub.close()


def test_a_restarted_metaserver_is_refilled_and_locate_never_raises(tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    held = {"a": [h(i) for i in range(2000)], "b": [h(i) for i in range(1000)]}
    pubs = {
        name: BlockPublisher(
            MetaServerTargets.parse(addr), f"node-{name}", f"10.0.1.{k}:50055", lambda n=name: [(NS, held[n])]
        )
        for k, name in enumerate(held, 1)
    }
    ms = MetaServerProcess(tmp_path, extra_args=["--lease-ttl", "3"], port=port)
    with ms:
        for pub in pubs.values():
            pub.start()
        try:
            prefix = [h(i) for i in range(64)]
            wait_until(
                lambda: len(pubs["b"].locate(NS, prefix, timeout_s=1.0)) == 1, 10, "a's blocks located"
            )
            assert [(x.node_id, x.num_blocks) for x in pubs["b"].locate(NS, prefix, 1.0)] == [("node-a", 64)]
            ms.kill()
            # Down: the fetch path gets empty answers promptly, never an exception; saves never block.
            started = time.monotonic()
            assert pubs["b"].locate(NS, prefix, timeout_s=0.2) == []
            assert time.monotonic() - started < 1.0
            assert pubs["a"].blocks_added(NS, [h(5000)])
            assert pubs["b"].stats().locate_failures >= 1
            ms.start()
            wait_until(
                lambda: (
                    [(x.node_id, x.num_blocks) for x in pubs["b"].locate(NS, prefix, 1.0)] == [("node-a", 64)]
                ),
                15,
                "re-published after the restart",
            )
            with MetaClient(addr) as c:
                wait_until(lambda: c.stats().entries == 2000, 10, "everything back")
            assert pubs["a"].stats().republishes >= 1 and pubs["a"].stats().registrations >= 2
        finally:
            for pub in pubs.values():
                pub.close()


def test_bad_deltas_are_counted_not_raised(running):
    pub = BlockPublisher(MetaServerTargets.parse(running.address), "bad-node", "10.0.0.3:50055", lambda: [])
    with pub:
        wait_until(lambda: pub.stats().connected, 10, "registered")
        assert not pub.blocks_added(NS, [b""])
        assert not pub.blocks_added(NS, [b"x" * 65])
        assert not pub.blocks_removed("", [b"x"])
        assert pub.stats().invalid_keys == 3
        assert pub.locate(NS, [b"x" * 100]) == []  # refused locally, counted
        assert pub.locate(NS, []) == []
