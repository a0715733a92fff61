"""The peer data plane's frames: round trips, and every corruption a receiver must catch."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.common.wire import peer_frames as frames
from pegaflow.common.wire.checksum import checksum

TID = bytes(range(16))


def test_header_is_56_bytes_and_round_trips():
    raw = frames.encode_block_header(TID, 7, 1 << 20, 0x1234_5678_9ABC_DEF0)
    assert len(raw) == frames.HEADER_BYTES == 56
    head = frames.decode_header(raw)
    assert head == frames.FrameHeader(frames.FrameType.BLOCK, 0, TID, 7, 0, 1 << 20, 0x1234_5678_9ABC_DEF0)
    assert not head.fatal


@settings(deadline=None)  # a shared 2-core machine: wall time per example is not the point
@given(st.integers(0, frames.HEADER_BYTES - 1), st.integers(1, 255))
def test_any_flipped_header_byte_is_caught(position, flip):
    raw = bytearray(frames.encode_block_header(TID, 3, 4096, 99))
    raw[position] ^= flip
    with pytest.raises(frames.FrameError):
        frames.decode_header(raw)


def test_wrong_magic_version_type_and_length_are_refused_with_a_reason():
    with pytest.raises(frames.FrameError, match="magic"):
        frames.decode_header(b"XXXX" + bytes(52))
    with pytest.raises(frames.FrameError, match="56 bytes"):
        frames.decode_header(b"PGPF")
    head = struct.pack("<4sBBH16sIIQQ", frames.MAGIC, 2, 1, 0, TID, 0, 0, 0, 0)
    with pytest.raises(frames.FrameError, match="version 2"):
        frames.decode_header(head + struct.pack("<Q", checksum(head)))
    head = struct.pack("<4sBBH16sIIQQ", frames.MAGIC, frames.VERSION, 9, 0, TID, 0, 0, 0, 0)
    with pytest.raises(frames.FrameError, match="type 9"):
        frames.decode_header(head + struct.pack("<Q", checksum(head)))


@settings(deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.floats(0.001, 1000))
def test_read_round_trips(indices, timeout_s):
    raw = frames.encode_read(TID, indices, timeout_s)
    head = frames.decode_header(raw)
    assert head.type is frames.FrameType.READ and head.transfer_id == TID
    got_timeout, got = frames.decode_read(head, raw[frames.HEADER_BYTES :])
    assert got == indices
    assert got_timeout == pytest.approx(max(0.001, int(timeout_s * 1000) / 1000))


def test_read_bodies_that_lie_are_refused():
    raw = bytearray(frames.encode_read(TID, [1, 2, 3], 5.0))
    head = frames.decode_header(raw)
    body = bytes(raw[frames.HEADER_BYTES :])
    with pytest.raises(frames.FrameError, match="checksum"):
        frames.decode_read(head, body[:-1] + bytes([body[-1] ^ 1]))
    with pytest.raises(frames.FrameError, match="checksum"):
        frames.decode_read(head, body + b"\x00")
    # a body whose count disagrees with its length, with a checksum that matches
    lying = struct.pack("<II", 5000, 9) + struct.pack("<3I", 1, 2, 3)
    lying_head = head._replace(length=len(lying), payload_checksum=checksum(lying))
    with pytest.raises(frames.FrameError, match="9 blocks"):
        frames.decode_read(lying_head, lying)
    no_deadline = struct.pack("<II", 0, 1) + struct.pack("<I", 0)
    with pytest.raises(frames.FrameError, match="deadline"):
        frames.decode_read(head._replace(length=12, payload_checksum=checksum(no_deadline)), no_deadline)
    with pytest.raises(ValueError):
        frames.encode_read(TID, [], 1.0)
    with pytest.raises(ValueError):
        frames.encode_read(TID, [0] * (frames.MAX_READ_BLOCKS + 1), 1.0)
    with pytest.raises(ValueError, match="16 bytes"):
        frames.encode_read(b"short", [0], 1.0)


def test_error_frames_carry_status_message_and_fatality():
    raw = frames.encode_error(TID, frames.PeerStatus.UNKNOWN_TRANSFER, "no such transfer", block_index=4)
    head = frames.decode_header(raw)
    assert head.type is frames.FrameType.ERROR and not head.fatal and head.block_index == 4
    assert frames.decode_error(head, raw[frames.HEADER_BYTES :]) == (
        frames.PeerStatus.UNKNOWN_TRANSFER,
        "no such transfer",
    )
    for status in (frames.PeerStatus.PROTOCOL, frames.PeerStatus.BUSY, frames.PeerStatus.SHUTTING_DOWN):
        assert frames.decode_header(frames.encode_error(TID, status, "x")).fatal
    long = frames.encode_error(TID, frames.PeerStatus.INTERNAL, "é" * 10_000)
    assert len(long) - frames.HEADER_BYTES == frames.MAX_ERROR_MESSAGE_BYTES
    head = frames.decode_header(long)
    status, message = frames.decode_error(head, long[frames.HEADER_BYTES :])  # a cut code point is replaced
    assert status is frames.PeerStatus.INTERNAL and message.startswith("é")
    with pytest.raises(frames.FrameError):
        frames.decode_error(head, long[frames.HEADER_BYTES : -1])


def test_done_counts_the_blocks_sent():
    head = frames.decode_header(frames.encode_done(TID, 12))
    assert head.type is frames.FrameType.DONE and head.block_index == 12 and head.length == 0
