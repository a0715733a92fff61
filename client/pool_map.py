"""The server's KV pool in this process: fd passing at connect, the mapping on first use.

At connect the client proves its session on the server's fd-broker socket (see
server/endpoints/fd_broker.py) and receives the pool's memfd. That Unix connection
stays open for the session's life: the server ends our session the moment it
closes (so a killed client's leases and unsealed blocks are reclaimed at once),
and we see the server's death as EOF on it.

The pool is mapped only when this process first asks for its bytes
(``PoolMapping.view``): a process that never copies (vLLM's scheduler, a stats
or lookup-only client) keeps the fd and the liveness connection but maps
nothing. A mapping's page tables are then filled in a background thread (madvise
MADV_POPULATE_WRITE through ctypes, which releases the GIL), so the first
copies do not pay a page fault per 4 KiB page.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import socket
import threading
import time

import numpy as np

from pegaflow.client.errors import ServerUnavailable
from pegaflow.common.native import page_copy
from pegaflow.common.wire.frames import readable

log = logging.getLogger(__name__)

MAGIC = b"PEGAFLOW-POOL 1 "
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_POPULATE_CHUNK = 1 << 30


def _populate(mapping: mmap.mmap, size: int, stop: threading.Event, done: threading.Event) -> None:
    try:
        _populate_pages(mapping, size, stop)
    finally:
        done.set()


def _populate_pages(mapping: mmap.mmap, size: int, stop: threading.Event) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        view = np.frombuffer(mapping, dtype=np.uint8)
        base = view.ctypes.data
        del view  # do not keep the buffer exported: release() must be able to unmap
    except (ValueError, OSError, AttributeError):
        return
    for advice in (_MADV_POPULATE_WRITE, _MADV_POPULATE_READ):
        offset = 0
        while offset < size and not stop.is_set():
            length = min(_POPULATE_CHUNK, size - offset)
            if libc.madvise(base + offset, length, advice) != 0:
                break
            offset += length
        else:
            return
        if offset:
            return  # failed part-way (e.g. memory pressure): leave the rest to page faults
    log.debug("pool populate not supported by this kernel; pages fault in on first touch")


class PoolMapping:
    """The pool of one server epoch: its fd-broker connection and fd, mapped on first ``view()``."""

    def __init__(self, sock: socket.socket, fd: int, epoch: str, size_bytes: int, hugepages: bool):
        self.epoch = epoch
        self.size_bytes = size_bytes
        self.hugepages = hugepages
        self.read_only = False  # a reader's session: the fd is read-only, so is the mapping and the view
        self._sock: socket.socket | None = sock
        self._fd = fd  # -1 once mapped (the mapping holds the memfd) or released
        self._lock = threading.Lock()
        self._mapping: mmap.mmap | None = None
        self._view: np.ndarray | None = None
        self._released = False
        self._stop_populate = threading.Event()
        self.populated = threading.Event()  # set once the page tables are filled (or that was given up)
        page_copy.start()  # the block copies' streaming stores, built on a thread (numpy's until then)

    @classmethod
    def open(cls, socket_path: str, session_id: str, timeout_s: float) -> PoolMapping:
        """Connects, proves the session and receives the memfd (not mapped yet). Raises ServerUnavailable."""
        deadline = time.monotonic() + timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            sock.settimeout(max(timeout_s, 0.001))
            sock.connect(socket_path)
            sock.sendall(MAGIC + session_id.encode("ascii") + b"\n")
            data = b""
            while b"\n" not in data:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk, new_fds, _, _ = socket.recv_fds(sock, 4096, 4)
                fds.extend(new_fds)
                if not chunk:
                    raise ServerUnavailable(f"pool fd socket {socket_path} closed during the handshake")
                data += chunk
                if len(data) > 65536:
                    raise ServerUnavailable("pool fd socket sent an oversized header")
            header = json.loads(data.split(b"\n", 1)[0])
            if "error" in header:
                raise ServerUnavailable(f"pool fd socket refused the session: {header['error']}")
            if len(fds) != 1:
                raise ServerUnavailable(f"pool fd socket passed {len(fds)} fds instead of 1")
            size = int(header["size_bytes"])
            if os.fstat(fds[0]).st_size < size:
                raise ServerUnavailable("pool fd is smaller than the announced pool size")
            pool = cls(sock, fds.pop(), str(header["epoch"]), size, bool(header.get("hugepages", False)))
            pool.read_only = bool(header.get("read_only", False))
        except ServerUnavailable:
            sock.close()
            raise
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            sock.close()
            raise ServerUnavailable(f"cannot receive the pool through {socket_path}: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        sock.setblocking(False)
        return pool

    @property
    def mapped(self) -> bool:
        return self._mapping is not None

    def view(self) -> np.ndarray:
        """The whole pool as a writable uint8 array; maps it on the first call."""
        view = self._view
        if view is not None:
            return view
        with self._lock:
            if self._view is None:
                self._view = np.frombuffer(self._map(), dtype=np.uint8)
            return self._view

    def _map(self) -> mmap.mmap:
        """Under the lock."""
        if self._released:
            raise ServerUnavailable("pool mapping is released")
        if self._mapping is None:
            try:
                prot = mmap.PROT_READ if self.read_only else mmap.PROT_READ | mmap.PROT_WRITE
                mapping = mmap.mmap(self._fd, self.size_bytes, flags=mmap.MAP_SHARED, prot=prot)
            except OSError as exc:
                raise ServerUnavailable(f"cannot map the pool: {exc}") from exc
            os.close(self._fd)  # the mapping keeps its own reference to the memfd
            self._fd = -1
            self._mapping = mapping
            threading.Thread(
                target=_populate,
                args=(mapping, self.size_bytes, self._stop_populate, self.populated),
                name="pegaflow-pool-populate",
                daemon=True,
            ).start()
        return self._mapping

    def server_gone(self) -> bool:
        """True once the server closed our pool connection (it died, or ended our session)."""
        sock = self._sock
        if sock is None:
            return True
        try:
            if not readable(sock, 0):
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def release(self) -> bool:
        """Closes the connection (the server ends the session at once), the fd and the mapping.

        False if views handed out are still alive: call again later to unmap.
        """
        with self._lock:
            self._released = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._stop_populate.set()
            if self._mapping is None:
                return True
            self._view = None
            try:
                self._mapping.close()
            except BufferError:
                return False
            self._mapping = None
            return True
