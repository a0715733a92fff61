"""The MetaServer gRPC service: validates, applies the deadline, calls the index, maps errors to codes.

Every handler runs under ``_handler`` (pegaflow.common.rpc_handler): the
caller's deadline (or the default one when a call arrives without) becomes an
absolute deadline the index honours while waiting for its lock; bad input
becomes INVALID_ARGUMENT with a message naming the field; anything unexpected
is logged and answered INTERNAL, so no request can take the metaserver down.

Replicas: every handler but GetLeader and GetStats first asks the leadership
seam whether this replica serves *now* (``LeaderView.serving()``: leader, and
its etcd lease provably alive); if not, FAILED_PRECONDITION with the leader's
address and term in the trailing metadata, so the node redirects itself.
Standbys redirect rather than forward: a forwarded call would cost a second
hop on every publish and Locate, tie standbys' threads to the leader's
latency, and give a partitioned standby a way to relay stale answers; a
redirect costs one extra round trip per leader change only. Writes re-check
after they were applied: a lease lost meanwhile answers FAILED_PRECONDITION,
so the node never counts a batch the next leader has not seen.
"""

from __future__ import annotations

import logging

import grpc

from pegaflow.common.rpc_handler import rpc_handler
from pegaflow.metaserver import validation as check
from pegaflow.metaserver.config import MetaServerConfig
from pegaflow.metaserver.index import (
    DeadlinePassed,
    GlobalIndex,
    LeaseNotFound,
    StaleIncarnation,
    TooManyNamespaces,
    TooManyNodes,
)
from pegaflow.metaserver.leadership.base import Leadership, LeaderView
from pegaflow.metaserver.metrics import MetaServerMetrics
from pegaflow.metaserver.types import LEADER_ADDRESS_KEY, LEADER_TERM_KEY, NamespaceDelta
from pegaflow.proto import metaserver_pb2 as pb
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class NotServing(Exception):
    """This replica is not the serving leader now."""

    def __init__(self, view: LeaderView) -> None:
        super().__init__("not the leader")
        self.view = view


def _status_of(exc: Exception, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
    """The status code of a refusal the service means; None for anything else (a bug: INTERNAL)."""
    if isinstance(exc, NotServing):
        view = exc.view
        context.set_trailing_metadata(
            ((LEADER_ADDRESS_KEY, view.leader_address), (LEADER_TERM_KEY, str(view.term)))
        )
        where = (
            f"the leader is {view.leader_address} (term {view.term})"
            if view.leader_address
            else ("no leader is known yet")
        )
        return grpc.StatusCode.FAILED_PRECONDITION, f"this metaserver replica does not serve now: {where}"
    if isinstance(exc, check.InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, LeaseNotFound):
        return (
            grpc.StatusCode.NOT_FOUND,
            "unknown or expired lease: register the node again and republish its blocks",
        )
    if isinstance(exc, TooManyNodes | TooManyNamespaces):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, StaleIncarnation):
        return grpc.StatusCode.ABORTED, str(exc)
    if isinstance(exc, DeadlinePassed):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    return None


_handler = rpc_handler(_status_of, DeadlinePassed)


