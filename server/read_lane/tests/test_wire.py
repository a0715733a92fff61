"""The read lane's wire format (common/wire/read_lane.py) in Python, and the C reader and writer
(read_lane.c) held to it at its edges: the longest request, the longest ids, every flag."""

from __future__ import annotations

import time

import pytest

from pegaflow.client.read_lane import NOT_RUN, ReadLaneClient
from pegaflow.common.wire import read_lane as wire
from pegaflow.common.wire.frames import LEN, FrameError
from pegaflow.server.config import ServerConfig
from pegaflow.server.read_lane.lane import ReadLane
from pegaflow.server.store.index import BlockEntry


def test_requests_round_trip_in_python():
    hashes = [b"a", b"b" * 64, bytes(range(17))]
    frame = wire.encode_query(
        "s-1", "i-2", hashes, lease_id=77, lease_ttl_ms=1500, purpose_load=True, timeout_ms=900
    )
    (size,) = LEN.unpack_from(frame)
    assert size == len(frame) - 4 <= wire.max_request_bytes(len(hashes))
    req = wire.decode_request(frame[4:])
    assert req == wire.Request(
        wire.OP_QUERY,
        wire.FLAG_LEASE | wire.FLAG_PURPOSE_LOAD,
        900,
        "s-1",
        "i-2",
        1500,
        77,
        0,
        hashes,
    )
    release = wire.decode_request(wire.encode_release("s-1", 77, 4096, timeout_ms=5)[4:])
    assert (release.op, release.lease_id, release.loaded_bytes, release.hashes) == (
        wire.OP_RELEASE,
        77,
        4096,
        [],
    )


def test_what_the_frame_cannot_carry_is_refused_before_sending():
    with pytest.raises(ValueError):
        wire.encode_query("s", "i", [b""], timeout_ms=1)
    with pytest.raises(ValueError):
        wire.encode_query("s", "i", [b"x" * 65], timeout_ms=1)
    with pytest.raises(ValueError):
        wire.encode_query("s" * 256, "i", [b"x"], timeout_ms=1)
    with pytest.raises(ValueError):
        wire.encode_query("s", "i", [b"x"] * (wire.MAX_HASHES + 1), timeout_ms=1)


def test_truncated_or_foreign_bytes_are_frame_errors():
    body = wire.encode_query("s", "i", [b"abc"], timeout_ms=1)[4:]
    for bad in (body[:-1], body + b"x", b"NOPE" + body[4:], b""):
        with pytest.raises(FrameError):
            wire.decode_request(bad)
    with pytest.raises(FrameError):
        wire.decode_response(b"PGR1\x00\x00\x01\x00" + bytes(6))  # one hit announced, none carried


def test_lease_names_round_trip_and_other_ids_are_not_lane_leases():
    assert wire.parse_lease_name(wire.lease_name(0xDEADBEEF)) == 0xDEADBEEF
    for other in ("l-" + "0" * 24, "r-xyz", "r-" + "0" * 16, "", "r-" + "f" * 17):
        assert wire.parse_lease_name(other) is None


def test_the_c_side_reads_the_longest_request_and_writes_the_longest_answer(tmp_path):
    lane = ReadLane.create(ServerConfig(pool_size_bytes=1 << 30), fallback_on_miss=False)
    path = str(tmp_path / "w.sock")
    lane.serve(path, "e")
    sid, iid = "s" * 64, "i" * 64  # the longest ids the lane keeps
    lane.add_session(sid, 0, 1 << 40, 8, True)
    lane.add_instance(iid, sid, 9, 4096)
    hashes = [i.to_bytes(2, "little") * 32 for i in range(4096)]  # 4096 hashes of 64 bytes
    entries = []
    for i, h in enumerate(hashes):
        e = BlockEntry((9, h), 4096)
        e.dram, e.checksum = i * 4096 + (1 << 33), (1 << 64) - 1 - i
        entries.append(e)
    lane.publish(entries)
    client = ReadLaneClient(path, "e", 4096)
    try:
        lease = client.new_lease_id()
        hit = client.query(sid, iid, hashes, lease, 600.0, True, time.monotonic() + 10)
        assert hit.num_hits == 4096 and hit.lease_id == wire.lease_name(lease)
        assert [loc.offset for loc in hit.locations] == [e.dram for e in entries]
        assert [loc.checksum for loc in hit.locations] == [e.checksum for e in entries]
        assert client.release(sid, lease, 1 << 62, time.monotonic() + 10) is None
        sig = lane.drain()
        assert sig.queries[0].load and sig.queries[0].hashes == hashes
        assert sig.counts["loaded_bytes"] == 4096 * 4096  # a release reports at most what it leased
        assert client.query("s" * 65, iid, hashes[:1], 0, None, False, time.monotonic() + 10) is NOT_RUN
    finally:
        client.close()
        lane.stop()
