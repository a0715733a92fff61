"""The SSD tier's own on-disk structures around the block records: segment header, segment
summary + footer, lane label. (The block record itself is common/wire/block_record.py.)

A segment is ``segment_bytes`` of one lane file, filled front to back with block records::

    [segment header 4 KiB][record][record]...[free]...[summary (padded)][footer 4 KiB]

* **Segment header** (offset 0): written when the segment empties (or is first opened), with
  its next generation, and *completed before any record of that generation is submitted*.
  Recovery trusts a record only if its generation equals its segment header's, so nothing of
  an earlier fill of the segment comes back once the header of the next one is on disk.
* **Summary + footer** (the segment's last bytes): written when a sealed segment has no write
  pending, one vectored write. The footer (last 4 KiB) names the generation and the summary's
  length and checksum; the summary lists (offset, length, sequence, tag) of each record written
  in that generation. Recovery of a closed segment is then one header read and one tail read
  instead of a scan of up to ``segment_bytes``. Space for the summary is reserved while the
  segment is filled (``summary_reserve``), so it never overlaps a record.
* **Lane label** (the 4 KiB after a lane file's last segment): volume id, lane, boot epoch.
  Written at every start: it is the O_DIRECT write probe of the file, on a block no data uses.

All little-endian, every structure with a magic, a version and an XXH3-64 checksum
(pegaflow.common.wire.checksum).
"""

from __future__ import annotations

import dataclasses
import struct

from pegaflow.common.wire.block_record import MAX_TAG_BYTES, RECORD_ALIGN, padded
from pegaflow.common.wire.checksum import checksum

BLOCK = RECORD_ALIGN
VERSION = 1

SEGMENT_MAGIC = b"PGFS"
FOOTER_MAGIC = b"PGFF"
LABEL_MAGIC = b"PGFL"

_SEG = struct.Struct("<4sHHQIIQQ")  # magic, version, 0, volume, lane, local index, generation, bytes
_FOOTER = struct.Struct("<4sHHQQIIQ")  # magic, version, 0, volume, generation, summary len, count, sum
_LABEL = struct.Struct("<4sHHQIIQQ")  # magic, version, 0, volume, lane, lanes, boot epoch, file bytes
_SUM = struct.Struct("<Q")
_ENTRY = struct.Struct("<IIQH")  # offset in segment, payload length, sequence, tag length; tag follows

# Summary bytes reserved per record while a segment fills: the entry with the longest tag.
MAX_ENTRY_BYTES = _ENTRY.size + MAX_TAG_BYTES


def summary_reserve(records: int) -> int:
    """Bytes kept free at the end of a segment (before the footer) for a summary of ``records``."""
    return padded(records * MAX_ENTRY_BYTES) if records else 0


class FormatError(ValueError):
    """A segment structure did not check out; the message says why (recovery reports it)."""


def _seal(body: bytes) -> bytes:
    out = bytearray(BLOCK)
    out[: len(body)] = body
    _SUM.pack_into(out, len(body), checksum(body))
    return bytes(out)


def _unseal(block, fmt: struct.Struct, magic: bytes, what: str) -> tuple:
    view = memoryview(block).cast("B")
    if len(view) < fmt.size + _SUM.size or bytes(view[:4]) != magic:
        raise FormatError(f"no {what}")
    (stored,) = _SUM.unpack_from(view, fmt.size)
    if checksum(view[: fmt.size]) != stored:
        raise FormatError(f"{what} checksum mismatch")
    fields = fmt.unpack_from(view, 0)
    if fields[1] != VERSION:
        raise FormatError(f"{what} of unsupported version {fields[1]}")
    return fields


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentHeader:
    volume_id: int
    lane: int
    index: int  # the segment's index within its lane file
    generation: int
    segment_bytes: int

    def encode(self) -> bytes:
        return _seal(
            _SEG.pack(
                SEGMENT_MAGIC,
                VERSION,
                0,
                self.volume_id,
                self.lane,
                self.index,
                self.generation,
                self.segment_bytes,
            )
        )

    @classmethod
    def decode(cls, block) -> SegmentHeader:
        _, _, _, volume, lane, index, gen, size = _unseal(block, _SEG, SEGMENT_MAGIC, "segment header")
        return cls(volume, lane, index, gen, size)


