"""The TCP transport's requester end: parallel streams into caller-given pool slots.

``TcpTransport(streams=4).connect(peer, deadline)`` shakes hands over gRPC (the peer names its
data port), then opens ``streams`` TCP connections to it. A fetch spreads its blocks over the
streams round-robin (block i on stream i mod n), so the blocks that arrive first are the leading
ones on every stream and a fetch cut short by its deadline still leaves the longest prefix.

Each stream has one worker thread that owns its socket and runs the stream's jobs in order: it
sends one READ frame (common/wire/peer_frames.py) and reads the answer straight into the slots:
the 56-byte header into a small buffer, the block's bytes with one
``recv_into(slot, MSG_WAITALL)`` (no bounce buffer; the GIL is released while the kernel copies),
then XXH3-64 over the slot (GIL released too) while the kernel buffers the next block. The
checksum must match the frame's, and the frame's must match the one OpenTransfer announced, if
any: a mismatch is a CHECKSUM failure of that block, never an OK.

The guarantee of base.py, that no byte lands in a slot after the fetch's future resolved, holds
by construction: only a stream's worker writes into slots, synchronously, and a fetch resolves
only once each of its jobs is finished by its worker (it returned from its last ``recv_into``)
or was taken off a queue before any worker claimed it. Each receive is bounded by the fetch's
deadline (SO_RCVTIMEO, sockets.py), so a dead or partitioned peer ends the fetch at its deadline,
or at once on RST. A stream that timed out, broke or received a malformed frame is closed (its
framing is lost) and reconnected by the next job; the link's other streams and other links go on.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import heapq
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from pegaflow.common.auth import ClientAuth
from pegaflow.common.wire import peer_frames as frames
from pegaflow.common.wire.checksum import checksum
from pegaflow.common.wire.frames import readable
from pegaflow.server.interpreter_core import release_thread
from pegaflow.server.peers import sockets
from pegaflow.server.peers.base import (
    BlockStatus,
    FetchResult,
    LinkClosed,
    PeerAddress,
    PeerError,
    PeerLink,
    PeerRefused,
    PeerUnavailable,
    RemoteExtent,
    RemoteTransfer,
    Transport,
)
from pegaflow.server.peers.control import ControlClient
from pegaflow.server.peers.metrics import TransportCounters, TransportStats

log = logging.getLogger(__name__)

DEFAULT_STREAMS = 4
DEFAULT_MAX_FETCH_BYTES = 64 << 30

# What a peer's ERROR frame means for the blocks it was about.
_CAUSE_OF = {
    frames.PeerStatus.UNKNOWN_TRANSFER: BlockStatus.REFUSED,
    frames.PeerStatus.BAD_REQUEST: BlockStatus.REFUSED,
    frames.PeerStatus.PROTOCOL: BlockStatus.PROTOCOL,
    frames.PeerStatus.DEADLINE: BlockStatus.TIMEOUT,
    frames.PeerStatus.BUSY: BlockStatus.REFUSED,
    frames.PeerStatus.INTERNAL: BlockStatus.REFUSED,
    frames.PeerStatus.SHUTTING_DOWN: BlockStatus.PEER_GONE,
}


def host_of(address: str) -> str:
    """``host:port`` / ``[v6]:port`` -> host."""
    host, _, _ = address.rpartition(":")
    return host[1:-1] if host.startswith("[") else host


# ------------------------------------------------------------------ one fetch


class _JobState(enum.Enum):
    QUEUED = 0
    RUNNING = 1
    DONE = 2


class _Job:
    """The blocks of one fetch that one stream moves with one READ."""

    __slots__ = ("fetch", "transfer_id", "positions", "extents", "views", "state")

    def __init__(self, fetch: _Fetch, transfer_id: bytes):
        self.fetch = fetch
        self.transfer_id = transfer_id
        self.positions: list[int] = []  # indices into the fetch's extents
        self.extents: list[RemoteExtent] = []
        self.views: list[memoryview] = []
        self.state = _JobState.QUEUED


class _Fetch:
    def __init__(self, lengths: list[int], deadline: float, counters: TransportCounters):
        self.lengths = lengths
        self.deadline = deadline
        self.started = time.monotonic()
        self.statuses: list[BlockStatus | None] = [None] * len(lengths)
        self.jobs: list[_Job] = []
        self.future: Future[FetchResult] = Future()
        self.error = ""
        self._pending = 0
        self._resolved = False
        self._lock = threading.Lock()
        self._counters = counters

    def add_job(self, job: _Job) -> None:
        self.jobs.append(job)
        self._pending += 1

    def claim(self, job: _Job) -> bool:
        """The worker takes a queued job; False when it was cancelled meanwhile."""
        with self._lock:
            if job.state is not _JobState.QUEUED:
                return False
            job.state = _JobState.RUNNING
            return True

    def finish(self, job: _Job, statuses: list[BlockStatus], error: str = "") -> None:
        """Called by the worker once it touches none of the job's slots any more."""
        with self._lock:
            if job.state is _JobState.DONE:
                return
            self._record(job, statuses, error)
        self._maybe_resolve()

    def cancel_queued(self, status: BlockStatus, error: str) -> None:
        """Ends every job no worker has claimed (they have not touched their slots)."""
        with self._lock:
            for job in self.jobs:
                if job.state is _JobState.QUEUED:
                    self._record(job, [status] * len(job.positions), error)
        self._maybe_resolve()

    def _record(self, job: _Job, statuses: list[BlockStatus], error: str) -> None:
        job.state = _JobState.DONE
        for pos, status in zip(job.positions, statuses, strict=True):
            self.statuses[pos] = status
        if error and not self.error:
            self.error = error
        self._pending -= 1

    def _maybe_resolve(self) -> None:
        with self._lock:
            if self._pending or self._resolved:
                return
            self._resolved = True
            statuses = [s if s is not None else BlockStatus.CANCELLED for s in self.statuses]
        seconds = time.monotonic() - self.started
        ok_bytes = sum(n for n, s in zip(self.lengths, statuses, strict=True) if s is BlockStatus.OK)
        self._counters.fetch_done(statuses, self.lengths, seconds)
        self.future.set_result(FetchResult(statuses, ok_bytes, seconds, self.error))


