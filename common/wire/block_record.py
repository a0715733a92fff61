"""The block record: one block's bytes on a disk, with the header that lets a reader (and
recovery, after a crash) vouch for them. Writer, reader and recovery all use this module.

Modelled on LevelDB's log format (db/log_format.h): a tiny fixed header, a checksum over the
header and another over the payload, and a reader that *reports* what it cannot vouch for
instead of guessing. Unlike LevelDB's 7-byte header ours is one O_DIRECT block (4096 bytes): the
payload that follows must start on a 4096 boundary so it can be read straight into, and written
straight from, a DRAM pool slot (no bounce copy), so a smaller header would save nothing on disk.
Only the first ``HEADER_USED`` bytes carry fields; the rest of the block is zero.

Layout (little-endian), record = header block + payload padded to ``RECORD_ALIGN``::

    off  size  field
      0     4  magic            b"PGFR"
      4     2  version          1
      6     2  header_bytes     4096 (lets a later version grow the header)
      8     4  flags            0 (no flag defined yet; a reader refuses unknown flags)
     12     2  tag_len          <= MAX_TAG_BYTES
     14     2  reserved         0
     16     8  payload_len      the block's bytes (the padding after them is not covered)
     24     8  payload_xxh3     XXH3-64 of payload[:payload_len]
     32     8  sequence         monotonic per tier: on recovery the newest record of a tag wins
     40     8  generation       the generation of the segment it was written into: a record whose
                                generation is not its segment's current one is stale, never served
     48     8  volume_id        which tier layout wrote it (a file re-initialised gets a new id)
     56   128  tag              opaque identity (the block store's), zero-padded
    184     8  header_xxh3      XXH3-64 of bytes [0, 184)
    192  3904  zero

The header checksum covers every field, so a flipped header byte is caught before any field is
trusted; the payload checksum (pegaflow.common.wire.checksum, XXH3-64, GIL released, ~18 GB/s on
this machine kind) catches a flipped or torn payload. Neither is masked: unlike LevelDB we never
checksum data that embeds checksums of the same kind.
"""

from __future__ import annotations

import dataclasses
import enum
import struct

from pegaflow.common.wire.checksum import checksum

MAGIC = b"PGFR"
VERSION = 1
RECORD_ALIGN = 4096  # O_DIRECT's boundary; equals server/tiers/base.py IO_ALIGN (asserted there)
HEADER_BYTES = RECORD_ALIGN
MAX_TAG_BYTES = 128

_FIELDS = struct.Struct("<4sHHIHHQQQQQ128s")  # everything the header checksum covers
_SUM = struct.Struct("<Q")
HEADER_USED = _FIELDS.size + _SUM.size  # 192
_ZERO_TAIL = bytes(HEADER_BYTES - HEADER_USED)
assert _FIELDS.size == 184


def padded(length: int) -> int:
    """``length`` rounded up to RECORD_ALIGN (the payload's size on disk)."""
    return -(-length // RECORD_ALIGN) * RECORD_ALIGN


def record_bytes(payload_len: int) -> int:
    """Bytes one record of ``payload_len`` occupies on disk: header block + padded payload."""
    return HEADER_BYTES + padded(payload_len)


class RecordFault(enum.Enum):
    """Why a header block is not a record we can use (what recovery reports)."""

    NO_RECORD = "no record header here"  # no magic: never written, zeros, another format
    BAD_HEADER = "record header checksum or fields do not match (corrupt or torn header)"
    UNSUPPORTED = "record written by an unsupported format version or with unknown flags"


class RecordError(ValueError):
    def __init__(self, fault: RecordFault, detail: str = ""):
        super().__init__(fault.value + (f": {detail}" if detail else ""))
        self.fault = fault


@dataclasses.dataclass(frozen=True, slots=True)
class RecordHeader:
    tag: bytes
    payload_len: int
    payload_checksum: int
    sequence: int
    generation: int
    volume_id: int
    flags: int = 0

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.payload_len)


def encode_header(header: RecordHeader, into) -> None:
    """Writes the HEADER_BYTES-byte header block into ``into`` (a writable buffer of at least
    HEADER_BYTES, e.g. an aligned scratch block); bytes past HEADER_USED are zeroed."""
    tag = header.tag
    if len(tag) > MAX_TAG_BYTES:
        raise ValueError(f"tag of {len(tag)} bytes > {MAX_TAG_BYTES}")
    if header.payload_len < 0:
        raise ValueError("negative payload length")
    view = memoryview(into).cast("B")
    _FIELDS.pack_into(
        view,
        0,
        MAGIC,
        VERSION,
        HEADER_BYTES,
        header.flags,
        len(tag),
        0,
        header.payload_len,
        header.payload_checksum,
        header.sequence,
        header.generation,
        header.volume_id,
        tag,
    )
    _SUM.pack_into(view, _FIELDS.size, checksum(view[: _FIELDS.size]))
    view[HEADER_USED:HEADER_BYTES] = _ZERO_TAIL


def build_header(
    tag: bytes,
    payload,
    payload_len: int,
    *,
    sequence: int,
    generation: int,
    volume_id: int,
    payload_checksum: int | None = None,
) -> RecordHeader:
    """The header for ``payload[:payload_len]``: checksums it (GIL released) unless the caller knows
    its checksum already (``payload_checksum``: the block's own, computed at seal)."""
    if payload_checksum is None:
        payload_checksum = checksum(memoryview(payload).cast("B")[:payload_len])
    return RecordHeader(
        tag=bytes(tag),
        payload_len=payload_len,
        payload_checksum=payload_checksum,
        sequence=sequence,
        generation=generation,
        volume_id=volume_id,
    )


def is_record_start(block) -> bool:
    """Cheap pre-check for scanners: does this block start with the record magic?"""
    return bytes(memoryview(block)[:4]) == MAGIC


def decode_header(block) -> RecordHeader:
    """Parses and checks a header block; raises RecordError (with ``.fault``) if it is not one
    we can trust. Does not check the payload (see ``payload_matches``)."""
    view = memoryview(block).cast("B")
    if len(view) < HEADER_USED:
        raise RecordError(RecordFault.NO_RECORD, "short block")
    if bytes(view[:4]) != MAGIC:
        raise RecordError(RecordFault.NO_RECORD)
    (stored,) = _SUM.unpack_from(view, _FIELDS.size)
    if checksum(view[: _FIELDS.size]) != stored:
        raise RecordError(RecordFault.BAD_HEADER, "header checksum mismatch")
    (_, version, header_bytes, flags, tag_len, reserved, payload_len, payload_sum, seq, gen, vol, tag) = (
        _FIELDS.unpack_from(view, 0)
    )
    if version != VERSION or flags != 0:
        raise RecordError(RecordFault.UNSUPPORTED, f"version {version}, flags {flags:#x}")
    if header_bytes != HEADER_BYTES or tag_len > MAX_TAG_BYTES or reserved != 0:
        raise RecordError(RecordFault.BAD_HEADER, f"header_bytes {header_bytes}, tag_len {tag_len}")
    return RecordHeader(
        tag=tag[:tag_len],
        payload_len=payload_len,
        payload_checksum=payload_sum,
        sequence=seq,
        generation=gen,
        volume_id=vol,
        flags=flags,
    )


def payload_matches(header: RecordHeader, payload) -> bool:
    """True when ``payload[:header.payload_len]`` has the header's checksum (GIL released)."""
    view = memoryview(payload).cast("B")
    if len(view) < header.payload_len:
        return False
    return checksum(view[: header.payload_len]) == header.payload_checksum