@dataclasses.dataclass(frozen=True, slots=True)
class SummaryEntry:
    offset: int  # of the record within its segment
    payload_len: int
    sequence: int
    tag: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Footer:
    volume_id: int
    generation: int
    summary_len: int  # bytes of entries (unpadded)
    count: int
    summary_checksum: int

    def encode(self) -> bytes:
        body = _FOOTER.pack(
            FOOTER_MAGIC,
            VERSION,
            0,
            self.volume_id,
            self.generation,
            self.summary_len,
            self.count,
            self.summary_checksum,
        )
        return _seal(body)

    @classmethod
    def decode(cls, block) -> Footer:
        _, _, _, volume, gen, length, count, s = _unseal(block, _FOOTER, FOOTER_MAGIC, "segment footer")
        return cls(volume, gen, length, count, s)


def encode_summary(
    entries: list[SummaryEntry], volume_id: int, generation: int, segment_bytes: int
) -> tuple[int, bytes]:
    """(offset in segment, bytes) of the summary + footer tail: one write ending at the segment's end."""
    body = b"".join(_ENTRY.pack(e.offset, e.payload_len, e.sequence, len(e.tag)) + e.tag for e in entries)
    footer = Footer(volume_id, generation, len(body), len(entries), checksum(body))
    pad = padded(len(body))
    tail = bytes(pad - len(body)) + body + footer.encode()  # entries end right before the footer
    return segment_bytes - len(tail), tail


def decode_summary(tail, footer: Footer, segment_bytes: int) -> list[SummaryEntry]:
    """Entries from ``tail`` (the segment's last len(tail) bytes, footer included); raises FormatError."""
    view = memoryview(tail).cast("B")
    end = len(view) - BLOCK
    start = end - footer.summary_len
    if start < 0:
        raise FormatError("summary longer than the tail read")
    body = view[start:end]
    if checksum(body) != footer.summary_checksum:
        raise FormatError("segment summary checksum mismatch")
    entries = []
    pos = 0
    limit = segment_bytes - BLOCK - padded(footer.summary_len)
    prev_end = BLOCK
    for _ in range(footer.count):
        if pos + _ENTRY.size > len(body):
            raise FormatError("segment summary truncated")
        off, length, seq, tag_len = _ENTRY.unpack_from(body, pos)
        pos += _ENTRY.size
        if tag_len > MAX_TAG_BYTES or pos + tag_len > len(body):
            raise FormatError("segment summary entry malformed")
        tag = bytes(body[pos : pos + tag_len])
        pos += tag_len
        if off % BLOCK or off < prev_end or off + BLOCK + padded(length) > limit:
            raise FormatError(f"segment summary entry out of place (offset {off})")
        prev_end = off + BLOCK + padded(length)
        entries.append(SummaryEntry(off, length, seq, tag))
    if pos != len(body):
        raise FormatError("segment summary has trailing bytes")
    return entries


@dataclasses.dataclass(frozen=True, slots=True)
class LaneLabel:
    volume_id: int
    lane: int
    lanes: int
    boot_epoch: int
    file_bytes: int

    def encode(self) -> bytes:
        return _seal(
            _LABEL.pack(
                LABEL_MAGIC,
                VERSION,
                0,
                self.volume_id,
                self.lane,
                self.lanes,
                self.boot_epoch,
                self.file_bytes,
            )
        )

    @classmethod
    def decode(cls, block) -> LaneLabel:
        _, _, _, volume, lane, lanes, epoch, size = _unseal(block, _LABEL, LABEL_MAGIC, "lane label")
        return cls(volume, lane, lanes, epoch, size)
