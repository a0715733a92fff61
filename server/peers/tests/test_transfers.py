"""The serving side's transfer and link tables: expiry, and no release under a send in flight."""

from __future__ import annotations

import pytest

from pegaflow.server.peers.base import SourceBlock
from pegaflow.server.peers.metrics import ServeCounters
from pegaflow.server.peers.transfers import LinkTable, TooMany, TransferTable


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class RecordingSource:
    """Only what the table calls: which store leases it released and renewed."""

    pool_fd = -1
    pool_view = memoryview(b"")

    def __init__(self, renew_ok: bool = True):
        self.closed: list[str] = []
        self.renewed: list[tuple[str, float]] = []
        self.renew_ok = renew_ok

    def close_transfer(self, transfer_id):
        self.closed.append(transfer_id)

    def renew_transfer(self, transfer_id, ttl_s):
        self.renewed.append((transfer_id, ttl_s))
        return self.renew_ok


BLOCKS = [SourceBlock(0, 10), SourceBlock(4096, 10)]


def make(max_transfers=4, renew_ok=True):
    clock, source, counters = Clock(), RecordingSource(renew_ok), ServeCounters()
    return TransferTable(source, counters, max_transfers, clock), clock, source, counters


def test_close_releases_the_store_lease_once_and_is_idempotent():
    table, _, source, counters = make()
    t = table.add("lease-1", BLOCKS, ttl_s=5)
    assert len(t.wire_id) == 16 and table.acquire(t.wire_id) is t
    table.release(t)
    assert table.close(t.wire_id) and not table.close(t.wire_id)
    assert source.closed == ["lease-1"] and table.acquire(t.wire_id) is None
    snap = counters.snapshot()
    assert snap.transfers_opened == 1 and snap.transfers_closed == 1 and snap.open_transfers == 0


def test_a_transfer_ended_under_a_send_is_released_only_when_the_send_finishes():
    table, clock, source, _ = make()
    t = table.add("lease-1", BLOCKS, ttl_s=5)
    assert table.acquire(t.wire_id) is t  # a READ is sending
    table.close(t.wire_id)
    assert source.closed == [] and not table.sendable(t)  # the sender stops before its next block
    table.release(t)
    assert source.closed == ["lease-1"]

    t2 = table.add("lease-2", BLOCKS, ttl_s=5)
    table.acquire(t2.wire_id)
    clock.now += 5
    assert table.expire() == 1 and source.closed == ["lease-1"]
    table.release(t2)
    assert source.closed == ["lease-1", "lease-2"]


def test_expiry_ends_silent_transfers_and_counts_them():
    table, clock, source, counters = make()
    ts = [table.add(f"lease-{i}", BLOCKS, ttl_s=1 + i) for i in range(3)]
    clock.now += 1.5
    assert table.acquire(ts[0].wire_id) is None  # past its TTL even before the reaper ran
    assert table.expire() == 1 and source.closed == ["lease-0"]
    clock.now += 10
    assert table.expire() == 2 and len(table) == 0
    assert counters.snapshot().transfers_expired == 3


def test_renew_extends_here_and_in_the_store_with_the_grace():
    table, clock, source, _ = make()
    t = table.add("lease-1", BLOCKS, ttl_s=1)
    clock.now += 0.9
    assert table.renew(t.wire_id, ttl_s=2, grace_s=0.5)
    assert source.renewed == [("lease-1", 2.5)]
    clock.now += 1.5  # past the first TTL, inside the renewed one
    assert table.expire() == 0 and table.acquire(t.wire_id) is t
    table.release(t)
    assert not table.renew(b"\0" * 16, 1, 0)

    table2, clock2, source2, _ = make(renew_ok=False)
    t2 = table2.add("lease-x", BLOCKS, ttl_s=1)
    assert not table2.renew(t2.wire_id, ttl_s=10, grace_s=0)  # the store no longer holds it
    clock2.now += 1
    assert table2.expire() == 1 and source2.closed == ["lease-x"]


def test_the_cap_refuses_before_anything_is_pinned():
    table, *_ = make(max_transfers=2)
    table.add("a", BLOCKS, 5)
    table.reserve()
    table.add("b", BLOCKS, 5)
    with pytest.raises(TooMany, match="cap is 2"):
        table.reserve()


def test_links_expire_unless_touched_and_run_their_end_hook_once():
    clock, counters = Clock(), ServeCounters()
    links = LinkTable(counters, max_links=2, ttl_s=10, clock=clock)
    ended = []
    a = links.add("rdma", "node-b", on_end=lambda: ended.append("a"))
    b = links.add("tcp", "node-c")
    with pytest.raises(TooMany):
        links.add("tcp", "node-d")
    clock.now += 9
    assert links.touch(a.link_id) is a
    clock.now += 2
    assert links.expire() == 1 and links.touch(b.link_id) is None  # b was silent
    assert links.remove(a.link_id) and not links.remove(a.link_id)
    assert ended == ["a"]
    snap = counters.snapshot()
    assert snap.open_links == 0 and snap.links_expired == 1
