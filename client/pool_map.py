"""Maps the server's KV pool into this process by fd passing (see server/pool/fd_broker.py).

The Unix connection that delivered the fd stays open for the session's life:
the server ends our session the moment it closes (so a killed client's leases
and unsealed blocks are reclaimed at once), and we see the server's death as
EOF on it.

Page tables are filled in a background thread (madvise MADV_POPULATE_WRITE
through ctypes, which releases the GIL), so connect() does not wait for a big
pool and the first copies do not pay a page fault per 4 KiB.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import select
import socket
import threading
import time

import numpy as np

from pegaflow.client.errors import ServerUnavailable

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
        del view  # do not keep the buffer exported: close() must be able to unmap
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
    """One mapping of one server epoch."""

    def __init__(self, sock: socket.socket, mapping: mmap.mmap, epoch: str, size_bytes: int, hugepages: bool):
        self.epoch = epoch
        self.size_bytes = size_bytes
        self.hugepages = hugepages
        self._sock: socket.socket | None = sock
        self._mapping: mmap.mmap | None = mapping
        self._view: np.ndarray | None = None
        self._stop_populate = threading.Event()
        self.populated = threading.Event()  # set once the page tables are filled (or that was given up)
        self._populate = threading.Thread(
            target=_populate,
            args=(mapping, size_bytes, self._stop_populate, self.populated),
            name="pegaflow-pool-populate",
            daemon=True,
        )
        self._populate.start()

    @classmethod
    def open(cls, socket_path: str, session_id: str, timeout_s: float) -> PoolMapping:
        """Connects, proves the session, receives the memfd and maps it. Raises ServerUnavailable."""
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
            mapping = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except ServerUnavailable:
            sock.close()
            raise
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            sock.close()
            raise ServerUnavailable(f"cannot map the pool through {socket_path}: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)  # mmap keeps its own reference
        sock.setblocking(False)
        return cls(sock, mapping, str(header["epoch"]), size, bool(header.get("hugepages", False)))

    def view(self) -> np.ndarray:
        """The whole pool as a writable uint8 array."""
        if self._view is None:
            if self._mapping is None:
                raise ServerUnavailable("pool mapping is released")
            self._view = np.frombuffer(self._mapping, dtype=np.uint8)
        return self._view

    def server_gone(self) -> bool:
        """True once the server closed our pool connection (it died, or ended our session)."""
        sock = self._sock
        if sock is None:
            return True
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close_connection(self) -> None:
        """Tells the server this session is done with the pool (it ends the session at once)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def release(self) -> bool:
        """Closes the connection and unmaps. False if views handed out are still alive (retry later)."""
        self.close_connection()
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
