"""The doorbell's wire format: SaveFromDevice / LoadToDevice as one small fixed binary frame.

Why: a Python gRPC round trip costs about a millisecond on the GPU host we measured (GetStats
0.7-1.3 ms), as much as 10% of a 576 MiB copy at the host link's 55 GB/s. A GPU worker is always
on the server's host, so once its KV tensors are registered (over gRPC) it sends its saves and
loads here: one ``sendall`` and one ``recv`` on a Unix socket, a few tens of microseconds. The
semantics are exactly the RPCs' (the same handler frame, checks, status codes and deadlines);
gRPC stays the contract and the fallback. Why a codec of its own rather than the local RPC
codec (protobuf messages): measured on the H200 (bench/gpu_bench.py, 576 MiB ops), saves and
loads reach 84% / 85% of the link here against 79% / 81% as protobuf frames.

The server end is ``pegaflow.server.endpoints.doorbell``, the client end
``pegaflow.client.doorbell``; both import this module, which imports no other part. Framing,
greeting (magic ``HELLO_MAGIC``, version ``VERSION``) and GOODBYE are the shared ones
(``frames.py``). Bodies, little-endian. Request::

    magic "PGD2" | op u8 (1 save, 2 load) | flags u8 | n u16 | timeout_ms u32
    | session_id len u8 + ascii | registration_id len u8 + ascii
    | block_ids n x u32 | hash lengths n x u8 | hashes concatenated

``flags`` bit 0 (loads): the query purpose is LOAD (proto QueryPurpose), else LOOKUP.
Response::

    magic "PGD2" | code u8 (gRPC status number, status.py) | flags u8 | n u16 | value u32
    | message len u16 + utf-8 | not-found kind len u8 + ascii | statuses n x u8 (a save's, when OK)

``flags`` bit 0: NOT_EXECUTED, the request was not run (the client may send it over gRPC).
``value`` is the blocks written (save) or loaded (load); the not-found kind is what a NOT_FOUND
names ("session", "device registration"), as gRPC's trailing metadata carries it. A request the
frame cannot carry (more than ``MAX_BLOCKS`` blocks, an empty hash or one longer than
``MAX_HASH_BYTES``, differing counts of hashes and block ids: ``encode_request`` raises
ValueError) is sent over gRPC instead, which answers it.
"""

from __future__ import annotations

import itertools
import struct
from typing import NamedTuple

from pegaflow.common.wire.frames import LEN, FrameError

VERSION = 2
HELLO_MAGIC = b"PGDB"
MAGIC = b"PGD2"
OP_SAVE, OP_LOAD = 1, 2
METHODS = {OP_SAVE: "SaveFromDevice", OP_LOAD: "LoadToDevice"}
FLAG_PURPOSE_LOAD = 0x01
FLAG_NOT_EXECUTED = 0x01
MAX_BLOCKS = 0xFFFF
MAX_HASH_BYTES = 255
MAX_ID_BYTES = 255
_REQ_HEAD = struct.Struct("<4sBBHI")
_RESP_HEAD = struct.Struct("<4sBBHIH")
MAX_MESSAGE_BYTES = 4000


class Request(NamedTuple):
    op: int
    session_id: str
    registration_id: str
    hashes: list[bytes]
    block_ids: list[int]
    timeout_s: float
    purpose: int  # proto QueryPurpose of a load (0 LOOKUP, 1 LOAD)


class Response(NamedTuple):
    code: int  # gRPC status number
    value: int
    message: str
    not_found_kind: str
    statuses: list[int]
    not_executed: bool


def max_request_bytes(max_blocks: int, max_hash_bytes: int) -> int:
    """The longest request body a server with these limits accepts."""
    blocks, hash_bytes = min(max_blocks, MAX_BLOCKS), min(max_hash_bytes, MAX_HASH_BYTES)
    return _REQ_HEAD.size + 2 * (1 + MAX_ID_BYTES) + blocks * (4 + 1 + hash_bytes)


