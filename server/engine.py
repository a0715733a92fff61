"""KVEngine: the pool, the block index, the eviction policy, sessions, leases and saves, composed.

No gRPC here: the servicer is a thin translation layer over this class, and
the connector's embedded mode runs it in-process. The engine hands out and
takes back *locations* in the pool; it never moves KV bytes itself. Whoever
writes or reads them (a client through its mapping today, a server-side GPU
copier driving CUDA IPC handles later) uses the same allocate -> seal and
query(lease) -> release calls, so bookkeeping and copying stay separate.

Concurrency: one lock guards the index, the allocator, the sessions, leases and
saves; every critical section is a short loop over one request's blocks. The
policy has its own lock and is only entered *after* the engine lock (never the
reverse). Frequency signals (record_lookups, on_access) and metrics/HLL
observations are issued after the engine lock is released, so they cannot
stall other requests. Each public method takes an optional ``deadline``
(time.monotonic() value) and raises DeadlineExceeded rather than finishing late.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from pegaflow import __version__
from pegaflow.server.config import ServerConfig
from pegaflow.server.errors import (
    Closed,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from pegaflow.server.index.block_index import SEALED, BlockEntry, BlockIndex, BlockKey
from pegaflow.server.index.namespace import KvLayout, Namespace, NamespaceTable
from pegaflow.server.lease.leases import Lease, LeaseTable
from pegaflow.server.lease.saves import Save, SaveTable
from pegaflow.server.lease.sessions import Session, SessionTable
from pegaflow.server.lease.tombstones import Tombstones
from pegaflow.server.policy import make_policy
from pegaflow.server.pool.allocator import SlabAllocator
from pegaflow.server.pool.region import PoolRegion

log = logging.getLogger(__name__)


class AllocStatus(enum.IntEnum):
    """Same numbers as proto AllocStatus."""

    GRANTED = 1
    EXISTS = 2
    IN_PROGRESS = 3
    REJECTED = 4
    NO_SPACE = 5


class Tier(enum.IntEnum):
    """Same numbers as proto Tier."""

    DRAM = 1


class QueryPurpose(enum.IntEnum):
    """Same numbers as proto QueryPurpose: what a prefix query means for the statistics.

    A block is *requested* once (LOOKUP: hits, misses, hit-rate windows, HLL ceiling, the policy's
    frequency sketch) however many times it is then *loaded* (LOAD: pins and recency only), e.g. a
    scheduler's lookup followed by each worker rank's leasing query.
    """

    LOOKUP = 0
    LOAD = 1


class Location(NamedTuple):
    offset: int
    length: int
    tier: Tier = Tier.DRAM


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    session_id: str
    heartbeat_interval_s: float
    ttl_s: float
    epoch: str
    pool_size_bytes: int
    hugepages: bool
    server_version: str


@dataclasses.dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    namespace_id: str
    block_bytes: int


@dataclasses.dataclass(frozen=True)
class PrefixResult:
    num_hits: int
    lease_id: str  # "" when no lease was taken
    offsets: list[int]  # one per hit; each block is block_bytes long, in DRAM
    block_bytes: int
    epoch: str

    @property
    def locations(self) -> list[Location]:
        return [Location(offset, self.block_bytes) for offset in self.offsets]


@dataclasses.dataclass(frozen=True)
class AllocateResult:
    save_id: str  # "" when nothing was granted
    statuses: list[AllocStatus]  # one per requested hash
    offsets: list[int]  # one per GRANTED status, in order
    block_bytes: int
    epoch: str

    @property
    def locations(self) -> list[Location | None]:
        """One per requested hash: where to write it, or None when not GRANTED."""
        granted = iter(self.offsets)
        return [
            Location(next(granted), self.block_bytes) if status == AllocStatus.GRANTED else None
            for status in self.statuses
        ]


@dataclasses.dataclass(frozen=True)
class NamespaceStats:
    namespace_id: str
    model_id: str
    block_bytes: int
    resident_blocks: int
    instances: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    epoch: str
    pool_capacity_bytes: int
    pool_used_bytes: int  # bytes of allocated blocks (sealed + being written)
    resident_blocks: int  # sealed
    pinned_blocks: int
    writing_blocks: int
    hits: int
    misses: int
    evictions: int
    admission_rejections: int
    live_sessions: int
    live_instances: int
    live_leases: int
    open_saves: int
    namespaces: list[NamespaceStats]
    slab_bytes: int
    free_slabs: int
    total_slabs: int
    stranded_bytes: int
    slab_moves: int
    save_bytes: int
    load_bytes: int
    lookup_queries: int
    load_queries: int
    load_missed_blocks: int


class Counters:
    """Monotonic totals; read without the lock by metrics (a torn read is one scrape off)."""

    __slots__ = (
        "hits",
        "misses",
        "queries",
        "load_queries",
        "load_missed_blocks",
        "evictions",
        "sealed_blocks",
        "save_bytes",
        "load_bytes",
        "aborted_blocks",
        "expired_leases",
        "timed_out_saves",
        "expired_sessions",
        "closed_sessions",
        "disconnected_sessions",
        "no_space_blocks",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


class EngineObserver:
    """Receives what metrics need, outside the engine lock. The default does nothing."""

    def on_lookup(self, namespace_index: int, hashes: Sequence[bytes], hits: int) -> None:
        pass

    def on_save(self, nbytes: int, seconds: float) -> None:
        pass

    def on_load(self, nbytes: int, seconds: float) -> None:
        pass


class _Instance:
    __slots__ = ("id", "session_id", "namespace", "name")

    def __init__(self, session_id: str, namespace: Namespace, name: str):
        self.id = "i-" + secrets.token_hex(12)
        self.session_id = session_id
        self.namespace = namespace
        self.name = name


class KVEngine:
    """Thread-safe cache engine. ``KVEngine(config)`` allocates the pool; ``close()`` frees it."""

    def __init__(
        self,
        config: ServerConfig,
        observer: EngineObserver | None = None,
        region: PoolRegion | None = None,
    ):
        self.config = config
        self.observer = observer or EngineObserver()
        self.epoch = secrets.token_hex(8)
        self.region = region or PoolRegion.create(
            config.pool_size_bytes, config.use_hugepages, config.pool_dir
        )
        try:
            self.allocator = SlabAllocator(self.region.size_bytes, config.slab_bytes)
            self.policy = make_policy(config.enable_lfu_admission, self.region.size_bytes)
        except BaseException:
            self.region.close()
            raise
        self.counters = Counters()
        self._lock = threading.Lock()
        self._namespaces = NamespaceTable()
        self._index = BlockIndex()
        self._sessions = SessionTable(config.session_ttl_s)
        self._leases = LeaseTable()
        self._saves = SaveTable()
        # Ids released / aborted before they existed: a late call with one is refused (see tombstones.py).
        self._tombstones = Tombstones(config.write_timeout_s)
        self._instances: dict[str, _Instance] = {}
        self._session_listeners: list[Callable[[str], None]] = []
        self._ended_sessions: list[str] = []  # ended under the lock, announced after it
        self._closed = False
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="pegaflow-reaper", daemon=True)
        self._reaper.start()
        log.info(
            "engine: epoch %s, policy %s, %d slabs of %d bytes",
            self.epoch,
            self.policy.name,
            self.allocator.total_slabs,
            self.allocator.slab_bytes,
        )

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stops background work and frees the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._reaper.is_alive() and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)
        self.region.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def add_session_listener(self, callback: Callable[[str], None]) -> None:
        """``callback(session_id)`` runs after a session ended for any reason (closed, its pool connection
        dropped, heartbeat timeout), outside the engine lock, on the thread that ended it. For state kept
        per session outside the engine (e.g. a GPU data path's CUDA IPC mappings)."""
        self._session_listeners.append(callback)

    def _announce_ended_sessions(self) -> None:
        if not self._ended_sessions:
            return
        with self._lock:
            ended, self._ended_sessions = self._ended_sessions, []
        for session_id in ended:
            for callback in self._session_listeners:
                try:
                    callback(session_id)
                except Exception:
                    log.exception("session listener failed for %s", session_id)

    def pool_view(self) -> np.ndarray:
        """The whole pool as a uint8 array (embedded users and a server-side copier write through it)."""
        return np.frombuffer(self.region.buffer, dtype=np.uint8)

    @contextlib.contextmanager
    def _locked(self, deadline: float | None):
        if deadline is None:
            self._lock.acquire()
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._lock.acquire(timeout=remaining):
                raise DeadlineExceeded("deadline passed while waiting for the engine")
        try:
            if self._closed:
                raise Closed("engine is closed")
            yield
        finally:
            self._lock.release()

    # -------------------------------------------------------------- sessions

    def open_session(
        self,
        client_name: str = "",
        pid: int = 0,
        hostname: str = "",
        expires: bool = True,
        deadline: float | None = None,
    ) -> SessionInfo:
        """A new session. ``expires=False`` (in-process users) needs no heartbeat; close it explicitly."""
        with self._locked(deadline):
            session = self._sessions.open(client_name, pid, hostname, time.monotonic(), expires)
        log.info("session %s opened: %r pid %d on %r", session.id, client_name, pid, hostname)
        return SessionInfo(
            session_id=session.id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            ttl_s=self.config.session_ttl_s,
            epoch=self.epoch,
            pool_size_bytes=self.region.size_bytes,
            hugepages=self.region.hugepages,
            server_version=__version__,
        )

    def heartbeat(self, session_id: str, deadline: float | None = None) -> str:
        with self._locked(deadline):
            self._live_session(session_id)
        return self.epoch

    def close_session(self, session_id: str, deadline: float | None = None) -> None:
        with self._locked(deadline):
            session = self._live_session(session_id)
            self._end_session(session, "closed by client")
            self.counters.closed_sessions += 1
        self._announce_ended_sessions()

    def attach_session(self, session_id: str) -> dict:
        """A pool-fd connection of this session opened (fd broker). Returns the broker's header."""
        with self._locked(None):
            session = self._live_session(session_id)
            session.attachments += 1
        return {"epoch": self.epoch, "size_bytes": self.region.size_bytes, "hugepages": self.region.hugepages}

    def detach_session(self, session_id: str) -> None:
        """A pool-fd connection closed: the client process is gone (or dropped the pool), end its session."""
        with self._locked(None):
            session = self._sessions.get(session_id)
            if session is None:
                return
            session.attachments -= 1
            if session.attachments <= 0:
                self._end_session(session, "pool connection closed")
                self.counters.disconnected_sessions += 1
        self._announce_ended_sessions()

    # ------------------------------------------------------------- instances

    def register_instance(
        self, session_id: str, layout: KvLayout, name: str = "", deadline: float | None = None
    ) -> InstanceInfo:
        layout.validate(self.allocator.max_block_bytes)
        with self._locked(deadline):
            session = self._live_session(session_id)
            if len(session.instances) >= self.config.max_instances_per_session:
                raise ResourceExhausted(
                    f"session {session_id} already has {len(session.instances)} instances (the limit)"
                )
            namespace = self._namespaces.intern(layout)
            instance = _Instance(session.id, namespace, name)
            self._instances[instance.id] = instance
            session.instances.add(instance.id)
        log.info(
            "instance %s (%r) registered in %s (%s, %d bytes/block)",
            instance.id,
            name,
            namespace.id,
            layout.model_id,
            layout.block_bytes,
        )
        return InstanceInfo(instance.id, namespace.id, layout.block_bytes)

    def unregister_instance(self, session_id: str, instance_id: str, deadline: float | None = None) -> None:
        with self._locked(deadline):
            self._live_session(session_id)
            instance = self._instance(instance_id)
            del self._instances[instance.id]
            owner = self._sessions.get(instance.session_id)
            if owner is not None:
                owner.instances.discard(instance.id)

    # ------------------------------------------------------------- load path

    def query_prefix(
        self,
        session_id: str,
        instance_id: str,
        hashes: Sequence[bytes],
        lease: bool = False,
        lease_ttl_s: float | None = None,
        deadline: float | None = None,
        lease_id: str = "",
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
        account: bool = True,
    ) -> PrefixResult:
        """Leading sealed hits of ``hashes``; with ``lease`` they are pinned until released or expired.

        ``lease_id`` optionally names the lease (client-chosen, so it can release it after a timeout).
        ``purpose``: LOOKUP counts the hashes as block requests, LOAD only renews the hits' recency
        (see QueryPurpose). ``account=False``: the caller queries one chain in several calls and
        accounts for all of them at once with ``account_query`` (the hits are touched either way).
        """
        self._check_hashes(hashes)
        ttl = self._lease_ttl(lease_ttl_s)
        with self._locked(deadline):
            session = self._live_session(session_id)
            if lease and lease_id:
                self._check_new_id(lease_id, self._leases.get(lease_id) is not None, "lease")
            namespace = self._instance(instance_id).namespace
            ns_index = namespace.index
            get = self._index.get
            hits: list[BlockEntry] = []
            for block_hash in hashes:
                entry = get((ns_index, block_hash))
                if entry is None or entry.state != SEALED:
                    break
                hits.append(entry)
            taken = ""
            if lease and hits and len(session.leases) >= self.config.max_leases_per_session:
                raise ResourceExhausted(
                    f"session {session_id} holds {len(session.leases)} leases (the limit)"
                )
            if lease and hits:
                taken = self._take_lease(session, instance_id, hits, ttl, lease_id)
            offsets = [e.offset for e in hits]
            if account:
                self._count_query(purpose, len(hashes), len(hits))
        self._after_query(purpose, ns_index, hashes, hits, account)
        return PrefixResult(len(hits), taken, offsets, namespace.block_bytes, self.epoch)

    def account_query(
        self,
        session_id: str,
        instance_id: str,
        hashes: Sequence[bytes],
        num_hits: int,
        purpose: QueryPurpose,
        deadline: float | None = None,
    ) -> None:
        """Counts ``hashes`` as one query of ``purpose`` that hit its first ``num_hits`` blocks, for a
        caller that looked the chain up in several ``query_prefix(account=False)`` calls."""
        self._check_hashes(hashes)
        if not 0 <= num_hits <= len(hashes):
            raise InvalidArgument(f"num_hits {num_hits} is not within 0..{len(hashes)}")
        with self._locked(deadline):
            self._live_session(session_id)
            ns_index = self._instance(instance_id).namespace.index
            self._count_query(purpose, len(hashes), num_hits)
        if purpose == QueryPurpose.LOOKUP:
            self._signal(self._lookup_signals, ns_index, hashes, num_hits)

    def refresh_chain(
        self, session_id: str, instance_id: str, hashes: Sequence[bytes], deadline: float | None = None
    ) -> None:
        """Renews the recency of the stored blocks of the chain ``hashes``, tail first, so that its
        head ends the most recent; counts nothing. For a caller that saved or loaded one chain in
        several calls, each of which left its own part head-first (the GPU data path's chunks)."""
        self._check_hashes(hashes)
        with self._locked(deadline):
            self._live_session(session_id)
            ns_index = self._instance(instance_id).namespace.index
            self._refresh_stored(ns_index, hashes)

    def load_blocks(
        self, session_id: str, instance_id: str, lease_id: str, deadline: float | None = None
    ) -> PrefixResult:
        """Locations of a lease's blocks (all DRAM-resident today; lower tiers would be promoted here)."""
        with self._locked(deadline):
            self._live_session(session_id)
            instance = self._instance(instance_id)
            held = self._leases.get(lease_id)
            if held is None:
                raise NotFound("lease", lease_id)
            if held.entries and held.entries[0].key[0] != instance.namespace.index:
                raise InvalidArgument(
                    f"lease {lease_id} belongs to another namespace than instance {instance_id}"
                )
            return PrefixResult(
                len(held.entries),
                lease_id,
                [e.offset for e in held.entries],
                instance.namespace.block_bytes,
                self.epoch,
            )

    def release_lease(
        self, session_id: str, lease_id: str, loaded_bytes: int = 0, deadline: float | None = None
    ) -> None:
        with self._locked(deadline):
            self._live_session(session_id)
            held = self._leases.get(lease_id)
            if held is None:
                self._tombstones.add(lease_id, time.monotonic())
                raise NotFound("lease", lease_id)
            self._drop_lease(held)
            age = time.monotonic() - held.created_at
            if loaded_bytes:
                self.counters.load_bytes += loaded_bytes
        if loaded_bytes:
            self.observer.on_load(loaded_bytes, age)

    # ------------------------------------------------------------- save path

    def allocate_blocks(
        self,
        session_id: str,
        instance_id: str,
        hashes: Sequence[bytes],
        deadline: float | None = None,
        save_id: str = "",
    ) -> AllocateResult:
        """Per hash: GRANTED (+ location to write, then seal), EXISTS, IN_PROGRESS or NO_SPACE.

        ``save_id`` optionally names the save (client-chosen, so it can abort it after a timeout).
        """
        self._check_hashes(hashes)
        with self._locked(deadline):
            session = self._live_session(session_id)
            if save_id:
                self._check_new_id(save_id, self._saves.get(save_id) is not None, "save")
            namespace = self._instance(instance_id).namespace
            ns_index, block_bytes = namespace.index, namespace.block_bytes
            now = time.monotonic()
            save = Save(
                session.id, instance_id, ns_index, tuple(hashes), now, self.config.write_timeout_s, save_id
            )
            statuses: list[AllocStatus] = []
            new_hashes: list[bytes] = []
            new_positions: list[int] = []
            get = self._index.get
            stored: list[BlockEntry] = []
            for position, block_hash in enumerate(hashes):
                entry = get((ns_index, block_hash))
                if entry is not None:
                    if entry.state == SEALED:
                        statuses.append(AllocStatus.EXISTS)
                        stored.append(entry)
                    else:
                        statuses.append(AllocStatus.IN_PROGRESS)
                elif block_hash in save.pending:  # the same hash twice in one request
                    statuses.append(AllocStatus.IN_PROGRESS)
                else:
                    save.pending[block_hash] = None  # placeholder, keeps request order
                    statuses.append(AllocStatus.GRANTED)
                    new_hashes.append(block_hash)
                    new_positions.append(position)
            # Slots come back held, so a slab holding them is never chosen for a slab move meanwhile;
            # whatever could not be had (nothing evictable, deadline) is NO_SPACE. The chain's stored
            # blocks are not evicted to make room for its own tail, which is useless without them.
            offsets = self._allocate_slots(block_bytes, len(new_hashes), deadline, keep=stored)
            for position, block_hash in zip(
                new_positions[len(offsets) :], new_hashes[len(offsets) :], strict=True
            ):
                statuses[position] = AllocStatus.NO_SPACE
                del save.pending[block_hash]
                self.counters.no_space_blocks += 1
            entries = self._index.add_writing_many(
                ns_index, new_hashes[: len(offsets)], offsets, block_bytes, save.id
            )
            for entry in entries:
                save.pending[entry.key[1]] = entry
            save_id = ""
            if save.pending:
                self._saves.add(save)
                session.saves.add(save.id)
                save_id = save.id
            else:
                # Nothing to write, so no seal will restate the chain: restate it now.
                self._refresh_stored(ns_index, save.chain)
        return AllocateResult(save_id, statuses, offsets, block_bytes, self.epoch)

    def seal_blocks(
        self, session_id: str, save_id: str, hashes: Sequence[bytes] = (), deadline: float | None = None
    ) -> int:
        """Makes written blocks visible: the listed ones, or every pending block of the save."""
        with self._locked(deadline):
            self._live_session(session_id)
            save = self._saves.get(save_id)
            if save is None:
                raise NotFound("save", save_id)
            if hashes:
                targets = list(dict.fromkeys(hashes))
                for block_hash in targets:
                    if block_hash not in save.pending:
                        raise InvalidArgument(
                            f"block {block_hash.hex()} is not a granted, unsealed block of save {save_id}"
                        )
            else:
                targets = list(save.pending)
            sealing = {block_hash: save.pending.pop(block_hash) for block_hash in targets}
            self.allocator.unhold_many([entry.offset for entry in sealing.values()])
            sealed_bytes = self._seal_chain(save, sealing)
            save.sealed_bytes += sealed_bytes
            self.counters.sealed_blocks += len(targets)
            self.counters.save_bytes += sealed_bytes
            finished = not save.pending
            if finished:
                self._forget_save(save)
            age = time.monotonic() - save.created_at
        if finished and save.sealed_bytes:
            self.observer.on_save(save.sealed_bytes, age)
        return len(targets)

    def abort_blocks(self, session_id: str, save_id: str, deadline: float | None = None) -> int:
        """Frees a save's unsealed blocks (they never become visible). Returns how many."""
        with self._locked(deadline):
            self._live_session(session_id)
            save = self._saves.get(save_id)
            if save is None:
                self._tombstones.add(save_id, time.monotonic())
                raise NotFound("save", save_id)
            return self._abort_save(save)

    # ---------------------------------------------------------- introspection

    def stats(self, deadline: float | None = None) -> EngineStats:
        with self._locked(deadline):
            alloc = self.allocator.stats()
            per_ns_instances: dict[int, int] = {}
            for instance in self._instances.values():
                per_ns_instances[instance.namespace.index] = (
                    per_ns_instances.get(instance.namespace.index, 0) + 1
                )
            namespaces = [
                NamespaceStats(
                    ns.id,
                    ns.model_id,
                    ns.block_bytes,
                    self._index.sealed_in(ns.index),
                    per_ns_instances.get(ns.index, 0),
                )
                for ns in self._namespaces
            ]
            return EngineStats(
                epoch=self.epoch,
                pool_capacity_bytes=self.region.size_bytes,
                pool_used_bytes=alloc.used_bytes,
                resident_blocks=self._index.sealed,
                pinned_blocks=self._index.pinned,
                writing_blocks=self._index.writing,
                hits=self.counters.hits,
                misses=self.counters.misses,
                evictions=self.counters.evictions,
                admission_rejections=self.policy.admission_rejections,
                live_sessions=len(self._sessions),
                live_instances=len(self._instances),
                live_leases=len(self._leases),
                open_saves=len(self._saves),
                namespaces=namespaces,
                slab_bytes=alloc.slab_bytes,
                free_slabs=alloc.free_slabs,
                total_slabs=alloc.total_slabs,
                stranded_bytes=alloc.stranded_bytes,
                slab_moves=self.allocator.slab_moves,
                save_bytes=self.counters.save_bytes,
                load_bytes=self.counters.load_bytes,
                lookup_queries=self.counters.queries,
                load_queries=self.counters.load_queries,
                load_missed_blocks=self.counters.load_missed_blocks,
            )

    # -------------------------------------------------------------- internals

    def _live_session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound("session", session_id)
        # Any request is as good as a heartbeat.
        session.last_seen = time.monotonic()
        return session

    def _instance(self, instance_id: str) -> _Instance:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise NotFound("instance", instance_id)
        return instance

    def _check_hashes(self, hashes: Sequence[bytes]) -> None:
        # The RPC layer checks too (with clearer messages); embedded callers only pass through here.
        if len(hashes) > self.config.max_batch_blocks:
            raise InvalidArgument(
                f"{len(hashes)} block hashes exceed the limit of {self.config.max_batch_blocks}"
            )
        if not hashes:
            return
        if not all(map(bytes.__instancecheck__, hashes)):
            raise InvalidArgument("block hashes must be bytes")
        lengths = list(map(len, hashes))
        if min(lengths) == 0 or max(lengths) > self.config.max_hash_bytes:
            raise InvalidArgument(f"every block hash must be 1..{self.config.max_hash_bytes} bytes")

    def _lease_ttl(self, lease_ttl_s: float | None) -> float:
        if not lease_ttl_s:
            return self.config.lease_ttl_s
        if lease_ttl_s < 0 or lease_ttl_s > self.config.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl must be in (0, {self.config.max_lease_ttl_s}] seconds")
        return lease_ttl_s

    def _count_query(self, purpose: QueryPurpose, requested: int, hits: int) -> None:
        """Under the lock. Only a LOOKUP is a block request; a LOAD's misses are blocks that vanished
        between the lookup that found them and the load."""
        counters = self.counters
        if purpose == QueryPurpose.LOOKUP:
            counters.queries += 1
            counters.hits += hits
            counters.misses += requested - hits
        else:
            counters.load_queries += 1
            counters.load_missed_blocks += requested - hits

    def _after_query(
        self,
        purpose: QueryPurpose,
        ns_index: int,
        hashes: Sequence[bytes],
        hits: list[BlockEntry],
        account: bool,
    ) -> None:
        """Recency, frequency and metrics signals of a query, outside the engine lock (the policy has
        its own). Hits are touched tail first, so the head of the prefix ends the most recent."""
        if purpose == QueryPurpose.LOOKUP:
            self._signal(self._lookup_signals, ns_index, hashes, len(hits) if account else None, hits)
        else:
            self._signal(self._refresh_signals, hits)

    def _signal(self, fn: Callable, *args) -> None:
        # A failure here must not fail the query (its lease is already taken): it is logged.
        try:
            fn(*args)
        except Exception:
            log.exception("query signals (policy / metrics) failed; the query itself succeeded")

    def _lookup_signals(
        self, ns_index: int, hashes: Sequence[bytes], num_hits: int | None, hits: Sequence[BlockEntry] = ()
    ) -> None:
        """A block request: ``hits`` are accessed; with ``num_hits`` (None: accounted later) every
        hash feeds the frequency sketch, the hit-rate windows and the HLL ceiling."""
        for entry in reversed(hits):
            self.policy.on_access(entry.key)
        if num_hits is not None:
            self.policy.record_lookups([(ns_index, h) for h in hashes])
            self.observer.on_lookup(ns_index, tuple(hashes), num_hits)

    def _refresh_signals(self, hits: Sequence[BlockEntry]) -> None:
        for entry in reversed(hits):
            self.policy.on_refresh(entry.key)

    def _seal_chain(self, save: Save, sealing: dict[bytes, BlockEntry]) -> int:
        """Under the lock: seals ``sealing`` and restates the save's chain, tail first.

        A save is an ordered chain (a prefix); its blocks are useless without the ones before them.
        Walking it from the tail, each block is inserted (being sealed now) or refreshed (stored
        already: the caller resent the part of the chain it loaded or found stored), so the chain
        ends ordered head > ... > tail in the policy, and under pressure a prefix loses its tail
        first. Blocks of the save still unwritten, and blocks not (or no longer) stored, are skipped.
        Returns the bytes sealed.
        """
        policy, get, seal, pending = self.policy, self._index.get, self._index.seal, save.pending
        ns_index = save.ns_index
        sealed_bytes = 0
        for block_hash in reversed(save.chain):
            entry = sealing.pop(block_hash, None)
            if entry is not None:
                seal(entry)
                policy.on_insert(entry.key, entry.length)
                sealed_bytes += entry.length
            elif block_hash not in pending:
                entry = get((ns_index, block_hash))
                if entry is not None and entry.state == SEALED:
                    policy.on_refresh(entry.key)
        return sealed_bytes

    def _refresh_stored(self, ns_index: int, chain: Sequence[bytes]) -> None:
        """Under the lock: refreshes the stored blocks of ``chain``, tail first."""
        policy, get = self.policy, self._index.get
        for block_hash in reversed(chain):
            entry = get((ns_index, block_hash))
            if entry is not None and entry.state == SEALED:
                policy.on_refresh(entry.key)

    def _check_new_id(self, ident: str, in_use: bool, kind: str) -> None:
        if ident in self._tombstones:
            raise DeadlineExceeded(f"{kind} {ident} was already given up by its caller")
        if in_use:
            raise FailedPrecondition(f"{kind} id {ident} is already in use")

    def _take_lease(
        self, session: Session, instance_id: str, entries: list[BlockEntry], ttl_s: float, ident: str = ""
    ) -> str:
        held = Lease(session.id, instance_id, entries, time.monotonic(), ttl_s, ident)
        for entry in entries:
            if self._index.pin(entry):
                self.allocator.hold(entry.offset)
        self._leases.add(held)
        session.leases.add(held.id)
        return held.id

    def _drop_lease(self, held: Lease) -> None:
        self._leases.remove(held.id)
        owner = self._sessions.get(held.session_id)
        if owner is not None:
            owner.leases.discard(held.id)
        for entry in held.entries:
            if self._index.unpin(entry):
                self.allocator.unhold(entry.offset)

    def _abort_save(self, save: Save) -> int:
        freed = 0
        for entry in save.pending.values():
            self._index.remove(entry)
            self.allocator.unhold(entry.offset)
            self.allocator.free(entry.offset)
            freed += 1
        save.pending.clear()
        self._forget_save(save)
        self.counters.aborted_blocks += freed
        return freed

    def _forget_save(self, save: Save) -> None:
        self._saves.remove(save.id)
        owner = self._sessions.get(save.session_id)
        if owner is not None:
            owner.saves.discard(save.id)

    def _end_session(self, session: Session, reason: str) -> None:
        self._sessions.remove(session.id)
        if self._session_listeners:
            self._ended_sessions.append(session.id)
        leases = [self._leases.get(lease_id) for lease_id in session.leases]
        for held in leases:
            if held is not None:
                self._drop_lease(held)
        freed = 0
        for save_id in list(session.saves):
            save = self._saves.get(save_id)
            if save is not None:
                freed += self._abort_save(save)
        for instance_id in session.instances:
            self._instances.pop(instance_id, None)
        log.info(
            "session %s (%r pid %d) ended: %s; "
            "released %d leases, freed %d unsealed blocks, dropped %d instances",
            session.id,
            session.client_name,
            session.pid,
            reason,
            len(leases),
            freed,
            len(session.instances),
        )

    def _is_pinned(self, key: BlockKey) -> bool:
        entry = self._index.get(key)
        return entry is None or entry.pins > 0

    def _evict(self, entry: BlockEntry) -> None:
        self._index.remove(entry)
        self.allocator.free(entry.offset)
        self.policy.on_remove(entry.key)
        self.counters.evictions += 1

    def _allocate_slots(
        self, block_bytes: int, count: int, deadline: float | None, keep: Sequence[BlockEntry] = ()
    ) -> list[int]:
        """Up to ``count`` held slots for blocks of this size, evicting as the policy says when the pool
        is full (never a block of ``keep``); fewer only when nothing evictable is left or the deadline
        passed.

        The policy's victims are evicted (whatever their size) until enough slots of this size are
        free: a victim of this size frees one, and a slab that empties can go to any size. Victims of
        other sizes leave free slots there that this size cannot use; whenever a slab's worth of those
        has piled up, a whole slab of another size (no pinned or half-written blocks, the emptiest) is
        evicted and moves to this size. Evicting first and allocating in one step afterwards hands out
        the freed slots in address order, so a batch that replaces an evicted batch stays contiguous.
        """
        allocator = self.allocator
        offsets = allocator.allocate_many(block_bytes, count, hold=True)
        need = count - len(offsets)
        if need == 0:
            return offsets
        skip = self._is_pinned
        if keep:
            kept = {entry.key for entry in keep}

            def skip(key: BlockKey) -> bool:
                return key in kept or self._is_pinned(key)

        freed_elsewhere = 0
        rounds = 0
        while allocator.available(block_bytes) < need:
            rounds += 1
            if rounds % 64 == 0 and deadline is not None and time.monotonic() > deadline:
                break  # grant what is free; the RPC layer undoes everything if the caller has left
            if freed_elsewhere >= allocator.slab_bytes:
                freed_elsewhere = 0
                if self._move_slab(block_bytes):
                    continue
            victim = self.policy.next_victim(skip)
            if victim is None:
                if not self._move_slab(block_bytes):
                    break  # nothing evictable is left
                continue
            entry = self._index.get(victim)
            if entry is None or entry.state != SEALED or entry.pins:
                # The policy tracks a key the engine no longer holds as resident: resync and go on.
                log.warning("policy offered a non-evictable key %r; dropping it from the policy", victim)
                self.policy.on_remove(victim)
                continue
            self._evict(entry)
            if entry.length != block_bytes:
                freed_elsewhere += entry.length
        offsets += allocator.allocate_many(block_bytes, need, hold=True)
        return offsets

    def _move_slab(self, block_bytes: int) -> bool:
        """Evicts every block of the emptiest movable slab of another size; False if there is none."""
        slab = self.allocator.reclaimable_slab(block_bytes)
        if slab is None:
            return False
        for slot_offset in self.allocator.used_offsets(slab):
            self._evict(self._index.at_offset(slot_offset))
        self.allocator.note_slab_move()
        return True

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.config.reaper_interval_s):
            try:
                self.reap()
            except Closed:
                return
            except Exception:
                log.exception("reaper failed; continuing")

    def reap(self, now: float | None = None) -> None:
        """Ends silent sessions, expires leases, frees saves past the write timeout."""
        now = time.monotonic() if now is None else now
        with self._locked(None):
            for session in self._sessions.expired(now):
                self._end_session(session, f"no heartbeat for {self.config.session_ttl_s:g} s")
                self.counters.expired_sessions += 1
            for held in self._leases.expired(now):
                self._drop_lease(held)
                self.counters.expired_leases += 1
            self._tombstones.prune(now)
            for save in self._saves.expired(now):
                freed = self._abort_save(save)
                self.counters.timed_out_saves += 1
                log.info(
                    "save %s timed out after %g s; freed %d unsealed blocks",
                    save.id,
                    self.config.write_timeout_s,
                    freed,
                )
        self._announce_ended_sessions()
