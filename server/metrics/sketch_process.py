"""The lookup sketches (lookup_sketches.py) in a child process of the server: same interface.

Why a process. The sketches' per-key Python (an XXH3 call and HLL registers per key, the MRC's
sampled reuse distances) ran on the metrics feeder thread, in the interpreter that serves the
requests. Profiled with py-spy on the 2-vCPU dev VM (a closed loop of 64-hash queries with a
lease over the local socket), the feeder took 52 % of a core and the request thread waited for the
GIL behind its slices: query p99 4.4 ms with the feeder, 0.6 ms with it stubbed out (p50 280 vs
272 us). Here the server's feeder only packs each lookup's hashes into one frame (a struct header
and one join) and writes it to a socket; the child does the rest on its own interpreter, at a
lower CPU priority (nice +10), so on a small host the request path keeps the cores first.

Protocol, over one SOCK_STREAM socketpair, in the framing of the local sockets
(common/wire/frames.py: a u32 length, then the body); parent -> child bodies are ``u8 kind | payload``:

* ``FEED``: lookup records, each ``u32 ns_index | u64 block_bytes | u32 count | u16 hash_len``
  then ``count * hash_len`` bytes; ``hash_len = 0xFFFF`` means varying lengths, a ``u16`` per hash
  first. No answer.
* ``SNAPSHOT``: no payload; the child answers with a frame of the snapshot as JSON. Frames are
  handled in order, so a snapshot counts every record fed before it (tests and scrapes rely on it).

Child -> parent, unasked, once: ``READY`` (one byte), when its sketches are built. Until then the
feeder does not write to the socket: a child starting at nice +10 on a busy host can take seconds
to import, and a feeder waiting on that would be timed out like a stalled child (CI saw a fresh
child killed that way, then a third one started). Lookups meanwhile wait in a bounded backlog
(``BACKLOG_BYTES``, then dropped and counted) and go out in order once the child is ready; a child
that is not ready in ``start_timeout_s`` is killed and started again.

Back-pressure: a ready child that is behind makes the feeder thread wait in its send (without the GIL);
the lookups waiting meanwhile queue in ServerMetrics' bounded deque, whose overflow is counted
(``pegaflow_metrics_dropped_lookups``), as when the sketches ran on the feeder itself.

Failure is contained: a child that dies, takes in nothing for ``io_timeout_s`` or answers garbage is
killed and started again (at most once per ``restart_backoff_s``; its windows start empty,
``restarts`` counts it); lookups that cannot be handed over meanwhile are dropped and counted, and a
snapshot that cannot be had is None (the collectors then export no sketch series). The engine never
waits on it: only the feeder thread and scrapes touch the socket. The child exits when the socket
closes, and on the parent's death (PR_SET_PDEATHSIG).

A snapshot asked for with a ``deadline`` (GetStats, a scrape) is None once the deadline passes,
whatever the child is doing: a healthy child that is behind (seconds of backlog at nice +10 on a
busy host) is waited for up to ``start_timeout_s``, longer than any caller's deadline (CI saw a
10 s GetStats time out). The child is not blamed for the caller's hurry: its answer, owed to a
snapshot that stopped waiting, is read and dropped before the next snapshot asks again.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Sequence

from pegaflow.common.deadlines import acquire_by
from pegaflow.common.wire import frames
from pegaflow.server.metrics.lookup_sketches import LookupRecord, LookupSketches, SketchSnapshot

log = logging.getLogger(__name__)

FEED, SNAPSHOT, READY = 1, 2, 3
_RECORD = struct.Struct("<IQIH")
VARYING = 0xFFFF
MAX_FRAME_BYTES = 64 << 20
IO_TIMEOUT_S = 5.0
START_TIMEOUT_S = 30.0
RESTART_BACKOFF_S = 5.0
CHILD_NICE = 10
SEND_BUFFER_BYTES = 4 << 20
# Lookups held while a child starts: ~500 lookups of 64 32-byte hashes (~2 KiB a frame), about a
# second of a busy server's, and what a ready child eats in well under io_timeout_s, so handing the
# backlog over never looks like a stall.
BACKLOG_BYTES = 1 << 20


def encode_records(records: Sequence[LookupRecord]) -> bytes:
    parts: list[bytes] = []
    for ns_index, block_bytes, hashes in records:
        lengths = set(map(len, hashes))
        if len(lengths) == 1 and (size := lengths.pop()) < VARYING:
            parts.append(_RECORD.pack(ns_index, block_bytes, len(hashes), size))
        else:
            parts.append(_RECORD.pack(ns_index, block_bytes, len(hashes), VARYING))
            parts.append(struct.pack(f"<{len(hashes)}H", *map(len, hashes)))
        parts.append(b"".join(hashes))
    return frames.encode_frame(bytes((FEED,)) + b"".join(parts))


def decode_records(body: memoryview) -> list[LookupRecord]:
    """ValueError on a malformed body."""
    out: list[LookupRecord] = []
    pos, end = 0, len(body)
    while pos < end:
        if end - pos < _RECORD.size:
            raise ValueError("truncated lookup record")
        ns_index, block_bytes, count, size = _RECORD.unpack_from(body, pos)
        pos += _RECORD.size
        # Bounds first: a count the body cannot hold is refused before anything is sized from it.
        if count * (2 if size == VARYING else size) > end - pos:
            raise ValueError("truncated lookup record")
        if size == VARYING:
            lengths = struct.unpack_from(f"<{count}H", body, pos)
            pos += 2 * count
        else:
            lengths = (size,) * count
        hashes = []
        for n in lengths:
            if pos + n > end:
                raise ValueError("truncated lookup record")
            hashes.append(bytes(body[pos : pos + n]))
            pos += n
        out.append(LookupRecord(ns_index, block_bytes, hashes))
    return out


class SketchProcess:
    """LookupSketches' interface (add, snapshot, close), computed in a child process."""

    def __init__(
        self,
        windows: dict[str, float],
        capacity_bytes: int,
        mrc_options: dict | None = None,
        *,
        io_timeout_s: float = IO_TIMEOUT_S,
        restart_backoff_s: float = RESTART_BACKOFF_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.windows = dict(windows)
        self._config = {"windows": self.windows, "capacity_bytes": capacity_bytes, "mrc": mrc_options or {}}
        self.io_timeout_s = io_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.dropped_records = 0
        self._lock = threading.Lock()  # the socket: one frame (or one request + answer) at a time
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._next_start = 0.0
        self._started_at = 0.0
        self._ready = False  # the child said READY: frames go to the socket, not the backlog
        # (frame, records in it) while the child starts
        self._backlog: collections.deque[tuple[bytes, int]] = collections.deque()
        self._backlog_bytes = 0
        self._closed = False
        self._owed = 0  # snapshot answers the child still owes to callers that stopped waiting
        self._send_room = 0
        self._start_locked()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ the child's life

    def _start_locked(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The child imports pegaflow the way this process did, whatever put it on sys.path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pegaflow.server.metrics.sketch_process", "--fd", str(child.fileno()),
                 "--config", json.dumps(self._config)],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as exc:
            parent.close()
            log.warning("lookup sketches: cannot start their process: %s", exc)
            self._next_start = time.monotonic() + self.restart_backoff_s
            return
        finally:
            child.close()
        parent.settimeout(0)  # non-blocking: frames.send_all / recv_exact wait with their own deadlines
        # Room for bursts while the child catches up (the kernel caps it at net.core.wmem_max).
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        # What the kernel granted, in its own accounting (the unread bytes below count the same way).
        self._send_room = parent.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        self._sock = parent
        self._ready = False
        self._owed = 0
        self._started_at = time.monotonic()
        self._next_start = self._started_at + self.restart_backoff_s

    def _fail_locked(self, why: str) -> None:
        log.warning("lookup sketches' process %s: %s; starting another", self.pid, why)
        self.dropped_records += sum(n for _, n in self._backlog)
        self._backlog, self._backlog_bytes, self._ready = collections.deque(), 0, False
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            self._proc.kill()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None

    def _ready_locked(self) -> bool:
        if self._closed:
            return False
        if self._sock is not None and self._proc is not None and self._proc.poll() is not None:
            self._fail_locked(f"exited with {self._proc.returncode}")
        if self._sock is None and time.monotonic() >= self._next_start:
            self.restarts += 1
            self._start_locked()
        return self._sock is not None

    def _await_ready_locked(self, timeout_s: float) -> bool:
        """Whether the child is ready, waiting up to ``timeout_s`` for its READY; hands the backlog
        over when it comes. OSError / ValueError (for _fail_locked) on garbage, EOF, a feed that
        times out, or a child not ready ``start_timeout_s`` after it was started."""
        if self._ready:
            return True
        give_up = self._started_at + self.start_timeout_s
        wait = max(0.0, min(timeout_s, give_up - time.monotonic()))
        if not frames.readable(self._sock, wait):
            if time.monotonic() >= give_up:
                raise TimeoutError(f"not ready {self.start_timeout_s:.0f} s after its start")
            return False
        body = frames.read_frame(self._sock, 16, time.monotonic() + self.io_timeout_s)
        if body is None:
            raise ConnectionError("closed before it was ready")
        if body != bytes((READY,)):
            raise frames.FrameError(f"expected READY, got {bytes(body[:16])!r}")
        self._ready = True
        while self._backlog:  # in order; what is not handed over is counted by _fail_locked
            frame, n = self._backlog[0]
            frames.send_all(self._sock, frame, time.monotonic() + self.io_timeout_s)
            self._backlog.popleft()
            self._backlog_bytes -= len(frame)
        return True

    def _unread_bytes(self) -> int:
        """Bytes written to the child and not yet read by it (SIOCOUTQ; Unix sockets have it)."""
        out = fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        return struct.unpack("i", out)[0]

    def _read_answer_locked(self, deadline: float | None = None) -> bytes | None:
        """The child's next answer, which comes after every frame fed before it: a child that is
        behind but reading (a busy host gives a nice +10 process little CPU) is waited for, up to
        ``start_timeout_s`` in all; one that reads nothing for ``io_timeout_s`` is stalled
        (TimeoutError). ``deadline``: the caller's; past it, None (the answer is still owed)."""
        now = time.monotonic()
        give_up, progress_at = now + self.start_timeout_s, now
        unread = self._unread_bytes()
        while True:
            wait = progress_at + self.io_timeout_s - now  # until the child counts as stalled
            if deadline is not None:
                wait = min(wait, deadline - now)
            if frames.readable(self._sock, max(wait, 0.0)):
                body = frames.read_frame(self._sock, MAX_FRAME_BYTES, time.monotonic() + self.io_timeout_s)
                if body is None:
                    raise ConnectionError("closed")
                return body
            now = time.monotonic()
            now_unread = self._unread_bytes()
            if now_unread < unread:
                unread, progress_at = now_unread, now
            elif now - progress_at >= self.io_timeout_s:
                raise TimeoutError(f"no answer, {now_unread} bytes unread")
            if now >= give_up:
                raise TimeoutError(f"no answer {self.start_timeout_s:.0f} s after it was asked")
            if deadline is not None and now >= deadline:
                return None

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, default the start timeout) until a child is ready; False if none is."""
        deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
        while True:
            with self._lock:
                if self._ready_locked():
                    try:
                        if self._await_ready_locked(min(0.1, max(0.0, deadline - time.monotonic()))):
                            return True
                    except (OSError, ValueError) as exc:
                        self._fail_locked(f"no start ({exc!r})")
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # ------------------------------------------------------------------ interface

    def add(self, records: Sequence[LookupRecord], deadline: float | None = None) -> None:
        """Hands ``records`` to the child (or its start's backlog). ``deadline``: a caller that cannot
        wait (a GetStats flushing the pending lookups) drops and counts the records rather than wait
        for the socket's lock past it or for room in the socket of a child that is behind."""
        if not records:
            return
        frame = encode_records(records)
        if not acquire_by(self._lock, deadline):
            self.dropped_records += len(records)
            return
        try:
            if not self._ready_locked():
                self.dropped_records += len(records)
                return
            try:
                if not self._await_ready_locked(0.0):
                    if self._backlog_bytes + len(frame) <= BACKLOG_BYTES:
                        self._backlog.append((frame, len(records)))
                        self._backlog_bytes += len(frame)
                    else:
                        self.dropped_records += len(records)
                    return
                if deadline is not None and self._unread_bytes() + len(frame) > self._send_room:
                    self.dropped_records += len(records)  # the send would wait for the child
                    return
                frames.send_all(self._sock, frame, time.monotonic() + self.io_timeout_s)
            except (OSError, ValueError) as exc:  # a timeout too: a partial frame leaves the stream unusable
                self.dropped_records += len(records)
                self._fail_locked(f"feeding failed ({exc!r})")
        finally:
            self._lock.release()

    def snapshot(self, deadline: float | None = None) -> SketchSnapshot | None:
        """The sketches now (every record fed before counted); None while there is no ready child,
        or once ``deadline`` (``time.monotonic``) passes: the socket's lock, the child's start and
        its answer are each waited for only until then."""
        if not acquire_by(self._lock, deadline):
            return None  # the feeder is handing a frame to a child that is behind
        try:
            if not self._ready_locked():
                return None
            try:
                wait = (
                    self.io_timeout_s
                    if deadline is None
                    else min(self.io_timeout_s, deadline - time.monotonic())
                )
                if not self._await_ready_locked(max(wait, 0.0)):
                    return None  # still starting: no sketch series this scrape
                while self._owed:  # answers to snapshots that stopped waiting: stale, dropped
                    if self._read_answer_locked(deadline) is None:
                        return None
                    self._owed -= 1
                if deadline is not None and self._unread_bytes() >= self._send_room:
                    return None  # the socket is full: the send would wait for a child that is behind
                frames.send_all(
                    self._sock, frames.encode_frame(bytes((SNAPSHOT,))), time.monotonic() + self.io_timeout_s
                )
                self._owed += 1
                body = self._read_answer_locked(deadline)
                if body is None:
                    return None  # the child is behind, not stalled: its answer is read next time
                self._owed -= 1
                return SketchSnapshot.from_json(json.loads(body))
            except (OSError, ValueError, KeyError, TypeError) as exc:  # FrameError is a ValueError
                self._fail_locked(f"no snapshot ({exc!r})")
                return None
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()  # the child sees EOF and exits
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None


# ---------------------------------------------------------------------- the child


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(sock: socket.socket, sketches: LookupSketches) -> None:
    """The child's loop: frames in order until EOF. A malformed frame ends it (the parent restarts)."""
    while True:
        body = frames.read_frame(sock, MAX_FRAME_BYTES)
        if body is None:
            return
        kind, payload = (body[0] if body else 0), memoryview(body)[1:]
        if kind == FEED:
            sketches.add(decode_records(payload))
        elif kind == SNAPSHOT:
            sock.sendall(frames.encode_frame(json.dumps(sketches.snapshot().to_json()).encode()))
        else:
            raise ValueError(f"unknown frame kind {kind}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="pegaflow-server's lookup sketches (started by the server)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the server's to handle
    try:
        os.nice(CHILD_NICE)
    except OSError:
        pass
    config = json.loads(args.config)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    sketches = LookupSketches(config["windows"], config["capacity_bytes"], config["mrc"])
    try:
        sock.sendall(frames.encode_frame(bytes((READY,))))
        serve(sock, sketches)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the server closed its end first: a normal stop
    except (OSError, ValueError, struct.error) as exc:  # FrameError is a ValueError
        print(f"pegaflow lookup sketches: {exc!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