def encode_request(
    op: int, session_id: str, registration_id: str, hashes, block_ids, timeout_s: float, purpose: int = 0
) -> bytes:
    """The whole frame (length prefix included). Raises ValueError for a request the frame cannot carry.

    struct and bytes, not numpy: for the 1-256 blocks of a request they are 3-4x faster (measured on
    the dev VM: 1 block 7 vs 29 us, 256 blocks 53 vs 149 us, numpy's fixed cost dominating).
    """
    n = len(hashes)
    if n != len(block_ids):
        raise ValueError(f"{n} hashes but {len(block_ids)} block ids")
    if n > MAX_BLOCKS:
        raise ValueError(f"at most {MAX_BLOCKS} blocks per doorbell request, got {n}")
    if purpose not in (0, 1):
        raise ValueError(f"unknown query purpose {purpose}")
    try:
        lengths = bytes(map(len, hashes))  # ValueError for a hash over 255 bytes
    except ValueError:
        raise ValueError(f"every block hash must be 1..{MAX_HASH_BYTES} bytes") from None
    if 0 in lengths:
        raise ValueError(f"every block hash must be 1..{MAX_HASH_BYTES} bytes")
    sid, rid = session_id.encode("ascii"), registration_id.encode("ascii")
    if len(sid) > MAX_ID_BYTES or len(rid) > MAX_ID_BYTES:
        raise ValueError(f"ids must be at most {MAX_ID_BYTES} bytes")
    try:
        ids = struct.pack(f"<{n}I", *block_ids)
    except struct.error as exc:
        raise ValueError(f"block ids must be 0..2**32-1: {exc}") from None
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    body = b"".join(
        (
            _REQ_HEAD.pack(MAGIC, op, FLAG_PURPOSE_LOAD if purpose else 0, n, timeout_ms),
            bytes((len(sid),)),
            sid,
            bytes((len(rid),)),
            rid,
            ids,
            lengths,
            b"".join(hashes),
        )
    )
    return LEN.pack(len(body)) + body


def decode_request(body: bytes) -> Request:
    """Raises FrameError for a body that is not a doorbell request."""
    if len(body) < _REQ_HEAD.size:
        raise FrameError("short doorbell request")
    magic, op, flags, n, timeout_ms = _REQ_HEAD.unpack_from(body)
    if magic != MAGIC or op not in METHODS:
        raise FrameError("not a doorbell request")
    try:
        pos = _REQ_HEAD.size
        ids = []
        for _ in range(2):
            size = body[pos]
            ids.append(body[pos + 1 : pos + 1 + size].decode("ascii"))
            pos += 1 + size
        block_ids = list(struct.unpack_from(f"<{n}I", body, pos))
    except (IndexError, ValueError, struct.error) as exc:  # ValueError: UnicodeDecodeError
        raise FrameError(f"malformed doorbell request: {exc}") from exc
    pos += 4 * n
    ends = list(itertools.accumulate(body[pos : pos + n], initial=pos + n))
    if len(ends) != n + 1 or ends[-1] != len(body):
        raise FrameError("doorbell request length does not match its hashes")
    hashes = [body[a:b] for a, b in zip(ends, ends[1:])]  # noqa: B905 - ends has n + 1 entries
    return Request(
        op, ids[0], ids[1], hashes, block_ids, timeout_ms / 1000.0, 1 if flags & FLAG_PURPOSE_LOAD else 0
    )


def encode_response(
    code: int,
    value: int = 0,
    message: str = "",
    statuses=(),
    not_found_kind: str = "",
    not_executed: bool = False,
) -> bytes:
    """The whole frame (length prefix included); the message and kind are cut to fit their fields."""
    text = message.encode("utf-8")[:MAX_MESSAGE_BYTES]
    kind = not_found_kind.encode("ascii", "replace")[:255]
    body = b"".join(
        (
            _RESP_HEAD.pack(
                MAGIC, code, FLAG_NOT_EXECUTED if not_executed else 0, len(statuses), value, len(text)
            ),
            text,
            bytes((len(kind),)),
            kind,
            bytes(statuses),  # AllocStatus numbers (< 256); bytes() is 5x faster than numpy here
        )
    )
    return LEN.pack(len(body)) + body


def decode_response(body: bytes) -> Response:
    """Raises FrameError for a body that is not a doorbell response."""
    if len(body) < _RESP_HEAD.size + 1:
        raise FrameError("short doorbell response")
    magic, code, flags, n, value, text_len = _RESP_HEAD.unpack_from(body)
    if magic != MAGIC:
        raise FrameError("not a doorbell response")
    pos = _RESP_HEAD.size
    message = body[pos : pos + text_len].decode("utf-8", "replace")
    pos += text_len
    if pos >= len(body):
        raise FrameError("doorbell response shorter than its fields")
    kind_len = body[pos]
    kind = body[pos + 1 : pos + 1 + kind_len].decode("ascii", "replace")
    pos += 1 + kind_len
    statuses = list(body[pos : pos + n])
    if len(statuses) != n:
        raise FrameError("doorbell response shorter than its statuses")
    return Response(code, value, message, kind, statuses, bool(flags & FLAG_NOT_EXECUTED))
