"""The read lane's native core on its own: a real Lane, its serving thread on a real Unix socket, the
real client (client/read_lane.py) and raw sockets for what no client sends."""

from __future__ import annotations

import socket
import struct
import time

import grpc
import pytest

from pegaflow.client.frame_link import LocalRpcError
from pegaflow.client.read_lane import NOT_RUN, ReadLaneClient
from pegaflow.common.wire import frames
from pegaflow.common.wire import read_lane as wire
from pegaflow.server.config import ServerConfig
from pegaflow.server.read_lane import native
from pegaflow.server.read_lane.lane import ReadLane
from pegaflow.server.store.index import BlockEntry

BLOCK = 4096
NS = 3
EPOCH = "e1"


def entry(key: bytes, slot: int, checksum: int = 0, ns: int = NS) -> BlockEntry:
    e = BlockEntry((ns, key), BLOCK)
    e.dram = slot
    e.checksum = checksum
    return e


def make_lane(fallback_on_miss: bool = False, **config) -> ReadLane:
    lane = ReadLane.create(ServerConfig(pool_size_bytes=1 << 30, **config), fallback_on_miss)
    assert lane is not None, "the read lane must build on this machine"
    return lane


@pytest.fixture
def served(tmp_path):
    """(lane, client): a lane serving on a socket, one session 's1' (quota 64 blocks) with instance
    'i1' in namespace NS, and a client of that socket."""
    lane = make_lane()
    path = str(tmp_path / "lane.sock")
    lane.serve(path, EPOCH, max_connections=4, idle_timeout_s=30.0)
    lane.add_session("s1", 0, 64 * BLOCK, 8, True)
    lane.add_instance("i1", "s1", NS, BLOCK)
    client = ReadLaneClient(path, EPOCH, 4096)
    yield lane, client
    client.close()
    lane.stop()


def query(client: ReadLaneClient, hashes, lease=True, sid="s1", iid="i1", ttl=None, load=False):
    return client.query(
        sid, iid, hashes, client.new_lease_id() if lease else 0, ttl, load, time.monotonic() + 5
    )


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_a_published_prefix_is_answered_with_its_offsets_checksums_and_a_lease(served):
    lane, client = served
    lane.publish([entry(k, 1 << 20 | i * BLOCK, checksum=100 + i) for i, k in enumerate(keys(4))])
    hit = query(client, keys(4) + [b"absent", b"k0"])
    assert hit.num_hits == 4 and hit.lease_id.startswith("r-")
    assert [loc.offset for loc in hit.locations] == [1 << 20 | i * BLOCK for i in range(4)]
    assert [loc.checksum for loc in hit.locations] == [100, 101, 102, 103]
    assert all(loc.length == BLOCK for loc in hit.locations)
    assert lane.pinned((NS, b"k0")) and not lane.pinned((NS, b"absent"))
    assert client.release("s1", wire.parse_lease_name(hit.lease_id), 4 * BLOCK, time.monotonic() + 5) is None
    assert not lane.pinned((NS, b"k0"))


def test_a_pinned_block_cannot_be_unpublished_and_an_unpinned_one_can(served):
    lane, client = served
    blocks = [entry(k, i * BLOCK) for i, k in enumerate(keys(2))]
    lane.publish(blocks)
    hit = query(client, keys(1))
    assert lane.unpublish(blocks[0]) is False  # read by a lane lease: the store must keep it
    assert query(client, keys(1), lease=False).num_hits == 1  # still published
    assert lane.unpublish(blocks[1]) is True
    assert query(client, keys(2), lease=False).num_hits == 1
    client.release("s1", wire.parse_lease_name(hit.lease_id), 0, time.monotonic() + 5)
    assert lane.unpublish(blocks[0]) is True
    assert query(client, keys(1), lease=False).num_hits == 0


def test_a_retired_block_is_hidden_at_once_and_reported_when_its_last_reader_lets_go(served):
    lane, client = served
    block = entry(b"bad", 0)
    lane.publish([block])
    first, second = query(client, [b"bad"]), query(client, [b"bad"])
    lane.drain()
    assert lane.retire(block) == 2
    assert query(client, [b"bad"], lease=False).num_hits == 0
    assert lane.unpublish(block) is True  # nothing published under that key any more
    client.release("s1", wire.parse_lease_name(first.lease_id), 0, time.monotonic() + 5)
    assert lane.drain().dead_released == []
    client.release("s1", wire.parse_lease_name(second.lease_id), 0, time.monotonic() + 5)
    assert lane.drain().dead_released == [(NS, b"bad")]
    assert lane.stats()["retired_pinned"] == 0


