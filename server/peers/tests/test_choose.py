"""Choosing the transport at start: auto falls back to TCP with a reason, rdma insists."""

from __future__ import annotations

import pytest

from pegaflow.server.peers import choose
from pegaflow.server.peers.tcp import TcpTransport


def test_tcp_without_nics_or_when_asked():
    assert choose.choose("auto", []).name == "tcp"
    assert choose.choose("tcp", ["mlx5_0"]).reason == "tcp (--peer-transport tcp)"


def test_auto_falls_back_to_tcp_with_the_reason_and_rdma_refuses_to_start():
    # No RDMA device exists on the machines CI runs on (and pyverbs may be absent): both say why.
    choice = choose.choose("auto", ["mlx5_0", "mlx5_1"])
    assert choice.name == "tcp" and "RDMA unavailable" in choice.reason and choice.rdma_nics == ()
    with pytest.raises(choose.TransportUnavailable, match="--peer-transport rdma: "):
        choose.choose("rdma", ["mlx5_0"])
    with pytest.raises(ValueError, match="must be one of"):
        choose.choose("udp", [])


def test_make_transport_gives_the_tcp_transport_and_no_responder():
    choice = choose.choose("auto", [])
    transport = choose.make_transport(choice, node_id="n", streams=3)
    assert isinstance(transport, TcpTransport) and transport.streams == 3
    assert choose.make_responder(choice, memoryview(bytearray(4096))) is None
    transport.close()
