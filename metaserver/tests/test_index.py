"""GlobalIndex: publish/locate semantics, leases, re-registration, the cap, the sweep, deadlines."""

import threading
import time

import pytest

from pegaflow.metaserver.index import DeadlinePassed, GlobalIndex, LeaseNotFound, NamespaceDelta, TooManyNodes

NS = "ns-0123456789abcdef0123"


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def h(i):
    return i.to_bytes(8, "big")


def hits(index, hashes, namespace=NS, exclude=""):
    return [(x.node_id, x.num_blocks) for x in index.locate(namespace, hashes, exclude)]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def index(clock):
    return GlobalIndex(max_entries=1000, clock=clock)


def test_locate_counts_leading_blocks_per_node(index):
    a = index.register("a", "10.0.0.1:50055", ttl_s=10)
    b = index.register("b", "10.0.0.2:50055", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(0), h(1), h(2)])])
    index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(0), h(2), h(3)])])
    assert hits(index, [h(0), h(1), h(2), h(3)]) == [("a", 3), ("b", 1)]
    assert hits(index, [h(2), h(3)]) == [("b", 2), ("a", 1)]
    assert hits(index, [h(9), h(0)]) == []
    located = index.locate(NS, [h(0)])
    assert {(x.node_id, x.address) for x in located} == {("a", "10.0.0.1:50055"), ("b", "10.0.0.2:50055")}


def test_a_node_holding_the_whole_prefix_gets_its_length(index):
    a = index.register("a", "h:1", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(50)])])
    assert hits(index, [h(i) for i in range(50)]) == [("a", 50)]
    assert hits(index, [h(i) for i in range(60)]) == [("a", 50)]


def test_namespaces_are_separate(index):
    a = index.register("a", "h:1", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(0)]), NamespaceDelta("ns-other", added=[h(1)])])
    assert hits(index, [h(0)]) == [("a", 1)]
    assert hits(index, [h(0)], namespace="ns-other") == []
    assert hits(index, [h(1)], namespace="ns-other") == [("a", 1)]


def test_exclude_leaves_the_asking_node_out(index):
    a = index.register("a", "h:1", ttl_s=10)
    b = index.register("b", "h:2", ttl_s=10)
    for node in (a, b):
        index.publish(node.lease_id, [NamespaceDelta(NS, added=[h(0), h(1)])])
    assert hits(index, [h(0), h(1)], exclude="a") == [("b", 2)]
    assert hits(index, [h(0), h(1)], exclude="nobody") == [("a", 2), ("b", 2)]


def test_removed_blocks_stop_counting_and_counts_are_kept(index):
    a = index.register("a", "h:1", ttl_s=10)
    b = index.register("b", "h:2", ttl_s=10)
    r = index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(0), h(1), h(1)])])
    assert (r.added, r.removed) == (2, 0)
    index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(0)])])
    r = index.publish(a.lease_id, [NamespaceDelta(NS, removed=[h(0), h(7)])])
    assert (r.added, r.removed) == (0, 1)  # h(7) was never held
    assert hits(index, [h(0), h(1)]) == [("b", 1)]
    assert index.node_entries(a.lease_id) == 1
    assert index.node_entries(b.lease_id) == 1
    assert len(index) == 2
    index.publish(b.lease_id, [NamespaceDelta(NS, removed=[h(0)])])
    assert len(index) == 1  # a key nobody holds is gone


def test_lease_expires_without_heartbeat_and_heartbeat_renews(index, clock):
    a = index.register("a", "h:1", ttl_s=10)
    b = index.register("b", "h:2", ttl_s=10)
    for node in (a, b):
        index.publish(node.lease_id, [NamespaceDelta(NS, added=[h(0)])])
    clock.now += 8
    index.heartbeat(a.lease_id)
    clock.now += 8  # b has been silent for 16 s
    assert hits(index, [h(0)]) == [("a", 1)]
    with pytest.raises(LeaseNotFound):
        index.heartbeat(b.lease_id)
    with pytest.raises(LeaseNotFound):
        index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(1)])])
    assert index.stats().expired_nodes == 1
    assert [n.node_id for n in index.stats().nodes] == ["a"]