class MetaServerServicer(pb_grpc.MetaServerServicer):
    """``index`` is read on every call: the runtime installs a fresh one at each term it wins."""

    def __init__(
        self,
        index: GlobalIndex,
        config: MetaServerConfig,
        metrics: MetaServerMetrics,
        leadership: Leadership,
    ) -> None:
        self.index = index
        self._config = config
        self._metrics = metrics
        self._leadership = leadership

    def _serving(self) -> tuple[GlobalIndex, LeaderView]:
        view = self._leadership.view()
        if not view.serving():
            raise NotServing(view)
        return self.index, view

    def _still_serving(self, view: LeaderView) -> None:
        now = self._leadership.view()
        if not now.serving() or now.term != view.term:
            raise NotServing(now)

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
        index, view = self._serving()
        node = index.register(node_id, address, ttl_s, deadline=deadline, incarnation=request.incarnation)
        self._still_serving(view)
        log.info(
            "metaserver: node %s registered at %s (lease ttl %.1fs, incarnation %d, term %d)",
            node_id,
            address,
            ttl_s,
            request.incarnation,
            view.term,
        )
        ttl_ms, interval_ms = self._lease_response_ms(node.ttl_s)
        return pb.RegisterNodeResponse(
            lease_id=node.lease_id, lease_ttl_ms=ttl_ms, heartbeat_interval_ms=interval_ms, term=view.term
        )

    @_handler
    def Heartbeat(self, request: pb.HeartbeatRequest, context, deadline: float) -> pb.HeartbeatResponse:
        lease_id = check.lease_id(request.lease_id)
        index, view = self._serving()
        node = index.heartbeat(lease_id, deadline=deadline)
        self._still_serving(view)
        return pb.HeartbeatResponse(lease_ttl_ms=int(node.ttl_s * 1000), entries=node.entries, term=view.term)

    @_handler
    def UnregisterNode(
        self, request: pb.UnregisterNodeRequest, context, deadline: float
    ) -> pb.UnregisterNodeResponse:
        lease_id = check.lease_id(request.lease_id)
        index, _ = self._serving()
        index.unregister(lease_id, deadline=deadline)
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
            total += len(delta.added) + len(delta.removed)
            if total > check.MAX_KEYS_PER_CALL:
                raise check.InvalidRequest(f"more than {check.MAX_KEYS_PER_CALL} hashes in one publish")
            # Materialized once: every pass over a protobuf repeated field makes new bytes objects.
            added = check.block_hashes(list(delta.added), f"deltas[{i}].added")
            removed = check.block_hashes(list(delta.removed), f"deltas[{i}].removed")
            deltas.append(NamespaceDelta(namespace, added, removed))
        index, view = self._serving()
        result = index.publish(
            lease_id, deltas, deadline=deadline, incarnation=request.incarnation, sequence=request.sequence
        )
        self._still_serving(view)
        return pb.PublishBlocksResponse(
            added=result.added,
            removed=result.removed,
            evicted=result.evicted,
            outcome=int(result.outcome),
            expected_sequence=result.expected_sequence,
            term=view.term,
        )

    @_handler
    def Locate(self, request: pb.LocateRequest, context, deadline: float) -> pb.LocateResponse:
        namespace = check.namespace(request.namespace)
        hashes = check.block_hashes(list(request.block_hashes), "block_hashes")
        if not hashes:
            raise check.InvalidRequest("block_hashes must not be empty")
        exclude = check.node_id(request.exclude_node_id) if request.exclude_node_id else ""
        index, view = self._serving()
        hits = index.locate(namespace, hashes, exclude, deadline=deadline)
        self._metrics.located_blocks.observe(hits[0].num_blocks if hits else 0)
        return pb.LocateResponse(
            nodes=[pb.NodeHit(node_id=h.node_id, address=h.address, num_blocks=h.num_blocks) for h in hits],
            term=view.term,
        )

    @_handler
    def GetStats(self, request: pb.GetStatsRequest, context, deadline: float) -> pb.GetStatsResponse:
        view = self._leadership.view()
        stats = self.index.stats(deadline=deadline)
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
            duplicate_batches=stats.duplicate_batches,
            stale_batches=stats.stale_batches,
            sequence_gaps=stats.sequence_gaps,
            term=view.term,
        )

    @_handler
    def GetLeader(self, request: pb.GetLeaderRequest, context, deadline: float) -> pb.GetLeaderResponse:
        view = self._leadership.view()
        return pb.GetLeaderResponse(
            is_leader=view.serving(),
            leader_address=view.leader_address,
            term=view.term,
            replica_address=self._leadership.advertise_address,
        )
