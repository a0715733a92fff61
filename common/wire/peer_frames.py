"""The peer data plane's frames: block bytes moving host to host over TCP.

A requester (server/peers/tcp.py) opens a few TCP streams to a peer's data port
(server/peers/tcp_serve.py) and asks, per stream, for blocks of a *transfer*: the blocks the
peer pinned for it when the peer control plane (proto/peer.proto, OpenTransfer) answered. The
transfer id is a 16-byte bearer token; the per-block lengths and checksums came with it.

Every frame starts with one fixed header, little-endian, 56 bytes::

    magic "PGPF" | version u8 | type u8 | flags u16 | transfer id 16 bytes
    | block index u32 | status u32 | length u64 | payload checksum u64 | header checksum u64

``length`` payload bytes follow the header; ``payload checksum`` is XXH3-64 of them
(``pegaflow.common.wire.checksum``); ``header checksum`` is XXH3-64 of the 48 header bytes
before it, so a corrupted length or index is caught before anything is read into a buffer.

Frame types:

``READ`` (requester -> peer)
    payload ``timeout_ms u32 | count u32 | count x block index u32``: send these blocks of the
    transfer, in this order, and stop trying once ``timeout_ms`` (the requester's deadline) is
    spent. One READ at a time per stream; the answer is ``count`` BLOCK frames then DONE, or an
    ERROR.
``BLOCK`` (peer -> requester)
    one block: ``block index``, ``length`` = the block's bytes, ``payload checksum`` = the
    block's checksum as OpenTransfer announced it; the block's bytes follow.
``DONE`` (peer -> requester)
    the READ is answered; ``block index`` = the number of blocks sent.
``ERROR`` (peer -> requester)
    ``status`` a ``PeerStatus``; ``block index`` the block concerned or ``NO_BLOCK``; payload an
    utf-8 message. With ``FLAG_FATAL`` the peer closes the connection after it (it could not
    make sense of the stream); otherwise the stream stays usable for the next READ.

A receiver that sees a header whose magic, version or header checksum is wrong cannot know
where the next frame starts: it closes that stream (one stream, never the others).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import NamedTuple

from pegaflow.common.wire.checksum import checksum

MAGIC = b"PGPF"
VERSION = 1
TRANSFER_ID_BYTES = 16
NO_BLOCK = 0xFFFFFFFF
FLAG_FATAL = 0x0001

# A READ lists at most this many blocks (16384 blocks of 64 KiB is 1 GiB; the peer's
# max_read_blocks may be lower and is announced at Handshake).
MAX_READ_BLOCKS = 65536
MAX_ERROR_MESSAGE_BYTES = 4096

_HEAD = struct.Struct("<4sBBH16sIIQQ")  # everything the header checksum covers (48 bytes)
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SUM.size  # 56
_READ = struct.Struct("<II")


class FrameType(enum.IntEnum):
    READ = 1
    BLOCK = 2
    DONE = 3
    ERROR = 4


class PeerStatus(enum.IntEnum):
    """Why a peer refused (ERROR frames); the requester maps each to a failure cause."""

    OK = 0
    UNKNOWN_TRANSFER = 1  # no such transfer: never opened, closed, or its lease expired
    BAD_REQUEST = 2  # a block index outside the transfer, too many blocks, a malformed READ
    PROTOCOL = 3  # not a frame of this protocol (magic, version, header checksum): always fatal
    DEADLINE = 4  # the READ's deadline passed before the peer could send
    BUSY = 5  # too many connections: always fatal
    INTERNAL = 6  # the peer failed to read its own memory
    SHUTTING_DOWN = 7  # the peer is stopping: always fatal


class FrameError(ValueError):
    """Bytes that are not a well-formed frame of this version (the stream cannot be trusted)."""


class FrameHeader(NamedTuple):
    type: FrameType
    flags: int
    transfer_id: bytes
    block_index: int
    status: int
    length: int
    payload_checksum: int

    @property
    def fatal(self) -> bool:
        return bool(self.flags & FLAG_FATAL)


def _check_id(transfer_id: bytes) -> None:
    if len(transfer_id) != TRANSFER_ID_BYTES:
        raise ValueError(f"a transfer id is {TRANSFER_ID_BYTES} bytes, got {len(transfer_id)}")


def encode_header(
    type_: FrameType,
    transfer_id: bytes,
    block_index: int = 0,
    length: int = 0,
    payload_checksum: int = 0,
    status: int = 0,
    flags: int = 0,
) -> bytes:
    _check_id(transfer_id)
    head = _HEAD.pack(
        MAGIC, VERSION, int(type_), flags, transfer_id, block_index, status, length, payload_checksum
    )
    return head + _SUM.pack(checksum(head))


def decode_header(buf) -> FrameHeader:
    """The header in the first HEADER_BYTES of ``buf``. Raises FrameError when it is not one."""
    if len(buf) < HEADER_BYTES:
        raise FrameError(f"a frame header is {HEADER_BYTES} bytes, got {len(buf)}")
    head = bytes(buf[: _HEAD.size])
    magic, version, type_, flags, transfer_id, index, status, length, payload_sum = _HEAD.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not a pegaflow peer frame")
    (header_sum,) = _SUM.unpack_from(buf, _HEAD.size)
    if header_sum != checksum(head):
        raise FrameError("header checksum mismatch")
    if version != VERSION:
        raise FrameError(f"frame version {version}; this end speaks {VERSION}")
    try:
        kind = FrameType(type_)
    except ValueError:
        raise FrameError(f"unknown frame type {type_}") from None
    return FrameHeader(kind, flags, transfer_id, index, status, length, payload_sum)


# ------------------------------------------------------------------ READ


def encode_read(transfer_id: bytes, indices: Sequence[int], timeout_s: float) -> bytes:
    """A whole READ frame (header and payload)."""
    if not 0 < len(indices) <= MAX_READ_BLOCKS:
        raise ValueError(f"a READ names 1..{MAX_READ_BLOCKS} blocks, got {len(indices)}")
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    payload = _READ.pack(timeout_ms, len(indices)) + struct.pack(f"<{len(indices)}I", *indices)
    head = encode_header(FrameType.READ, transfer_id, length=len(payload), payload_checksum=checksum(payload))
    return head + payload


def read_payload_limit() -> int:
    return _READ.size + 4 * MAX_READ_BLOCKS


def decode_read(header: FrameHeader, payload: bytes) -> tuple[float, list[int]]:
    """(timeout_s, block indices) of a READ's payload. Raises FrameError when it is malformed."""
    if header.type != FrameType.READ:
        raise FrameError(f"expected a READ frame, got {header.type.name}")
    if len(payload) != header.length or checksum(payload) != header.payload_checksum:
        raise FrameError("READ payload checksum mismatch")
    if len(payload) < _READ.size:
        raise FrameError("READ payload shorter than its fields")
    timeout_ms, count = _READ.unpack_from(payload)
    if not 0 < count <= MAX_READ_BLOCKS or len(payload) != _READ.size + 4 * count:
        raise FrameError(f"READ of {count} blocks does not match its {len(payload)}-byte payload")
    if timeout_ms == 0:
        raise FrameError("READ without a deadline")
    return timeout_ms / 1000.0, list(struct.unpack_from(f"<{count}I", payload, _READ.size))


