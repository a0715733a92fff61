"""The TCP requester's own contract, in one process over loopback (no root needed).

A real PeerServer over a real memfd source serves the control plane; for the deadline cases its
Handshake points the requester at a data port that accepts READs and never answers (a peer that
hangs mid-transfer).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import numpy as np
import pytest

from pegaflow.common.grpc_server import listen, new_grpc_server
from pegaflow.server.peers.base import BlockStatus, LinkClosed, PeerAddress, PeerUnavailable
from pegaflow.server.peers.serve import PeerServeConfig, PeerServer
from pegaflow.server.peers.tcp import TcpTransport
from pegaflow.server.peers.testing import NAMESPACE, MemfdTransferSource, block_hash, pattern

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 << 10


class Staller:
    """A data port that reads whatever comes and never answers."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                self.conns.append(conn)

    def close(self):
        self.listener.close()
        for c in self.conns:
            c.close()


@contextlib.contextmanager
def peer(advertise_port: int = 0, blocks: int = 8):
    source = MemfdTransferSource(blocks, BLOCK)
    server = PeerServer(source, PeerServeConfig(data_host="127.0.0.1", advertise_port=advertise_port))
    grpc_server = new_grpc_server(4, "peer-test", 16 << 20)
    server.add_to(grpc_server)
    address = listen(grpc_server, "127.0.0.1:0", "127.0.0.1")
    grpc_server.start()
    server.start()
    try:
        yield address, server, source
    finally:
        server.stop()
        grpc_server.stop(0)
        source.close()


def slots(count: int) -> tuple[np.ndarray, list[memoryview]]:
    arena = np.full(count * BLOCK, 0xA5, dtype=np.uint8)
    return arena, [memoryview(arena[i * BLOCK : (i + 1) * BLOCK]) for i in range(count)]


def open_all(link, count: int):
    return link.open_transfer(NAMESPACE, [block_hash(i) for i in range(count)], 10.0, time.monotonic() + 5)


def test_fetch_lands_in_the_slots_and_counts_it():
    with peer() as (address, server, _):
        transport = TcpTransport(streams=3, node_id="t")
        link = transport.connect(PeerAddress(address), time.monotonic() + 5)
        transfer = open_all(link, 8)
        arena, views = slots(8)
        result = link.fetch(transfer.extents, views, time.monotonic() + 5).result(10)
        assert result.ok and result.leading_ok == 8 and result.bytes_ok == 8 * BLOCK and result.cause is None
        for i in range(8):
            assert np.array_equal(arena[i * BLOCK : (i + 1) * BLOCK], pattern(i, BLOCK))
        assert link.close_transfer(transfer.transfer_id, time.monotonic() + 5)
        stats = transport.stats()
        assert stats.fetches == 1 and stats.blocks_ok == 8 and stats.bytes_ok == 8 * BLOCK
        assert stats.open_links == 1 and stats.open_streams == 3 and stats.fetch_seconds.count == 1
        assert server.stats().blocks_sent == 8
        # an empty fetch is a result at once
        assert link.fetch([], [], time.monotonic() + 1).result(1).ok
        transport.close()
        assert transport.stats().open_links == 0 and transport.stats().open_streams == 0


def test_caller_bugs_raise_at_once_and_a_closed_link_refuses():
    with peer() as (address, _, _):
        transport = TcpTransport(streams=2, max_fetch_bytes=4 * BLOCK)
        link = transport.connect(PeerAddress(address), time.monotonic() + 5)
        extents = open_all(link, 8).extents
        _, views = slots(8)
        with pytest.raises(ValueError, match="extents but"):
            link.fetch(extents[:2], views[:1], time.monotonic() + 1)
        with pytest.raises(ValueError, match="holds"):
            link.fetch(extents[:1], [views[0][:100]], time.monotonic() + 1)
        with pytest.raises(ValueError, match="read-only"):
            link.fetch(extents[:1], [memoryview(bytes(BLOCK))], time.monotonic() + 1)
        with pytest.raises(ValueError, match="limit"):
            link.fetch(extents, views, time.monotonic() + 1)
        link.close()
        assert not link.healthy
        with pytest.raises(LinkClosed):
            link.fetch(extents[:1], views[:1], time.monotonic() + 1)
        transport.close()


def test_a_hung_peer_ends_each_fetch_at_its_own_deadline_even_when_queued_behind_another():
    staller = Staller()
    with peer(advertise_port=staller.port) as (address, _, _):
        transport = TcpTransport(streams=1)
        link = transport.connect(PeerAddress(address), time.monotonic() + 5)
        extents = open_all(link, 4).extents
        arena_a, views_a = slots(2)
        arena_b, views_b = slots(2)
        start = time.monotonic()
        slow = link.fetch(extents[:2], views_a, start + 2.0)
        quick = link.fetch(extents[2:], views_b, start + 0.5)  # queued behind `slow` on the one stream
        r_quick = quick.result(5)
        assert 0.45 <= time.monotonic() - start < 1.5
        assert r_quick.statuses == [BlockStatus.TIMEOUT] * 2 and "stream was free" in r_quick.error
        assert not slow.done()
        r_slow = slow.result(5)
        assert 1.95 <= time.monotonic() - start < 3.0 and r_slow.statuses == [BlockStatus.TIMEOUT] * 2
        assert (arena_a == 0xA5).all() and (arena_b == 0xA5).all()
        assert transport.stats().blocks_failed["timeout"] == 4
        transport.close()
    staller.close()


def test_close_cancels_a_fetch_in_flight_and_resolves_it_before_returning():
    staller = Staller()
    with peer(advertise_port=staller.port) as (address, _, _):
        transport = TcpTransport(streams=2)
        link = transport.connect(PeerAddress(address), time.monotonic() + 5)
        extents = open_all(link, 4).extents
        _, views = slots(4)
        future = link.fetch(extents, views, time.monotonic() + 30)
        time.sleep(0.1)  # let the workers block in their receives
        started = time.monotonic()
        link.close()
        assert future.done() and time.monotonic() - started < 2
        assert future.result().statuses == [BlockStatus.CANCELLED] * 4
        transport.close()
    staller.close()


def test_connect_to_nothing_fails_fast_with_peer_gone():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        transport = TcpTransport()
        with pytest.raises(PeerUnavailable) as info:
            transport.connect(PeerAddress(f"127.0.0.1:{port}"), time.monotonic() + 3)
        assert info.value.cause is BlockStatus.PEER_GONE
        assert transport.stats().connect_failures == {"peer_gone": 1}
        transport.close()


def test_sendfile_is_used_where_the_pool_fd_supports_it_and_refused_loudly_where_not():
    from pegaflow.server.peers.tcp_serve import sendfile_works

    source = MemfdTransferSource(1, BLOCK)
    read_end, write_end = os.pipe()  # like a hugetlb memfd, a pipe cannot be sendfile's source
    try:
        assert sendfile_works(source.pool_fd)
        assert not sendfile_works(read_end)
        with peer() as (_, server, _):
            assert server.data.send_mode == "sendfile"
    finally:
        os.close(read_end)
        os.close(write_end)
        source.close()
