"""The doorbell: a low-latency local path for SaveFromDevice / LoadToDevice, a Unix socket with a tiny
binary frame. This module is its wire format and its client end; the server end is
``pegaflow.server.gpu.doorbell``.

Why: a Python gRPC round trip costs about a millisecond on the GPU host we
measured (GetStats 0.7-1.3 ms), as much as 10% of a 576 MiB copy at the host
link's 55 GB/s. A GPU worker is always on the server's host, so once its KV
tensors are registered (over gRPC) it may ring this doorbell instead: one
``sendall`` and one ``recv`` on a Unix socket, a few tens of microseconds. The
semantics are exactly the RPCs' (the same server calls, the same checks, the
same error kinds and deadlines); gRPC stays the contract and the fallback.

Frames (little-endian), each sent as a u32 length and the frame. Request::

    magic "PGD1" | op u8 (1 save, 2 load) | flags u8 | n u16 | timeout_ms u32
    | session_id len u8 + bytes | registration_id len u8 + bytes
    | block_ids n x u32 | hash lengths n x u8 | hashes concatenated

``flags`` bit 0 (loads): the query purpose is LOAD (proto QueryPurpose), else LOOKUP.
Response::

    magic "PGD1" | code u8 (CODE_*) | pad u8 | n u16 | value u32
    | message len u16 + utf-8 | statuses n x u8 (save only)

``value`` is the blocks written (save) or loaded (load). One request at a
time per connection; a client keeps one connection per thread.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

import numpy as np

from pegaflow.client import errors

MAGIC = b"PGD1"
OP_SAVE, OP_LOAD = 1, 2
FLAG_PURPOSE_LOAD = 0x01
_REQ_HEAD = struct.Struct("<4sBBHI")
_RESP_HEAD = struct.Struct("<4sBBHIH")
MAX_BLOCKS = 0xFFFF
MAX_HASH_BYTES = 255

# Response codes; the server maps its error kinds onto them, the client onto its exceptions.
CODE_OK = 0
CODE_INVALID_ARGUMENT = 1
CODE_NOT_FOUND = 2
CODE_FAILED_PRECONDITION = 3
CODE_DEADLINE_EXCEEDED = 4
CODE_UNAVAILABLE = 5
CODE_RESOURCE_EXHAUSTED = 6
CODE_INTERNAL = 7


class FrameError(ValueError):
    """A malformed frame: the connection is closed (the peer is not speaking this protocol)."""


# ------------------------------------------------------------------ frames


def encode_request(
    op: int, session_id: str, registration_id: str, hashes, block_ids, timeout_s: float, purpose: int = 0
) -> bytes:
    """``purpose``: proto QueryPurpose of a load (0 LOOKUP, 1 LOAD)."""
    n = len(hashes)
    if n != len(block_ids):
        raise ValueError(f"{n} hashes but {len(block_ids)} block ids")
    if n > MAX_BLOCKS:
        raise ValueError(f"at most {MAX_BLOCKS} blocks per doorbell request, got {n}")
    if purpose not in (0, 1):
        raise ValueError(f"unknown query purpose {purpose}")
    lengths = np.fromiter((len(h) for h in hashes), dtype=np.uint16, count=n)
    if n and (lengths.max() > MAX_HASH_BYTES or lengths.min() == 0):
        raise ValueError(f"every block hash must be 1..{MAX_HASH_BYTES} bytes")
    sid, rid = session_id.encode(), registration_id.encode()
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    flags = FLAG_PURPOSE_LOAD if purpose else 0
    return b"".join(
        (
            _REQ_HEAD.pack(MAGIC, op, flags, n, timeout_ms),
            bytes((len(sid),)),
            sid,
            bytes((len(rid),)),
            rid,
            np.asarray(block_ids, dtype=np.uint32).tobytes(),
            lengths.astype(np.uint8).tobytes(),
            b"".join(hashes),
        )
    )


def decode_request(buf: bytes) -> tuple[int, str, str, list[bytes], list[int], float, int]:
    """(op, session_id, registration_id, hashes, block_ids, timeout_s, purpose) of a complete request."""
    if len(buf) < _REQ_HEAD.size:
        raise FrameError("short request")
    magic, op, flags, n, timeout_ms = _REQ_HEAD.unpack_from(buf)
    if magic != MAGIC or op not in (OP_SAVE, OP_LOAD):
        raise FrameError("not a doorbell request")
    pos = _REQ_HEAD.size
    ids = []
    for _ in range(2):
        size = buf[pos]
        ids.append(buf[pos + 1 : pos + 1 + size].decode())
        pos += 1 + size
    block_ids = np.frombuffer(buf, dtype=np.uint32, count=n, offset=pos).tolist()
    pos += 4 * n
    lengths = np.frombuffer(buf, dtype=np.uint8, count=n, offset=pos)
    pos += n
    ends = np.cumsum(lengths, dtype=np.int64) + pos
    if n and ends[-1] != len(buf):
        raise FrameError("request length does not match its hashes")
    starts = ends - lengths
    hashes = [buf[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    purpose = 1 if flags & FLAG_PURPOSE_LOAD else 0
    return op, ids[0], ids[1], hashes, block_ids, timeout_ms / 1000.0, purpose


def encode_response(code: int, value: int = 0, message: str = "", statuses=()) -> bytes:
    text = message.encode()[:4000]
    return b"".join(
        (
            _RESP_HEAD.pack(MAGIC, code, 0, len(statuses), value, len(text)),
            text,
            np.asarray(statuses, dtype=np.uint8).tobytes(),
        )
    )


def decode_response(buf: bytes) -> tuple[int, int, str, list[int]]:
    """(code, value, message, statuses) of a complete response frame."""
    if len(buf) < _RESP_HEAD.size:
        raise FrameError("short response")
    magic, code, _, n, value, text_len = _RESP_HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError("not a doorbell response")
    pos = _RESP_HEAD.size
    message = buf[pos : pos + text_len].decode(errors="replace")
    statuses = list(buf[pos + text_len : pos + text_len + n])
    return code, value, message, statuses


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def recv_frame(sock: socket.socket, limit: int = 64 << 20) -> bytes | None:
    """One length-prefixed frame, or None when the peer closed the connection between frames."""
    head = _recv_exact(sock, 4, allow_eof=True)
    if head is None:
        return None
    (size,) = struct.unpack("<I", head)
    if size > limit:
        raise FrameError(f"frame of {size} bytes exceeds {limit}")
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, size: int, allow_eof: bool = False) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            if allow_eof and got == 0:
                return None
            raise ConnectionError("doorbell peer closed the connection mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------ client


class DoorbellClient:
    """The worker's end: one connection per calling thread (saves and loads run side by side).

    While a request is outstanding the caller polls its socket for up to
    ``spin_s`` before sleeping in the kernel: on the VMs we measured, waking a
    sleeping thread costs several hundred microseconds, a few percent of a
    10 ms copy, and the caller is waiting for this answer anyway.
    """

    def __init__(self, path: str, spin_s: float = 0.05):
        self.path = path
        self.spin_s = spin_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: set[socket.socket] = set()

    def _conn(self) -> socket.socket:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.path)
            except OSError:
                conn.close()
                raise
            self._local.conn = conn
            with self._lock:
                self._all.add(conn)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                self._all.discard(conn)
            conn.close()

    def call(
        self,
        op: int,
        session_id: str,
        registration_id: str,
        hashes,
        block_ids,
        timeout_s: float,
        purpose: int = 0,
    ) -> tuple[int, int, str, list[int]]:
        """(code, value, message, statuses). Raises TimeoutError or OSError on transport failure."""
        request = encode_request(op, session_id, registration_id, hashes, block_ids, timeout_s, purpose)
        conn = self._conn()
        conn.settimeout(timeout_s)
        try:
            send_frame(conn, request)
            _await_readable(conn, min(self.spin_s, timeout_s), timeout_s)
            frame = recv_frame(conn)
            if frame is None:
                raise ConnectionError("the server closed the doorbell connection")
            return decode_response(frame)
        except BaseException:
            self._drop()  # the stream's state is unknown now
            raise

    def close(self) -> None:
        """Closes every thread's connection."""
        with self._lock:
            conns, self._all = list(self._all), set()
        for conn in conns:
            conn.close()