# ------------------------------------------------------------------ answers


def encode_block_header(transfer_id: bytes, block_index: int, length: int, block_checksum: int) -> bytes:
    """The header that precedes a block's ``length`` bytes."""
    return encode_header(FrameType.BLOCK, transfer_id, block_index, length, block_checksum)


def encode_done(transfer_id: bytes, blocks_sent: int) -> bytes:
    return encode_header(FrameType.DONE, transfer_id, block_index=blocks_sent)


def encode_error(
    transfer_id: bytes, status: PeerStatus, message: str, block_index: int = NO_BLOCK, fatal: bool = False
) -> bytes:
    """A whole ERROR frame. PROTOCOL, BUSY and SHUTTING_DOWN are always fatal."""
    fatal = fatal or status in (PeerStatus.PROTOCOL, PeerStatus.BUSY, PeerStatus.SHUTTING_DOWN)
    text = message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES]
    head = encode_header(
        FrameType.ERROR,
        transfer_id,
        block_index,
        len(text),
        checksum(text),
        status=int(status),
        flags=FLAG_FATAL if fatal else 0,
    )
    return head + text


def decode_error(header: FrameHeader, payload: bytes) -> tuple[PeerStatus, str]:
    if len(payload) != header.length or checksum(payload) != header.payload_checksum:
        raise FrameError("ERROR payload checksum mismatch")
    try:
        status = PeerStatus(header.status)
    except ValueError:
        status = PeerStatus.INTERNAL
    return status, payload.decode("utf-8", "replace")


NULL_TRANSFER = bytes(TRANSFER_ID_BYTES)  # ERROR frames about no transfer in particular
