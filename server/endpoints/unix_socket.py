"""The one Unix-socket server of the local endpoints (the local RPC socket, the GPU doorbell), and the
socket plumbing the fd broker shares with it.

``UnixFrameServer(path, codec, epoch)`` serves a ``FrameCodec`` (base.py) on ``path``; ``start()``
starts its threads, ``stop()`` ends them. The framing is ``pegaflow.common.wire.frames``.

Threads. One *loop* thread owns an epoll set holding the listener and every *parked* connection
(one with no call in progress). When a parked connection becomes readable the loop hands it to a
*worker* (a pool that grows to as many threads as connections are busy at once, and shrinks when
they idle); the worker reads the frame, runs the codec, answers, and then *lingers*: it waits on
that connection alone for ``linger_s`` and serves the next request at once if one comes, else
parks the connection again and returns to the pool. Why: a request that arrives while its
connection lingers wakes one thread, as with a thread per connection, while a connection that
went quiet holds no thread at all (before, each idle connection held one forever; issue 12 F11).
Only the first request after a quiet spell pays the loop's hand-off (a second wake-up). Measured
with bench/transport_rtt.py (p50 of the median run, one client thread; bench/results/), lingering
against handing every request through the loop (``linger_s=0``): on the H200 host's 16 CPUs a
local RPC call 45 vs 58 us, a doorbell save of 1 / 256 hashes 43 / 134 vs 53 / 131 us; on the
loaded 2-vCPU dev VM 86 vs 107 us and 52 / 173 vs 104 / 226 us. The thread-per-connection servers
this replaced measured no faster on that path (interleaved on the H200 host: local RPC 44-64 us
before, 42-54 after; bench/results/transport_rtt_before_after.json).

Bounds, every one enforced here, whatever the codec:

* **Connections**: at most ``max_connections``. At the cap a new connection evicts the longest
  idle parked one (it gets GOODBYE), so idle connections can never lock new clients out; only
  when every connection is busy is the new one closed before its greeting (the client then uses
  gRPC).
* **Idle timeout**: a connection parked for ``idle_timeout_s`` gets GOODBYE and is closed.
* **Memory**: a frame longer than the codec's ``max_frame_bytes`` is refused before any of its
  body is read; a body is read as it arrives, never allocated from its announced length, and
  every connection's frames in flight together stay under ``memory_limit_bytes`` (a frame that
  would pass it is refused, not run, and its connection closed). A frame must arrive whole within
  ``frame_timeout_s`` of its first byte.
* **File descriptors**: ``accept`` failing with EMFILE / ENFILE (or ENOBUFS / ENOMEM) pauses
  accepting with exponential back-off, logged once per episode and once at recovery, instead of
  spinning on a listener that stays readable (issue 12 F4: ~5,500 warnings/s). The runtime raises
  the process's own open-file limit at start (``raise_open_file_limit``).

No double execution: a connection is only ever closed by the server without an answer in two
ways. GOODBYE means the server did not and will not read from it again (idle, evicted, stopping),
so a request the client sent meanwhile was not run and may be retried; any other close (a crash,
a stalled frame) after a request went out means "may have run", which the client reports as
UNAVAILABLE rather than sending the request again (client/frame_link.py).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import resource
import select
import socket
import stat
import threading
import time

import grpc

from pegaflow.common.wire import frames
from pegaflow.server.endpoints.base import FrameCodec

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660  # whoever may map the pool may call the services that manage it; nobody else
MAX_CONNECTIONS = 1024
IDLE_TIMEOUT_S = 300.0
# Long enough to keep a steadily calling client's connection on its worker (vLLM calls every step,
# 10-100 ms), short enough that quiet connections give their threads back.
LINGER_S = 1.0
FRAME_TIMEOUT_S = 10.0  # from a frame's first byte to its last; local peers send MiBs in milliseconds
SEND_TIMEOUT_S = 10.0  # an answer the client does not read within this closes its connection
MEMORY_LIMIT_BYTES = 256 << 20  # frame bytes held by all connections of one server at once
WORKER_IDLE_EXIT_S = 30.0
_ACCEPT_BACKOFF_FIRST_S = 0.05
_ACCEPT_BACKOFF_MAX_S = 1.0
# accept() failures that mean "no resources for another fd / socket now": back off, do not spin.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_PARKED, _WORKING, _CLOSED = "parked", "working", "closed"
_EPOLL_ARMED = select.EPOLLIN | select.EPOLLONESHOT


# ------------------------------------------------------------------ the socket path


def check_socket_dir(path: str) -> None:
    """Refuses a socket directory in which another user could replace our socket (OSError): it must be
    owned by us or root, and if others may write to it, have the sticky bit (as /tmp does)."""
    directory = os.path.dirname(os.path.abspath(path))
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{directory} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise OSError(errno.EPERM, f"socket directory {directory} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise OSError(
            errno.EPERM,
            f"socket directory {directory} is writable by others without the sticky bit: "
            "another user could replace the socket; use a private directory",
        )


def prepare_socket_path(path: str) -> None:
    """Removes a stale socket left by a dead server; never a live one (OSError EADDRINUSE) or a
    non-socket (OSError EEXIST).

    Live means anything but "connection refused": a server that accepts, one whose backlog is full
    (the connect times out), one we may not connect to (EACCES, another user's) all stay.
    """
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
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a dead server's leftover
        return
    except FileNotFoundError:
        return  # removed meanwhile
    except OSError as exc:
        raise OSError(errno.EADDRINUSE, f"{path} is a socket in use ({exc}); not replacing it") from exc
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another server is listening on {path}")


def bind_unix_listener(path: str, mode: int = SOCKET_MODE, backlog: int = 128) -> socket.socket:
    """A listening Unix socket at ``path`` with permissions ``mode``, after the directory and path
    checks above. The mode is set on the socket before bind (Linux creates the inode with it, less
    the umask), so the path is never more open than ``mode``, not even for an instant."""
    check_socket_dir(path)
    prepare_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), mode)
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def socket_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def unlink_if_ours(path: str, identity: tuple[int, int] | None) -> None:
    """Removes ``path`` only if it is still the socket we bound (a successor may have bound it since)."""
    if identity is not None and socket_identity(path) == identity:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def raise_open_file_limit() -> tuple[int, int]:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (logged); returns (old, new) soft.

    Every local client costs the server a few descriptors (fd-broker connection, local RPC
    connections, gRPC); a 1,024 default ran out under 1,100 idle local connections (issue 12 F4).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        target = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    else:
        target = hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        log.info("open-file limit: %s (hard %s)", soft, hard)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("open-file limit stays %d: raising it to %s failed: %s", soft, target, exc)
        return soft, soft
    log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
    return soft, target


class AcceptBackoff:
    """What an accept loop does when ``accept`` fails for lack of resources: pause with exponential
    back-off, and log one line when the episode starts and one when it ends (not one per failure)."""

    def __init__(self, what: str, logger: logging.Logger = log):
        self._what = what
        self._log = logger
        self._delay = 0.0
        self._failures = 0
        self._since = 0.0
        self.resume_at = 0.0  # time.monotonic when accepting may be tried again; 0 = not paused

    @property
    def paused(self) -> bool:
        return self.resume_at > 0.0

    def failed(self, exc: OSError) -> float:
        """Records a failure; returns the pause before the next accept."""
        now = time.monotonic()
        if self._failures == 0:
            self._since = now
            self._delay = _ACCEPT_BACKOFF_FIRST_S
            self._log.warning(
                "%s: accept failed (%s); pausing new connections with back-off up to %.1f s until "
                "resources free up (clients use gRPC meanwhile); logged again when it recovers",
                self._what,
                exc,
                _ACCEPT_BACKOFF_MAX_S,
            )
        else:
            self._delay = min(self._delay * 2, _ACCEPT_BACKOFF_MAX_S)
        self._failures += 1
        self.resume_at = now + self._delay
        return self._delay

    def resumed(self) -> None:
        self.resume_at = 0.0

    def succeeded(self) -> None:
        if self._failures:
            self._log.warning(
                "%s: accepting again after %d failed accepts over %.1f s",
                self._what,
                self._failures,
                time.monotonic() - self._since,
            )
            self._failures = 0
        self.resume_at = 0.0


class RateLimitedLog:
    """One warning per ``interval_s`` for a repeating event, with the count of those not logged."""

    def __init__(self, logger: logging.Logger = log, interval_s: float = 10.0):
        self._log = logger
        self._interval = interval_s
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next = now + self._interval
        if suppressed:
            message += f" ({suppressed} more like it not logged)"
        self._log.warning(message, *args)


# ------------------------------------------------------------------ a call's context


class CallAborted(Exception):
    """Raised by CallContext.abort, as grpc's context.abort raises: the handler ends there."""


class CallContext:
    """What a handler uses of ``grpc.ServicerContext``, for a call read off a Unix socket.

    The deadline is counted from when the whole request was read (``arrived``), as gRPC counts the
    caller's timeout from when its call arrived; the codec sets it from the request
    (``set_timeout``). The call is inactive once the client closed its connection (it gave up at
    its deadline), as gRPC reports a cancelled call.
    """

    __slots__ = ("_sock", "arrived", "_deadline", "code", "message", "trailing_metadata", "marks")

    def __init__(self, sock: socket.socket, arrived: float):
        self._sock = sock
        self.arrived = arrived
        self._deadline: float | None = None
        self.code = grpc.StatusCode.OK
        self.message = ""
        self.trailing_metadata: tuple = ()
        self.marks: dict | None = None  # a codec's timing marks for this call (codec.answered)

    def set_timeout(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else self.arrived + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def is_active(self) -> bool:
        if self._deadline is not None and time.monotonic() > self._deadline:
            return False
        # While a call is served its client waits for the answer: EOF here means it hung up. (A poll
        # first: a Python socket with a timeout waits for data before any recv, MSG_DONTWAIT or not.)
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        if not poller.poll(0):
            return True
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str):
        self.code, self.message = code, details
        raise CallAborted(details)


# ------------------------------------------------------------------ the server


class _Conn:
    __slots__ = ("sock", "fd", "poller", "state", "last_active", "lingering")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN)
        self.state = _PARKED
        self.last_active = time.monotonic()
        self.lingering = False


