"""The read lane's wire format: a prefix query with its lease, and the lease's release, as one small
fixed binary frame that the server answers from native code, without its interpreter.

Why: every other local call runs in the server's Python, behind one interpreter lock that the save
path, the GPU copies' bookkeeping and the metrics also take. A lookup waits behind them: on the
H200 host its p50 went from ~0.45 ms idle to ~1.6 ms while other clients saved 12 GB/s
(bench/README.md, "Tail latency"). The read lane (server/read_lane/) is a thread of C code with a
directory of the blocks readable in DRAM; it answers a query and pins what it found under its own
mutex, never the interpreter lock, and hands the recency and metrics signals of each call to the
Python side afterwards. What it cannot answer exactly as the engine would (an unknown session or
instance, a chain that continues on SSD or another node, a tenant with a lease cap, a lease over
the session's quota, anything malformed or unusual) it answers NOT_EXECUTED, and the client sends
the call over the local RPC socket instead, where the engine answers it with its own checks and
messages.

The server end is ``server/read_lane/read_lane.c`` (its reader and writer of these frames follow
this docstring, field for field; ``server/read_lane/tests/test_wire.py`` holds both to it), the
client end ``pegaflow.client.read_lane``. Framing, greeting (magic ``HELLO_MAGIC``, version
``VERSION``, the pool epoch) and GOODBYE are the shared ones (``frames.py``). Little-endian.

Request::

    magic "PGR1" | op u8 (1 query, 2 release) | flags u8 | n u16 | timeout_ms u32
    | session_id len u8 + ascii | instance_id len u8 + ascii
    | lease_ttl_ms u32 | lease_id u64 | loaded_bytes u64
    | hash lengths n x u8 | hashes concatenated

``flags`` bit 0 (query): take a lease on the hits; bit 1: the query's purpose is LOAD (proto
QueryPurpose), else LOOKUP. ``lease_id``: the client's id for the lease (nonzero, unguessable: a
random u64; the caller sees it as ``"r-"`` + 16 hex digits), or the lease a release ends.
``lease_ttl_ms`` 0: the server's default. ``loaded_bytes``: what a release read from its lease.
A release carries no hashes (n = 0) and no instance.

Response::

    magic "PGR1" | code u8 (gRPC status number, status.py) | flags u8 | n u16 (hits)
    | block_bytes u32 | message len u16 + utf-8 | not-found kind len u8 + ascii
    | offsets n x u64 | checksums n x u64

``flags`` bit 0: NOT_EXECUTED (nothing was done; send the call over the local RPC socket). On OK a
query's ``n`` leading hashes are readable in DRAM at ``offsets`` (relative to the memory the
session maps), ``block_bytes`` each, with their writers' XXH3-64 ``checksums`` (0: unknown); a
lease, if asked for and n > 0, pins them under the client's id. A release answers n = 0.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from pegaflow.common.wire.frames import LEN, FrameError

VERSION = 1
HELLO_MAGIC = b"PGRD"
MAGIC = b"PGR1"
OP_QUERY, OP_RELEASE = 1, 2
FLAG_LEASE = 0x01
FLAG_PURPOSE_LOAD = 0x02
FLAG_NOT_EXECUTED = 0x01
MAX_HASHES = 0xFFFF
MAX_HASH_BYTES = 64  # the lane's directory keeps keys up to this long; longer ones go to the engine
MAX_ID_BYTES = 255
LEASE_PREFIX = "r-"
MAX_MESSAGE_BYTES = 4000

REQ_HEAD = struct.Struct("<4sBBHI")
REQ_LEASE = struct.Struct("<IQQ")
RESP_HEAD = struct.Struct("<4sBBHIH")


class Request(NamedTuple):
    op: int
    flags: int
    timeout_ms: int
    session_id: str
    instance_id: str
    lease_ttl_ms: int
    lease_id: int
    loaded_bytes: int
    hashes: list[bytes]


class Response(NamedTuple):
    code: int  # gRPC status number
    not_executed: bool
    block_bytes: int
    message: str
    not_found_kind: str
    offsets: tuple[int, ...]
    checksums: tuple[int, ...]


def max_request_bytes(max_hashes: int) -> int:
    """The longest request body carrying up to ``max_hashes`` hashes."""
    n = min(max_hashes, MAX_HASHES)
    return REQ_HEAD.size + 2 * (1 + MAX_ID_BYTES) + REQ_LEASE.size + n * (1 + MAX_HASH_BYTES)


def max_response_bytes(max_hashes: int) -> int:
    n = min(max_hashes, MAX_HASHES)
    return RESP_HEAD.size + MAX_MESSAGE_BYTES + 1 + MAX_ID_BYTES + 16 * n


def lease_name(lease_id: int) -> str:
    """The lease id as callers see it (PrefixHit.lease_id, release)."""
    return f"{LEASE_PREFIX}{lease_id:016x}"


def parse_lease_name(name: str) -> int | None:
    """The u64 of a read lane lease name; None for any other lease id (the engine's own)."""
    if len(name) != len(LEASE_PREFIX) + 16 or not name.startswith(LEASE_PREFIX):
        return None
    try:
        value = int(name[len(LEASE_PREFIX) :], 16)
    except ValueError:
        return None
    return value or None


def _ascii(text: str, what: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > MAX_ID_BYTES:
        raise ValueError(f"{what} longer than {MAX_ID_BYTES} bytes")
    return raw


def encode_query(
    session_id: str,
    instance_id: str,
    hashes: list[bytes],
    *,
    lease_id: int = 0,
    lease_ttl_ms: int = 0,
    purpose_load: bool = False,
    timeout_ms: int,
) -> bytes:
    """A whole query frame (length prefix included). Raises ValueError for what the frame cannot
    carry (too many hashes, an empty one or one longer than MAX_HASH_BYTES, ids too long or not
    ascii): such a query goes to the engine instead."""
    n = len(hashes)
    if n > MAX_HASHES:
        raise ValueError(f"more than {MAX_HASHES} hashes")
    lengths = bytes(map(len, hashes))  # ValueError for a length over 255
    if n and (min(lengths) == 0 or max(lengths) > MAX_HASH_BYTES):
        raise ValueError(f"hashes must be 1..{MAX_HASH_BYTES} bytes for the read lane")
    flags = (FLAG_LEASE if lease_id else 0) | (FLAG_PURPOSE_LOAD if purpose_load else 0)
    sid, iid = _ascii(session_id, "session id"), _ascii(instance_id, "instance id")
    body = b"".join(
        (
            REQ_HEAD.pack(MAGIC, OP_QUERY, flags, n, max(timeout_ms, 1)),
            bytes((len(sid),)),
            sid,
            bytes((len(iid),)),
            iid,
            REQ_LEASE.pack(lease_ttl_ms, lease_id, 0),
            lengths,
            *hashes,
        )
    )
    return LEN.pack(len(body)) + body


def encode_release(session_id: str, lease_id: int, loaded_bytes: int, *, timeout_ms: int) -> bytes:
    sid = _ascii(session_id, "session id")
    body = b"".join(
        (
            REQ_HEAD.pack(MAGIC, OP_RELEASE, 0, 0, max(timeout_ms, 1)),
            bytes((len(sid),)),
            sid,
            b"\x00",
            REQ_LEASE.pack(0, lease_id, max(int(loaded_bytes), 0)),
        )
    )
    return LEN.pack(len(body)) + body


def decode_request(body: bytes) -> Request:
    """The request in ``body`` (the server's reading, in Python: tests hold the C reader to it)."""
    view = memoryview(body)
    try:
        magic, op, flags, n, timeout_ms = REQ_HEAD.unpack_from(view)
        if magic != MAGIC or op not in (OP_QUERY, OP_RELEASE):
            raise FrameError("not a read lane request")
        at = REQ_HEAD.size
        ids = []
        for _ in range(2):
            size = view[at]
            ids.append(bytes(view[at + 1 : at + 1 + size]).decode("ascii"))
            at += 1 + size
        ttl, lease_id, loaded = REQ_LEASE.unpack_from(view, at)
        at += REQ_LEASE.size
        lengths = view[at : at + n]
        if len(lengths) != n:
            raise FrameError("truncated read lane request")
        at += n
        hashes = []
        for size in lengths:
            if at + size > len(view):
                raise FrameError("truncated read lane request")
            hashes.append(bytes(view[at : at + size]))
            at += size
        if at != len(view):
            raise FrameError("trailing bytes in a read lane request")
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise FrameError(f"malformed read lane request: {exc}") from exc
    return Request(op, flags, timeout_ms, ids[0], ids[1], ttl, lease_id, loaded, hashes)


def decode_response(body: bytes) -> Response:
    """Raises FrameError for bytes that are not an answer of this protocol."""
    try:
        magic, code, flags, n, block_bytes, msg_len = RESP_HEAD.unpack_from(body)
        if magic != MAGIC:
            raise FrameError("not a read lane answer")
        at = RESP_HEAD.size
        message = body[at : at + msg_len].decode("utf-8", "replace")
        at += msg_len
        kind_len = body[at]
        kind = body[at + 1 : at + 1 + kind_len].decode("ascii", "replace")
        at += 1 + kind_len
        if at + 16 * n != len(body):
            raise FrameError("a read lane answer of the wrong length")
        offsets = struct.unpack_from(f"<{n}Q", body, at)
        checksums = struct.unpack_from(f"<{n}Q", body, at + 8 * n)
    except (struct.error, IndexError) as exc:
        raise FrameError(f"malformed read lane answer: {exc}") from exc
    return Response(code, bool(flags & FLAG_NOT_EXECUTED), block_bytes, message, kind, offsets, checksums)
