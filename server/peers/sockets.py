"""Blocking socket I/O with an absolute deadline, for both ends of the TCP data plane.

Sockets stay in blocking mode (Python timeout None) with the kernel's SO_RCVTIMEO / SO_SNDTIMEO
set to the time left before each call, so one ``recv_into(..., MSG_WAITALL)`` fills a whole
block slot and one ``os.sendfile`` sends a whole block: one system call per block and side, the
GIL released for all of it, instead of Python's timeout mode (non-blocking socket + poll) where
MSG_WAITALL is ignored and a 4 MiB block arrives in dozens of short reads.

Only the thread that owns a socket reads or writes it. Another thread may ``interrupt`` it
(shutdown: a blocked call returns at once); it is closed by its owner.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time

_TIMEVAL = struct.Struct("@ll")
# SO_*TIMEO of 0 means "forever": never set less than this.
_MIN_TIMEO_S = 0.001


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, _MIN_TIMEO_S)
    whole = int(seconds)
    return _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fills ``view`` from the socket. Raises TimeoutError at the deadline, ConnectionError on EOF
    (``EOFError`` when nothing at all was read, so a caller can tell a clean close between frames),
    OSError for a reset. Bytes may have landed in ``view`` when it raises; none land after."""
    size = len(view)
    got = 0
    while got < size:
        set_recv_timeout(sock, _left(deadline))
        try:
            n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing read: the loop re-checks the deadline
            continue
        if n == 0:
            if got == 0:
                raise EOFError("the peer closed the connection")
            raise ConnectionError(f"the peer closed the connection after {got} of {size} bytes")
        got += n


def recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    buf = bytearray(size)
    if size:
        recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data, deadline: float, flags: int = 0) -> None:
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        set_send_timeout(sock, _left(deadline))
        try:
            sent += sock.send(view[sent:], flags)
        except BlockingIOError:
            continue


def sendfile_all(sock: socket.socket, fd: int, offset: int, count: int, deadline: float) -> None:
    """``count`` bytes of ``fd`` from ``offset``, page references into the socket (no user copy)."""
    out = sock.fileno()
    while count > 0:
        set_send_timeout(sock, _left(deadline))
        try:
            n = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            continue
        if n == 0:
            raise ConnectionError(f"sendfile sent nothing at offset {offset} (past the end of the pool?)")
        offset += n
        count -= n


def sendmsg_all(sock: socket.socket, parts, deadline: float) -> None:
    """The buffers in ``parts``, gathered by the kernel (one copy into the socket, no join here)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        set_send_timeout(sock, _left(deadline))
        try:
            n = sock.sendmsg(views)
        except BlockingIOError:
            continue
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def interrupt(sock: socket.socket | None) -> None:
    """Makes a call blocked on ``sock`` in another thread return now (the owner then closes it)."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def tune(sock: socket.socket) -> None:
    """Data-plane sockets: no Nagle delay on the small frames (headers, READs, DONE)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