class _Workers:
    """Threads that serve busy connections: as many as are busy at once, none left over when idle."""

    def __init__(self, serve, name: str, idle_exit_s: float = WORKER_IDLE_EXIT_S, thread_setup=None):
        self._serve = serve
        self._name = name
        self._thread_setup = thread_setup
        self._idle_exit_s = idle_exit_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # connections queued, not yet taken by a worker
        self._waiting = 0  # workers blocked in get()
        self.threads = 0
        self._stopped = False

    def submit(self, conn: _Conn) -> None:
        with self._lock:
            self._queue.put(conn)
            self._pending += 1
            spawn = self._pending > self._waiting
            if spawn:
                self.threads += 1
        if spawn:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for _ in range(self.threads):
                self._queue.put(None)

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        while True:
            with self._lock:
                if self._stopped:
                    self.threads -= 1
                    return
                self._waiting += 1
            try:
                conn = self._queue.get(timeout=self._idle_exit_s)
            except queue.Empty:
                with self._lock:
                    self._waiting -= 1
                    if self._pending > self._waiting:  # the other workers cannot take what is queued
                        continue
                    self.threads -= 1
                    return
            with self._lock:
                self._waiting -= 1
                if conn is None:
                    self.threads -= 1
                    return
                self._pending -= 1
            try:
                self._serve(conn)
            except Exception:
                log.exception("%s: serving a connection failed unexpectedly", self._name)


