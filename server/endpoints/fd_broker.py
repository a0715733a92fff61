"""Passes the pool's fd to local clients over a Unix socket (SCM_RIGHTS).

The handshake is ``pegaflow.common.wire.pool_fd``: one connection per client session, kept open
for the session's life. Afterwards the connection is the client's liveness signal: when it closes
(process exit, SIGKILL, crash) the broker reports it at once, so the engine reclaims the session's
leases and half-written blocks without waiting for the heartbeat TTL. Anything the client sends
after the handshake is discarded. The fd handed out is sealed against resizing
(tiers/dram/region.py), so a client can write the pool's bytes but never shrink or grow it.

One thread multiplexes every connection with ``selectors``; the listener, its path checks and the
EMFILE back-off are the ones the other local endpoints use (unix_socket.py). Bounds (issue 12 F5):

* a connection must complete its handshake within ``handshake_timeout_s``;
* at most ``max_pending`` connections may be handshaking at once; a new one beyond that evicts
  the oldest, so connections that never handshake cannot lock honest clients out (an honest
  client handshakes within a millisecond of connecting);
* a session may hold at most ``max_attachments_per_session`` pool connections (the client opens
  one per session); attached connections end with their session (``forget_session``), so none
  outlives the session TTL;
* at most ``max_connections`` in all: beyond that a new connection evicts the oldest handshaking
  one, or is refused when every connection is attached (a session's liveness is never cut).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping

from pegaflow.common.wire import pool_fd as wire
from pegaflow.server.endpoints.unix_socket import (
    RESOURCE_ERRNOS,
    AcceptBackoff,
    RateLimitedLog,
    bind_unix_listener,
    socket_identity,
    unlink_if_ours,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 4096
MAX_PENDING = 256
MAX_ATTACHMENTS_PER_SESSION = 4


class _Conn:
    __slots__ = ("sock", "buf", "opened_at", "session_id", "peer")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.opened_at = time.monotonic()
        self.session_id: str | None = None
        self.peer = _peer_credentials(sock)


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connecting process, as the kernel reports it (SO_PEERCRED)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)
    except OSError:
        return (0, -1, -1)


class FdBroker:
    """Serves ``fd`` on ``path``.

    ``attach(session_id) -> dict`` validates the session and returns the header fields (it raises
    to refuse); ``detach(session_id)`` is called when an attached connection closes. Both run on the
    broker's thread. The constructor binds (OSError as UnixFrameServer's); ``start()`` serves.
    """

    def __init__(
        self,
        path: str,
        fd: int | Mapping[str, int],
        attach: Callable[[str], dict],
        detach: Callable[[str], None],
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_pending: int = MAX_PENDING,
        max_attachments_per_session: int = MAX_ATTACHMENTS_PER_SESSION,
    ):
        self.path = path
        # The memfd per part of the pool (tiers/dram/region.py): "" the shared pool, else a tenant's
        # own region; the engine's answer to the handshake names the one a session gets.
        self._fds = dict(fd) if not isinstance(fd, int) else {"": fd}
        self._ro_fds: dict[str, int] = {}  # parts reopened read-only, for readers (on first use)
        self._attach = attach
        self._detach = detach
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.max_attachments_per_session = max_attachments_per_session
        self._listener = bind_unix_listener(path)
        self._identity = socket_identity(path)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, _Conn] = {}
        self._pending: dict[int, _Conn] = {}  # handshaking, oldest first (dicts keep insertion order)
        self._attached: dict[str, int] = {}  # session id -> its open pool connections
        self._forget: list[str] = []  # sessions ended elsewhere, whose connections the loop closes
        self._forget_lock = threading.Lock()
        self._stopping = False
        self._backoff = AcceptBackoff(f"fd broker {path}", log)
        self._refusals = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name="pegaflow-fd-broker", daemon=True)
        # Connections the broker closed on its own (for tests and logs).
        self.timed_out = self.evicted = self.refused = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._drop(conn, notify=False)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        for fd in self._ro_fds.values():
            os.close(fd)
        self._ro_fds.clear()
        unlink_if_ours(self.path, self._identity)

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def forget_session(self, session_id: str) -> None:
        """Closes the session's connections (it ended for another reason: heartbeat timeout, CloseSession),
        so its client sees EOF at once and reconnects. Thread-safe; the broker thread does the closing."""
        with self._forget_lock:
            self._forget.append(session_id)
        try:
            self._wake_w.send(b"f")
        except OSError:
            pass

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            timeout = 1.0
            if self._pending:
                oldest = next(iter(self._pending.values()))
                timeout = min(timeout, max(oldest.opened_at + self.handshake_timeout_s - now, 0.0))
            if self._backoff.paused:
                timeout = min(timeout, max(self._backoff.resume_at - now, 0.0))
            try:
                events = self._selector.select(timeout=timeout)
            except OSError:
                if self._stopping:
                    return
                log.exception("fd broker: select failed")
                time.sleep(0.1)
                continue
            for key, _ in events:
                if key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    self._close_forgotten()
                elif key.data is None:
                    self._accept()
                else:
                    self._readable(key.data)
            if self._backoff.paused and time.monotonic() >= self._backoff.resume_at:
                self._backoff.resumed()
                self._selector.register(self._listener, selectors.EVENT_READ, None)
            self._drop_slow_handshakes()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    self._refusals.warning("fd broker: accept failed: %s", exc)
                    return
                # The listener stays readable while its backlog waits: stop watching it for a while.
                self._backoff.failed(exc)
                self._selector.unregister(self._listener)
                return
            self._backoff.succeeded()
            if len(self._pending) >= self.max_pending or len(self._conns) >= self.max_connections:
                if self._pending:
                    self.evicted += 1
                    self._refuse(next(iter(self._pending.values())), "evicted: too many handshakes at once")
                if len(self._conns) >= self.max_connections:
                    self.refused += 1
                    self._refusals.warning(
                        "fd broker: %d pool connections, all attached; refusing one", self.max_connections
                    )
                    sock.close()
                    continue
            sock.setblocking(False)
            conn = _Conn(sock)
            self._conns[sock.fileno()] = conn
            self._pending[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, notify=True)
            return
        if conn.session_id is not None:
            return  # after the handshake the client has nothing to say; ignore whatever it sends
        conn.buf += data
        if b"\n" not in conn.buf:
            if len(conn.buf) > wire.MAX_HELLO_BYTES:
                self._refuse(conn, "handshake too long")
            return
        try:
            session_id = wire.parse_hello(conn.buf.split(b"\n", 1)[0])
        except ValueError as exc:
            self._refuse(conn, str(exc))
            return
        held = self._attached.get(session_id, 0)
        if held >= self.max_attachments_per_session:
            self._refuse(conn, f"session {session_id} already holds {held} pool connections")
            return
        try:
            header = self._attach(session_id)
        except Exception as exc:  # the engine's refusal (unknown session, closed, ...)
            self._refuse(conn, str(exc))
            return
        self._pending.pop(conn.sock.fileno(), None)
        conn.session_id = session_id
        self._attached[session_id] = held + 1
        log.debug("fd broker: session %s attached from pid %d uid %d", session_id, conn.peer[0], conn.peer[1])
        try:
            # The handshake's answer is small and the client waits for it: its buffer has room.
            part = header.pop("part", "")
            fd = self._read_only_fd(part) if header.get("read_only") else self._fds[part]
            socket.send_fds(conn.sock, [wire.encode_header(header)], [fd], socket.MSG_DONTWAIT)
        except OSError as exc:
            log.info("fd broker: could not send the pool fd to session %s: %s", session_id, exc)
            self._drop(conn, notify=True)

    def _read_only_fd(self, part: str) -> int:
        """A pool part reopened read-only (through /proc/self/fd): a reader's mapping of it cannot be
        writable (mmap with PROT_WRITE and MAP_SHARED fails with EACCES), whatever the client does."""
        fd = self._ro_fds.get(part)
        if fd is None:
            fd = self._ro_fds[part] = os.open(f"/proc/self/fd/{self._fds[part]}", os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _refuse(self, conn: _Conn, reason: str) -> None:
        self._refusals.warning("fd broker: refusing a connection: %s", reason)
        try:
            conn.sock.send(wire.encode_error(reason), socket.MSG_DONTWAIT)
        except OSError:
            pass
        self._drop(conn, notify=False)

    def _drop(self, conn: _Conn, notify: bool) -> None:
        fileno = conn.sock.fileno()
        if fileno >= 0:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            self._conns.pop(fileno, None)
            self._pending.pop(fileno, None)
        conn.sock.close()
        session_id = conn.session_id
        if session_id is None:
            return
        conn.session_id = None
        left = self._attached.get(session_id, 1) - 1
        if left > 0:
            self._attached[session_id] = left
        else:
            self._attached.pop(session_id, None)
        if notify:
            try:
                self._detach(session_id)
            except Exception:
                log.exception("fd broker: detach of session %s failed", session_id)

    def _close_forgotten(self) -> None:
        with self._forget_lock:
            forget, self._forget = set(self._forget), []
        if forget:
            for conn in list(self._conns.values()):
                if conn.session_id in forget:
                    self._drop(conn, notify=False)

    def _drop_slow_handshakes(self) -> None:
        limit = time.monotonic() - self.handshake_timeout_s
        for conn in list(self._pending.values()):
            if conn.opened_at > limit:
                break  # oldest first: the rest are younger
            self.timed_out += 1
            self._refuse(conn, "handshake timed out")
