"""The client end of the server's local Unix sockets (the local RPC socket, the GPU doorbell), written once.

A ``FrameLink`` belongs to one session: the socket path its server named, and the pool epoch the
server must greet with (``pegaflow.common.wire.frames``: magic, version, epoch; anything else and
the socket is never used). A call takes an idle connection (the one used last: a single-threaded
caller's calls, oneway ones included, run in order on one connection) or opens one, and puts it
back once its answer is in: as many connections as calls run at once, whichever threads make
them. The codec clients on top (``local_rpc.LocalRpcClient``, ``doorbell.DoorbellClient``) encode
requests and decode answers; everything about connections, deadlines and failures is here.

What a call reports, so that a request is never run twice:

* ``NotSent``: the server surely did not run it (no connection, a refused or foreign greeting, a
  send that failed on a new connection, the server's GOODBYE) - the caller may send it over gRPC.
  After one, the socket rests for ``RETRY_AFTER_S`` (calls meanwhile go to gRPC), then is tried
  again.
* ``TimeoutError``: the deadline passed (nothing is resent: the caller reports DEADLINE_EXCEEDED).
* ``LinkFailed``: the connection broke after the request went out - it may have run; the caller
  reports UNAVAILABLE, as gRPC does when a connection dies mid-call.

A connection the server closed while it sat idle here (idle timeout, eviction at the server's
cap) fails the send (EPIPE), or, if the close races with the send, answers with the server's
GOODBYE, which says it never read the request: either way the call is sent once more, on a new
connection. Every socket operation is bounded by the time left before the call's deadline.

A caller waits for its answer outside the interpreter lock (native/frame_wait.py): the spin, the sleep
and the read with the lock released once, not once per poll, which other threads of the process
(vLLM's, a GPU copy's waiter) would take meanwhile.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

import grpc

from pegaflow.client.native import frame_wait
from pegaflow.common.wire import frames

log = logging.getLogger("pegaflow.client")

RETRY_AFTER_S = 1.0


class NotSent(Exception):
    """The request did not reach the server (it ran nothing): the call may go over gRPC instead."""


class LinkFailed(ConnectionError):
    """The connection failed after the request was sent: it may have run."""


class LocalRpcError(grpc.RpcError):
    """A call answered with an error status over a local socket (or failed there after it was sent):
    the same code, details and trailing metadata gRPC would give, so the client maps it alike."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata=()):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._metadata = code, details, tuple(metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._metadata


class _Conn:
    """One connection, used by one call at a time."""

    __slots__ = ("sock", "poller")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def stale(self) -> bool:
        """Between calls the server says nothing: anything readable is its GOODBYE or EOF."""
        return bool(self.poller.poll(0))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it (a close from elsewhere)
        except OSError:
            pass
        self.sock.close()


class PendingAnswer:
    """A call sent on ``conn`` whose answer is not read yet (FrameLink.start)."""

    __slots__ = ("conn", "fresh", "frame", "deadline", "held_s")

    def __init__(self, conn: _Conn, fresh: bool, frame: bytes, deadline: float, held_s: float = 0.0):
        self.conn, self.fresh, self.frame, self.deadline = conn, fresh, frame, deadline
        self.held_s = held_s


