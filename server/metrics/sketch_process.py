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
snapshot that cannot be had is, for a caller with a deadline, a recent one (below), else None (the
collectors then export no sketch series). The engine never waits on it: only the feeder thread
and scrapes touch the socket. The child exits when the socket closes, and on the parent's death
(PR_SET_PDEATHSIG).

A snapshot asked for with a ``deadline`` (GetStats, a scrape) waits for a fresh answer only
``FRESH_WAIT_S`` (never past the deadline) while the last snapshot the child delivered can stand
in for it (asked for at most ``MAX_STAND_IN_AGE_S`` ago), then answers with that one, marked with
its age (``AgedSnapshot.age_s``, exported as ``pegaflow_lookup_sketch_snapshot_age_seconds``). A
healthy child that is behind (seconds of backlog at nice +10 on a busy host; CI saw a 10 s GetStats
time out when the server waited for it) thus costs a caller half a second and the newest numbers,
not its deadline and the ceiling. With nothing to stand in (no snapshot yet: a child still
starting; or only an old one) the fresh one is waited for until the deadline, then None: an early
answer would have nothing to say. The child is not blamed for the caller's hurry: the answer it
still owes is read before the next snapshot asks again (no second ask while one is owed), and
becomes the last snapshot, since it counts more than the one before it. Answers come in the order
they were asked for, so each is paired with its own ask (``_owed``, the ask times, oldest first),
and its age is counted from that ask: it counts every lookup fed before it, and an answer read long
after it was written is not taken for a fresh one. Without a deadline (tests, callers that need
every record counted) a snapshot waits as long as the child makes progress, as before, and is
fresh or None.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
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
from pegaflow.server import interpreter_core
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
# How long a caller with a deadline (GetStats, a scrape) waits for a fresh snapshot while an earlier
# one can stand in. A child that keeps up answers in milliseconds (its snapshot comes after the
# frames queued before the ask: ~3.4 us a key, a few ms of JSON); at nice +10 beside a busy process
# on each core it gets about a tenth of a core, so tens of milliseconds, still well inside this. A
# child that misses it is seconds behind, and waiting longer buys a slower answer, not a fresher
# one. Half a second leaves a 2 s GetStats client most of its time, and a scrape's two asks (the
# windows, the miss-ratio families) far inside Prometheus' default 10 s timeout.
FRESH_WAIT_S = 0.5
# The oldest snapshot (counted from its ask) that stands in for a fresh one. Within it, what the
# stand-in misses is at most this much of the lookups: 3 % of the shortest window (15 m) once it is
# full. An older one may describe another phase of the load (a benchmark's GetStats before an arm of
# minutes, then after it), and a GetStats caller cannot see the age (the response has no field for
# it): without a stand-in the fresh snapshot is waited for until the deadline, as a first one is.
MAX_STAND_IN_AGE_S = 30.0


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


