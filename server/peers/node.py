"""This node's L2 parts, composed for the runtime: the transport it pulls with, the server that lets
peers pull from it, the metaserver publisher, and the remote source the engine asks on a miss.

    node = PeerNode.create(config, engine, grpc_server)   # before gRPC starts: adds PeerTransfer
    node.start()                                          # after: data plane, publisher, engine hook
    node.stop()                                           # before the engine closes

Only built when ``--metaserver-addr`` is given; without it the server behaves exactly as a single
node. The transport is chosen once (RDMA with usable ``--nics``, else TCP, one log line). The
PeerTransfer service shares the server's gRPC server, hence its token check and TLS; what this node
presents to its peers and to the metaserver comes from server/remote_access.py.
"""

from __future__ import annotations

import logging

from pegaflow.metaserver.publisher import BlockPublisher, MetaServerTargets
from pegaflow.server.config import ServerConfig, parse_host_port
from pegaflow.server.peers.choose import choose, make_responder, make_transport
from pegaflow.server.peers.engine_source import EngineTransferSource
from pegaflow.server.peers.remote_source import RemoteOptions, RemoteSource
from pegaflow.server.peers.serve import PeerServeConfig, PeerServer
from pegaflow.server.remote_access import metaserver_client_auth, peer_client_auth

log = logging.getLogger(__name__)


class PeerNode:
    def __init__(
        self, engine, transport, server: PeerServer, publisher: BlockPublisher, remote: RemoteSource
    ):
        self.engine = engine
        self.transport = transport
        self.server = server
        self.publisher = publisher
        self.remote = remote

    @classmethod
    def create(cls, config: ServerConfig, engine, grpc_server, advertised_addr: str) -> PeerNode:
        """``advertised_addr``: this node's gRPC address as peers dial it (the bound --addr)."""
        choice = choose(config.peer_transport, config.nics)  # TransportUnavailable: refuse to start
        pool = memoryview(engine.region.buffer)
        host, _ = parse_host_port(advertised_addr)
        data_host, data_port = parse_host_port(config.peer_data_addr) if config.peer_data_addr else (host, 0)
        transport = make_transport(
            choice,
            node_id=advertised_addr,
            streams=config.peer_streams,
            max_fetch_bytes=config.peer_max_fetch_bytes,
            local_pool=pool,
            control_auth=peer_client_auth(config),  # peers check it on their --addr
        )
        server = PeerServer(
            EngineTransferSource(engine),
            PeerServeConfig(data_host=data_host, data_port=data_port),
            rdma=make_responder(choice, pool),
        )
        server.add_to(grpc_server)
        publisher = BlockPublisher(
            MetaServerTargets.parse(config.metaserver_addr),
            node_id=advertised_addr,
            address=advertised_addr,
            snapshot=engine.dram_snapshot,
            auth=metaserver_client_auth(config),
        )
        remote = RemoteSource(
            engine,
            publisher,
            transport,
            RemoteOptions(
                fetch_deadline_s=config.peer_fetch_deadline_s,
                transfer_ttl_s=config.peer_transfer_ttl_s,
                max_fetch_bytes=config.peer_max_fetch_bytes,
                inflight_bytes=config.peer_inflight_bytes,
            ),
        )
        return cls(engine, transport, server, publisher, remote)

    def start(self) -> None:
        self.server.start()  # OSError: the data plane cannot bind
        self.engine.attach_peers(self.remote, self.publisher)
        self.publisher.start()
        log.info("peers: node %s publishes to the metaserver and pulls from peers", self.publisher.node_id)

    def stop(self) -> None:
        self.engine.detach_peers()
        self.remote.close()
        self.publisher.close()
        self.server.stop()
        self.transport.close()

    def stats(self) -> dict:
        return {
            "remote": self.remote.stats(),
            "transport": self.transport.stats(),
            "serve": self.server.stats(),
            "publisher": self.publisher.stats(),
        }
