"""The local sockets' byte formats: the shared framing, the local RPC and doorbell codecs, the fd broker's
handshake and the GPU registration's wire spellings. Round trips, and garbage that is refused
cleanly (FrameError, never anything else)."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.common.wire import doorbell, frames, local_rpc, status
from pegaflow.common.wire.device_registration import normalize_uuid, raw_ipc_handle

RAW = bytes(range(64))


def body(frame: bytes) -> bytes:
    (size,) = frames.LEN.unpack_from(frame)
    assert size == len(frame) - frames.LEN.size
    return frame[frames.LEN.size :]


# ------------------------------------------------------------------ framing


def test_greetings_round_trip_and_garbage_is_refused():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frames.encode_hello(b"ECHO", 3, "epoch-1"))
        assert frames.read_hello(b, None) == (b"ECHO", 3, "epoch-1")
        a.sendall(b"ECHO\x03\x02\xff\xfe")
        with pytest.raises(frames.FrameError):
            frames.read_hello(b, None)
        a.close()
        with pytest.raises(ConnectionError):
            frames.read_hello(b, None)


def test_a_frame_is_read_as_it_arrives_and_charged_to_the_budget():
    a, b = socket.socketpair()
    budget = frames.MemoryBudget(1 << 20)
    payload = bytes(range(256)) * 2048  # 512 KiB: several recvs
    t = threading.Thread(target=a.sendall, args=(frames.encode_frame(payload),))
    t.start()
    assert frames.read_frame(b, 1 << 20, budget=budget) == payload
    t.join()
    assert budget.used_bytes == len(payload)  # the caller releases it once done with the body
    budget.release(len(payload))
    # Past the limit: refused from its length alone; past the budget: refused, nothing kept.
    a.sendall(frames.LEN.pack(2 << 20))
    with pytest.raises(frames.FrameTooLarge):
        frames.read_frame(b, 1 << 20, budget=budget)
    small = frames.MemoryBudget(1000)
    a.sendall(frames.encode_frame(b"x" * 5000))
    with pytest.raises(frames.MemoryCapExceeded):
        frames.read_frame(b, 1 << 20, budget=small)
    assert small.used_bytes == 0
    a.close()
    b.close()


def test_eof_between_frames_is_none_and_inside_a_frame_an_error():
    a, b = socket.socketpair()
    a.sendall(frames.GOODBYE + frames.LEN.pack(10) + b"abc")
    a.close()
    assert frames.read_frame(b, 100) == b""  # GOODBYE
    with pytest.raises(ConnectionError):
        frames.read_frame(b, 100)
    b.close()
    c, d = socket.socketpair()
    c.close()
    assert frames.read_frame(d, 100) is None
    d.close()


def test_a_read_never_outlasts_its_deadline():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frames.LEN.pack(10) + b"ab")  # the rest never comes
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            frames.read_frame(b, 100, time.monotonic() + 0.2)
        assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------ the local RPC codec


@given(
    method=st.sampled_from(sorted(local_rpc.LOCAL_METHODS)),
    payload=st.binary(max_size=200),
    timeout=st.one_of(st.none(), st.floats(0.001, 1e5)),
    oneway=st.booleans(),
)
@settings(max_examples=100, deadline=None, database=None)
def test_local_rpc_requests_round_trip(method, payload, timeout, oneway):
    got = local_rpc.decode_request(body(local_rpc.encode_request(method, payload, timeout, oneway)))
    assert (got.method, got.payload, got.oneway) == (method, payload, oneway)
    assert (got.timeout_s is None) == (timeout is None)


@given(
    code=st.sampled_from(list(grpc.StatusCode)),
    message=st.text(max_size=100),
    metadata=st.lists(st.tuples(st.text("abc-", max_size=10), st.text(max_size=20)), max_size=3),
    payload=st.binary(max_size=100),
    not_executed=st.booleans(),
)
@settings(max_examples=100, deadline=None, database=None)
def test_local_rpc_responses_round_trip(code, message, metadata, payload, not_executed):
    got = local_rpc.decode_response(
        body(local_rpc.encode_response(code, message, metadata, payload, not_executed))
    )
    assert got == (code, message, tuple(metadata), payload, not_executed)


@given(st.binary(max_size=200))
@settings(max_examples=200, deadline=None, database=None)
def test_garbage_is_a_frame_error_in_both_codecs(data):
    for decode in (local_rpc.decode_request, doorbell.decode_request, doorbell.decode_response):
        try:
            decode(data)
        except frames.FrameError:
            pass


# ------------------------------------------------------------------ the doorbell codec


@given(
    op=st.sampled_from([doorbell.OP_SAVE, doorbell.OP_LOAD]),
    hashes=st.lists(st.binary(min_size=1, max_size=64), max_size=300),
    sid=st.text("abcdef0123456789-", max_size=40),
    timeout=st.floats(0.001, 1000),
    purpose=st.sampled_from([0, 1]),
    data=st.data(),
)
@settings(max_examples=150, deadline=None, database=None)
def test_doorbell_requests_round_trip(op, hashes, sid, timeout, purpose, data):
    ids = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes), max_size=len(hashes)))
    got = doorbell.decode_request(
        body(doorbell.encode_request(op, sid, "g-1", hashes, ids, timeout, purpose))
    )
    assert got[:5] == (op, sid, "g-1", hashes, ids)
    assert abs(got.timeout_s - max(0.001, int(timeout * 1000) / 1000)) < 1e-9
    assert got.purpose == purpose


@given(
    code=st.sampled_from([c.value[0] for c in grpc.StatusCode]),
    value=st.integers(0, 2**32 - 1),
    message=st.text(max_size=100),
    kind=st.text("abcdefghij ", max_size=30),
    statuses=st.lists(st.integers(0, 5), max_size=300),
    not_executed=st.booleans(),
)
@settings(max_examples=100, deadline=None, database=None)
def test_doorbell_responses_round_trip(code, value, message, kind, statuses, not_executed):
    got = doorbell.decode_response(
        body(doorbell.encode_response(code, value, message, statuses, kind, not_executed))
    )
    assert got == (code, value, message, kind, statuses, not_executed)


def test_what_the_doorbell_frame_cannot_carry_is_refused_before_it_is_sent():
    for hashes, ids in (([b"a"], [1, 2]), ([b"x" * 256], [1]), ([b""], [1]), ([b"a"] * 65536, [1] * 65536)):
        with pytest.raises(ValueError):  # the client sends these over gRPC, which answers them
            doorbell.encode_request(doorbell.OP_SAVE, "s", "g", hashes, ids, 1.0)
    good = body(doorbell.encode_request(doorbell.OP_SAVE, "s", "g", [b"ab", b"c"], [1, 2], 1.0))
    for bad in (good[:-1], b"XXXX" + good[4:], good + b"z"):
        with pytest.raises(frames.FrameError):
            doorbell.decode_request(bad)


def test_status_numbers_are_grpcs():
    for code in grpc.StatusCode:
        assert status.from_number(status.number(code)) is code
    assert status.from_number(200) is grpc.StatusCode.UNKNOWN


# ------------------------------------------------------------------ GPU registration spellings


@pytest.mark.parametrize(
    "spelling",
    [
        "GPU-00112233-4455-6677-8899-aabbccddeeff",
        "00112233-4455-6677-8899-AABBCCDDEEFF",
        bytes.fromhex("00112233445566778899aabbccddeeff"),
    ],
)
def test_uuid_spellings_agree(spelling):
    assert normalize_uuid(spelling) == "00112233445566778899aabbccddeeff"


def test_torch_handles_are_unwrapped_to_the_raw_ipc_handle():
    assert raw_ipc_handle(RAW) == RAW  # torch <= 2.0: the raw handle
    assert raw_ipc_handle(b"\x02c" + RAW) == RAW  # versioned, cudaMalloc block
    with pytest.raises(ValueError, match="expandable_segments"):
        raw_ipc_handle(b"\x02e" + b"\x00" * 40)
    with pytest.raises(ValueError, match="unrecognised"):
        raw_ipc_handle(b"\x02x" + RAW)


def test_readable_sees_data_and_eof_and_takes_descriptors_past_select_s_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2100:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: cannot open descriptor 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2100), hard))
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 2048)  # where select() raises ValueError
    try:
        assert not frames.readable(high, 0)
        b.sendall(b"x")
        assert frames.readable(high, 0.5)
        os.read(high, 1)
        assert not frames.readable(a, 0.01)
        b.close()
        assert frames.readable(a, 0.5)  # EOF reads as readable
    finally:
        os.close(high)
        a.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