def _await_readable(conn: socket.socket, spin_s: float, timeout_s: float) -> None:
    """Returns once ``conn`` has data: polls without sleeping for ``spin_s``, then sleeps in poll()."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    start = time.perf_counter()
    while time.perf_counter() - start < spin_s:
        if poller.poll(0):
            return
    left_ms = max(int((timeout_s - (time.perf_counter() - start)) * 1000), 0)
    if not poller.poll(left_ms):
        raise TimeoutError(f"no doorbell answer within {timeout_s:.3f} s")


_ERRORS: dict[int, type[errors.PegaflowError]] = {
    CODE_INVALID_ARGUMENT: errors.InvalidArgument,
    CODE_DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    CODE_UNAVAILABLE: errors.ServerUnavailable,
    CODE_RESOURCE_EXHAUSTED: errors.ResourceExhausted,
}


def ring(
    client: DoorbellClient,
    op: int,
    session_id: str,
    registration_id: str,
    hashes,
    block_ids,
    timeout_s: float,
    purpose: int = 0,
) -> tuple[int, list[int]] | None:
    """One request as the pegaflow client sees it: (value, statuses), or None if the socket is unusable.

    Errors the server reports are raised as the client's exceptions, the same
    ones the RPC would raise; None tells the caller to use the RPC instead
    (the server restarted, or this process may not reach its socket).
    """
    try:
        code, value, message, statuses = client.call(
            op, session_id, registration_id, hashes, block_ids, timeout_s, purpose
        )
    except TimeoutError as exc:
        raise errors.DeadlineExceeded(f"doorbell: no answer within {timeout_s:.3f} s") from exc
    except (OSError, FrameError):
        return None
    except ValueError as exc:  # the request itself is malformed (counts, hash sizes)
        raise errors.InvalidArgument(f"doorbell request: {exc}") from exc
    if code == CODE_OK:
        return value, statuses
    what = "SaveFromDevice" if op == OP_SAVE else "LoadToDevice"
    text = f"{what} (doorbell): {message}"
    if code == CODE_NOT_FOUND:
        raise errors.NotFound(text, "device registration")
    raise _ERRORS.get(code, errors.ServerError)(text)
