"""The TCP data plane's serving end: answers READ frames with the pinned blocks' bytes.

One listening socket; one thread per accepted stream (a requester opens a few per link), capped
at ``max_connections`` (one more is answered ERROR BUSY and closed). Per stream, READs are served
one at a time, in order (common/wire/peer_frames.py): each block goes out as a 56-byte header
(``send(MSG_MORE)``, so it rides in the block's first segment) followed by the block's bytes,
sent with ``os.sendfile`` from the pool memfd: the kernel takes the pool's pages by reference,
no user-space copy and no GIL. ``send_mode="sendmsg"`` gathers header and the mapped block in one
``sendmsg`` instead (one kernel copy); bench/peer_transport_bench.py measures both. ``auto`` (the
default) uses sendfile unless the pool's fd cannot do it: a hugetlb memfd (``--use-hugepages``)
answers EINVAL to sendfile.

A block's checksum is the store's when it keeps one; otherwise it is hashed here (XXH3-64, GIL
released, ~18 GB/s on one core on a quiet machine), on a small hash pool ``HASH_AHEAD`` blocks
ahead of the send, so hashing overlaps the network even on one stream (hashing on the stream's
own thread before each send measured 72% of iperf3 on one stream vs 103% with the store's
checksums, bench/peer_transport_bench.py, loaded 2-core machine).

Bad input never takes the serving side down and never blocks other streams:
* a header that is not one (magic, version, header checksum) or not a READ: ERROR PROTOCOL
  (fatal), the stream is closed: nothing after it can be framed;
* a READ whose body is malformed or fails its checksum, names an unknown or expired transfer,
  or a block outside it: ERROR BAD_REQUEST / UNKNOWN_TRANSFER, and the stream stays usable;
* a client that connects and sends nothing is closed after ``idle_timeout_s``; one that stalls
  inside a frame after ``frame_timeout_s``; one that stops reading is dropped when the READ's
  deadline (its own, capped by ``max_read_timeout_s``) passes inside a send.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import socket
import threading
import time

from pegaflow.common.wire import peer_frames as frames
from pegaflow.common.wire.checksum import checksum
from pegaflow.server.peers import sockets
from pegaflow.server.peers.base import TransferSource
from pegaflow.server.peers.metrics import ServeCounters
from pegaflow.server.peers.transfers import TransferTable

log = logging.getLogger(__name__)

SEND_MODES = ("auto", "sendfile", "sendmsg")
HASH_AHEAD = 2


@dataclasses.dataclass(frozen=True)
class TcpServeConfig:
    host: str  # the address to bind (the node's routable address)
    port: int = 0  # 0: a free port
    max_connections: int = 64
    max_read_blocks: int = frames.MAX_READ_BLOCKS
    idle_timeout_s: float = 300.0  # a stream with no READ for this long is closed
    frame_timeout_s: float = 5.0  # the rest of a frame once its first byte arrived
    max_read_timeout_s: float = 120.0  # a READ's own deadline is capped to this
    error_send_timeout_s: float = 1.0
    send_mode: str = "auto"  # auto: sendfile where the pool's fd supports it (not hugetlbfs), else sendmsg
    hash_threads: int = 2  # hashing blocks the store kept no checksum for (GIL released)

    def __post_init__(self):
        if self.send_mode not in SEND_MODES:
            raise ValueError(f"send_mode must be one of {SEND_MODES}, got {self.send_mode!r}")


def sendfile_works(fd: int) -> bool:
    """Whether ``os.sendfile`` can read ``fd`` into a socket. A hugetlb memfd cannot (EINVAL, seen on
    kernel 6.18): the pool of ``--use-hugepages`` is then sent with ``sendmsg``."""
    a, b = socket.socketpair()
    try:
        return os.sendfile(a.fileno(), fd, 0, 1) == 1
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
            return False
        raise
    finally:
        a.close()
        b.close()


class _Fatal(Exception):
    """The stream must be closed (after the ERROR frame, if any, was sent)."""


class TcpDataServer:
    def __init__(
        self, table: TransferTable, source: TransferSource, config: TcpServeConfig, counters: ServeCounters
    ):
        self._table = table
        self._source = source
        self.config = config
        self._counters = counters
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._stopping = threading.Event()
        self._hasher = concurrent.futures.ThreadPoolExecutor(
            config.hash_threads, thread_name_prefix="peer-hash"
        )
        self.port = 0
        self.send_mode = config.send_mode  # "auto" is resolved at start()

    def start(self) -> int:
        """Binds and listens; returns the port. Raises OSError when it cannot bind."""
        if self.config.send_mode != "sendmsg":
            works = sendfile_works(self._source.pool_fd)
            if not works and self.config.send_mode == "sendfile":
                raise OSError("send_mode sendfile: os.sendfile cannot read the pool's fd (hugetlbfs?)")
            if not works:
                log.info(
                    "the pool's fd does not support sendfile (hugetlb pages): blocks are sent with sendmsg"
                )
            self.send_mode = "sendfile" if works else "sendmsg"
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.config.host, self.config.port))
        except OSError as exc:
            listener.close()
            raise OSError(
                f"cannot listen for the peer data plane on {self.config.host}:{self.config.port}: {exc}"
            ) from exc
        listener.listen(128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="peer-data-accept", daemon=True)
        self._accept_thread.start()
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, ends every stream (in-flight sends are cut), joins the threads."""
        self._stopping.set()
        if self._listener is not None:
            sockets.interrupt(self._listener)
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout_s)
        with self._lock:
            conns = list(self._conns.values())
        for conn, _ in conns:
            sockets.interrupt(conn)
        for _, thread in conns:
            thread.join(timeout_s)
        self._hasher.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.01)  # EMFILE and the like: do not spin
                continue
            with self._lock:
                full = len(self._conns) >= self.config.max_connections
            if full:
                self._counters.add("connections_refused")
                self._counters.error_frame(frames.PeerStatus.BUSY.name)
                self._send_error(
                    conn, frames.NULL_TRANSFER, frames.PeerStatus.BUSY, "too many peer connections"
                )
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="peer-data-stream", daemon=True)
            with self._lock:
                self._conns[conn.fileno()] = (conn, thread)
            self._counters.add("connections_opened")
            thread.start()

    # ------------------------------------------------------------------ one stream

    def _serve(self, conn: socket.socket) -> None:
        key = conn.fileno()
        try:
            sockets.tune(conn)
            header = bytearray(frames.HEADER_BYTES)
            while not self._stopping.is_set():
                if not self._next_request(conn, header):
                    return
        except _Fatal:
            pass
        except (OSError, EOFError, TimeoutError) as exc:  # the requester went away or stalled
            log.debug("peer data stream closed: %s", exc)
        except Exception:
            log.exception("peer data stream failed")
        finally:
            with self._lock:
                self._conns.pop(key, None)
            self._counters.add("connections_closed")
            with contextlib.suppress(OSError):
                conn.close()

    def _next_request(self, conn: socket.socket, header: bytearray) -> bool:
        """Serves one READ; False when the requester closed the stream between frames."""
        cfg = self.config
        view = memoryview(header)
        try:  # the first byte may take up to the idle timeout, the rest of the frame not
            sockets.recv_into_exact(conn, view[:1], time.monotonic() + cfg.idle_timeout_s)
        except EOFError:
            return False
        sockets.recv_into_exact(conn, view[1:], time.monotonic() + cfg.frame_timeout_s)
        try:
            head = frames.decode_header(header)
        except frames.FrameError as exc:
            self._abort(conn, frames.NULL_TRANSFER, frames.PeerStatus.PROTOCOL, str(exc))
        if head.type != frames.FrameType.READ:
            self._abort(
                conn, head.transfer_id, frames.PeerStatus.PROTOCOL, f"expected READ, got {head.type.name}"
            )
        if head.length > frames.read_payload_limit():
            # Its body is not read, so the stream cannot be framed any more.
            self._abort(conn, head.transfer_id, frames.PeerStatus.BAD_REQUEST, "READ body too long")
        payload = sockets.recv_exact(conn, head.length, time.monotonic() + cfg.frame_timeout_s)
        arrived = time.monotonic()
        tid = head.transfer_id
        try:
            timeout_s, indices = frames.decode_read(head, payload)
        except frames.FrameError as exc:
            self._reject(conn, tid, frames.PeerStatus.BAD_REQUEST, str(exc))
            return True
        if len(indices) > cfg.max_read_blocks:
            msg = f"a READ names at most {cfg.max_read_blocks} blocks, got {len(indices)}"
            self._reject(conn, tid, frames.PeerStatus.BAD_REQUEST, msg)
            return True
        transfer = self._table.acquire(tid)
        if transfer is None:
            msg = "unknown transfer (never opened, closed, or its lease expired)"
            self._reject(conn, tid, frames.PeerStatus.UNKNOWN_TRANSFER, msg)
            return True
        try:
            bad = next((i for i in indices if i >= len(transfer.blocks)), None)
            if bad is not None:
                msg = f"block {bad} is outside the transfer's {len(transfer.blocks)} blocks"
                self._reject(conn, tid, frames.PeerStatus.BAD_REQUEST, msg, bad)
                return True
            self._send_blocks(conn, transfer, indices, arrived + min(timeout_s, cfg.max_read_timeout_s))
        finally:
            self._table.release(transfer)
        return True

    def _send_blocks(self, conn: socket.socket, transfer, indices: list[int], deadline: float) -> None:
        pool_file, pool = self._source.pool_file, self._source.pool_view
        tid = transfer.wire_id
        sendfile = self.send_mode == "sendfile"
        # Checksums the store did not keep are hashed HASH_AHEAD blocks ahead on the hash pool, so
        # hashing block k+1 overlaps sending block k (one stream otherwise alternates the two).
        ahead: collections.deque = collections.deque()
        upcoming = iter(indices)

        def queue_next() -> None:
            index = next(upcoming, None)
            if index is None:
                return
            block = transfer.blocks[index]
            if block.checksum is not None:
                ahead.append(block.checksum)
            else:
                ahead.append(self._hasher.submit(checksum, pool[block.offset : block.offset + block.length]))

        for _ in range(HASH_AHEAD):
            queue_next()
        try:
            for index in indices:
                queue_next()
                pending = ahead.popleft()
                if time.monotonic() >= deadline:
                    self._reject(conn, tid, frames.PeerStatus.DEADLINE, "the READ's deadline passed", index)
                    return
                if not self._table.sendable(transfer):
                    msg = "the transfer was closed or its lease expired"
                    self._reject(conn, tid, frames.PeerStatus.UNKNOWN_TRANSFER, msg, index)
                    return
                block = transfer.blocks[index]
                block_sum = pending if isinstance(pending, int) else pending.result()
                head = frames.encode_block_header(tid, index, block.length, block_sum)
                # A requester that stops reading makes these time out at the READ's deadline: the
                # stream is then dropped (raise), the block's bytes half-sent.
                if sendfile:
                    sockets.send_all(conn, head, deadline, socket.MSG_MORE)
                    fd, at = pool_file(block.offset)
                    sockets.sendfile_all(conn, fd, at, block.length, deadline)
                else:
                    data = pool[block.offset : block.offset + block.length]
                    sockets.sendmsg_all(conn, (head, data), deadline)
                self._counters.add("blocks_sent")
                self._counters.add("bytes_sent", block.length)
            sockets.send_all(conn, frames.encode_done(tid, len(indices)), deadline)
        finally:
            for pending in ahead:
                if not isinstance(pending, int):
                    pending.cancel()
            for pending in ahead:  # none may still read the pool once the transfer is released
                if not isinstance(pending, int) and not pending.cancelled():
                    pending.exception()

    # ------------------------------------------------------------------ errors

    def _reject(self, conn, transfer_id: bytes, status, message: str, block: int = frames.NO_BLOCK) -> None:
        """An ERROR frame about one READ; the stream stays usable (its framing is intact)."""
        self._counters.error_frame(status.name)
        self._send_error(conn, transfer_id, status, message, block, fatal=False)

    def _abort(self, conn, transfer_id: bytes, status, message: str):
        """A fatal ERROR frame, then the stream is closed (raises _Fatal)."""
        self._counters.error_frame(status.name)
        self._send_error(conn, transfer_id, status, message, fatal=True)
        raise _Fatal(message)

    def _send_error(self, conn, transfer_id, status, message, block=frames.NO_BLOCK, fatal=True) -> None:
        frame = frames.encode_error(transfer_id, status, message, block, fatal)
        with contextlib.suppress(OSError, TimeoutError):
            sockets.send_all(conn, frame, time.monotonic() + self.config.error_send_timeout_s)