@dataclasses.dataclass(frozen=True)
class AgedSnapshot(SketchSnapshot):
    """A snapshot of the child's, with ``age_s``: seconds since it was asked for (it counts every
    lookup fed before then). Milliseconds for a fresh one; more for the last one standing in."""

    age_s: float = 0.0


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
        fresh_wait_s: float = FRESH_WAIT_S,
        max_stand_in_age_s: float = MAX_STAND_IN_AGE_S,
    ):
        self.windows = dict(windows)
        self._config = {"windows": self.windows, "capacity_bytes": capacity_bytes, "mrc": mrc_options or {}}
        self.io_timeout_s = io_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.start_timeout_s = start_timeout_s
        self.fresh_wait_s = fresh_wait_s
        self.max_stand_in_age_s = max_stand_in_age_s
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
        # When each snapshot the child still owes was asked for, oldest first (answers come in this
        # order): asks whose callers stopped waiting, read by the next snapshot before it asks.
        self._owed: collections.deque[float] = collections.deque()
        # (the newest snapshot read, when it was asked for): replaced whole under the lock, read
        # without it (a caller the feeder keeps from the lock still answers with it). Kept across a
        # restart: a dead child's numbers, with their age, say more than none.
        self._last: tuple[AgedSnapshot, float] | None = None
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
        env = interpreter_core.child_environment(env)
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
        self._owed.clear()  # a new stream: the old child's answers are gone
        self._started_at = time.monotonic()
        self._next_start = self._started_at + self.restart_backoff_s

    def _fail_locked(self, why: str) -> None:
        log.warning("lookup sketches' process %s: %s; starting another", self.pid, why)
        self.dropped_records += sum(n for _, n in self._backlog)
        self._backlog, self._backlog_bytes, self._ready = collections.deque(), 0, False
        self._owed.clear()
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

    def snapshot(self, deadline: float | None = None) -> AgedSnapshot | None:
        """The sketches now (every record fed before counted). With a ``deadline``
        (``time.monotonic``): while the last snapshot read is at most ``max_stand_in_age_s`` old, a
        fresh one is waited for ``fresh_wait_s`` at most (the socket's lock, the child's start and
        its answer), then that last one stands in, with its age; without such a one, the fresh one is
        waited for until the deadline, then None. Never past the deadline. Without a deadline, only a
        fresh snapshot, or None while there is no ready child or it fails."""
        called_at = time.monotonic()
        fresh = self._fresh_snapshot(deadline, called_at)
        if fresh is not None or deadline is None:
            return fresh
        return self._stand_in(called_at)

    def last_snapshot(self) -> AgedSnapshot | None:
        """The newest snapshot read from a child, aged to now; None if none ever was."""
        last = self._last  # one read: a consistent pair, lock or not
        if last is None:
            return None
        snap, asked_at = last
        return dataclasses.replace(snap, age_s=max(0.0, time.monotonic() - asked_at))

    def _stand_in(self, called_at: float) -> AgedSnapshot | None:
        """The last snapshot if it may stand in for a fresh one asked for at ``called_at`` (its age
        judged then: one that was good enough when the wait began still is at its end)."""
        last = self._last
        if last is None or called_at - last[1] > self.max_stand_in_age_s:
            return None
        return self.last_snapshot()

    def _wait_until(self, deadline: float | None, called_at: float) -> float | None:
        """Until when a fresh snapshot is waited for: briefly while a stand-in is at hand."""
        if deadline is None or self._stand_in(called_at) is None:
            return deadline
        return min(deadline, called_at + self.fresh_wait_s)

    def _fresh_snapshot(self, deadline: float | None, called_at: float) -> AgedSnapshot | None:
        wait_until = self._wait_until(deadline, called_at)
        if not acquire_by(self._lock, wait_until):
            return None  # the feeder is handing a frame to a child that is behind
        try:
            if not self._ready_locked():
                return None
            try:
                wait = (
                    self.io_timeout_s
                    if wait_until is None
                    else min(self.io_timeout_s, wait_until - time.monotonic())
                )
                if not self._await_ready_locked(max(wait, 0.0)):
                    return None  # still starting
                while self._owed:  # answers to asks that stopped waiting: older than the next one
                    if not self._take_answer_locked(wait_until):
                        return None  # still behind: no second ask while one is owed
                wait_until = self._wait_until(deadline, called_at)  # what was just read may stand in
                if deadline is not None and self._unread_bytes() >= self._send_room:
                    return None  # the socket is full: the send would wait for a child that is behind
                asked_at = time.monotonic()
                frames.send_all(
                    self._sock, frames.encode_frame(bytes((SNAPSHOT,))), time.monotonic() + self.io_timeout_s
                )
                self._owed.append(asked_at)
                if not self._take_answer_locked(wait_until):
                    return None  # the child is behind, not stalled: its answer is read next time
                return self.last_snapshot()
            except (OSError, ValueError, KeyError, TypeError) as exc:  # FrameError is a ValueError
                self._fail_locked(f"no snapshot ({exc!r})")
                return None
        finally:
            self._lock.release()

    def _take_answer_locked(self, deadline: float | None) -> bool:
        """Reads the answer to the oldest owed ask into ``_last``; False if ``deadline`` passed first
        (still owed). Raises as _read_answer_locked, or on an answer that is not a snapshot."""
        body = self._read_answer_locked(deadline)
        if body is None:
            return False
        asked_at = self._owed.popleft()
        self._last = (AgedSnapshot.from_json(json.loads(body)), asked_at)
        return True

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
    interpreter_core.release_child()  # the server's CPUs, not a pinned thread's (a restart's)
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