class UnixFrameServer:
    """Serves ``codec`` on the Unix socket ``path``; ``epoch`` goes in every connection's greeting.

    The constructor binds (OSError: path too long, directory refused, another live server on it)
    and starts nothing; ``start()`` starts the loop; ``stop()`` says GOODBYE to idle connections,
    lets calls in progress finish within its grace and removes the socket (only if it is still ours).
    """

    def __init__(
        self,
        path: str,
        codec: FrameCodec,
        epoch: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        linger_s: float = LINGER_S,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        memory_limit_bytes: int = MEMORY_LIMIT_BYTES,
        worker_setup=None,
    ):
        """``worker_setup``: called by each worker thread as it starts (the local RPC socket's pin it to
        the interpreter's core: server/interpreter_core.py)."""
        if max_connections < 1 or idle_timeout_s <= 0 or linger_s < 0 or frame_timeout_s <= 0:
            raise ValueError("connection cap, idle timeout and frame timeout must be positive")
        self.path = path
        self.codec = codec
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._linger_ms = int(linger_s * 1000)
        self._frame_timeout_s = frame_timeout_s
        self._hello = frames.encode_hello(codec.hello_magic, codec.version, epoch)
        self.budget = frames.MemoryBudget(memory_limit_bytes)
        self._what = f"{codec.name} socket {path}"
        self._listener = bind_unix_listener(path)
        self._identity = socket_identity(path)
        self._listener.setblocking(False)
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._conns: dict[int, _Conn] = {}
        self._closed = False
        self._backoff = AcceptBackoff(self._what)
        self._refusals = RateLimitedLog()
        self._workers = _Workers(self._serve, f"pegaflow-{codec.name}", thread_setup=worker_setup)
        self._loop = threading.Thread(target=self._run, name=f"pegaflow-{codec.name}-loop", daemon=True)
        # What happened to connections the server closed on its own (for tests and logs).
        self.evicted = self.idle_closed = self.refused = 0

    def start(self) -> None:
        self._loop.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    @property
    def worker_threads(self) -> int:
        return self._workers.threads

    def stop(self, grace_s: float = 2.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        if self._loop.is_alive():
            self._loop.join(timeout=5)
        self._listener.close()
        unlink_if_ours(self.path, self._identity)
        with self._lock:
            parked = [c for c in self._conns.values() if c.state == _PARKED]
            for conn in parked:
                self._forget(conn)
            lingering = [c for c in self._conns.values() if c.lingering]
        for conn in parked:
            self._say_goodbye(conn)
        for conn in lingering:  # wakes its worker, which says GOODBYE; a worker mid-call finishes first
            try:
                conn.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        end = time.monotonic() + grace_s
        with self._lock:
            while self._conns and time.monotonic() < end:
                self._drained.wait(max(end - time.monotonic(), 0.0))
            stuck = list(self._conns.values())
        for conn in stuck:  # a call still running past the grace: its client sees the connection die
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._workers.stop()
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        listener_fd = self._listener.fileno()
        sweep_every = min(1.0, self.idle_timeout_s / 4)
        next_sweep = time.monotonic() + sweep_every
        while not self._closed:
            now = time.monotonic()
            timeout = next_sweep - now
            if self._backoff.paused:
                timeout = min(timeout, self._backoff.resume_at - now)
            try:
                events = self._epoll.poll(max(timeout, 0.0))
            except InterruptedError:
                continue
            except OSError:
                if self._closed:
                    return
                raise
            if self._closed:
                return
            try:
                for fd, _ in events:
                    if fd == listener_fd:
                        self._accept()
                    elif fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    else:
                        self._readable(fd)
            except Exception:  # the loop must outlive anything one connection does to it
                log.exception("%s: serving loop error; going on", self._what)
            now = time.monotonic()
            if self._backoff.paused and now >= self._backoff.resume_at:
                self._backoff.resumed()
                self._epoll.modify(listener_fd, select.EPOLLIN)
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + sweep_every

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time: the loop must also serve parked connections
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    self._refusals.warning("%s: accept failed: %s", self._what, exc)
                    return
                # The listener stays readable while the backlog waits: stop watching it for a while.
                self._backoff.failed(exc)
                self._epoll.modify(self._listener.fileno(), 0)
                return
            self._backoff.succeeded()
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        # Non-blocking for good: reads and writes wait in poll only when they must (frames.recv_exact).
        sock.setblocking(False)
        evict = None
        admitted = False
        with self._lock:
            full = len(self._conns) >= self.max_connections
            if full:
                evict = self._least_recently_used()
                if evict is not None:
                    self._forget(evict)
                    self.evicted += 1
            if not full or evict is not None:
                try:
                    # Greet before anything can be read; a fresh socket's buffer always has room.
                    admitted = sock.send(self._hello, socket.MSG_DONTWAIT) == len(self._hello)
                except OSError:
                    admitted = False
                if admitted:
                    conn = _Conn(sock)
                    try:
                        self._epoll.register(conn.fd, _EPOLL_ARMED)
                        self._conns[conn.fd] = conn
                    except OSError:  # no memory for the epoll entry: as if refused
                        admitted = False
            else:
                self.refused += 1
        if evict is not None:
            self._say_goodbye(evict)
        if not admitted:
            if full and evict is None:
                self._refusals.warning(
                    "%s: %d connections, all busy; refusing a new one (it uses gRPC)",
                    self._what,
                    self.max_connections,
                )
            sock.close()

    def _least_recently_used(self) -> _Conn | None:
        """Under the lock: the parked connection idle the longest (None if every connection is busy)."""
        parked = [c for c in self._conns.values() if c.state == _PARKED]
        return min(parked, key=lambda c: c.last_active) if parked else None

    def _readable(self, fd: int) -> None:
        with self._lock:
            conn = self._conns.get(fd)
            if conn is None or conn.state != _PARKED:
                return
            conn.state = _WORKING
        self._workers.submit(conn)

    def _sweep(self, now: float) -> None:
        limit = now - self.idle_timeout_s
        with self._lock:
            idle = [c for c in self._conns.values() if c.state == _PARKED and c.last_active < limit]
            for conn in idle:
                self._forget(conn)
            self.idle_closed += len(idle)
        for conn in idle:
            self._say_goodbye(conn)

    # ------------------------------------------------------------------ connection states

    def _forget(self, conn: _Conn) -> None:
        """Under the lock: the connection leaves the server (its socket is closed by the caller)."""
        conn.state = _CLOSED
        if self._conns.pop(conn.fd, None) is not None:
            try:
                self._epoll.unregister(conn.fd)
            except (OSError, ValueError):
                pass
        self._drained.notify_all()

    @staticmethod
    def _say_goodbye(conn: _Conn) -> None:
        """GOODBYE and close: nothing more is read from this connection, so nothing it sent was run."""
        try:
            conn.sock.send(frames.GOODBYE, socket.MSG_DONTWAIT)
        except OSError:
            pass
        conn.sock.close()

    def _close(self, conn: _Conn) -> None:
        with self._lock:
            self._forget(conn)
        conn.sock.close()

    def _park(self, conn: _Conn) -> None:
        """Back to the loop's epoll set (armed for one event), or GOODBYE when the server is stopping."""
        with self._lock:
            if not self._closed and conn.state == _WORKING:
                conn.state = _PARKED
                conn.last_active = time.monotonic()
                try:
                    self._epoll.modify(conn.fd, _EPOLL_ARMED)
                    return
                except OSError:
                    pass
            self._forget(conn)
        self._say_goodbye(conn)

    # ------------------------------------------------------------------ a worker's connection

    def _serve(self, conn: _Conn) -> None:
        """On a worker: serve requests on ``conn`` until it is quiet for the linger time, then park it."""
        try:
            while True:
                if self._closed:
                    with self._lock:
                        self._forget(conn)
                    self._say_goodbye(conn)
                    return
                if not self._serve_one(conn):
                    self._close(conn)
                    return
                if self._linger_ms:
                    conn.lingering = True
                    ready = conn.poller.poll(self._linger_ms)
                    conn.lingering = False
                    if ready:
                        continue
                self._park(conn)
                return
        except Exception:
            log.exception("%s: a connection failed unexpectedly; closing it", self._what)
            self._close(conn)

    def _serve_one(self, conn: _Conn) -> bool:
        """One request: False when the connection is to be closed (EOF, a bad or stalled frame)."""
        sock = conn.sock
        codec = self.codec
        deadline = time.monotonic() + self._frame_timeout_s
        try:
            body = frames.read_frame(sock, codec.max_frame_bytes, deadline, self.budget)
        except frames.FrameTooLarge as exc:  # its body is never read
            return self._refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except frames.MemoryCapExceeded as exc:
            return self._refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TimeoutError:
            self._refusals.warning("%s: closing a connection whose frame stalled", self._what)
            return False
        except OSError:
            return False  # the client went away (or stop() hung up on it)
        if body is None:
            return False
        try:
            if not body:
                return self._refuse(sock, grpc.StatusCode.UNIMPLEMENTED, "an empty frame is no request")
            context = CallContext(sock, time.monotonic())
            try:
                answer = codec.handle(body, context)
            except frames.FrameError as exc:
                return self._refuse(sock, grpc.StatusCode.UNIMPLEMENTED, str(exc))
        finally:
            self.budget.release(len(body))
        if answer is not None:
            try:
                frames.send_all(sock, answer, time.monotonic() + SEND_TIMEOUT_S)
            except OSError:
                return False
            if context.marks is not None:
                codec.answered(context)
        return True

    def _refuse(self, sock: socket.socket, code: grpc.StatusCode, reason: str) -> bool:
        self._refusals.warning("%s: refusing a frame and closing its connection: %s", self._what, reason)
        try:
            frames.send_all(sock, self.codec.refusal(code, reason), time.monotonic() + 1.0)
        except OSError:
            pass
        return False
