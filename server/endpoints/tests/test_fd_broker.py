"""The fd broker's bounds (issue 12 F5): handshake timeouts, handshakes that never complete cannot lock
clients out, a cap on pool connections per session, EMFILE back-off; and the fd it passes is sealed."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import threading
import time

import pytest

from pegaflow.client.errors import ServerUnavailable
from pegaflow.client.pool_map import PoolMapping
from pegaflow.common.wire import pool_fd as wire
from pegaflow.server.endpoints.fd_broker import FdBroker
from pegaflow.server.endpoints.tests.support import connect_raw
from pegaflow.server.testing import wait_for

pytestmark = pytest.mark.timeout(120)
POOL_BYTES = 1 << 20


class Sessions:
    """The engine's side of the broker: which sessions exist, which pool connections closed."""

    def __init__(self):
        self.live = {"s-a", "s-b"}
        self.detached: list[str] = []
        self._lock = threading.Lock()

    def attach(self, session_id: str) -> dict:
        if session_id not in self.live:
            raise ValueError(f"unknown session {session_id!r}")
        return {"epoch": "e1", "size_bytes": POOL_BYTES, "hugepages": False}

    def detach(self, session_id: str) -> None:
        with self._lock:
            self.detached.append(session_id)


@pytest.fixture
def broker(sock_dir):
    fd = os.memfd_create("pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, POOL_BYTES)
    sessions = Sessions()
    made: list[FdBroker] = []

    def start(**bounds) -> FdBroker:
        b = FdBroker(
            os.path.join(sock_dir, f"b{len(made)}.sock"), fd, sessions.attach, sessions.detach, **bounds
        )
        b.start()
        made.append(b)
        return b

    yield start, sessions
    for b in made:
        b.stop()
    os.close(fd)


def connect_silent(path: str) -> socket.socket:
    """A connection that never handshakes (retrying while the listener's backlog is full)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return connect_raw(path)
        except BlockingIOError:  # a Unix socket's full backlog: the broker has not accepted yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def answer_of(sock: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return json.loads(data)


def test_a_session_attaches_and_its_close_is_reported(broker):
    start, sessions = broker
    b = start()
    pool = PoolMapping.open(b.path, "s-a", 5.0)
    assert (pool.epoch, pool.size_bytes) == ("e1", POOL_BYTES)
    wait_for(lambda: b.connections == 1 and b.pending == 0)
    with pytest.raises(ServerUnavailable, match="unknown session"):
        PoolMapping.open(b.path, "s-nobody", 5.0)
    pool.release()
    wait_for(lambda: sessions.detached == ["s-a"])


def test_a_handshake_that_never_comes_is_cut_off(broker):
    start, _ = broker
    b = start(handshake_timeout_s=0.3)
    with connect_raw(b.path) as silent:
        assert answer_of(silent) == {"error": "handshake timed out"}
        assert silent.recv(1) == b""
    assert b.timed_out == 1


def test_handshakes_that_never_complete_cannot_lock_clients_out(broker):
    start, _ = broker
    b = start(max_pending=8, handshake_timeout_s=30.0)
    silent = [connect_silent(b.path) for _ in range(200)]
    try:
        wait_for(lambda: b.evicted >= 150, timeout_s=20)
        assert b.pending <= 8
        t0 = time.monotonic()
        pool = PoolMapping.open(b.path, "s-a", 5.0)  # an honest client gets in at once
        assert time.monotonic() - t0 < 2.0
        more = [connect_silent(b.path) for _ in range(50)]  # and later floods never evict it
        wait_for(lambda: b.evicted >= 200, timeout_s=20)
        assert not pool.server_gone()
        pool.release()
        for sock in more:
            sock.close()
    finally:
        for sock in silent:
            sock.close()


def test_a_session_holds_a_bounded_number_of_pool_connections(broker):
    start, sessions = broker
    b = start(max_attachments_per_session=2)
    first = PoolMapping.open(b.path, "s-a", 5.0)
    second = PoolMapping.open(b.path, "s-a", 5.0)
    with pytest.raises(ServerUnavailable, match="already holds 2 pool connections"):
        PoolMapping.open(b.path, "s-a", 5.0)
    other = PoolMapping.open(b.path, "s-b", 5.0)  # other sessions are not affected
    first.release()
    wait_for(lambda: sessions.detached == ["s-a"])
    third = PoolMapping.open(b.path, "s-a", 5.0)
    b.forget_session("s-a")  # the session ended elsewhere: its connections close
    wait_for(lambda: second.server_gone() and third.server_gone())
    assert not other.server_gone()
    for pool in (second, third, other):
        pool.release()


def test_the_broker_backs_off_when_out_of_descriptors_and_logs_once(broker, caplog):
    start, _ = broker
    b = start()
    caplog.set_level(logging.WARNING, logger="pegaflow.server.endpoints.fd_broker")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(40)]
    try:
        # A new descriptor takes the lowest free number below the limit: leave this process (the
        # broker's) five free numbers.
        used = {int(fd) for fd in os.listdir("/proc/self/fd")}
        limit, free = 0, 0
        while free < 5:
            free += limit not in used
            limit += 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            for s in clients:  # connecting takes no descriptor on our side; accepting takes one there
                s.setblocking(False)
                try:
                    s.connect(b.path)
                except BlockingIOError:
                    pass
            wait_for(lambda: any("accept failed" in r.getMessage() for r in caplog.records), timeout_s=10)
            time.sleep(1.0)  # a window in which a spinning broker would log thousands of lines
            assert sum("accept failed" in r.getMessage() for r in caplog.records) == 1
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        for s in clients:
            s.close()
    wait_for(lambda: any("accepting again" in r.getMessage() for r in caplog.records), timeout_s=10)
    pool = PoolMapping.open(b.path, "s-a", 5.0)
    pool.release()


def test_the_wire_handshake_is_the_one_definition():
    assert wire.encode_hello("s-a") == b"PEGAFLOW-POOL 1 s-a\n"
    assert wire.parse_hello(b"PEGAFLOW-POOL 1 s-a") == "s-a"
    for bad in (b"HELLO", b"PEGAFLOW-POOL 1 \xff", b"PEGAFLOW-POOL 1 " + b"x" * 300):
        with pytest.raises(ValueError):
            wire.parse_hello(bad)
