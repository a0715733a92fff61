"""Passes the pool's memfd to local clients over a Unix socket (SCM_RIGHTS).

Protocol (one connection per client session, kept open for the session's life):

    client -> server   b"PEGAFLOW-POOL 1 <session_id>\\n"       (at most 256 bytes, within 5 s)
    server -> client   b'{"epoch": ..., "size_bytes": ..., "hugepages": ...}\\n' + the fd (SCM_RIGHTS)
                   or  b'{"error": "..."}\\n' and the connection is closed

Afterwards the connection is the client's liveness signal: when it closes
(process exit, SIGKILL, crash) the broker reports it at once, so the engine
reclaims the session's leases and half-written blocks without waiting for the
heartbeat TTL. Anything the client sends after the handshake is discarded.

One thread multiplexes every connection with ``selectors``; malformed or slow
handshakes are dropped without affecting other clients.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAGIC = b"PEGAFLOW-POOL 1 "
MAX_HELLO_BYTES = 256
HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 4096


class _Conn:
    __slots__ = ("sock", "buf", "opened_at", "session_id")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.opened_at = time.monotonic()
        self.session_id: str | None = None


def prepare_socket_path(path: str) -> None:
    """Removes a stale socket left by a dead server; refuses to steal a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another server is serving the pool fd on {path}")


class FdBroker:
    """Serves ``fd`` on ``path``.

    ``attach(session_id) -> dict`` validates the session and returns the header
    fields (it raises to refuse); ``detach(session_id)`` is called when an
    attached connection closes.
    """

    def __init__(
        self,
        path: str,
        fd: int,
        attach: Callable[[str], dict],
        detach: Callable[[str], None],
    ):
        self.path = path
        self._fd = fd
        self._attach = attach
        self._detach = detach
        prepare_socket_path(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, 0o660)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, _Conn] = {}
        self._forget: list[str] = []  # sessions ended elsewhere, whose connections the loop closes
        self._forget_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pegaflow-fd-broker", daemon=True)

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
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def connections(self) -> int:
        return len(self._conns)

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
            try:
                events = self._selector.select(timeout=1.0)
            except OSError:
                log.exception("fd broker: select failed")
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
            self._drop_slow_handshakes()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE and friends: leave the backlog for the next round rather than spin.
                log.warning("fd broker: accept failed: %s", exc)
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                log.warning("fd broker: too many connections, refusing one")
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock)
            self._conns[sock.fileno()] = conn
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
            if len(conn.buf) > MAX_HELLO_BYTES:
                self._refuse(conn, "handshake too long")
            return
        line = conn.buf.split(b"\n", 1)[0]
        if len(line) > MAX_HELLO_BYTES or not line.startswith(MAGIC):
            self._refuse(conn, "bad handshake: expected 'PEGAFLOW-POOL 1 <session_id>'")
            return
        try:
            session_id = line[len(MAGIC) :].decode("ascii").strip()
        except UnicodeDecodeError:
            self._refuse(conn, "bad handshake: session id is not ASCII")
            return
        try:
            header = self._attach(session_id)
        except Exception as exc:  # the engine's refusal (unknown session, closed, ...)
            self._refuse(conn, str(exc))
            return
        conn.session_id = session_id
        payload = json.dumps(header).encode() + b"\n"
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(2.0)
            socket.send_fds(conn.sock, [payload], [self._fd])
            conn.sock.setblocking(False)
        except OSError as exc:
            log.info("fd broker: could not send the pool fd to session %s: %s", session_id, exc)
            self._drop(conn, notify=True)

    def _refuse(self, conn: _Conn, reason: str) -> None:
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(0.5)
            conn.sock.sendall(json.dumps({"error": reason}).encode() + b"\n")
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
        conn.sock.close()
        if notify and conn.session_id is not None:
            try:
                self._detach(conn.session_id)
            except Exception:
                log.exception("fd broker: detach of session %s failed", conn.session_id)

    def _close_forgotten(self) -> None:
        with self._forget_lock:
            forget, self._forget = set(self._forget), []
        if forget:
            for conn in list(self._conns.values()):
                if conn.session_id in forget:
                    self._drop(conn, notify=False)

    def _drop_slow_handshakes(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.session_id is None and now - conn.opened_at > HELLO_TIMEOUT_S:
                self._refuse(conn, "handshake timed out")
