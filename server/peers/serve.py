"""The serving side of the peer transports: the control plane (gRPC PeerTransfer) and the data planes.

``PeerServer(source, config)`` owns the transfer and link tables, the TCP data server and, when
this node serves RDMA, the RDMA responder. Inside pegaflow-server::

    peers = PeerServer(block_store_facade, PeerServeConfig(data_host=routable_host))
    peers.add_to(grpc_server)          # registers PeerTransfer on the server's gRPC server (--addr)
    peers.start()                      # binds the data port, starts the reaper
    ...
    peers.stop()                       # before the block store closes: ends transfers, joins threads

Threads: the gRPC handlers run on the server's pool (each call bounded by its deadline; the
store's ``open_transfer`` does no I/O); the data plane has one accept thread and one thread per
stream (tcp_serve.py); one reaper thread ends transfers and links past their TTL every
``reap_interval_s``.

Who may call: ``add_to`` puts PeerTransfer on the server's own gRPC server, so the token check and
TLS of ``--addr`` (common/auth.py, server/remote_access.py) guard it as they guard the Engine
service. The data planes serve only transfers an authenticated OpenTransfer opened (16 random bytes
each, frames.TRANSFER_ID_BYTES); their bytes are not encrypted (ARCHITECTURE.md, "Trust model").

Every handler runs in common/rpc_handler.py's frame (deadline, error -> status code, INTERNAL
for a bug, per-call metrics), so bad input is answered with a precise status and the node stays
up. A transfer pins blocks in the store for at most ``ttl + ttl_grace_s`` even if the requester
never calls again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc

from pegaflow.common.rpc_handler import rpc_handler
from pegaflow.common.wire import peer_frames as frames
from pegaflow.common.wire.checksum import checksum
from pegaflow.proto import peer_pb2, peer_pb2_grpc
from pegaflow.server.peers.base import SourceBlock, TransferSource
from pegaflow.server.peers.metrics import ServeCounters, ServeStats
from pegaflow.server.peers.tcp_serve import TcpDataServer, TcpServeConfig
from pegaflow.server.peers.transfers import LinkTable, TooMany, TransferTable

log = logging.getLogger(__name__)

SERVICE_NAME = peer_pb2.DESCRIPTOR.services_by_name["PeerTransfer"].full_name
MAX_NODE_ID_CHARS = 128
MAX_NAMESPACE_CHARS = 256
MAX_HASH_BYTES = 64


@dataclasses.dataclass(frozen=True)
class PeerServeConfig:
    data_host: str  # where the TCP data plane binds: the node's routable address
    data_port: int = 0  # 0: a free port (announced at Handshake)
    advertise_host: str = ""  # announced data host; "": the host the requester dialled
    advertise_port: int = 0  # announced data port; 0: the bound one (set both behind a NAT)
    max_streams_per_link: int = 16
    max_connections: int = 64
    max_links: int = 256
    max_transfers: int = 1024
    max_transfer_blocks: int = 16384
    max_read_blocks: int = 16384
    max_ttl_s: float = 600.0
    link_ttl_s: float = 120.0
    ttl_grace_s: float = 5.0
    default_rpc_deadline_s: float = 10.0
    idle_timeout_s: float = 300.0
    frame_timeout_s: float = 5.0
    max_read_timeout_s: float = 120.0
    send_mode: str = "auto"
    reap_interval_s: float = 0.2

    def tcp(self) -> TcpServeConfig:
        return TcpServeConfig(
            host=self.data_host,
            port=self.data_port,
            max_connections=self.max_connections,
            max_read_blocks=self.max_read_blocks,
            idle_timeout_s=self.idle_timeout_s,
            frame_timeout_s=self.frame_timeout_s,
            max_read_timeout_s=self.max_read_timeout_s,
            send_mode=self.send_mode,
        )


class PeerRpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> PeerRpcError:
    return PeerRpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _status_of(exc: Exception, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, PeerRpcError):
        return exc.code, str(exc)
    if isinstance(exc, TooMany):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    return None


def _arrived_late(message: str) -> Exception:
    return TimeoutError(message)


_handler = rpc_handler(_status_of, _arrived_late)


class PeerServer:
    """See the module docstring. ``rdma``: an ``rdma.RdmaResponder`` when this node serves RDMA."""

    def __init__(
        self,
        source: TransferSource,
        config: PeerServeConfig,
        rdma=None,
        counters: ServeCounters | None = None,
    ):
        self.source = source
        self.config = config
        self.rdma = rdma
        self.counters = counters or ServeCounters()
        self.transfers = TransferTable(source, self.counters, config.max_transfers)
        self.links = LinkTable(self.counters, config.max_links, config.link_ttl_s)
        self.data = TcpDataServer(self.transfers, source, config.tcp(), self.counters)
        self.servicer = PeerTransferServicer(self)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def data_port(self) -> int:
        return self.data.port

    def add_to(self, grpc_server: grpc.Server) -> None:
        peer_pb2_grpc.add_PeerTransferServicer_to_server(self.servicer, grpc_server)

    def start(self) -> None:
        """Binds the data plane (OSError when it cannot) and starts the reaper."""
        port = self.data.start()
        self._reaper = threading.Thread(target=self._reap, name="peer-reaper", daemon=True)
        self._reaper.start()
        log.info(
            "peer transfers served: tcp data plane on %s:%d%s",
            self.config.data_host,
            port,
            ", rdma on " + ", ".join(self.rdma.devices) if self.rdma is not None else "",
        )

    def stop(self) -> None:
        self._stop.set()
        self.data.stop()
        if self._reaper is not None:
            self._reaper.join(5)
        self.transfers.close_all()
        self.links.close_all()
        if self.rdma is not None:
            self.rdma.close()

    def stats(self) -> ServeStats:
        return self.counters.snapshot()

    def _reap(self) -> None:
        while not self._stop.wait(self.config.reap_interval_s):
            try:
                self.transfers.expire()
                self.links.expire()
            except Exception:
                log.exception("peer reaper failed")


class PeerTransferServicer(peer_pb2_grpc.PeerTransferServicer):
    """The gRPC methods of proto/peer.proto over a PeerServer."""

    def __init__(self, server: PeerServer):
        self._server = server
        self._config = server.config  # read by the rpc_handler frame (default_rpc_deadline_s)
        self._metrics = server.counters  # observe_rpc

    # ------------------------------------------------------------------ links

    @_handler
    def Handshake(self, request, context, deadline):
        srv, cfg = self._server, self._config
        if len(request.node_id) > MAX_NODE_ID_CHARS:
            raise _invalid(f"node_id is longer than {MAX_NODE_ID_CHARS} characters")
        if request.frame_version != frames.VERSION:
            raise PeerRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"data-plane version {request.frame_version} is not spoken here ({frames.VERSION} is)",
            )
        srv.counters.add("handshakes")
        response = peer_pb2.HandshakeResponse(
            frame_version=frames.VERSION,
            max_streams=cfg.max_streams_per_link,
            max_read_blocks=cfg.max_read_blocks,
            max_transfer_blocks=cfg.max_transfer_blocks,
            link_ttl_ms=int(cfg.link_ttl_s * 1000),
        )
        if request.transport == "tcp":
            if request.queue_pairs:
                raise _invalid("a tcp handshake carries no queue pairs")
            entry = srv.links.add("tcp", request.node_id)
            response.data_host = cfg.advertise_host
            response.data_port = cfg.advertise_port or srv.data_port
        elif request.transport == "rdma":
            if srv.rdma is None:
                raise PeerRpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "this node serves no RDMA (no --nics, or no usable device): use the tcp transport",
                )
            from pegaflow.server.peers import rdma  # pyverbs is imported lazily, only with NICs

            try:
                theirs = [rdma.QueuePairInfo.from_proto(qp) for qp in request.queue_pairs]
            except ValueError as exc:
                raise _invalid(str(exc)) from None
            try:
                ours, regions, on_end = srv.rdma.accept(theirs, deadline)
            except ValueError as exc:
                raise _invalid(str(exc)) from None
            try:
                entry = srv.links.add("rdma", request.node_id, on_end)
            except TooMany:
                on_end()
                raise
            response.queue_pairs.extend(qp.to_proto() for qp in ours)
            response.regions.extend(region.to_proto() for region in regions)
        else:
            raise _invalid(f"transport must be 'tcp' or 'rdma', got {request.transport!r}")
        response.link_id = entry.link_id
        return response

    @_handler
    def CloseLink(self, request, context, deadline):
        self._server.links.remove(request.link_id)
        return peer_pb2.CloseLinkResponse()

    # ------------------------------------------------------------------ transfers

    def _ttl_s(self, ttl_ms: int) -> float:
        limit_ms = int(self._config.max_ttl_s * 1000)
        if not 0 < ttl_ms <= limit_ms:
            raise _invalid(f"ttl_ms must be 1..{limit_ms}, got {ttl_ms}")
        return ttl_ms / 1000.0

    @staticmethod
    def _transfer_id(raw: bytes) -> bytes:
        if len(raw) != frames.TRANSFER_ID_BYTES:
            raise _invalid(f"transfer_id must be {frames.TRANSFER_ID_BYTES} bytes, got {len(raw)}")
        return raw

    @_handler
    def OpenTransfer(self, request, context, deadline):
        srv, cfg = self._server, self._config
        link = srv.links.touch(request.link_id)
        if link is None:
            raise PeerRpcError(grpc.StatusCode.NOT_FOUND, "unknown or expired link: shake hands again")
        ns = request.namespace_id
        if not 0 < len(ns) <= MAX_NAMESPACE_CHARS:
            raise _invalid(f"namespace_id must be 1..{MAX_NAMESPACE_CHARS} characters")
        hashes = list(request.block_hashes)
        if not 0 < len(hashes) <= cfg.max_transfer_blocks:
            raise _invalid(f"block_hashes must name 1..{cfg.max_transfer_blocks} blocks, got {len(hashes)}")
        lengths = list(map(len, hashes))
        if min(lengths) == 0 or max(lengths) > MAX_HASH_BYTES:
            bad = next(i for i, n in enumerate(lengths) if not 0 < n <= MAX_HASH_BYTES)
            raise _invalid(f"block_hashes[{bad}] is {lengths[bad]} bytes; each must be 1..{MAX_HASH_BYTES}")
        ttl_s = self._ttl_s(request.ttl_ms)
        srv.transfers.reserve()
        try:
            store_id, blocks = srv.source.open_transfer(ns, hashes, ttl_s + cfg.ttl_grace_s)
        except LookupError:
            store_id, blocks = "", []
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        if not blocks:
            srv.counters.add("transfers_missed")
            return peer_pb2.OpenTransferResponse(num_blocks=0, ttl_ms=request.ttl_ms)
        try:
            blocks = self._checked(blocks, len(hashes), request.want_checksums, deadline)
        except BaseException:
            srv.source.close_transfer(store_id)
            raise
        transfer = srv.transfers.add(store_id, blocks, ttl_s)
        response = peer_pb2.OpenTransferResponse(
            transfer_id=transfer.wire_id,
            num_blocks=len(blocks),
            ttl_ms=request.ttl_ms,
            lengths=[b.length for b in blocks],
        )
        if all(b.checksum is not None for b in blocks):
            response.checksums.extend(b.checksum for b in blocks)
        if link.transport == "rdma":
            response.offsets.extend(b.offset for b in blocks)
        return response

    def _checked(self, blocks, asked: int, want_checksums: bool, deadline: float) -> list[SourceBlock]:
        """The store's answer checked against the pool (a store bug must not send other memory),
        with the checksums hashed here when the requester needs them up front (RDMA)."""
        pool = self._server.source.pool_view
        if len(blocks) > asked:
            raise RuntimeError(f"the block store pinned {len(blocks)} blocks for {asked} hashes")
        out = []
        for i, block in enumerate(blocks):
            block = SourceBlock(*block)
            if block.length <= 0 or block.offset < 0 or block.offset + block.length > len(pool):
                raise RuntimeError(f"the block store answered block {i} outside the pool: {block}")
            if want_checksums and block.checksum is None:
                if time.monotonic() >= deadline:
                    raise TimeoutError("deadline passed while hashing the transfer's blocks")
                block = block._replace(checksum=checksum(pool[block.offset : block.offset + block.length]))
            out.append(block)
        return out

    @_handler
    def RenewTransfer(self, request, context, deadline):
        srv = self._server
        transfer_id = self._transfer_id(request.transfer_id)
        ttl_s = self._ttl_s(request.ttl_ms)
        if not srv.transfers.renew(transfer_id, ttl_s, self._config.ttl_grace_s):
            raise PeerRpcError(grpc.StatusCode.NOT_FOUND, "unknown, closed or expired transfer")
        return peer_pb2.RenewTransferResponse(ttl_ms=request.ttl_ms)

    @_handler
    def CloseTransfer(self, request, context, deadline):
        self._server.transfers.close(self._transfer_id(request.transfer_id))
        return peer_pb2.CloseTransferResponse()