def test_the_session_quota_covers_both_lanes_and_the_engine_decides_at_it(served):
    lane, client = served  # quota: 64 blocks
    lane.publish([entry(k, i * BLOCK) for i, k in enumerate(keys(64))])
    assert lane.charge("s1", 40 * BLOCK, BLOCK) == 40 * BLOCK  # the engine's leases
    # A lease that would pass the quota is the engine's to cut or refuse: a release the client sent
    # the engine just before may not have run yet, and the engine runs a client's calls in order.
    assert query(client, keys(64)) is NOT_RUN
    assert not lane.pinned((NS, b"k0"))
    hit = query(client, keys(24))
    assert hit.num_hits == 24
    assert lane.charge("s1", BLOCK, BLOCK) == 0  # nothing left for the engine either
    assert query(client, keys(1)) is NOT_RUN
    lane.uncharge("s1", 40 * BLOCK)
    assert query(client, keys(8)).num_hits == 8
    assert query(client, keys(8), lease=False).num_hits == 8  # no lease: no quota


def test_the_lease_count_limit_covers_both_lanes(served):
    lane, client = served  # at most 8 leases
    lane.publish([entry(b"a", 0)])
    for _ in range(5):
        assert lane.charge("s1", BLOCK, BLOCK) == BLOCK
    for _ in range(3):
        assert query(client, [b"a"]).num_hits == 1
    assert query(client, [b"a"]) is NOT_RUN  # the engine says why
    assert lane.charge("s1", BLOCK, BLOCK) == -1