def test_publish_renews_the_lease(index, clock):
    a = index.register("a", "h:1", ttl_s=10)
    for _ in range(5):
        clock.now += 6
        index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(0)])])
    assert hits(index, [h(0)]) == [("a", 1)]


def test_expire_reports_the_dead(index, clock):
    index.register("a", "h:1", ttl_s=5)
    index.register("b", "h:2", ttl_s=50)
    clock.now += 6
    assert index.expire() == ["a"]
    assert index.expire() == []


def test_reregistering_drops_the_old_incarnations_entries(index):
    old = index.register("a", "h:1", ttl_s=10)
    index.publish(old.lease_id, [NamespaceDelta(NS, added=[h(0), h(1)])])
    new = index.register("a", "h:9", ttl_s=10)
    assert new.lease_id != old.lease_id
    assert hits(index, [h(0)]) == []
    with pytest.raises(LeaseNotFound):
        index.heartbeat(old.lease_id)
    index.publish(new.lease_id, [NamespaceDelta(NS, added=[h(1)])])
    assert [(x.node_id, x.address, x.num_blocks) for x in index.locate(NS, [h(1)])] == [("a", "h:9", 1)]


def test_unregister_drops_the_node(index):
    a = index.register("a", "h:1", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(0)])])
    index.unregister(a.lease_id)
    assert hits(index, [h(0)]) == []
    with pytest.raises(LeaseNotFound):
        index.unregister(a.lease_id)


def test_cap_bounds_the_table_and_evicts_the_oldest_neighbours(clock):
    index = GlobalIndex(max_entries=16, clock=clock)  # two buckets of 8: every key may use both
    assert index.max_entries == 16
    a = index.register("a", "h:1", ttl_s=10)
    b = index.register("b", "h:2", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(14)])])
    index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(0)])])  # republished: h(0) is now the freshest
    r = index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(100, 105)])])
    assert r.evicted == 3
    assert len(index) == 16
    # With both buckets full the oldest stamps go first: three of a's first batch, never h(0).
    assert hits(index, [h(0)]) == [("a", 1), ("b", 1)]
    survivors = sum(1 for i in range(1, 14) if hits(index, [h(i)]) == [("a", 1)])
    assert survivors == 13 - 3
    assert all(hits(index, [h(i)]) == [("b", 1)] for i in range(100, 105))
    assert index.node_entries(a.lease_id) == 14 - 3
    assert index.node_entries(b.lease_id) == 6
    stats = index.stats()
    assert stats.evicted_entries == 3 and stats.entries == 16 and stats.max_entries == 16


def test_a_large_table_holds_what_it_was_given_and_never_answers_a_wrong_node(clock):
    index = GlobalIndex(max_entries=200_000, clock=clock)
    nodes = [index.register(f"n{i}", f"h:{i + 1}", ttl_s=1000) for i in range(70)]  # > 64: a 2nd word
    for i, node in enumerate(nodes):
        index.publish(node.lease_id, [NamespaceDelta(NS, added=[h(i * 1000 + k) for k in range(1000)])])
    assert len(index) == 70_000 and index.stats().evicted_entries == 0
    for i in (0, 63, 64, 69):
        prefix = [h(i * 1000 + k) for k in range(64)]
        assert hits(index, prefix) == [(f"n{i}", 64)]
        assert hits(index, prefix, namespace="ns-other") == []
    # Hashes of other lengths (and longer than 32 bytes: digested) are distinct keys.
    long_hash = b"L" * 40
    index.publish(nodes[5].lease_id, [NamespaceDelta(NS, added=[long_hash, b"\xff" * 8, b"\xff"])])
    assert hits(index, [long_hash]) == [("n5", 1)]
    assert hits(index, [b"L" * 41]) == [] and hits(index, [b"\xff" * 7]) == []
    assert hits(index, [b"\xff"]) == [("n5", 1)] and hits(index, [b"\xff" * 8]) == [("n5", 1)]


