"""The framing every local Unix-socket protocol of pegaflow shares (the local RPC socket, the GPU
doorbell, and the server's channel to its lookup sketches' process), written once for the server end
(server/endpoints/unix_socket.py) and the client end (client/frame_link.py). What goes inside a frame
is the codec's (local_rpc.py, doorbell.py here; server/metrics/sketch_process.py).

Little-endian. A connection carries frames, each a u32 body length and the body. On accept the
server greets once, before it reads anything::

    magic (4 bytes, names the codec) | version u8 | epoch length u8 | epoch (ascii)

The client checks all three: another protocol, another version, or another server's pool epoch
(the same configured path on another host, a restarted server) and it does not use the socket.
Because the server greets before reading, a connection that closes before the greeting ran
nothing.

``GOODBYE`` (an empty frame, length 0) is the server's last word on a connection it closes on
its own (idle timeout, eviction at the connection cap, shutdown): it never reads from that
connection again, so a request the client sent meanwhile was surely not run and may be sent
again on a new connection. No codec has empty requests or responses.

Reads are incremental: ``recv_exact`` never allocates the length a peer announced before the
bytes are there (a peer that announces 8 MiB and sends 10 bytes costs 10 bytes), reads at most
``CHUNK_BYTES`` per call, and charges what it received to an optional ``MemoryBudget`` (the
server's cap on frame bytes held by all its connections). Every wait is bounded by a deadline.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time

LEN = struct.Struct("<I")
GOODBYE = LEN.pack(0)
_HELLO = struct.Struct("<4sBB")
MAX_EPOCH_BYTES = 255
# The most one recv asks for (Python allocates that much for the call, then shrinks it to what came):
# bounds what a stalled, half-sent frame can make a reader allocate ahead. A Unix socket's buffer
# holds ~200 KiB by default, so a larger chunk would rarely fill anyway.
CHUNK_BYTES = 256 << 10


class FrameError(ValueError):
    """Bytes that are not this protocol (malformed, oversized, wrong magic): the connection is closed."""


class FrameTooLarge(FrameError):
    """A frame announced longer than the receiver accepts; its body is left unread."""


class MemoryCapExceeded(FrameError):
    """Reading this frame would take the server past its cap on frame bytes held at once."""


class MemoryBudget:
    """A byte budget shared by every connection of one server (thread-safe, never blocks)."""

    def __init__(self, limit_bytes: int):
        if limit_bytes <= 0:
            raise ValueError("a memory budget must be positive")
        self.limit_bytes = limit_bytes
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._used + nbytes > self.limit_bytes:
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes


# ------------------------------------------------------------------ greeting


def encode_hello(magic: bytes, version: int, epoch: str) -> bytes:
    raw = epoch.encode("ascii")
    if len(magic) != 4:
        raise ValueError("a greeting's magic has 4 bytes")
    if len(raw) > MAX_EPOCH_BYTES:
        raise ValueError(f"epoch longer than {MAX_EPOCH_BYTES} bytes")
    return _HELLO.pack(magic, version, len(raw)) + raw


def read_hello(sock: socket.socket, deadline: float) -> tuple[bytes, int, str]:
    """(magic, version, epoch) of a server's greeting. Raises ConnectionError on EOF (the server refused
    the connection before greeting: it read nothing), FrameError, TimeoutError."""
    magic, version, size = _HELLO.unpack(recv_exact(sock, _HELLO.size, deadline))
    try:
        epoch = recv_exact(sock, size, deadline).decode("ascii")
    except UnicodeDecodeError as exc:
        raise FrameError("the greeting's epoch is not ascii") from exc
    return magic, version, epoch


# ------------------------------------------------------------------ frames


def encode_frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def read_frame(
    sock: socket.socket, limit: int, deadline: float | None = None, budget: MemoryBudget | None = None
) -> bytes | None:
    """One frame's body (``b""`` for GOODBYE); None when the peer closed the connection between frames.

    Raises FrameTooLarge for a frame longer than ``limit`` (its body is left unread: close the
    connection), MemoryCapExceeded when ``budget`` runs out (nothing stays reserved), ConnectionError
    on EOF inside a frame, TimeoutError once ``deadline`` (time.monotonic) passes. With ``budget``,
    the body's length stays reserved on success: the caller releases it once done with the body.
    """
    head = recv_exact(sock, LEN.size, deadline, allow_eof=True)
    if head is None:
        return None
    (size,) = LEN.unpack(head)
    if size > limit:
        raise FrameTooLarge(f"frame of {size} bytes exceeds the limit of {limit} bytes")
    return recv_exact(sock, size, deadline, budget=budget)


def recv_exact(
    sock: socket.socket,
    size: int,
    deadline: float | None = None,
    allow_eof: bool = False,
    budget: MemoryBudget | None = None,
) -> bytes | None:
    """Exactly ``size`` bytes, read as they arrive (at most CHUNK_BYTES per recv). None on EOF before
    the first byte if ``allow_eof``.

    A non-blocking socket (``settimeout(0)``, what both ends of the local sockets use once
    connected) is read with plain recvs and waited on with poll only when no data is there: one
    syscall per read in the common case, where a socket with a timeout costs three (Python polls
    before every recv of such a socket, and setting the timeout is a syscall). Other sockets get
    their timeout kept to the time left before ``deadline``.
    """
    if size == 0:
        return b""
    nonblocking = sock.gettimeout() == 0.0
    poller = None
    chunks: list[bytes] = []
    got = reserved = 0
    try:
        while got < size:
            if nonblocking:
                try:
                    data = sock.recv(min(size - got, CHUNK_BYTES))
                except (BlockingIOError, InterruptedError):
                    if poller is None:
                        poller = select.poll()
                        poller.register(sock, select.POLLIN)
                    _wait(poller, deadline)
                    continue
            else:
                if deadline is not None:
                    sock.settimeout(_left(deadline))
                data = sock.recv(min(size - got, CHUNK_BYTES))
            if budget is not None and data:
                if not budget.reserve(len(data)):
                    raise MemoryCapExceeded(
                        f"the server holds {budget.used_bytes} bytes of frames in flight "
                        f"(cap {budget.limit_bytes}); try again later"
                    )
                reserved += len(data)
            if not data:
                if allow_eof and got == 0:
                    return None
                raise ConnectionError("the peer closed the connection inside a frame")
            chunks.append(data)
            got += len(data)
    except BaseException:
        if reserved:
            budget.release(reserved)
        raise
    # The common case, one recv for the whole frame, costs no copy.
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def send_all(sock: socket.socket, data: bytes, deadline: float | None) -> None:
    """All of ``data`` on a non-blocking socket, waiting (poll) only while its buffer is full. Raises
    TimeoutError at ``deadline`` (part of the frame may be out: the stream is unusable then)."""
    try:
        sent = sock.send(data)  # the common case: the buffer takes it all at once
    except (BlockingIOError, InterruptedError):
        sent = 0
    if sent == len(data):
        return
    view = memoryview(data)[sent:]
    poller = None
    while view:
        try:
            view = view[sock.send(view) :]
        except (BlockingIOError, InterruptedError):
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            _wait(poller, deadline)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _wait(poller, deadline: float | None) -> None:
    """Until the poller's socket is ready (or hung up); TimeoutError at ``deadline``."""
    while not poller.poll(None if deadline is None else max(int(_left(deadline) * 1000), 1)):
        pass


# ------------------------------------------------------------------ waiting


def readable(sock, timeout_s: float) -> bool:
    """Whether ``sock`` (a socket or an fd) has something to read (data, EOF or an error) within
    ``timeout_s``. poll, not select: a busy server's descriptors pass select's limit of 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(int(timeout_s * 1000), 0)))


def spin_until_readable(poller, spin_s: float, yield_cpu: bool) -> bool:
    """Polls ``poller`` (a select.poll with the socket registered for POLLIN) without sleeping for up
    to ``spin_s``; True as soon as it is readable, False when the spin is over (the caller then sleeps
    in the kernel, in recv). Waking a sleeping thread costs ~50-70 us on the 2-vCPU VMs we measured
    (and several hundred on GPU hosts), so a caller that expects its answer soon spins first.
    ``yield_cpu`` gives the CPU to any other runnable thread each turn (sched_yield), so the spin only
    takes idle time; without it the spin is hot (the doorbell, whose caller waits for a GPU copy)."""
    start = time.perf_counter()
    while True:
        if poller.poll(0):
            return True
        if time.perf_counter() - start >= spin_s:
            return False
        if yield_cpu:
            os.sched_yield()
