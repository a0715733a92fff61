"""Helpers of the endpoint tests (imported as pegaflow.server.endpoints.tests.support; the fixtures
built on them are in conftest.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import time
import urllib.request

import numpy as np

from pegaflow.client import KvLayout, PegaClient, read_blocks, write_blocks
from pegaflow.server.errors import DeadlineExceeded, InvalidArgument, NotFound
from pegaflow.server.testing import ServerProcess

BLOCK = 64 * 1024
LAYOUT = KvLayout(model_id="m", block_bytes=BLOCK, dtype="bfloat16", block_tokens=16, num_layers=2)


def socket_paths(srv: ServerProcess) -> list[str]:
    """The server's Unix sockets: fd broker, local RPC, read lane, doorbell (when it has a GPU)."""
    fd_path = srv.fd_socket_path
    base = os.path.splitext(fd_path)[0]
    return [fd_path, base + ".rpc.sock", base + ".read.sock", base + ".doorbell.sock"]


def remove_stale_sockets(srv: ServerProcess) -> None:
    """A killed server cannot unlink its sockets (default paths live in the shared temp dir)."""
    if not srv.ready:
        return
    for path in socket_paths(srv):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def rpc_count(srv: ServerProcess, method: str, code: str = "OK") -> float:
    """The server's per-call metric (the servicer's frame counts every call, whichever transport)."""
    text = urllib.request.urlopen(f"http://{srv.http_addr}/metrics", timeout=10).read().decode()
    pattern = rf'^pegaflow_rpc_total\{{(?=[^}}]*method="{method}")(?=[^}}]*code="{code}")[^}}]*\}} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def connect_raw(path: str, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(path)
    return sock


def assert_hung_up(sock: socket.socket) -> None:
    """The server closed the connection (a reset when it left bytes we sent unread)."""
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def save_and_load(c: PegaClient, inst, tag: str, n: int = 8) -> tuple[np.ndarray, np.ndarray, int]:
    """Saves ``n`` random blocks, reads them back through a lease; (written, read, hits)."""
    hashes = [f"{tag}-{i}".encode() for i in range(n)]
    data = np.random.default_rng(len(tag) + n).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)
    batch = c.allocate(inst, hashes)
    write_blocks(c.pool_view(batch.epoch), batch.allocations, data)
    c.seal(batch.save_id)
    hit = c.query_prefix(inst, hashes, lease=True)
    out = np.zeros_like(data)
    read_blocks(c.pool_view(hit.epoch), hit.locations, out)
    c.release(hit.lease_id, loaded_bytes=out.nbytes, wait=False)
    return data, out, hit.num_hits


# ------------------------------------------------------------------ a GPU data path without a GPU


@dataclasses.dataclass
class Saved:
    statuses: list
    written: int
    mode: str = "none"


@dataclasses.dataclass
class Loaded:
    num_hits: int
    mode: str = "none"


class StandInGpu:
    """Answers as ``server.gpu.service.GpuDataPath`` does, on a machine without a GPU: registrations of
    live sessions, saves and loads that move no bytes. What the endpoint tests exercise is everything
    around the data path (transports, checks, status codes, deadlines), which is the same code.

    ``engine`` (optional): session checks go to it, as GpuDataPath's do. ``gate``: while cleared,
    saves wait for it (a copy in progress; ``entered`` is set once one waits). ``calls`` records
    every save and load that ran: (the serving thread's name, the registration id).
    """

    def __init__(self, engine=None, num_blocks: int = 100):
        self._engine = engine
        self._regs: dict[str, str] = {}
        self._lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self.doorbell_path = ""
        self.num_blocks = num_blocks

    def register(self, session_id, instance_id, reg, deadline=None) -> str:
        if self._engine is not None:
            self._engine.heartbeat(session_id, deadline)
        with self._lock:
            reg_id = f"g-{len(self._regs) + 1}"
            self._regs[reg_id] = session_id
        return reg_id

    def unregister(self, session_id, reg_id, deadline=None) -> None:
        with self._lock:
            if self._regs.get(reg_id) != session_id:
                raise NotFound("device registration", reg_id)
            del self._regs[reg_id]

    def on_session_end(self, session_id) -> None:
        with self._lock:
            for reg_id in [r for r, s in self._regs.items() if s == session_id]:
                del self._regs[reg_id]

    def close(self) -> None:
        pass

    def _check(self, session_id, reg_id, block_ids) -> None:
        self.calls.append((threading.current_thread().name, reg_id))
        if self._engine is not None:
            self._engine.heartbeat(session_id)
        elif reg_id.startswith("g-any"):  # without an engine (another process): any session may
            return
        if self._regs.get(reg_id) != session_id:
            raise NotFound("device registration", reg_id)
        if block_ids and max(block_ids) >= self.num_blocks:
            raise InvalidArgument(f"GPU block id {max(block_ids)} is outside the {self.num_blocks} blocks")

    def save(self, session_id, reg_id, hashes, block_ids, deadline):
        self._check(session_id, reg_id, block_ids)
        self.entered.set()
        if not self.gate.wait(max(deadline - time.monotonic(), 0)):
            raise DeadlineExceeded("the copy did not finish before the deadline")
        return Saved([1] * len(hashes), len(hashes))

    def load(self, session_id, reg_id, hashes, block_ids, deadline, purpose):
        self._check(session_id, reg_id, block_ids)
        return Loaded(len(hashes) if purpose else max(len(hashes) - 1, 0))
