"""The in-process server the client tests talk to (over gRPC and its local RPC socket)."""

from __future__ import annotations

import pytest

from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.runtime import start_server


@pytest.fixture
def inproc_server(tmp_path):
    srv = start_server(
        ServerConfig(
            pool_size_bytes=32 * MIB,
            addr="127.0.0.1:0",
            http_addr=None,
            fd_socket_path=str(tmp_path / "pool.sock"),
            session_ttl_s=30.0,  # robust on a loaded machine; a closed pool connection still ends a session
        )
    )
    yield srv
    srv.stop()