class _DeadlineWatch:
    """One thread per transport: at a fetch's deadline, ends its jobs still queued behind another
    fetch on a busy stream (running jobs end by themselves: their receives time out)."""

    def __init__(self):
        self._heap: list[tuple[float, int, _Fetch]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, fetch: _Fetch) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="peer-tcp-deadlines", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (fetch.deadline, next(self._seq), fetch))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        release_thread()  # perhaps started from a pinned request thread (interpreter_core.py)
        while True:
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    while self._heap and self._heap[0][2].future.done():
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                if self._closed:
                    return
                _, _, fetch = heapq.heappop(self._heap)
            fetch.cancel_queued(BlockStatus.TIMEOUT, "the fetch's deadline passed before its stream was free")


# ------------------------------------------------------------------ one stream


class _Stream:
    def __init__(self, link: TcpPeerLink, index: int):
        self.link = link
        self.index = index
        self._sock: socket.socket | None = None  # read and written by the worker only
        self._sock_lock = threading.Lock()  # guards replacing/closing it against interrupt()
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._header = bytearray(frames.HEADER_BYTES)
        self._thread = threading.Thread(target=self._run, name=f"peer-tcp-{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def submit(self, job: _Job) -> None:
        with self._cond:
            if not self._closed:
                self._queue.append(job)
                self._cond.notify()
                return
        job.fetch.cancel_queued(BlockStatus.CANCELLED, "the peer link is closed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify()
        for job in queued:
            job.fetch.cancel_queued(BlockStatus.CANCELLED, "the peer link was closed")
        with self._sock_lock:
            sockets.interrupt(self._sock)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._drop()

    # -------------------------------------------------------------- socket

    def connect(self, deadline: float) -> socket.socket:
        """The stream's connection, (re)opened if needed. Raises PeerError."""
        if self._sock is not None:
            return self._sock
        host, port = self.link.data_address
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerUnavailable(BlockStatus.TIMEOUT, "deadline passed before the stream could connect")
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except TimeoutError:
            raise PeerUnavailable(BlockStatus.TIMEOUT, f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise PeerUnavailable(BlockStatus.PEER_GONE, f"cannot connect to {host}:{port}: {exc}") from None
        sock.settimeout(None)  # blocking; deadlines go through SO_RCVTIMEO / SO_SNDTIMEO
        sockets.tune(sock)
        with self._sock_lock:
            if self._closed:
                sock.close()
                raise LinkClosed()
            self._sock = sock
        self.link.counters.add("streams_up")
        return sock

    def _drop(self) -> None:
        with self._sock_lock:
            sock, self._sock = self._sock, None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        if sock is not None:
            self.link.counters.add("streams_down")

    # -------------------------------------------------------------- worker

    def _run(self) -> None:
        release_thread()  # perhaps started from a pinned request thread (interpreter_core.py)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            if job.fetch.claim(job):
                try:
                    self._run_job(job)
                except BaseException as exc:  # a bug: still resolve, never leave a fetch hanging
                    log.exception("peer stream %d failed", self.index)
                    self._drop()
                    job.fetch.finish(
                        job, [BlockStatus.PROTOCOL] * len(job.positions), f"internal error: {exc!r}"
                    )

    def _run_job(self, job: _Job) -> None:
        n = len(job.positions)
        statuses: list[BlockStatus] = []
        fetch = job.fetch
        deadline = fetch.deadline
        where = "{}:{}".format(*self.link.data_address)

        def fail_rest(status: BlockStatus, error: str, drop: bool = True) -> None:
            if drop:
                self._drop()
            if self._closed:
                status, error = BlockStatus.CANCELLED, "the peer link was closed"
            fetch.finish(job, statuses + [status] * (n - len(statuses)), error)

        if time.monotonic() >= deadline:
            return fail_rest(
                BlockStatus.TIMEOUT, "the fetch's deadline passed before its stream was free", False
            )
        try:
            sock = self._send_read(job, deadline)
            header = memoryview(self._header)
            for k, (extent, view) in enumerate(zip(job.extents, job.views, strict=True)):
                if k > 0:  # the first header was read by _send_read
                    sockets.recv_into_exact(sock, header, deadline)
                head = frames.decode_header(header)
                if head.type is frames.FrameType.ERROR:
                    status, message = self._read_error(sock, head, deadline)
                    return fail_rest(
                        _CAUSE_OF[status], f"{where} refused: {status.name}: {message}", head.fatal
                    )
                bad = self._unexpected(head, job.transfer_id, extent)
                if bad:
                    return fail_rest(BlockStatus.PROTOCOL, f"{where}: {bad}")
                slot = view[: extent.length]
                sockets.recv_into_exact(sock, slot, deadline)
                # Hashed here, right after the kernel wrote it (still in cache). Handing the hash
                # to a pool thread so the worker could receive on measured worse on 2 cores:
                # receiver CPU 0.47-0.55 s/GB vs 0.33-0.38 inline, no gain in GB/s.
                if checksum(slot) == head.payload_checksum:
                    statuses.append(BlockStatus.OK)
                else:
                    statuses.append(BlockStatus.CHECKSUM)
                    log.warning(
                        "block %d of a peer transfer from %s failed its checksum", extent.index, where
                    )
            sockets.recv_into_exact(sock, header, deadline)
            head = frames.decode_header(header)
            if head.type is frames.FrameType.ERROR:  # e.g. the peer's deadline passed after the last block
                status, message = self._read_error(sock, head, deadline)
                if head.fatal:
                    self._drop()
            elif head.type is not frames.FrameType.DONE or head.block_index != n:
                self._drop()  # every block is verified by its checksum; only the stream is lost
        except PeerError as exc:
            return fail_rest(exc.cause, str(exc), drop=False)
        except TimeoutError:
            return fail_rest(BlockStatus.TIMEOUT, f"{where}: the deadline passed mid-transfer")
        except frames.FrameError as exc:
            return fail_rest(BlockStatus.PROTOCOL, f"{where}: malformed frame: {exc}")
        except (EOFError, OSError) as exc:
            return fail_rest(BlockStatus.PEER_GONE, f"{where}: connection lost: {exc}")
        error = f"{where}: a block failed its checksum" if BlockStatus.CHECKSUM in statuses else ""
        fetch.finish(job, statuses, error)

    def _send_read(self, job: _Job, deadline: float) -> socket.socket:
        """Sends the job's READ and reads the first answer header into ``self._header``.

        A stream kept from an earlier job may have been closed by the peer meanwhile (its idle
        timeout, a restart): then, before any byte of the answer arrived (nothing was written
        into a slot), the READ is sent once more on a fresh connection. READs are idempotent.
        """
        indices = [e.index for e in job.extents]
        for attempt in range(2):
            reused = self._sock is not None
            if reused and self._closed_by_peer():
                self._drop()
                reused = False
            sock = self.connect(deadline)
            read = frames.encode_read(job.transfer_id, indices, deadline - time.monotonic())
            try:
                sockets.send_all(sock, read, deadline)
                sockets.recv_into_exact(sock, memoryview(self._header), deadline)
                return sock
            except (EOFError, BrokenPipeError, ConnectionResetError):
                if not reused or attempt == 1 or self._closed:
                    raise
                self._drop()
        raise AssertionError("unreachable")

    def _closed_by_peer(self) -> bool:
        """An idle stream the peer closed (or wrote to unasked: a fatal BUSY / SHUTTING_DOWN)."""
        sock = self._sock
        if sock is None:
            return True
        return readable(sock, 0)

    @staticmethod
    def _unexpected(head: frames.FrameHeader, transfer_id: bytes, extent: RemoteExtent) -> str:
        if head.type is not frames.FrameType.BLOCK:
            return f"expected a BLOCK frame, got {head.type.name}"
        if head.transfer_id != transfer_id or head.block_index != extent.index:
            return f"expected block {extent.index}, got block {head.block_index} of another transfer or order"
        if head.length != extent.length:
            return f"block {extent.index} announced {extent.length} bytes, its frame says {head.length}"
        if extent.checksum is not None and head.payload_checksum != extent.checksum:
            return f"block {extent.index}'s frame checksum differs from the one OpenTransfer announced"
        return ""

    @staticmethod
    def _read_error(sock, head: frames.FrameHeader, deadline: float) -> tuple[frames.PeerStatus, str]:
        if head.length > frames.MAX_ERROR_MESSAGE_BYTES:
            raise frames.FrameError(f"an ERROR frame of {head.length} bytes")
        return frames.decode_error(head, sockets.recv_exact(sock, head.length, deadline))


# ------------------------------------------------------------------ the link


class TcpPeerLink(PeerLink):
    transport = "tcp"

    def __init__(
        self,
        owner: TcpTransport,
        peer: PeerAddress,
        control: ControlClient,
        link_id: str,
        data_address: tuple[str, int],
        streams: int,
        max_read_blocks: int,
        max_fetch_bytes: int,
    ):
        self.peer = peer
        self.link_id = link_id
        self.data_address = data_address
        self.max_fetch_bytes = max_fetch_bytes
        self.max_read_blocks = max(1, min(max_read_blocks or frames.MAX_READ_BLOCKS, frames.MAX_READ_BLOCKS))
        self.counters = owner.counters
        self._owner = owner
        self._control = control
        self._streams = [_Stream(self, i) for i in range(streams)]
        self._closed = False
        self._stale = False  # the peer forgot the link (it restarted): reconnect
        self._lock = threading.Lock()

    @property
    def streams(self) -> int:
        return len(self._streams)

    @property
    def connected_streams(self) -> int:
        return sum(s.connected for s in self._streams)

    @property
    def healthy(self) -> bool:
        return not self._closed and not self._stale

    def _open(self, deadline: float) -> None:
        for stream in self._streams:
            stream.connect(deadline)
        for stream in self._streams:
            stream.start()

    def _check_open(self) -> None:
        if self._closed:
            raise LinkClosed()

    # -------------------------------------------------------------- control plane

    def open_transfer(
        self, namespace_id: str, hashes: Sequence[bytes], ttl_s: float, deadline: float
    ) -> RemoteTransfer:
        self._check_open()
        try:
            return self._control.open_transfer(self.link_id, namespace_id, hashes, ttl_s, False, deadline)
        except PeerRefused as exc:
            if exc.code == "NOT_FOUND":
                self._stale = True
            raise

    def renew_transfer(self, transfer_id: bytes, ttl_s: float, deadline: float) -> float:
        self._check_open()
        return self._control.renew_transfer(transfer_id, ttl_s, deadline)

    def close_transfer(self, transfer_id: bytes, deadline: float, wait: bool = True) -> bool:
        if self._closed:
            return False
        return self._control.close_transfer(transfer_id, deadline, wait)

    # -------------------------------------------------------------- data plane

    def fetch(
        self, remote: Sequence[RemoteExtent], into: Sequence[memoryview], deadline: float
    ) -> Future[FetchResult]:
        self._check_open()
        if len(remote) != len(into):
            raise ValueError(f"{len(remote)} extents but {len(into)} buffers")
        views = []
        total = 0
        for i, (extent, buf) in enumerate(zip(remote, into, strict=True)):
            view = memoryview(buf)
            if view.readonly:
                raise ValueError(f"buffer {i} is read-only")
            if not view.c_contiguous:
                raise ValueError(f"buffer {i} is not contiguous")
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            if len(view) < extent.length:
                raise ValueError(
                    f"buffer {i} holds {len(view)} bytes, block {extent.index} has {extent.length}"
                )
            views.append(view)
            total += extent.length
        if total > self.max_fetch_bytes:
            raise ValueError(f"a fetch of {total} bytes exceeds the link's limit of {self.max_fetch_bytes}")
        fetch = _Fetch([e.length for e in remote], deadline, self.counters)
        if not remote:
            fetch._maybe_resolve()
            return fetch.future
        plans = self._plan(fetch, remote, views)
        self._owner._watch.add(fetch)
        for stream, job in plans:
            stream.submit(job)
        return fetch.future

    def _plan(self, fetch: _Fetch, remote, views) -> list[tuple[_Stream, _Job]]:
        """Block i goes to stream i mod n; one job per (stream, transfer, max_read_blocks blocks)."""
        n = len(self._streams)
        open_jobs: dict[tuple[int, bytes], _Job] = {}
        plans = []
        for pos, (extent, view) in enumerate(zip(remote, views, strict=True)):
            key = (pos % n, extent.transfer_id)
            job = open_jobs.get(key)
            if job is None or len(job.positions) >= self.max_read_blocks:
                job = _Job(fetch, extent.transfer_id)
                fetch.add_job(job)
                open_jobs[key] = job
                plans.append((self._streams[key[0]], job))
            job.positions.append(pos)
            job.extents.append(extent)
            job.views.append(view)
        return plans

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for stream in self._streams:
            stream.close()
        self._control.close_link(self.link_id, time.monotonic() + 1.0)
        self._control.close()
        self._owner._forget(self)


class TcpTransport(Transport):
    """The default transport. ``streams``: TCP connections per peer (the peer may allow fewer)."""

    name = "tcp"

    def __init__(
        self,
        streams: int = DEFAULT_STREAMS,
        node_id: str = "",
        max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES,
        counters: TransportCounters | None = None,
        control_auth: ClientAuth | None = None,
    ):
        """``control_auth``: what this node presents to peers' PeerTransfer (token, TLS; None: nothing)."""
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self.control_auth = control_auth
        self.streams = streams
        self.node_id = node_id
        self.max_fetch_bytes = max_fetch_bytes
        self.counters = counters or TransportCounters(self.name)
        self._watch = _DeadlineWatch()
        self._links: set[TcpPeerLink] = set()
        self._lock = threading.Lock()

    def connect(self, peer: PeerAddress, deadline: float) -> TcpPeerLink:
        control = ControlClient(peer, self.counters, self.control_auth)
        link = None
        try:
            hs = control.handshake("tcp", self.node_id, deadline)
            if not 0 < hs.data_port < 65536:
                raise PeerError(BlockStatus.PROTOCOL, f"{peer.control} announced data port {hs.data_port}")
            host = hs.data_host or host_of(peer.control)
            streams = max(1, min(self.streams, hs.max_streams or self.streams))
            link = TcpPeerLink(
                self,
                peer,
                control,
                hs.link_id,
                (host, hs.data_port),
                streams,
                hs.max_read_blocks,
                self.max_fetch_bytes,
            )
            link._open(deadline)
        except PeerError as exc:
            self.counters.connect_failed(exc.cause)
            if link is not None:
                for stream in link._streams:
                    stream.close()
                control.close_link(link.link_id, time.monotonic() + 1.0)
            control.close()
            raise
        with self._lock:
            self._links.add(link)
        self.counters.add("links_opened")
        return link

    def _forget(self, link: TcpPeerLink) -> None:
        with self._lock:
            if link in self._links:
                self._links.discard(link)
                self.counters.add("links_closed")

    def stats(self) -> TransportStats:
        return self.counters.snapshot()

    def close(self) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()
        self._watch.close()
