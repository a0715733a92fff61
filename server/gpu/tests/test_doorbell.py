"""The doorbell's frames and its socket round trip, on CPU.

The server end is exercised with a small in-test handler standing in for
GpuDataPath (the real one needs a GPU and is covered by test_cuda_service.py
and the GPU benchmark): what is tested here is the protocol layer -- framing,
limits, error kinds, deadlines, concurrent connections.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.client import errors
from pegaflow.client.doorbell import (
    OP_LOAD,
    OP_SAVE,
    DoorbellClient,
    FrameError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    recv_frame,
    ring,
    send_frame,
)
from pegaflow.server.engine import QueryPurpose
from pegaflow.server.errors import DeadlineExceeded, InvalidArgument, NotFound
from pegaflow.server.gpu.doorbell import DoorbellServer


@given(
    op=st.sampled_from([OP_SAVE, OP_LOAD]),
    hashes=st.lists(st.binary(min_size=1, max_size=64), max_size=300),
    sid=st.text(max_size=40),
    timeout=st.floats(0.001, 1000),
    purpose=st.sampled_from([0, 1]),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_request_frames_round_trip(op, hashes, sid, timeout, purpose, data):
    ids = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes), max_size=len(hashes)))
    got = decode_request(encode_request(op, sid, "g-1", hashes, ids, timeout, purpose))
    assert got[:5] == (op, sid, "g-1", hashes, ids)
    assert abs(got[5] - max(0.001, int(timeout * 1000) / 1000)) < 1e-9
    assert got[6] == purpose


@given(
    code=st.integers(0, 7),
    value=st.integers(0, 2**32 - 1),
    msg=st.text(max_size=100),
    statuses=st.lists(st.integers(0, 5), max_size=300),
)
@settings(max_examples=100, deadline=None)
def test_response_frames_round_trip(code, value, msg, statuses):
    assert decode_response(encode_response(code, value, msg, statuses)) == (code, value, msg, statuses)


def test_malformed_frames_are_refused():
    good = encode_request(OP_SAVE, "s", "g", [b"ab", b"c"], [1, 2], 1.0)
    with pytest.raises(FrameError):
        decode_request(good[:-1])  # a hash byte missing
    with pytest.raises(FrameError):
        decode_request(b"XXXX" + good[4:])
    with pytest.raises(FrameError):
        decode_response(b"PGD1")
    with pytest.raises(ValueError, match="block ids"):
        encode_request(OP_SAVE, "s", "g", [b"a"], [1, 2], 1.0)
    with pytest.raises(ValueError, match="1..255 bytes"):
        encode_request(OP_SAVE, "s", "g", [b""], [1], 1.0)


@dataclasses.dataclass
class _Saved:
    statuses: list[int]
    written: int


@dataclasses.dataclass
class _Loaded:
    num_hits: int


class _Handler:
    """Answers like GpuDataPath: known registration 'g-ok' of session 's'; hash b'slow' sleeps."""

    def __init__(self):
        self.calls = []

    def save(self, session_id, reg_id, hashes, block_ids, deadline):
        self.calls.append(("save", session_id, reg_id, hashes, block_ids, deadline - time.monotonic()))
        if reg_id != "g-ok":
            raise NotFound("device registration", reg_id)
        if hashes == [b"slow"]:
            time.sleep(0.5)
            raise DeadlineExceeded("too slow")
        return _Saved([1] * len(hashes), len(hashes))

    def load(self, session_id, reg_id, hashes, block_ids, deadline, purpose):
        self.calls.append(("load", session_id, reg_id, hashes, block_ids, purpose))
        if max(block_ids) > 100:
            raise InvalidArgument("GPU block id outside")
        return _Loaded(len(hashes) - 1)


@pytest.fixture
def doorbell(tmp_path):
    handler = _Handler()
    server = DoorbellServer(str(tmp_path / "d.sock"), handler, max_blocks=256, max_hash_bytes=64)
    client = DoorbellClient(server.path)
    try:
        yield handler, server, client
    finally:
        client.close()
        server.close()


def test_requests_reach_the_handler_and_answers_come_back(doorbell):
    handler, _, client = doorbell
    assert ring(client, OP_SAVE, "s", "g-ok", [b"a", b"b"], [3, 4], 2.0) == (2, [1, 1])
    assert ring(client, OP_LOAD, "s", "g-ok", [b"a", b"b"], [5, 6], 2.0) == (1, [])
    op, sid, rid, hashes, ids, remaining = handler.calls[0]
    assert (op, sid, rid, hashes, ids) == ("save", "s", "g-ok", [b"a", b"b"], [3, 4])
    assert 1.0 < remaining <= 2.0  # the caller's timeout became the server's deadline
    # a load's query purpose travels in the frame's flags (LOOKUP unless the caller says LOAD)
    assert handler.calls[1] == ("load", "s", "g-ok", [b"a", b"b"], [5, 6], QueryPurpose.LOOKUP)
    assert ring(client, OP_LOAD, "s", "g-ok", [b"c"], [7], 2.0, purpose=1) == (0, [])
    assert handler.calls[2][-1] is QueryPurpose.LOAD


def test_errors_come_back_as_the_clients_exception_kinds(doorbell):
    _, _, client = doorbell
    with pytest.raises(errors.NotFound):
        ring(client, OP_SAVE, "s", "g-unknown", [b"a"], [1], 2.0)
    with pytest.raises(errors.InvalidArgument, match="outside"):
        ring(client, OP_LOAD, "s", "g-ok", [b"a"], [1000], 2.0)
    with pytest.raises(errors.InvalidArgument, match="1..256 blocks"):
        ring(client, OP_SAVE, "s", "g-ok", [b"%d" % i for i in range(257)], list(range(257)), 2.0)
    with pytest.raises(errors.InvalidArgument, match="1..64 bytes"):
        ring(client, OP_SAVE, "s", "g-ok", [b"x" * 65], [1], 2.0)
    with pytest.raises(errors.InvalidArgument, match="block ids"):
        ring(client, OP_SAVE, "s", "g-ok", [b"a"], [1, 2], 2.0)
    # the connection is still usable after every refusal
    assert ring(client, OP_SAVE, "s", "g-ok", [b"a"], [1], 2.0) == (1, [1])


def test_a_slow_answer_is_a_deadline_and_the_connection_recovers(doorbell):
    _, _, client = doorbell
    with pytest.raises(errors.DeadlineExceeded):
        ring(client, OP_SAVE, "s", "g-ok", [b"slow"], [1], 0.1)
    assert ring(client, OP_SAVE, "s", "g-ok", [b"a"], [1], 2.0) == (1, [1])


def test_threads_get_their_own_connections(doorbell):
    handler, _, client = doorbell
    results = []

    def work(i):
        results.append(ring(client, OP_SAVE, "s", "g-ok", [b"%d" % i], [i], 5.0))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [(1, [1])] * 8 and len(handler.calls) == 8


def test_no_socket_means_use_the_rpc(tmp_path):
    assert ring(DoorbellClient(str(tmp_path / "none.sock")), OP_SAVE, "s", "g", [b"a"], [1], 1.0) is None


def test_garbage_closes_only_that_connection(doorbell):
    _, server, client = doorbell
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(server.path)
    send_frame(raw, b"this is not a doorbell frame")
    raw.settimeout(5)
    assert raw.recv(1) == b""  # the server hung up
    raw.close()
    assert ring(client, OP_SAVE, "s", "g-ok", [b"a"], [1], 2.0) == (1, [1])


def test_frames_survive_partial_reads():
    a, b = socket.socketpair()
    payload = encode_request(OP_LOAD, "s", "g", [b"h" * 64] * 200, list(range(200)), 1.0)
    t = threading.Thread(target=send_frame, args=(a, payload))
    t.start()
    assert recv_frame(b) == payload
    t.join()
    a.close()
    assert recv_frame(b) is None
    b.close()
