"""The MetaServer gRPC service: validates, applies the deadline, calls the index, maps errors to codes.

Every handler runs under ``_handler`` (pegaflow.common.rpc_handler): the
caller's deadline (or the default one when a call arrives without) becomes an
absolute deadline the index honours while waiting for its lock; bad input
becomes INVALID_ARGUMENT with a message naming the field; anything unexpected
is logged and answered INTERNAL, so no request can take the metaserver down.
"""

from __future__ import annotations

import logging

import grpc

from pegaflow.common.rpc_handler import rpc_handler
from pegaflow.metaserver import validation as check
from pegaflow.metaserver.config import MetaServerConfig
from pegaflow.metaserver.index import DeadlinePassed, GlobalIndex, LeaseNotFound, TooManyNodes
from pegaflow.metaserver.metrics import MetaServerMetrics
from pegaflow.metaserver.types import NamespaceDelta
from pegaflow.proto import metaserver_pb2 as pb
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def _status_of(exc: Exception, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
    """The status code of a refusal the service means; None for anything else (a bug: INTERNAL)."""
    if isinstance(exc, check.InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, LeaseNotFound):
        return (
            grpc.StatusCode.NOT_FOUND,
            "unknown or expired lease: register the node again and republish its blocks",
        )
    if isinstance(exc, TooManyNodes):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, DeadlinePassed):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    return None


_handler = rpc_handler(_status_of, DeadlinePassed)


class MetaServerServicer(pb_grpc.MetaServerServicer):
    def __init__(self, index: GlobalIndex, config: MetaServerConfig, metrics: MetaServerMetrics) -> None:
        self._index = index
        self._config = config
        self._metrics = metrics

    def _lease_response_ms(self, ttl_s: float) -> tuple[int, int]:
        ttl_ms = int(ttl_s * 1000)
        # Three heartbeats per TTL: one lost or late beat does not expire a live node.
        return ttl_ms, max(1, ttl_ms // 3)

    @_handler
    def RegisterNode(
        self, request: pb.RegisterNodeRequest, context, deadline: float
    ) -> pb.RegisterNodeResponse:
        node_id = check.node_id(request.node_id)
        address = check.address(request.address)
        cfg = self._config
        ttl_s = check.lease_ttl_ms(
            request.lease_ttl_ms, cfg.min_lease_ttl_s, cfg.max_lease_ttl_s, cfg.lease_ttl_s
        )
        node = self._index.register(node_id, address, ttl_s, deadline=deadline)
        log.info("metaserver: node %s registered at %s (lease ttl %.1fs)", node_id, address, ttl_s)
        ttl_ms, interval_ms = self._lease_response_ms(node.ttl_s)
        return pb.RegisterNodeResponse(
            lease_id=node.lease_id, lease_ttl_ms=ttl_ms, heartbeat_interval_ms=interval_ms
        )

    @_handler
    def Heartbeat(self, request: pb.HeartbeatRequest, context, deadline: float) -> pb.HeartbeatResponse:
        node = self._index.heartbeat(check.lease_id(request.lease_id), deadline=deadline)
        return pb.HeartbeatResponse(lease_ttl_ms=int(node.ttl_s * 1000), entries=node.entries)

    @_handler
    def UnregisterNode(
        self, request: pb.UnregisterNodeRequest, context, deadline: float
    ) -> pb.UnregisterNodeResponse:
        self._index.unregister(check.lease_id(request.lease_id), deadline=deadline)
        return pb.UnregisterNodeResponse()

    @_handler
    def PublishBlocks(
        self, request: pb.PublishBlocksRequest, context, deadline: float
    ) -> pb.PublishBlocksResponse:
        lease_id = check.lease_id(request.lease_id)
        if len(request.deltas) > check.MAX_DELTAS_PER_CALL:
            raise check.InvalidRequest(
                f"deltas: more than {check.MAX_DELTAS_PER_CALL} namespaces in one call"
            )
        total = 0
        deltas = []
        for i, delta in enumerate(request.deltas):
            namespace = check.namespace(delta.namespace)
            added = check.block_hashes(delta.added, f"deltas[{i}].added")
            removed = check.block_hashes(delta.removed, f"deltas[{i}].removed")
            total += len(added) + len(removed)
            if total > check.MAX_KEYS_PER_CALL:
                raise check.InvalidRequest(f"more than {check.MAX_KEYS_PER_CALL} hashes in one publish")
            deltas.append(NamespaceDelta(namespace, list(added), list(removed)))
        result = self._index.publish(lease_id, deltas, deadline=deadline)
        return pb.PublishBlocksResponse(added=result.added, removed=result.removed, evicted=result.evicted)

    @_handler
    def Locate(self, request: pb.LocateRequest, context, deadline: float) -> pb.LocateResponse:
        namespace = check.namespace(request.namespace)
        hashes = check.block_hashes(request.block_hashes, "block_hashes")
        if not hashes:
            raise check.InvalidRequest("block_hashes must not be empty")
        exclude = check.node_id(request.exclude_node_id) if request.exclude_node_id else ""
        hits = self._index.locate(namespace, list(hashes), exclude, deadline=deadline)
        self._metrics.located_blocks.observe(hits[0].num_blocks if hits else 0)
        return pb.LocateResponse(
            nodes=[pb.NodeHit(node_id=h.node_id, address=h.address, num_blocks=h.num_blocks) for h in hits]
        )

    @_handler
    def GetStats(self, request: pb.GetStatsRequest, context, deadline: float) -> pb.GetStatsResponse:
        stats = self._index.stats(deadline=deadline)
        return pb.GetStatsResponse(
            nodes=[
                pb.NodeInfo(
                    node_id=n.node_id,
                    address=n.address,
                    entries=n.entries,
                    lease_remaining_ms=int(n.lease_remaining_s * 1000),
                )
                for n in stats.nodes
            ],
            entries=stats.entries,
            max_entries=stats.max_entries,
            evicted_entries=stats.evicted_entries,
            expired_nodes=stats.expired_nodes,
        )
