"""The local RPC socket's wire format: the server's unary control-plane RPCs over a Unix socket.

Why: a Python gRPC unary round trip costs 0.65-1.3 ms on the machines we measured, as long as
copying a 16 MiB batch into the pool; the same call over this socket costs ~0.05 ms (a failing
ReleaseLease, p50, 2-vCPU VM: 51 us vs 666 us). A client on the server's host (the socket path
it was given exists there) sends the same request messages here, framed as below; the server
runs them through the very servicer methods gRPC calls (same validation, engine calls, error ->
status mapping, per-call metrics, deadlines). gRPC stays the contract and the fallback. The
server end is ``pegaflow.server.endpoints.local_rpc``, the client end ``pegaflow.client.local_rpc``;
both import this module, which imports no other part.

Framing, greeting and GOODBYE are the shared ones (``frames.py``); the greeting's magic is
``HELLO_MAGIC``, its version ``VERSION``. Request body (little-endian)::

    version u8 | flags u8 (FLAG_ONEWAY: send no response) | timeout_ms u32 (0: none)
    | method name length u8 + ascii | serialized request message

Response body::

    flags u8 (FLAG_NOT_EXECUTED: the request was not run; the client may send it over gRPC)
    | status code u8 (gRPC's number, ``status.py``) | message length u16 + utf-8
    | metadata pairs u8, each key length u8 + ascii, value length u16 + utf-8
    | serialized response message (empty unless the code is OK)

One request at a time per connection (oneway requests need no answer, so a client may send one
and go on); responses come in request order.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import grpc

from pegaflow.common.wire import status
from pegaflow.common.wire.frames import LEN, FrameError

VERSION = 1
HELLO_MAGIC = b"PGLR"
FLAG_ONEWAY = 0x01
FLAG_NOT_EXECUTED = 0x01

# The unary RPCs a local client sends here. Session set-up (OpenSession, whose answer names this
# socket), heartbeats and CloseSession stay on gRPC, so the channel a fallback needs is kept alive
# and proven. The GPU saves and loads keep their own codec on the same server and client plumbing
# (the doorbell, doorbell.py: a fixed binary frame, no protobuf). Moving them to this codec was
# measured on the H200 (bench/gpu_bench.py, 576 MiB ops): save 79% / load 81% of the link vs the
# doorbell's 84% / 85%.
LOCAL_METHODS = frozenset(
    {
        "RegisterInstance",
        "UnregisterInstance",
        "QueryPrefix",
        "LoadBlocks",
        "ReleaseLease",
        "AllocateBlocks",
        "SealBlocks",
        "AbortBlocks",
        "GetStats",
    }
)

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # gRPC's message limit on both ends (server/runtime, client codec)
MAX_METHOD_NAME = 64
_REQ = struct.Struct("<BBIB")
_RESP = struct.Struct("<BBH")
_U16 = struct.Struct("<H")
# Whatever a frame may carry besides its message (header, method name, error text, metadata).
FRAME_OVERHEAD = 64 << 10


class Request(NamedTuple):
    method: str
    timeout_s: float | None  # None: the caller sent no deadline
    oneway: bool
    payload: bytes


class Response(NamedTuple):
    code: grpc.StatusCode
    message: str
    metadata: tuple[tuple[str, str], ...]
    payload: bytes
    not_executed: bool


def max_frame_bytes(max_message_bytes: int) -> int:
    return max_message_bytes + FRAME_OVERHEAD


def encode_request(method: str, payload: bytes, timeout_s: float | None, oneway: bool = False) -> bytes:
    """The whole frame (length prefix included)."""
    name = method.encode("ascii")
    if not 0 < len(name) <= MAX_METHOD_NAME:
        raise ValueError(f"method name must be 1..{MAX_METHOD_NAME} bytes")
    timeout_ms = 0 if timeout_s is None else max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    head = _REQ.pack(VERSION, FLAG_ONEWAY if oneway else 0, timeout_ms, len(name))
    return b"".join((LEN.pack(len(head) + len(name) + len(payload)), head, name, payload))


def decode_request(body: bytes) -> Request:
    """Raises FrameError for a body that is not a request of this version."""
    if len(body) < _REQ.size:
        raise FrameError("request shorter than its header")
    version, flags, timeout_ms, name_len = _REQ.unpack_from(body)
    if version != VERSION:
        raise FrameError(f"request frame version {version}; this server speaks {VERSION}")
    pos = _REQ.size
    if not 0 < name_len <= MAX_METHOD_NAME or pos + name_len > len(body):
        raise FrameError("bad method name length")
    try:
        method = body[pos : pos + name_len].decode("ascii")
    except UnicodeDecodeError as exc:
        raise FrameError("method name is not ascii") from exc
    timeout_s = timeout_ms / 1000.0 if timeout_ms else None
    return Request(method, timeout_s, bool(flags & FLAG_ONEWAY), body[pos + name_len :])


def encode_response(
    code: grpc.StatusCode,
    message: str = "",
    metadata=(),
    payload: bytes = b"",
    not_executed: bool = False,
) -> bytes:
    """The whole frame (length prefix included). Error text and metadata are cut to fit their fields."""
    text = message.encode("utf-8")[:0xFFFF]
    pairs = list(metadata)[:255]
    parts = [_RESP.pack(FLAG_NOT_EXECUTED if not_executed else 0, status.number(code), len(text)), text]
    parts.append(bytes((len(pairs),)))
    for key, value in pairs:
        k = str(key).encode("ascii", "replace")[:255]
        v = (value if isinstance(value, bytes) else str(value).encode("utf-8"))[:0xFFFF]
        parts += [bytes((len(k),)), k, _U16.pack(len(v)), v]
    parts.append(payload)
    body = b"".join(parts)
    return LEN.pack(len(body)) + body


def decode_response(body: bytes) -> Response:
    """Raises FrameError for a body that is not a response."""
    try:
        flags, number, text_len = _RESP.unpack_from(body)
        pos = _RESP.size
        message = body[pos : pos + text_len].decode("utf-8", "replace")
        pos += text_len
        pairs = []
        count = body[pos]
        pos += 1
        for _ in range(count):
            k_len = body[pos]
            key = body[pos + 1 : pos + 1 + k_len].decode("ascii", "replace")
            pos += 1 + k_len
            (v_len,) = _U16.unpack_from(body, pos)
            value = body[pos + 2 : pos + 2 + v_len].decode("utf-8", "replace")
            pos += 2 + v_len
            pairs.append((key, value))
    except (struct.error, IndexError) as exc:
        raise FrameError(f"malformed response: {exc}") from exc
    if pos > len(body):
        raise FrameError("response shorter than its fields")
    code = status.from_number(number)
    return Response(code, message, tuple(pairs), body[pos:], bool(flags & FLAG_NOT_EXECUTED))
