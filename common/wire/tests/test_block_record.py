"""The block record format: round trip, every header byte covered, payload checksum, limits."""

from __future__ import annotations

import os

import pytest

from pegaflow.common.wire import block_record as rec


def _header(tag=b"ns:1/hash:abc", payload=b"x" * 5000):
    return rec.build_header(tag, payload, len(payload), sequence=7, generation=(3 << 32) + 9, volume_id=42)


def test_round_trip_keeps_every_field():
    payload = os.urandom(12345)
    h = rec.build_header(
        b"t" * rec.MAX_TAG_BYTES, payload, len(payload), sequence=1 << 50, generation=5, volume_id=9
    )
    block = bytearray(rec.HEADER_BYTES)
    rec.encode_header(h, block)
    back = rec.decode_header(block)
    assert back == h
    assert rec.payload_matches(back, payload)
    assert block[rec.HEADER_USED :] == bytes(rec.HEADER_BYTES - rec.HEADER_USED)


def test_sizes_are_aligned_and_the_header_is_one_block():
    assert rec.HEADER_BYTES == rec.RECORD_ALIGN == 4096
    assert rec.record_bytes(1) == 8192
    assert rec.record_bytes(4096) == 8192
    assert rec.record_bytes(4097) == 4096 + 8192
    assert rec.HEADER_USED == 192


@pytest.mark.parametrize("offset", range(rec.HEADER_USED))
def test_any_flipped_header_byte_is_caught(offset):
    block = bytearray(rec.HEADER_BYTES)
    rec.encode_header(_header(), block)
    block[offset] ^= 0x01
    with pytest.raises(rec.RecordError) as e:
        rec.decode_header(block)
    expected = rec.RecordFault.NO_RECORD if offset < 4 else rec.RecordFault.BAD_HEADER
    assert e.value.fault == expected


def test_flipped_payload_byte_fails_the_payload_check():
    payload = bytearray(os.urandom(9000))
    h = _header(payload=payload)
    payload[8999] ^= 0x80
    assert not rec.payload_matches(h, payload)
    assert not rec.payload_matches(h, payload[:100])  # short


def test_zeros_and_garbage_are_not_records():
    with pytest.raises(rec.RecordError) as e:
        rec.decode_header(bytes(rec.HEADER_BYTES))
    assert e.value.fault == rec.RecordFault.NO_RECORD
    assert not rec.is_record_start(bytes(8))


def test_a_newer_version_is_refused_not_misread():
    block = bytearray(rec.HEADER_BYTES)
    rec.encode_header(_header(), block)
    block[4] = 2  # version 2, and a valid checksum over it
    from pegaflow.common.wire.checksum import checksum

    block[184:192] = checksum(bytes(block[:184])).to_bytes(8, "little")
    with pytest.raises(rec.RecordError) as e:
        rec.decode_header(block)
    assert e.value.fault == rec.RecordFault.UNSUPPORTED


def test_tag_longer_than_the_limit_is_refused():
    with pytest.raises(ValueError):
        rec.encode_header(_header(tag=b"x" * (rec.MAX_TAG_BYTES + 1)), bytearray(rec.HEADER_BYTES))


def test_the_padding_after_the_payload_is_not_covered():
    payload = bytearray(os.urandom(5000)) + bytearray(rec.padded(5000) - 5000)
    h = _header(payload=payload[:5000])
    payload[6000] ^= 0xFF  # padding: whatever the DRAM slot had there
    assert rec.payload_matches(h, payload)
