"""Fixtures of the endpoint tests: real server processes (killed, their sockets removed, after each
test), a client of one, raw sockets closed after the test. Plain helpers are in support.py."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest

from pegaflow.client import PegaClient
from pegaflow.server.endpoints.tests.support import StandInGpu, connect_raw, remove_stale_sockets
from pegaflow.server.testing import ServerProcess


@pytest.fixture
def server_process(tmp_path):
    """``server_process(name="srv", **ServerProcess kwargs)`` starts a server; all are killed afterwards."""
    started: list[ServerProcess] = []

    def start(name: str = "srv", **kwargs) -> ServerProcess:
        kwargs.setdefault("pool_size", "64mb")
        srv = ServerProcess(tmp_path / name, **kwargs)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.kill()
        remove_stale_sockets(srv)


@pytest.fixture
def server(server_process) -> ServerProcess:
    return server_process()


@pytest.fixture
def client(server):
    # Queries over the local RPC socket (the read lane has its own tests: server/read_lane/tests).
    c = PegaClient(server.addr, timeout_s=10.0, name="endpoint-test", read_lane=False)
    c.connect()
    yield c
    c.close()


@pytest.fixture
def raw():
    """``raw(path)``: a plain connected Unix socket, closed after the test."""
    opened: list[socket.socket] = []

    def open_raw(path: str, timeout_s: float = 10.0) -> socket.socket:
        sock = connect_raw(path, timeout_s)
        opened.append(sock)
        return sock

    yield open_raw
    for sock in opened:
        sock.close()


@pytest.fixture
def sock_dir():
    """A short private directory for socket paths (a Unix socket path must fit in 107 bytes)."""
    path = tempfile.mkdtemp(prefix="pgf-sock-", dir="/tmp")
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def gpu_server(monkeypatch, sock_dir):
    """A whole in-process server whose GPU data path is a StandInGpu (so it serves the doorbell and
    the GPU RPCs on a machine without a GPU): ``(running_server, stand_in)``."""
    from pegaflow.server import runtime
    from pegaflow.server.config import MIB, ServerConfig

    made: list[StandInGpu] = []

    def start_gpu(config, engine):
        gpu = StandInGpu(engine)
        engine.add_session_listener(gpu.on_session_end)
        made.append(gpu)
        return gpu

    monkeypatch.setattr(runtime, "_start_gpu", start_gpu)
    config = ServerConfig(
        pool_size_bytes=32 * MIB,
        addr="127.0.0.1:0",
        http_addr=None,
        fd_socket_path=os.path.join(sock_dir, "p.sock"),
        max_batch_blocks=64,
        max_hash_bytes=64,
        session_ttl_s=30.0,
    )
    srv = runtime.start_server(config)
    try:
        yield srv, made[0]
    finally:
        srv.stop(grace_s=0)
