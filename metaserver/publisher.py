"""The node side of pegaflow-metaserver: what a pegaflow-server calls to publish its blocks and find peers'.

One ``BlockPublisher`` per pegaflow-server process. It finds the metaserver
leader, registers the node, keeps the lease alive, sends the node's block
changes in ordered batches, and, whenever the metaserver lost the node (a new
leader, a metaserver restart, an expired lease, a lost batch), registers again
and re-publishes everything the node holds, from a callback the server gives.

Primitives, by role:

Lifetime (the server's start-up and shutdown thread):
    pub = BlockPublisher(MetaServerTargets.parse(flag), node_id, address, snapshot)
    pub.start()        returns at once; finding the leader and registering happen
                       in the publisher's thread ("metaserver-publisher"). A
                       metaserver that is down never delays the server's start.
    pub.close()        stops that thread, then unregisters (best effort, bounded
                       by ``rpc_timeout_s``); the index forgets the node at once.

Publishing (any thread; the seal, eviction, promotion and fetch paths):
    pub.blocks_added(namespace_id, hashes) -> bool
    pub.blocks_removed(namespace_id, hashes) -> bool
        Call *after* the blocks became resident (sealed) / after they left.
        O(1) under a small lock, no I/O, never blocks, never raises. The delta
        joins a bounded FIFO queue (``max_queued_keys``); False when it was
        dropped because the queue is full (``dropped_keys``; the node then
        re-registers and re-publishes at most every ``resync_interval_s``, so
        the index converges) or its hashes are invalid (``invalid_keys``).
        While no leader is registered, deltas are not queued at all
        (``superseded_keys``): the re-publication that follows the next
        registration reads the snapshot, which already reflects them. So
        memory stays bounded however long the metaserver is away, and local
        serving never notices.

Locating (the fetch path's thread):
    pub.locate(namespace_id, hashes, timeout_s=0.05) -> list[NodeHit]
        Per other live node, how many leading blocks of ``hashes`` it holds,
        most first (this node excluded). One gRPC call to the leader with
        that deadline, on the caller's thread; never raises: no leader known
        -> [] at once (``locate_skipped``), any failure -> [] and a counter
        (``locate_failures``). The answer is a hint: a peer may no longer
        hold a block; during a leader's rebuild it is partial (a miss). It
        never names a node for a block that node did not publish.
    pub.try_locate(namespace_id, hashes, timeout_s) -> list[NodeHit] | None
        The same, but None when the metaserver could not be asked or did not
        answer (so the caller can tell "nobody holds it" from "no answer").

The snapshot callback (provided by the server, called in the publisher thread):
    snapshot() -> Iterable[tuple[str, Sequence[bytes]]]
        Yields (namespace_id, hashes) for every block resident on the node, in
        chunks of any size (the publisher re-cuts them into batches of
        ``batch_keys``); it is iterated lazily, while new deltas queue, so it
        must not hold a lock the request path takes for longer than one
        chunk. It must reflect every change made before it was called; a
        change made while it is iterated may or may not appear (its delta,
        queued meanwhile, is sent after the snapshot). An exception ends the
        re-publication; the publisher registers again later and retries.

Observability: ``stats()`` -> ``PublisherStats`` (plain numbers; queue depth,
drops, publish failures, re-publishes, leader changes, ... for the server's
Prometheus metrics).

Ordering and fencing: every batch carries the node's ``incarnation`` (its start
time in ns, unless given) and a ``sequence`` number (1, 2, ... per
registration); a batch that timed out is retried with the same number, so
the metaserver applies it once (a retry of an applied batch is DUPLICATE).
A SEQUENCE_GAP or STALE_INCARNATION answer, a NOT_FOUND lease, a
"not the leader" answer, or any answer from another term than the
registration's makes the node find the leader again, register and re-publish.
Answers of a lower term than the highest one seen are never believed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from pegaflow.common.auth import AuthConfigError, ClientAuth
from pegaflow.metaserver import errors
from pegaflow.metaserver import validation as check
from pegaflow.metaserver.client import MetaClient, Unauthenticated
from pegaflow.metaserver.types import NamespaceDelta, NodeHit, PublishOutcome

log = logging.getLogger(__name__)

Snapshot = Callable[[], Iterable[tuple[str, Sequence[bytes]]]]

ETCD_SCHEME = "etcd://"
DEFAULT_ETCD_PREFIX = "/pegaflow/metaserver"


@dataclasses.dataclass(frozen=True)
class MetaServerTargets:
    """Where the metaserver replicas are: a list of addresses, or an etcd cluster to read the leader from.

    ``--metaserver-addr`` syntax (``parse``):
      ``host:port``                      one metaserver (the seed's ``http://host:port`` is accepted)
      ``host:port,host:port,...``        replicas; the leader is found by asking them (GetLeader)
      ``etcd://host:port,host:port[/prefix]``  the leader is read from etcd's leadership key
    """

    addresses: tuple[str, ...] = ()
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = DEFAULT_ETCD_PREFIX

    @staticmethod
    def parse(text: str) -> MetaServerTargets:
        text = text.strip()
        prefix = DEFAULT_ETCD_PREFIX
        etcd = text.startswith(ETCD_SCHEME)
        if etcd:
            text = text[len(ETCD_SCHEME) :]
            if "/" in text:
                text, _, path = text.partition("/")
                prefix = "/" + path.strip("/")
        parts = []
        for part in text.split(","):
            part = part.strip()
            for scheme in ("http://", "grpc://"):
                part = part.removeprefix(scheme)
            host, sep, port = part.rpartition(":")
            if not host or not sep or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    "--metaserver-addr: expected host:port[,host:port...] or "
                    f"etcd://host:port[,...][/prefix], "
                    f"got {part!r}"
                )
            parts.append(part)
        if etcd:
            return MetaServerTargets(etcd_endpoints=tuple(parts), etcd_prefix=prefix)
        return MetaServerTargets(addresses=tuple(parts))


@dataclasses.dataclass(frozen=True)
class PublisherStats:
    connected: bool
    leader_address: str
    term: int
    queue_depth_keys: int
    queue_limit_keys: int
    published_keys: int
    published_batches: int
    duplicate_batches: int
    dropped_keys: int
    superseded_keys: int
    invalid_keys: int
    publish_failures: int
    registrations: int
    republishes: int
    republished_keys: int
    leader_changes: int
    sessions_lost: int
    locate_calls: int
    locate_failures: int
    locate_skipped: int
    locate_seconds_total: float


class _SessionLost(Exception):
    """The registration is gone (or untrustworthy): find the leader, register, re-publish."""


@dataclasses.dataclass
class _Session:
    client: MetaClient
    address: str
    lease_id: str
    term: int
    heartbeat_interval_s: float
    lease_ttl_s: float
    next_sequence: int = 1
    next_heartbeat: float = 0.0
    # When the metaserver last answered this session.
    last_ok: float = dataclasses.field(default_factory=time.monotonic)


class _LeaderFinder:
    """Finds the serving leader among the targets: (client, address, term) or None."""

    def __init__(
        self, targets: MetaServerTargets, rpc_timeout_s: float, auth: ClientAuth | None = None
    ) -> None:
        self.targets = targets
        self.auth = auth
        self._refused: set[str] = set()  # replicas that refused our credentials (warned once)
        # GetLeader is answered from memory: a replica slower than this is as good as absent.
        self.rpc_timeout_s = rpc_timeout_s
        self._clients: dict[str, MetaClient] = {}

    def client(self, address: str) -> MetaClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = MetaClient(
                address, timeout_s=self.rpc_timeout_s, auth=self.auth
            )
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _ask(self, address: str) -> tuple[MetaClient, str, int] | None:
        try:
            info = self.client(address).get_leader()
        except (Unauthenticated, AuthConfigError) as exc:
            # Nothing will change until an operator fixes a token or a file: say so, once per address.
            if address not in self._refused:
                self._refused.add(address)
                log.warning("metaserver: %s refuses this node's credentials: %s", address, exc)
            return None
        except errors.MetaServerError as exc:
            log.debug("metaserver: %s did not say who leads: %s", address, exc)
            return None
        if address in self._refused:
            self._refused.discard(address)
            log.info("metaserver: %s accepts this node's credentials again", address)
        if info.is_leader:
            return self.client(address), address, info.term
        if info.leader_address and info.leader_address != address:
            try:
                confirmed = self.client(info.leader_address).get_leader()
            except errors.MetaServerError:
                return None
            if confirmed.is_leader:
                return self.client(info.leader_address), info.leader_address, confirmed.term
        return None

    def find(self) -> tuple[MetaClient, str, int] | None:
        if self.targets.etcd_endpoints:
            address = self._leader_from_etcd()
            return self._ask(address) if address else None
        best = None
        for address in self.targets.addresses:
            found = self._ask(address)
            if found is not None and (best is None or found[2] > best[2]):
                best = found
        return best

    def _leader_from_etcd(self) -> str | None:
        import asyncio

        import aetcd  # only nodes configured with etcd:// need the etcd client

        key = f"{self.targets.etcd_prefix}/leader".encode()

        async def read() -> str | None:
            for endpoint in self.targets.etcd_endpoints:
                host, _, port = endpoint.rpartition(":")
                client = aetcd.Client(host=host.strip("[]"), port=int(port), timeout=self.rpc_timeout_s)
                try:
                    kv = await client.get(key)
                    return json.loads(kv.value).get("address") if kv is not None else None
                except (aetcd.exceptions.ClientError, ValueError, AttributeError) as exc:
                    log.debug("metaserver: etcd %s: %s", endpoint, exc)
                finally:
                    await client.close()
            return None

        try:
            return asyncio.run(read())
        except Exception as exc:
            log.debug("metaserver: reading the leader from etcd failed: %s", exc)
            return None


class BlockPublisher:
    def __init__(
        self,
        targets: MetaServerTargets,
        node_id: str,
        address: str,
        snapshot: Snapshot,
        *,
        incarnation: int | None = None,
        lease_ttl_s: float | None = None,
        rpc_timeout_s: float = 2.0,
        discovery_timeout_s: float = 0.5,
        max_queued_keys: int = 1 << 20,
        batch_keys: int = check.MAX_KEYS_PER_CALL,
        resync_interval_s: float = 30.0,
        retry_backoff_s: tuple[float, float] = (0.05, 0.25),
        auth: ClientAuth | None = None,
    ) -> None:
        """``auth``: what the node presents to every metaserver replica (token, TLS; common/auth.py)."""
        check.node_id(node_id)
        check.address(address)
        if not targets.addresses and not targets.etcd_endpoints:
            raise ValueError("no metaserver address given")
        if not 0 < batch_keys <= check.MAX_KEYS_PER_CALL:
            raise ValueError(f"batch_keys must be 1..{check.MAX_KEYS_PER_CALL}, got {batch_keys}")
        if max_queued_keys < batch_keys:
            raise ValueError("max_queued_keys must hold at least one batch")
        self.node_id = node_id
        self.address = address
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self._snapshot = snapshot
        self._finder = _LeaderFinder(targets, min(rpc_timeout_s, discovery_timeout_s), auth)
        self._lease_ttl_s = lease_ttl_s
        self.rpc_timeout_s = rpc_timeout_s
        self.max_queued_keys = max_queued_keys
        self.batch_keys = batch_keys
        self.resync_interval_s = resync_interval_s
        self._backoff = retry_backoff_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[bool, str, list[bytes]]] = collections.deque()
        self._queued_keys = 0
        # False while no registration stands: deltas are superseded by the next snapshot.
        self._accepting = False
        self._resync_wanted = False
        self._last_sync = 0.0
        self._session: _Session | None = None
        self._max_term = 0
        self._last_term: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # counters (plain ints: the server maps them to Prometheus metrics)
        self.published_keys = 0
        self.published_batches = 0
        self.duplicate_batches = 0
        self.dropped_keys = 0
        self.superseded_keys = 0
        self.invalid_keys = 0
        self.publish_failures = 0
        self.registrations = 0
        self.republishes = 0
        self.republished_keys = 0
        self.leader_changes = 0
        self.sessions_lost = 0
        self.locate_calls = 0
        self.locate_failures = 0
        self.locate_skipped = 0
        self.locate_seconds_total = 0.0

    # ------------------------------------------------------------ lifetime

    def start(self) -> BlockPublisher:
        self._thread = threading.Thread(target=self._run, name="metaserver-publisher", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.rpc_timeout_s + 5)
        session = self._session
        self._session = None
        if session is not None:
            try:
                session.client.unregister(session.lease_id, timeout_s=self.rpc_timeout_s)
            except errors.MetaServerError as exc:
                log.info("metaserver: unregister of %s failed (%s); its lease will expire", self.node_id, exc)
        self._finder.close()

    def __enter__(self) -> BlockPublisher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------- publishing

    def blocks_added(self, namespace: str, hashes: Sequence[bytes]) -> bool:
        return self._enqueue(True, namespace, hashes)

    def blocks_removed(self, namespace: str, hashes: Sequence[bytes]) -> bool:
        return self._enqueue(False, namespace, hashes)

    def _enqueue(self, added: bool, namespace: str, hashes: Sequence[bytes]) -> bool:
        n = len(hashes)
        if not n:
            return True
        if (
            not namespace
            or len(namespace) > check.MAX_NAMESPACE_CHARS
            or not all(0 < len(h) <= check.MAX_HASH_BYTES for h in hashes)
        ):
            with self._lock:
                self.invalid_keys += n
            return False
        with self._wake:
            if not self._accepting:
                self.superseded_keys += n
                return True
            if self._queued_keys + n > self.max_queued_keys:
                self.dropped_keys += n
                self._resync_wanted = True
                return False
            self._queue.append((added, namespace, list(hashes)))
            self._queued_keys += n
            self._wake.notify()
        return True

    # ------------------------------------------------------------ locating

    def locate(self, namespace: str, hashes: Sequence[bytes], timeout_s: float = 0.05) -> list[NodeHit]:
        return self.try_locate(namespace, hashes, timeout_s) or []

    def try_locate(
        self, namespace: str, hashes: Sequence[bytes], timeout_s: float = 0.05
    ) -> list[NodeHit] | None:
        session = self._session
        if session is None or not hashes:
            self.locate_skipped += 1
            return None if session is None else []
        started = time.perf_counter()
        self.locate_calls += 1
        try:
            hits, term = session.client.locate_term(namespace, hashes, self.node_id, timeout_s=timeout_s)
        except errors.NotLeader:
            self.locate_failures += 1
            self._suspect(session)
            return None
        except Exception as exc:  # the fetch path must never see an error from here
            self.locate_failures += 1
            log.debug("metaserver: locate failed: %s", exc)
            return None
        finally:
            self.locate_seconds_total += time.perf_counter() - started
        if term != session.term:
            # Another term answered (a new leader took over this address): not our registration's index.
            self.locate_failures += 1
            self._suspect(session)
            return None
        return hits

    def _suspect(self, session: _Session) -> None:
        """A caller saw the session's leader refuse: wake the publisher thread to check it now."""
        session.next_heartbeat = 0.0
        with self._wake:
            self._wake.notify()

    # --------------------------------------------------------------- stats

    def stats(self) -> PublisherStats:
        session = self._session
        return PublisherStats(
            connected=session is not None,
            leader_address=session.address if session else "",
            term=session.term if session else 0,
            queue_depth_keys=self._queued_keys,
            queue_limit_keys=self.max_queued_keys,
            published_keys=self.published_keys,
            published_batches=self.published_batches,
            duplicate_batches=self.duplicate_batches,
            dropped_keys=self.dropped_keys,
            superseded_keys=self.superseded_keys,
            invalid_keys=self.invalid_keys,
            publish_failures=self.publish_failures,
            registrations=self.registrations,
            republishes=self.republishes,
            republished_keys=self.republished_keys,
            leader_changes=self.leader_changes,
            sessions_lost=self.sessions_lost,
            locate_calls=self.locate_calls,
            locate_failures=self.locate_failures,
            locate_skipped=self.locate_skipped,
            locate_seconds_total=self.locate_seconds_total,
        )

    # ------------------------------------------------- the publisher thread

    def _run(self) -> None:
        backoff = self._backoff[0]
        while not self._stop.is_set():
            try:
                if self._session is None:
                    if not self._connect():
                        # Jittered so that many nodes do not ask the replicas in lockstep.
                        self._stop.wait(backoff * (0.5 + random.random()))
                        backoff = min(self._backoff[1], backoff * 2)
                        continue
                    backoff = self._backoff[0]
                self._pump(self._session)
            except _SessionLost as exc:
                self._lose_session(str(exc))
            except Exception:
                log.exception("metaserver: publisher step failed; registering again")
                self._lose_session("unexpected error")
                self._stop.wait(backoff)

    def _lose_session(self, reason: str) -> None:
        if self._session is not None:
            self.sessions_lost += 1
            log.warning(
                "metaserver: node %s lost its registration (%s); re-registering", self.node_id, reason
            )
        self._session = None
        with self._wake:
            self._accepting = False
            self.superseded_keys += self._queued_keys
            self._queue.clear()
            self._queued_keys = 0

    def _connect(self) -> bool:
        found = self._finder.find()
        if found is None:
            return False
        client, address, term = found
        if term < self._max_term:
            return False  # an old leader that has not noticed yet
        try:
            reg = client.register(self.node_id, self.address, self._lease_ttl_s, incarnation=self.incarnation)
        except errors.MetaServerError as exc:
            log.debug("metaserver: register at %s failed: %s", address, exc)
            return False
        if reg.term < self._max_term:
            return False
        self._max_term = reg.term
        if self._last_term is not None and reg.term != self._last_term:
            self.leader_changes += 1
        self._last_term = reg.term
        self.registrations += 1
        session = _Session(
            client=client,
            address=address,
            lease_id=reg.lease_id,
            term=reg.term,
            heartbeat_interval_s=reg.heartbeat_interval_s,
            lease_ttl_s=reg.lease_ttl_s,
            next_heartbeat=time.monotonic() + reg.heartbeat_interval_s,
        )
        with self._wake:
            # From here on deltas queue; everything before is in the snapshot read next.
            self._accepting = True
            self._resync_wanted = False
        first = self.registrations == 1
        log.info(
            "metaserver: node %s registered at %s (term %d); publishing what it holds",
            self.node_id,
            address,
            reg.term,
        )
        if not first:
            # Counted as it starts: the metaserver may hold every block before this thread returns.
            self.republishes += 1
        self._publish_snapshot(session)
        self._last_sync = time.monotonic()
        self._session = session
        return True

    def _publish_snapshot(self, session: _Session) -> None:
        batch: list[NamespaceDelta] = []
        size = 0
        try:
            for namespace, hashes in self._snapshot():
                if self._stop.is_set():
                    return
                hashes = [h for h in hashes if 0 < len(h) <= check.MAX_HASH_BYTES]
                start = 0
                while start < len(hashes):
                    take = min(self.batch_keys - size, len(hashes) - start)
                    batch.append(NamespaceDelta(namespace, added=hashes[start : start + take]))
                    size += take
                    start += take
                    if size == self.batch_keys or len(batch) == check.MAX_DELTAS_PER_CALL:
                        self._send(session, batch, snapshot=True)
                        batch, size = [], 0
            if batch:
                self._send(session, batch, snapshot=True)
        except _SessionLost:
            raise
        except Exception as exc:
            raise _SessionLost(f"the snapshot callback failed: {type(exc).__name__}: {exc}") from exc

    def _pump(self, session: _Session) -> None:
        """Sends what is queued, heartbeats when due; waits a little when there is nothing to do."""
        now = time.monotonic()
        if now >= session.next_heartbeat:
            self._heartbeat(session)
        if self._resync_wanted and now - self._last_sync >= self.resync_interval_s:
            raise _SessionLost("deltas were dropped from a full queue: re-publishing everything")
        batch = self._take_batch()
        if batch:
            self._send(session, batch, snapshot=False)
            return
        with self._wake:
            if not self._queue and not self._stop.is_set():
                self._wake.wait(timeout=max(0.0, session.next_heartbeat - time.monotonic()))

    def _take_batch(self) -> list[NamespaceDelta]:
        deltas: list[NamespaceDelta] = []
        size = 0
        with self._lock:
            while self._queue and size < self.batch_keys and len(deltas) < check.MAX_DELTAS_PER_CALL:
                added, namespace, hashes = self._queue[0]
                take = min(self.batch_keys - size, len(hashes))
                if take == len(hashes):
                    self._queue.popleft()
                    part = hashes
                else:
                    part, self._queue[0] = hashes[:take], (added, namespace, hashes[take:])
                self._queued_keys -= take
                size += take
                last = deltas[-1] if deltas else None
                if last is not None and last.namespace == namespace and bool(last.added) == added:
                    # The same kind of change to the same namespace as the previous one: merge.
                    (last.added if added else last.removed).extend(part)
                else:
                    deltas.append(
                        NamespaceDelta(namespace, added=list(part))
                        if added
                        else NamespaceDelta(namespace, removed=list(part))
                    )
        return deltas

    def _heartbeat(self, session: _Session) -> None:
        try:
            _, term = session.client.heartbeat_term(session.lease_id, timeout_s=self.rpc_timeout_s)
        except (errors.LeaseLost, errors.NotLeader, errors.StaleIncarnation) as exc:
            raise _SessionLost(f"{type(exc).__name__}: {exc}") from None
        except errors.MetaServerError as exc:
            # Unreachable for now: the lease may still be alive; retry soon, give up near its end.
            self.publish_failures += 1
            session.next_heartbeat = time.monotonic() + min(0.2, session.heartbeat_interval_s)
            log.debug("metaserver: heartbeat failed: %s", exc)
            self._check_for_new_leader(session)
            self._give_up_if_too_long(session)
            return
        if term != session.term:
            raise _SessionLost(f"heartbeat answered by term {term}, registered in {session.term}")
        session.last_ok = time.monotonic()
        session.next_heartbeat = session.last_ok + session.heartbeat_interval_s

    def _check_for_new_leader(self, session: _Session) -> None:
        """After a failed call: if another replica serves a later term, move there now (do not wait
        for the old leader's lease to run out on our side)."""
        found = self._finder.find()
        if found is not None and found[2] > session.term:
            raise _SessionLost(f"{found[1]} leads term {found[2]}")

    @staticmethod
    def _give_up_if_too_long(session: _Session) -> None:
        # A lease silent for half its TTL is as good as lost: find the leader (maybe a new one) now.
        if time.monotonic() - session.last_ok > 0.5 * session.lease_ttl_s:
            raise _SessionLost("the metaserver has not answered for half a lease")

    def _send(self, session: _Session, deltas: list[NamespaceDelta], snapshot: bool) -> None:
        """One sequenced batch, retried with the same sequence until applied (or the session is lost)."""
        keys = sum(len(d.added) + len(d.removed) for d in deltas)
        sequence = session.next_sequence
        give_up = time.monotonic() + 0.5 * session.lease_ttl_s
        wait = self._backoff[0]
        while True:
            if self._stop.is_set():
                raise _SessionLost("stopping")
            try:
                result, term = session.client.publish_batch(
                    session.lease_id, deltas, self.incarnation, sequence, timeout_s=self.rpc_timeout_s
                )
                break
            except (errors.LeaseLost, errors.NotLeader, errors.StaleIncarnation) as exc:
                raise _SessionLost(f"{type(exc).__name__}: {exc}") from None
            except errors.InvalidArgument as exc:
                # Our own checks ran on every key: a metaserver with other limits. Drop the batch.
                self.invalid_keys += keys
                log.error("metaserver: a publish batch was refused as invalid: %s", exc)
                raise _SessionLost("a batch was refused as invalid; its sequence number is spent") from None
            except errors.MetaServerError as exc:
                self.publish_failures += 1
                if time.monotonic() + wait > give_up:
                    raise _SessionLost(f"publishing failed for half a lease: {exc}") from None
                self._check_for_new_leader(session)
                self._stop.wait(wait)
                wait = min(self._backoff[1], wait * 2)
        if term != session.term:
            raise _SessionLost(f"publish answered by term {term}, registered in {session.term}")
        if result.outcome in (PublishOutcome.SEQUENCE_GAP, PublishOutcome.STALE_INCARNATION):
            raise _SessionLost(f"the metaserver answered {result.outcome.name} to batch {sequence}")
        if result.outcome is PublishOutcome.DUPLICATE:
            self.duplicate_batches += 1
        session.next_sequence = sequence + 1
        session.last_ok = time.monotonic()
        self.published_batches += 1
        self.published_keys += keys
        if snapshot:
            self.republished_keys += keys
