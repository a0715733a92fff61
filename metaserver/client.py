"""Python client of pegaflow-metaserver.

``MetaClient`` is one call per RPC, each with a deadline (the client's default
or ``timeout_s``), requests checked locally with the server's own rules, and
gRPC failures turned into ``pegaflow.metaserver.errors``. ``NodeMembership``
keeps a node registered: it heartbeats in a background thread and, when the
metaserver lost the node's lease (it expired, or the metaserver restarted),
registers again and calls ``on_registered`` so the node republishes its blocks.

    client = MetaClient("metaserver-host:50056")
    with NodeMembership(client, "node-a", "10.0.0.5:50055", on_registered=republish_all) as member:
        member.publish("ns-...", added=[h1, h2])
        hits = client.locate("ns-...", prefix_hashes, exclude_node_id="node-a")
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections.abc import Callable, Sequence

import grpc

from pegaflow.common.auth import ClientAuth
from pegaflow.common.auth import channel as auth_channel
from pegaflow.metaserver import errors
from pegaflow.metaserver import validation as check
from pegaflow.metaserver.types import (
    LEADER_ADDRESS_KEY,
    LEADER_TERM_KEY,
    NamespaceDelta,
    NodeHit,
    NodeStats,
    PublishOutcome,
    PublishResult,
)
from pegaflow.proto import metaserver_pb2 as pb
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Registration:
    lease_id: str
    lease_ttl_s: float
    heartbeat_interval_s: float
    term: int = 0


@dataclasses.dataclass(frozen=True)
class LeaderInfo:
    """What GetLeader says: whether the replica asked serves, and the leader it knows."""

    is_leader: bool
    leader_address: str
    term: int
    replica_address: str


@dataclasses.dataclass(frozen=True)
class Stats:
    """What GetStats reports: the index's IndexStats less its publish counters and sweep state."""

    nodes: list[NodeStats]
    entries: int
    max_entries: int
    evicted_entries: int
    expired_nodes: int
    duplicate_batches: int = 0
    stale_batches: int = 0
    sequence_gaps: int = 0
    term: int = 0


def _target(addr: str) -> str:
    # The seed's CLI spells the metaserver as http://host:port; gRPC wants host:port.
    for scheme in ("http://", "grpc://"):
        if addr.startswith(scheme):
            return addr[len(scheme) :]
    return addr