def test_sweep_clears_dead_bits_and_recycles_ordinals(clock):
    index = GlobalIndex(max_entries=100_000, clock=clock)
    a = index.register("a", "h:1", ttl_s=10)
    b = index.register("b", "h:2", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(5000)])])
    index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(100)])])
    ordinal_a = a.ordinal
    index.unregister(a.lease_id)
    # Dead at once for readers, before any sweep.
    assert hits(index, [h(0)]) == [("b", 1)]
    assert index.stats().sweeping
    steps = 0
    while index.sweep_step(max_keys=1000):
        steps += 1
    assert steps >= 4  # the work was split in chunks
    assert len(index) == 100  # only b's keys remain
    assert not index.stats().sweeping
    c = index.register("c", "h:3", ttl_s=10)
    assert c.ordinal == ordinal_a  # reused only after the sweep
    assert hits(index, [h(0), h(1)]) == [("b", 2)]
    index.publish(c.lease_id, [NamespaceDelta(NS, added=[h(0)])])
    assert hits(index, [h(0), h(1)]) == [("b", 2), ("c", 1)]


def test_a_node_dying_during_a_sweep_gets_a_sweep_of_its_own(clock):
    index = GlobalIndex(max_entries=100_000, clock=clock)
    a = index.register("a", "h:1", ttl_s=10)
    b = index.register("b", "h:2", ttl_s=10)
    index.publish(a.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(3000)])])
    index.unregister(a.lease_id)
    assert index.sweep_step(max_keys=1000)  # a's sweep is under way
    index.publish(b.lease_id, [NamespaceDelta(NS, added=[h(i) for i in range(10_000, 12_000)])])
    index.unregister(b.lease_id)  # b's keys published after the snapshot
    while index.sweep_step(max_keys=1000):
        pass
    assert len(index) == 0
    assert not index.stats().sweeping


def test_sweep_with_nothing_dead_does_nothing(index):
    assert index.sweep_step() is False


def test_too_many_nodes(clock):
    index = GlobalIndex(max_entries=10, max_nodes=2, clock=clock)
    index.register("a", "h:1", ttl_s=10)
    index.register("b", "h:2", ttl_s=10)
    with pytest.raises(TooManyNodes):
        index.register("c", "h:3", ttl_s=10)
    index.register("a", "h:1", ttl_s=10)  # re-registering an existing node is fine
    clock.now += 11
    index.register("c", "h:3", ttl_s=10)  # the expired ones made room


def test_deadline_is_honoured_while_the_index_is_busy(index):
    a = index.register("a", "h:1", ttl_s=10)
    with pytest.raises(DeadlinePassed):
        index.locate(NS, [h(0)], deadline=time.monotonic() - 1)
    index._lock.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(DeadlinePassed):
            index.heartbeat(a.lease_id, deadline=started + 0.05)
    finally:
        index._lock.release()
    index.heartbeat(a.lease_id, deadline=time.monotonic() + 5)


def test_concurrent_publishers_and_readers(clock):
    index = GlobalIndex(max_entries=50_000, clock=clock)
    leases = [index.register(f"n{i}", f"h:{i + 1}", ttl_s=1000) for i in range(4)]
    errors = []

    def publisher(i):
        try:
            for j in range(50):
                keys = [h(i * 100_000 + j * 100 + k) for k in range(100)]
                index.publish(leases[i].lease_id, [NamespaceDelta(NS, added=keys)])
                if j % 5 == 0:
                    index.publish(leases[i].lease_id, [NamespaceDelta(NS, removed=keys[:10])])
        except Exception as exc:
            errors.append(exc)

    def reader():
        for _ in range(200):
            index.locate(NS, [h(k) for k in range(100)])
            index.stats()

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(n.entries for n in index.stats().nodes) == len(index) == 4 * (5000 - 100)


def test_bad_construction():
    with pytest.raises(ValueError):
        GlobalIndex(max_entries=0)
    with pytest.raises(ValueError):
        GlobalIndex(max_entries=10, max_nodes=0)