class FrameLink:
    """Connections to one server's local socket at ``path``, for one session (thread-safe).

    ``magic`` / ``version``: the codec's greeting; ``epoch``: the session's pool epoch.
    ``max_frame_bytes``: the longest answer accepted. ``spin_s`` / ``yield_cpu``: how a caller
    waits for its answer (frames.spin_until_readable). ``what`` names the socket in log lines.
    """

    def __init__(
        self,
        path: str,
        magic: bytes,
        version: int,
        epoch: str,
        max_frame_bytes: int,
        spin_s: float,
        yield_cpu: bool,
        what: str,
    ):
        self.path = path
        self.epoch = epoch
        self.spin_s = spin_s
        self._magic = magic
        self._version = version
        self._max_frame = max_frame_bytes
        self._yield = yield_cpu
        self._what = what
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()  # every open connection (closed by close())
        self._idle: list[_Conn] = []  # not in a call; list.append / pop are atomic
        self._down_until = 0.0
        self._disabled = ""  # why this socket is never to be used (not our server); "" = usable
        self._closed = False
        self._warned = False
        frame_wait.start()  # the answers' wait without the interpreter lock, once built (native/frame_wait.c)

    @property
    def usable(self) -> bool:
        return not self._closed and not self._disabled and time.monotonic() >= self._down_until

    def call(self, frame: bytes, deadline: float, held_s: float = 0.0) -> bytes:
        """Sends one request frame (length prefix included) and returns its answer's body.

        ``held_s``: for a caller every other thread of its process waits for (vLLM's scheduler
        looking a prompt up): the frame is sent, and its answer waited for up to ``held_s``, without
        releasing the interpreter lock (with the native frame wait), so that a busy thread beside it
        cannot hold the call up by a switch interval (5 ms) each time it takes the lock back.
        Raises NotSent, TimeoutError or LinkFailed (module docstring).
        """
        return self.finish(self.start(frame, deadline, held_s))

    def start(self, frame: bytes, deadline: float, held_s: float = 0.0) -> PendingAnswer:
        """Sends one request frame and returns at once: ``finish`` collects its answer (or
        ``abandon`` drops it). The connection is the call's until then, so a caller can have
        several calls out at once - a save's next allocation while it copies the current batch.
        Raises NotSent or TimeoutError; a LinkFailed only comes with the answer."""
        if not self.usable:
            raise NotSent("resting")
        return self._send_on(frame, deadline, fresh_only=False, held_s=held_s)

    def finish(self, pending: PendingAnswer) -> bytes:
        """The answer's body of a started call. Raises NotSent, TimeoutError or LinkFailed."""
        while True:
            conn = pending.conn
            left = pending.deadline - time.monotonic()
            try:
                body = frame_wait.recv_frame(
                    conn.sock,
                    conn.poller,
                    self._max_frame,
                    max(min(self.spin_s, left), 0.0),
                    self._yield,
                    pending.deadline,
                    pending.held_s,
                )
            except TimeoutError:
                self._drop(conn)
                raise
            except (OSError, frames.FrameError) as exc:
                self._drop(conn)
                raise LinkFailed(f"{self._what} failed mid-call: {exc}") from exc
            if body is None:
                self._drop(conn)
                raise LinkFailed(f"{self._what} closed the connection mid-call")
            if not body:  # GOODBYE: the server closed this connection without reading the request
                self._drop(conn)
                if pending.fresh:
                    self.rest("the server is closing its connections")
                    raise NotSent("the server said goodbye")
                pending = self._send_on(
                    pending.frame, pending.deadline, fresh_only=True, held_s=pending.held_s
                )
                continue
            self._put_back(conn)  # the stream is in step again: the next call may take it
            return body

    def abandon(self, pending: PendingAnswer) -> None:
        """Gives up on a started call's answer: its connection is closed (an unread answer would put
        the stream out of step). The request may still run; undoing it is the caller's business."""
        self._drop(pending.conn)

    def _send_on(self, frame: bytes, deadline: float, fresh_only: bool, held_s: float = 0.0) -> PendingAnswer:
        while True:
            conn, fresh = self._take(deadline, fresh_only)
            if deadline - time.monotonic() <= 0:
                self._put_back(conn)
                raise TimeoutError("deadline passed")
            try:
                sent = (frame_wait.send_now(conn.sock, frame) or 0) if held_s > 0 else 0
                if sent < len(frame):
                    frames.send_all(conn.sock, frame[sent:] if sent else frame, deadline)
            except TimeoutError:
                self._drop(conn)  # part of a frame may be out: this stream is unusable
                raise
            except OSError as exc:
                self._drop(conn)
                if fresh:
                    self.rest(f"send failed: {exc}")
                    raise NotSent(f"send failed: {exc}") from exc
                fresh_only = True  # the server closed it while idle: nothing was read
                continue
            return PendingAnswer(conn, fresh, frame, deadline, held_s)

    def send(self, frame: bytes, timeout_s: float) -> bool:
        """Sends a request that wants no answer; False if not sent (use gRPC). Only on an idle open
        connection: opening one means awaiting the server's greeting, and a fire-and-forget call must
        not wait on a stalled server."""
        if not self.usable:
            return False
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return False
            if not conn.stale():
                break
            self._drop(conn)
        try:
            sent = conn.sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            self._put_back(conn)
            return False  # the server is not reading (stalled): gRPC's future does not block us
        except OSError as exc:
            self._drop(conn)
            self.rest(f"send failed: {exc}")
            return False
        if sent < len(frame):  # rare (a nearly full buffer): the frame's rest must follow, within the timeout
            try:
                frames.send_all(conn.sock, frame[sent:], time.monotonic() + timeout_s)
            except OSError:
                self._drop(conn)  # a partial frame is never run: the server sees it cut off
                return False
        self._put_back(conn)
        return True

    def rest(self, why: str) -> None:
        """Calls go to gRPC for RETRY_AFTER_S (the socket failed, or refused to run a request)."""
        self._down_until = time.monotonic() + RETRY_AFTER_S
        # The first time at warning level, then quietly: a remote client would repeat it every second.
        if not self._warned:
            self._warned = True
            log.warning("pegaflow: %s %s unusable (%s); using gRPC meanwhile", self._what, self.path, why)
        else:
            log.debug("pegaflow: %s %s unusable (%s)", self._what, self.path, why)

    def close(self) -> None:
        """Closes every connection (the session is over); a call still using one sees it closed."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            self._conns.clear()
            self._idle.clear()
        for conn in conns:
            conn.close()

    # ------------------------------------------------------------------ connections

    def _take(self, deadline: float, fresh_only: bool) -> tuple[_Conn, bool]:
        """An idle connection (the last one put back), or a new one. An idle one the server closed is
        not checked for here (a poll per call): sending on it fails, or meets its GOODBYE, and the
        call is sent again on a new one."""
        if not fresh_only:
            try:
                return self._idle.pop(), False
            except IndexError:
                pass
        return self._open(deadline), True

    def _open(self, deadline: float) -> _Conn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
            try:
                sock.connect(self.path)
                # The server greets before it reads anything: no greeting, nothing run.
                magic, version, epoch = frames.read_hello(sock, deadline)
            except TimeoutError:
                raise
            except (OSError, frames.FrameError) as exc:
                self.rest(f"cannot connect: {exc}")
                raise NotSent(f"cannot connect: {exc}") from exc
            if (magic, version, epoch) != (self._magic, self._version, self.epoch):
                self._disabled = (
                    f"its server greets as {magic!r} version {version} with pool epoch {epoch!r}; this "
                    f"session needs {self._magic!r} version {self._version}, epoch {self.epoch!r}"
                )
                log.warning("pegaflow: not using %s %s: %s", self._what, self.path, self._disabled)
                raise NotSent(self._disabled)
        except BaseException:
            sock.close()
            raise
        # Non-blocking from now on: a call's reads and writes poll only when they must wait.
        sock.setblocking(False)
        conn = _Conn(sock)
        with self._lock:
            if self._closed:
                conn.close()
                raise NotSent("the session is closed")
            self._conns.add(conn)
        return conn

    def _put_back(self, conn: _Conn) -> None:
        self._idle.append(conn)
        if self._closed:  # close() may have emptied the idle list before this append
            conn.close()

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()