def _trailing(exc: grpc.RpcError) -> dict[str, str]:
    try:
        return {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
    except Exception:  # a locally raised RpcError has no metadata
        return {}


class Unauthenticated(errors.ServerError):
    """The metaserver refused this client's credentials (UNAUTHENTICATED): a missing or wrong token.
    (A TLS refusal happens in the handshake: MetaServerUnavailable.)"""


def _translate(exc: grpc.RpcError) -> errors.MetaServerError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(f"UNAUTHENTICATED: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        meta = _trailing(exc)
        term = meta.get(LEADER_TERM_KEY, "0")
        return errors.NotLeader(detail, meta.get(LEADER_ADDRESS_KEY, ""), int(term) if term.isdigit() else 0)
    if code == grpc.StatusCode.ABORTED:
        return errors.StaleIncarnation(detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded(detail or "deadline exceeded")
    if code == grpc.StatusCode.UNAVAILABLE or code == grpc.StatusCode.CANCELLED:
        return errors.MetaServerUnavailable(detail or "metaserver unavailable")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(detail)
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.LeaseLost(detail)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.ResourceExhausted(detail)
    return errors.ServerError(f"{code.name if code else 'UNKNOWN'}: {detail}")


class MetaClient:
    """Thread-safe client of one metaserver. Every call sends a deadline."""

    def __init__(self, addr: str, timeout_s: float = 2.0, auth: ClientAuth | None = None) -> None:
        """``auth``: the token / TLS the metaserver asks for (common/auth.py); None: plaintext, no
        token (the environment is not read: a node passes what its flags say). A metaserver that
        refuses it answers UNAUTHENTICATED (``errors.ServerError``); AuthConfigError for a credential
        file that cannot be used."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.addr = _target(addr)
        self.timeout_s = timeout_s
        self._channel = auth_channel(
            self.addr,
            auth=auth,
            options=[
                ("grpc.max_receive_message_length", check.MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", check.MAX_MESSAGE_BYTES),
                # Reconnect quickly after a metaserver restart; calls never wait longer than their deadline.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = pb_grpc.MetaServerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MetaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout_s: float | None):
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _translate(exc) from None

    @staticmethod
    def _checked(fn, *args):
        try:
            return fn(*args)
        except check.InvalidRequest as exc:
            raise errors.InvalidArgument(str(exc)) from None

    # ------------------------------------------------------------- membership

    def register(
        self,
        node_id: str,
        address: str,
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
        incarnation: int = 0,
    ) -> Registration:
        self._checked(check.node_id, node_id)
        self._checked(check.address, address)
        ttl_ms = 0 if lease_ttl_s is None else max(1, int(lease_ttl_s * 1000))
        reply = self._call(
            self._stub.RegisterNode,
            pb.RegisterNodeRequest(
                node_id=node_id, address=address, lease_ttl_ms=ttl_ms, incarnation=incarnation
            ),
            timeout_s,
        )
        return Registration(
            reply.lease_id, reply.lease_ttl_ms / 1000.0, reply.heartbeat_interval_ms / 1000.0, reply.term
        )

    def heartbeat(self, lease_id: str, timeout_s: float | None = None) -> int:
        """Renews the lease; returns the entries the index holds for this node."""
        return self.heartbeat_term(lease_id, timeout_s)[0]

    def heartbeat_term(self, lease_id: str, timeout_s: float | None = None) -> tuple[int, int]:
        """Renews the lease; returns (entries the index holds for this node, the leader's term)."""
        reply = self._call(self._stub.Heartbeat, pb.HeartbeatRequest(lease_id=lease_id), timeout_s)
        return reply.entries, reply.term

    def get_leader(self, timeout_s: float | None = None) -> LeaderInfo:
        """Asks this replica who leads (any replica answers, leader or not)."""
        reply = self._call(self._stub.GetLeader, pb.GetLeaderRequest(), timeout_s)
        return LeaderInfo(reply.is_leader, reply.leader_address, reply.term, reply.replica_address)

    def unregister(self, lease_id: str, timeout_s: float | None = None) -> None:
        self._call(self._stub.UnregisterNode, pb.UnregisterNodeRequest(lease_id=lease_id), timeout_s)

    # ------------------------------------------------------------------ index

    def publish(
        self,
        lease_id: str,
        namespace: str,
        added: Sequence[bytes] = (),
        removed: Sequence[bytes] = (),
        timeout_s: float | None = None,
    ) -> PublishResult:
        return self.publish_deltas(lease_id, [NamespaceDelta(namespace, added, removed)], timeout_s)

    def publish_deltas(
        self, lease_id: str, deltas: Sequence[NamespaceDelta], timeout_s: float | None = None
    ) -> PublishResult:
        """Publishes any number of keys, unsequenced, in calls of <= MAX_KEYS_PER_CALL hashes (each with a
        deadline)."""
        for delta in deltas:
            self._checked(check.namespace, delta.namespace)
            self._checked(check.block_hashes, delta.added, "added", len(delta.added))
            self._checked(check.block_hashes, delta.removed, "removed", len(delta.removed))
        added = removed = evicted = 0
        for request in self._publish_requests(lease_id, deltas):
            reply = self._call(self._stub.PublishBlocks, request, timeout_s)
            added += reply.added
            removed += reply.removed
            evicted += reply.evicted
        return PublishResult(added, removed, evicted)

    def publish_batch(
        self,
        lease_id: str,
        deltas: Sequence[NamespaceDelta],
        incarnation: int,
        sequence: int,
        timeout_s: float | None = None,
    ) -> tuple[PublishResult, int]:
        """One sequenced PublishBlocks call (<= MAX_KEYS_PER_CALL hashes, <= MAX_DELTAS_PER_CALL deltas,
        checked by the server); returns (its result, the leader's term). Deltas are applied in order."""
        request = pb.PublishBlocksRequest(
            lease_id=lease_id,
            incarnation=incarnation,
            sequence=sequence,
            deltas=[
                pb.NamespaceDelta(namespace=d.namespace, added=d.added, removed=d.removed) for d in deltas
            ],
        )
        reply = self._call(self._stub.PublishBlocks, request, timeout_s)
        outcome = PublishOutcome(reply.outcome) if reply.outcome else PublishOutcome.APPLIED
        return PublishResult(
            reply.added, reply.removed, reply.evicted, outcome, reply.expected_sequence
        ), reply.term

    @staticmethod
    def _publish_requests(lease_id: str, deltas: Sequence[NamespaceDelta]):
        room = check.MAX_KEYS_PER_CALL
        pending: list[pb.NamespaceDelta] = []
        for delta in deltas:
            # Removals first: a key removed and re-added in one delta list ends up added.
            for field, hashes in (("removed", delta.removed), ("added", delta.added)):
                start = 0
                while start < len(hashes):
                    if room == 0 or len(pending) == check.MAX_DELTAS_PER_CALL:
                        yield pb.PublishBlocksRequest(lease_id=lease_id, deltas=pending)
                        pending, room = [], check.MAX_KEYS_PER_CALL
                    take = min(room, len(hashes) - start)
                    chunk = {field: hashes[start : start + take]}
                    pending.append(pb.NamespaceDelta(namespace=delta.namespace, **chunk))
                    room -= take
                    start += take
        if pending:
            yield pb.PublishBlocksRequest(lease_id=lease_id, deltas=pending)

    def locate(
        self,
        namespace: str,
        block_hashes: Sequence[bytes],
        exclude_node_id: str = "",
        timeout_s: float | None = None,
    ) -> list[NodeHit]:
        """Nodes holding the leading blocks of ``block_hashes``, most first (lists cut to the limit)."""
        return self.locate_term(namespace, block_hashes, exclude_node_id, timeout_s)[0]

    def locate_term(
        self,
        namespace: str,
        block_hashes: Sequence[bytes],
        exclude_node_id: str = "",
        timeout_s: float | None = None,
    ) -> tuple[list[NodeHit], int]:
        """``locate`` and the term of the leader that answered."""
        hashes = list(block_hashes[: check.MAX_KEYS_PER_CALL])
        if not hashes:
            return [], 0
        self._checked(check.namespace, namespace)
        self._checked(check.block_hashes, hashes, "block_hashes")
        reply = self._call(
            self._stub.Locate,
            pb.LocateRequest(namespace=namespace, block_hashes=hashes, exclude_node_id=exclude_node_id),
            timeout_s,
        )
        return [NodeHit(n.node_id, n.address, n.num_blocks) for n in reply.nodes], reply.term

    def stats(self, timeout_s: float | None = None) -> Stats:
        reply = self._call(self._stub.GetStats, pb.GetStatsRequest(), timeout_s)
        return Stats(
            nodes=[
                NodeStats(n.node_id, n.address, n.entries, n.lease_remaining_ms / 1000.0) for n in reply.nodes
            ],
            entries=reply.entries,
            max_entries=reply.max_entries,
            evicted_entries=reply.evicted_entries,
            expired_nodes=reply.expired_nodes,
            duplicate_batches=reply.duplicate_batches,
            stale_batches=reply.stale_batches,
            sequence_gaps=reply.sequence_gaps,
            term=reply.term,
        )


class NodeMembership:
    """Keeps a node registered: heartbeats, re-registers (then ``on_registered``) when the lease is lost.

    ``on_registered(membership)`` runs in the heartbeat thread after every
    registration but the first one made by ``start()``: the index holds nothing
    for the node then, so it should republish everything it holds.
    """

    def __init__(
        self,
        client: MetaClient,
        node_id: str,
        address: str,
        lease_ttl_s: float | None = None,
        on_registered: Callable[[NodeMembership], None] | None = None,
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.address = address
        self._lease_ttl_s = lease_ttl_s
        self._on_registered = on_registered
        self._registration: Registration | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registrations = 0

    @property
    def lease_id(self) -> str | None:
        registration = self._registration
        return registration.lease_id if registration else None

    def start(self) -> NodeMembership:
        """Registers (raising if the metaserver cannot be reached) and starts heartbeating."""
        self._register()
        self._thread = threading.Thread(
            target=self._run, name=f"metaserver-heartbeat-{self.node_id}", daemon=True
        )
        self._thread.start()
        return self

    def close(self, unregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_s + 5)
        lease_id = self.lease_id
        if unregister and lease_id:
            try:
                self.client.unregister(lease_id)
            except errors.MetaServerError as exc:
                log.info("metaserver: unregister of %s failed (%s); its lease will expire", self.node_id, exc)

    def __enter__(self) -> NodeMembership:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def publish(
        self, namespace: str, added: Sequence[bytes] = (), removed: Sequence[bytes] = ()
    ) -> PublishResult:
        """Publishes under the current lease; LeaseLost also wakes the heartbeat thread to re-register."""
        lease_id = self.lease_id
        if lease_id is None:
            raise errors.LeaseLost("not registered")
        try:
            return self.client.publish(lease_id, namespace, added, removed)
        except errors.LeaseLost:
            with self._lock:
                if self._registration is not None and self._registration.lease_id == lease_id:
                    self._registration = None
            raise

    def _register(self) -> None:
        registration = self.client.register(self.node_id, self.address, self._lease_ttl_s)
        with self._lock:
            self._registration = registration
            self.registrations += 1

    def _run(self) -> None:
        backoff = 0.2
        while True:
            registration = self._registration
            interval = registration.heartbeat_interval_s if registration else backoff
            if self._stop.wait(interval):
                return
            try:
                if registration is None or self._registration is None:
                    self._register()
                    log.info("metaserver: node %s registered again", self.node_id)
                    if self._on_registered is not None:
                        self._on_registered(self)
                else:
                    self.client.heartbeat(registration.lease_id)
                backoff = 0.2
            except errors.LeaseLost:
                with self._lock:
                    self._registration = None
            except errors.MetaServerError as exc:
                # Unreachable: keep the lease (it may still be alive there) and retry sooner, with jitter.
                log.debug("metaserver: heartbeat of %s failed: %s", self.node_id, exc)
                backoff = min(5.0, backoff * 2) * (0.8 + 0.4 * random.random())
                if self._stop.wait(backoff):
                    return
            except Exception:
                log.exception("metaserver: membership of %s: callback or call failed", self.node_id)