def test_what_the_lane_cannot_answer_as_the_engine_would_is_left_to_the_engine(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    lane.add_session("s2", 0, 64 * BLOCK, 8, True)
    lane.add_session("capped", 0, 64 * BLOCK, 8, False)  # a tenant with a lease cap: the engine's
    lane.add_instance("i2", "s2", NS, BLOCK)
    assert query(client, [b"a"], sid="nobody") is NOT_RUN
    assert query(client, [b"a"], iid="nobody") is NOT_RUN
    assert query(client, [b"a"], sid="s2", iid="i1") is NOT_RUN  # another session's instance
    assert query(client, [b"a"], sid="capped", iid="i1") is NOT_RUN
    assert query(client, [b"a"], ttl=10_000.0) is NOT_RUN  # over the longest ttl: the engine says why
    assert query(client, [b"a" * 65]) is NOT_RUN  # longer than the lane's keys: not even sent
    assert query(client, []) is NOT_RUN
    assert query(client, [b"a"], sid="s2", iid="i2").num_hits == 1
    assert lane.drain().counts["not_executed"] == 6  # the long hash was never sent
    assert client.usable  # routine: the lane stays in use


def test_with_fallback_on_miss_a_chain_going_beyond_dram_is_the_engines(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    lane.set_fallback_on_miss(True)  # an SSD tier or peers may hold what DRAM does not
    assert query(client, [b"a", b"b"]) is NOT_RUN
    assert not lane.pinned((NS, b"a"))  # nothing was done
    assert query(client, [b"a"]).num_hits == 1


def test_leases_expire_and_a_release_that_came_first_refuses_the_late_query(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    hit = query(client, [b"a"], ttl=0.5)
    assert lane.expire(time.monotonic() + 0.2) == 0
    assert lane.expire(time.monotonic() + 1.0) == 1
    assert not lane.pinned((NS, b"a"))
    with pytest.raises(LocalRpcError) as err:
        client.release("s1", wire.parse_lease_name(hit.lease_id), 0, time.monotonic() + 5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert dict(err.value.trailing_metadata())["pegaflow-not-found"] == "lease"
    # A query whose release was already handled (it timed out on the client): refused, pins nothing.
    frame = wire.encode_query(
        "s1", "i1", [b"a"], lease_id=wire.parse_lease_name(hit.lease_id), timeout_ms=1000
    )
    answer = raw_call(client, frame)
    assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert not lane.pinned((NS, b"a"))


def test_a_lease_id_in_use_is_refused(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    frame = wire.encode_query("s1", "i1", [b"a"], lease_id=1 << 62, timeout_ms=1000)
    assert raw_call(client, frame).code == 0
    assert raw_call(client, frame).code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert lane.pinned((NS, b"a"))


def test_removing_a_session_ends_its_leases_and_instances(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    query(client, [b"a"])
    assert lane.remove_session("s1") == 1
    assert not lane.pinned((NS, b"a"))
    assert query(client, [b"a"]) is NOT_RUN
    assert lane.charge("s1", BLOCK, BLOCK) is None


def test_offsets_are_relative_to_the_memory_the_session_maps(served):
    lane, client = served
    lane.add_session("region", 1 << 30, 64 * BLOCK, 8, True)
    lane.add_instance("ir", "region", NS, BLOCK)
    lane.publish([entry(b"a", (1 << 30) + 5 * BLOCK)])
    assert query(client, [b"a"], sid="region", iid="ir").locations[0].offset == 5 * BLOCK


def test_signals_carry_what_the_engine_needs(served):
    lane, client = served
    lane.publish([entry(k, i * BLOCK) for i, k in enumerate(keys(3))])
    lane.drain()
    hit = query(client, keys(3) + [b"miss"])
    query(client, keys(2), lease=False, load=True)
    client.release("s1", wire.parse_lease_name(hit.lease_id), 2 * BLOCK, time.monotonic() + 5)
    sig = lane.drain()
    assert [(q.load, q.ns_index, q.hashes, q.found, q.served) for q in sig.queries] == [
        (False, NS, keys(3) + [b"miss"], 3, 3),
        (True, NS, keys(2), 2, 2),
    ]
    assert [(ns, loaded) for ns, loaded, _ in sig.loads] == [(NS, 2 * BLOCK)]
    assert [(m, code) for m, code, _ in sig.calls] == [
        ("QueryPrefix", 0),
        ("QueryPrefix", 0),
        ("ReleaseLease", 0),
    ]
    c = sig.counts
    assert (c["lookup_queries"], c["dram_hits"], c["misses"], c["load_queries"], c["loaded_bytes"]) == (
        1,
        3,
        1,
        1,
        2 * BLOCK,
    )
    assert not lane.drain()


def test_a_full_signal_buffer_drops_records_and_counts_them(tmp_path):
    lane = ReadLane(native.load().Lane(signal_bytes=4096), 64, 4096)  # room for a few records
    path = str(tmp_path / "small.sock")
    lane.serve(path, EPOCH)
    lane.add_session("s1", 0, 1 << 30, 1 << 20, True)
    lane.add_instance("i1", "s1", NS, BLOCK)
    lane.publish([entry(k, i * BLOCK) for i, k in enumerate(keys(64, "long-key-" * 4))])
    client = ReadLaneClient(path, EPOCH, 4096)
    try:
        for _ in range(10):
            assert query(client, keys(64, "long-key-" * 4), lease=False).num_hits == 64
        sig = lane.drain()
        assert len(sig.queries) < 10 and sig.counts["signals_dropped"] > 0
        assert sig.counts["lookup_queries"] == 10  # counts stay exact
    finally:
        client.close()
        lane.stop()


# ------------------------------------------------------------------ the socket


def raw_connect(client: ReadLaneClient) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(client._link.path)
    magic, version, epoch = frames.read_hello(s, time.monotonic() + 5)
    assert (magic, version, epoch) == (wire.HELLO_MAGIC, wire.VERSION, EPOCH)
    return s


def raw_call(client: ReadLaneClient, frame: bytes) -> wire.Response:
    s = raw_connect(client)
    try:
        s.sendall(frame)
        body = frames.read_frame(s, 1 << 20, time.monotonic() + 5)
        return wire.decode_response(body)
    finally:
        s.close()


def test_garbage_closes_only_its_own_connection(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    good = raw_connect(client)
    bad = raw_connect(client)
    bad.sendall(struct.pack("<I", 12) + b"NOPE" + bytes(8))  # not this protocol
    assert bad.recv(16) == b""  # closed
    truncated = wire.encode_query("s1", "i1", [b"a"], timeout_ms=1000)
    bad2 = raw_connect(client)
    bad2.sendall(struct.pack("<I", len(truncated) - 5) + truncated[4:-1])  # a hash byte missing
    answer = wire.decode_response(frames.read_frame(bad2, 1 << 20, time.monotonic() + 5))
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    huge = raw_connect(client)
    huge.sendall(struct.pack("<I", 1 << 30))  # longer than any request: refused unread, closed
    answer = wire.decode_response(frames.read_frame(huge, 1 << 20, time.monotonic() + 5))
    assert answer.not_executed
    assert huge.recv(16) == b""
    good.sendall(wire.encode_query("s1", "i1", [b"a"], timeout_ms=1000))
    assert len(wire.decode_response(frames.read_frame(good, 1 << 20, time.monotonic() + 5)).offsets) == 1
    assert query(client, [b"a"], lease=False).num_hits == 1
    assert lane.stats()["protocol_errors"] >= 1
    for s in (good, bad, bad2, huge):
        s.close()


def test_at_the_connection_cap_the_longest_idle_connection_gets_goodbye(served):
    lane, client = served  # at most 4 connections
    conns = [raw_connect(client) for _ in range(4)]
    newest = raw_connect(client)  # evicts conns[0], the longest idle
    assert frames.read_frame(conns[0], 1 << 20, time.monotonic() + 5) == b""  # GOODBYE
    assert conns[0].recv(16) == b""
    newest.sendall(wire.encode_query("s1", "i1", [b"x"], timeout_ms=1000))
    assert wire.decode_response(frames.read_frame(newest, 1 << 20, time.monotonic() + 5)).code == 0
    assert lane.stats()["evicted_connections"] == 1
    for s in conns + [newest]:
        s.close()


def test_an_idle_connection_gets_goodbye_and_the_client_sends_again(tmp_path):
    lane = make_lane()
    path = str(tmp_path / "idle.sock")
    lane.serve(path, EPOCH, idle_timeout_s=0.3)
    lane.add_session("s1", 0, 1 << 30, 8, True)
    lane.add_instance("i1", "s1", NS, BLOCK)
    lane.publish([entry(b"a", 0)])
    client = ReadLaneClient(path, EPOCH, 4096)
    try:
        assert query(client, [b"a"], lease=False).num_hits == 1
        deadline = time.monotonic() + 5
        while lane.stats()["idle_closed_connections"] == 0:  # swept within a second or two
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert query(client, [b"a"], lease=False).num_hits == 1  # on a new connection, run once
        assert lane.stats()["connections"] == 1
    finally:
        client.close()
        lane.stop()


def test_stop_says_goodbye_and_removes_the_socket(tmp_path):
    lane = make_lane()
    path = tmp_path / "stop.sock"
    lane.serve(str(path), EPOCH)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    frames.read_hello(s, time.monotonic() + 5)
    lane.stop()
    assert frames.read_frame(s, 1 << 20, time.monotonic() + 5) == b""
    assert not path.exists()
    lane.stop()  # idempotent
    s.close()


def test_a_live_socket_is_never_taken_over(tmp_path):
    first, second = make_lane(), make_lane()
    path = str(tmp_path / "live.sock")
    first.serve(path, EPOCH)
    try:
        with pytest.raises(OSError):
            second.serve(path, "other")
        client = ReadLaneClient(path, EPOCH, 4096)
        first.add_session("s1", 0, 1 << 30, 8, True)
        first.add_instance("i1", "s1", NS, BLOCK)
        assert query(client, [b"x"], lease=False).num_hits == 0  # still the first one's
        client.close()
    finally:
        first.stop()


def test_tables_stay_sized_by_what_they_hold_however_many_ids_come_and_go(served):
    lane, client = served
    lane.publish([entry(b"a", 0)])
    for _ in range(20_000):  # every query takes a lease under a fresh id, its release ends it
        hit = query(client, [b"a"])
        client.release("s1", wire.parse_lease_name(hit.lease_id), 0, time.monotonic() + 5)
    for i in range(5_000):
        lane.add_session(f"churn-{i}", 0, BLOCK, 1, True)
        lane.remove_session(f"churn-{i}")
    stats = lane.stats()
    assert stats["leases"] == 0 and stats["lease_slots"] <= 256 and stats["session_slots"] <= 256
