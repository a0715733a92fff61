"""KVEngine: the facade the RPC endpoints and the embedded mode call.

It composes three parts and adds the lock, deadlines and accounting:

- ``ClientRegistry`` (server/clients/): sessions, instances, leases, saves,
  tombstones — who is connected and what each of them holds;
- ``BlockStore`` (server/store/): the block index, the tiers' space, eviction,
  demotion and promotion decisions;
- ``TierMover`` (server/movers/): runs the store's planned transfers off the lock.

No gRPC here: the servicer is a thin translation layer over this class, and the
connector's embedded mode runs it in-process. The engine hands out and takes
back *locations* in the pool; it never moves KV bytes itself. Clients (through
their mapping), the GPU data path (server/gpu) and the tiers move them.

Concurrency: one lock guards the registry and the store; every critical
section is a short loop over one request's blocks, and no disk or network I/O
happens under it (transfers are submitted after it is released; their
completions take it briefly). The policy has its own lock, entered only after
the engine lock. Frequency signals and metrics observations are issued after
the engine lock is released. Each public method takes an optional
``deadline`` (time.monotonic() value) and raises DeadlineExceeded rather than
finishing late, waiting for nothing (the lock included) past it. What must not
be lost when it passes with the lock busy (a session's close, freeing a grant
that is not handed out) is handed to the reaper, which does it once the lock is
free (_hand_to_reaper).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pegaflow import __version__
from pegaflow.common.deadlines import acquire_by
from pegaflow.common.wire import read_lane as lane_wire
from pegaflow.common.wire import status as wire_status
from pegaflow.common.wire.checksum import checksum
from pegaflow.common.wire.types import AllocStatus, Location, QueryPurpose, Tier
from pegaflow.server.clients.leases import Lease
from pegaflow.server.clients.registry import ClientRegistry
from pegaflow.server.clients.saves import Save
from pegaflow.server.clients.sessions import Session
from pegaflow.server.clients.tenants import DEFAULT_TENANT, Tenant
from pegaflow.server.config import ServerConfig
from pegaflow.server.errors import (
    Closed,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PoolCapacityError,
    ResourceExhausted,
)
from pegaflow.server.interpreter_core import InterpreterCore
from pegaflow.server.movers.block_hasher import BlockHasher
from pegaflow.server.movers.foreground_priority import ForegroundPriority
from pegaflow.server.movers.tier_io import TierMover
from pegaflow.server.policy import make_policy
from pegaflow.server.policy.placement import SsdPlacement, sighting_keys
from pegaflow.server.policy.tenant_caps import TenantCappedPolicy
from pegaflow.server.read_lane.lane import LaneSignals, ReadLane
from pegaflow.server.store import persistence
from pegaflow.server.store.block_store import BlockStore, IoBatch, StoreLimits
from pegaflow.server.store.free_reserve import FreeSlotReserve
from pegaflow.server.store.index import BlockEntry, BlockKey
from pegaflow.server.store.namespace import KvLayout, NamespaceTable
from pegaflow.server.store.stats import ClientCounters, EngineStats, NamespaceStats, TenantStats
from pegaflow.server.tiers.base import IoStatus
from pegaflow.server.tiers.base import Tier as TierBase
from pegaflow.server.tiers.dram.allocator import default_slab_bytes
from pegaflow.server.tiers.dram.journal import FILE_NAME as JOURNAL_FILE
from pegaflow.server.tiers.dram.journal import DramJournal, JournaledBlock, JournalLayout, replay
from pegaflow.server.tiers.dram.journal import verified as journal_verified
from pegaflow.server.tiers.dram.region import PoolRegion, RegionPart
from pegaflow.server.tiers.dram.tier import DramTier

log = logging.getLogger(__name__)

__all__ = ["AllocStatus", "KVEngine", "Location", "QueryPurpose", "EngineObserver"]


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


MAX_CORRUPT_CHECKS = 4  # reported blocks hashed again per ReleaseLease
# Victims the free-slot reserve evicts per hold of the engine lock (~1.5-2 us each, evicted in one pass
# since 2026-12-07; 32 before, at a few us each): short enough that a request waiting for the lock is
# not held up by more than ~0.1-0.2 ms, long enough that a slice's fixed cost is spread over a batch.
RESERVE_SLICE_BLOCKS = 64
# The read lane's signals (server/read_lane/lane.py) are applied at most this long after its first
# call since the last pass (so a pass carries many calls), and at least every LANE_TICK_S.
LANE_BATCH_S = 0.002
LANE_TICK_S = 0.5


@dataclasses.dataclass(frozen=True)
class PrefixResult:
    num_hits: int  # leading blocks readable in DRAM now
    lease_id: str  # "" when no lease was taken
    offsets: list[int]  # one per readable hit; each block is block_bytes long, in DRAM
    block_bytes: int
    epoch: str
    pending: int = 0  # blocks after them being promoted / fetched (LoadBlocks waits for them)
    sources: tuple[Tier, ...] = ()  # where each of the num_hits + pending blocks was found
    searching: bool = False  # other nodes are being asked for the blocks after these
    checksums: tuple[int, ...] = ()  # per readable hit: XXH3-64 of its bytes as written, 0 unknown

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


class EngineObserver:
    """Receives what metrics need, outside the engine lock. The default does nothing."""

    def on_lookup(self, namespace_index: int, hashes: Sequence[bytes], hits: int) -> None:
        pass

    def on_save(self, nbytes: int, seconds: float) -> None:
        pass

    def on_load(self, nbytes: int, seconds: float) -> None:
        pass

    def on_transfer(self, kind: str, nbytes: int, seconds: float, ok: int, failed: int) -> None:
        """A tier batch completed: kind "promote" (SSD -> DRAM) or "demote" (DRAM -> SSD)."""

    def on_rpc(self, method: str, code: str, seconds: float) -> None:
        """A call served outside the handler frame (the read lane): its method, status name, time."""


class KVEngine:
    """Thread-safe cache engine. ``KVEngine(config)`` allocates the pool; ``close()`` frees it."""

    def __init__(
        self,
        config: ServerConfig,
        observer: EngineObserver | None = None,
        region: PoolRegion | None = None,
        ssd: TierBase | None = None,
        foreground: ForegroundPriority | None = None,
        tenant_caps: Mapping[str, int] | None = None,
        tenant_regions: Mapping[str, int] | None = None,
    ):
        """``foreground``: told of every query served wholly from DRAM, so that the SSD tier's
        reads yield to it (server/movers/foreground_priority.py). ``tenant_caps``: tenant name ->
        the most DRAM bytes its blocks may hold (--tenant-file pool=SIZE, policy/tenant_caps.py).
        ``tenant_regions``: tenant name -> the size of its memory of its own (region=SIZE): a memfd
        beside the pool holding only its blocks, the only one its sessions are handed."""
        self.config = config
        self._foreground = foreground
        self.observer = observer or EngineObserver()
        self.epoch = secrets.token_hex(8)
        tenant_regions = dict(tenant_regions or {})
        slab_bytes = config.slab_bytes
        if region is None and tenant_regions:
            if config.pool_dir:
                raise PoolCapacityError(
                    "tenant regions (--tenant-file region=SIZE) are memfds of their own: they need the "
                    "default pool backing, not --pool-dir"
                )
            slab_bytes = slab_bytes or default_slab_bytes(config.pool_size_bytes)
            region = PoolRegion.create_with_parts(
                config.pool_size_bytes, list(tenant_regions.items()), slab_bytes, config.use_hugepages
            )
        self.region = region or PoolRegion.create(
            config.pool_size_bytes, config.use_hugepages, config.pool_dir, persistent=config.persist_pool
        )
        try:
            self.dram = DramTier(self.region, slab_bytes, io_aligned=ssd is not None)
            self.allocator = self.dram.allocator
            self.policy = make_policy(config.enable_lfu_admission, self.region.parts[0].size_bytes)
            isolated = {p.name: p.size_bytes for p in self.region.parts[1:]}
            if tenant_caps or isolated:
                self.policy = TenantCappedPolicy(
                    self.policy, tenant_caps or {}, self._tenant_of_key, isolated
                )
        except BaseException:
            self.region.close()
            raise
        self.ssd = ssd
        self.counters = ClientCounters()
        self._tenant_refusals: dict[str, int] = {}  # quota refusals per tenant name (a counter)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a transfer completed
        self._namespaces = NamespaceTable(config.max_namespaces)
        self._ns_idle_since: dict[int, float] = {}
        self._registry = ClientRegistry(
            config.session_ttl_s,
            config.write_timeout_s,
            config.max_instances_per_session,
            config.max_leases_per_session,
        )
        checksums = config.persist_pool if config.block_checksums is None else config.block_checksums
        self._hasher = BlockHasher() if checksums else None
        # Queries and releases of DRAM blocks answered natively (server/read_lane/); None: off or
        # unavailable here. With an SSD tier (or peers) a chain that goes on beyond DRAM is the engine's.
        self.lane = ReadLane.create(config, fallback_on_miss=ssd is not None)
        self._store = BlockStore(
            self.dram,
            self.policy,
            self._namespaces,
            ssd=ssd,
            placement=(
                SsdPlacement(config.ssd_write_policy, sighting_keys(ssd.stats().capacity_bytes))
                if ssd is not None
                else SsdPlacement("off")
            ),
            limits=StoreLimits(config.promote_inflight_bytes, config.demote_inflight_bytes),
            hasher=self._hasher,
            free_reserve=FreeSlotReserve(config.free_reserve_bytes),
            lane=self.lane,
        )
        self._mover = TierMover(self._transfer_done)
        # Where the namespaces' layouts are kept beside persisted blocks: the SSD tier's records, the
        # persistent pool's journal (none: nothing outlives this process).
        self._state_dirs: list[str] = []
        if ssd is not None and config.ssd_cache_paths:
            self._state_dirs.append(persistence.state_dir(config.ssd_cache_paths))
        if self.region.persistent_dir:
            self._state_dirs.append(self.region.persistent_dir)
        self._persist_lock = threading.Lock()  # one writer of the layouts file at a time (newest last)
        self._namespaces_unsaved = False  # the last write failed (a full disk): the reaper retries
        self._session_listeners: list[Callable[[str], None]] = []
        self._ended_sessions: list[str] = []  # ended under the lock, announced after it
        # What a call could not finish by its deadline (the lock was busy) and must not be lost: run
        # under the lock by the reaper's next pass (_hand_to_reaper). deque: appended without a lock.
        self._handed_over: deque[Callable[[], None]] = deque()
        self._closed = False
        self.recovery_seconds = 0.0
        self.dram_recovery_seconds = 0.0
        self._journal: DramJournal | None = None
        # L2 (server/peers/): set by attach_peers when a metaserver is configured.
        self._remote = None  # RemoteSource: pulls other nodes' blocks on a local miss
        self._publisher = None  # metaserver BlockPublisher: what this node holds
        self._peer_session: Session | None = None  # owns the leases of transfers peers read
        try:
            self._restore_namespaces()
            if self.region.persistent_dir:
                self._recover_pool()
            if ssd is not None:
                self._recover()
        except BaseException:
            self._close_parts()
            raise
        self._stop = threading.Event()
        self._reap_wanted = threading.Event()  # work was handed to the reaper: its pass now, not next tick
        self._reaper = threading.Thread(target=self._reap_loop, name="pegaflow-reaper", daemon=True)
        self._reaper.start()
        self._reserve_wanted = threading.Event()
        self._lane_drain_lock = threading.Lock()  # before the engine lock, never inside it (_drain_lane)
        self._reserver: threading.Thread | None = None
        # The CPU shared by the threads running the save path's Python: the reserve's and the local
        # RPC socket's workers (runtime.py pins those).
        self.interpreter_core = InterpreterCore(config.interpreter_cpu)
        if config.free_reserve_bytes:
            self._reserver = threading.Thread(
                target=self._reserve_loop, name="pegaflow-free-reserve", daemon=True
            )
            self._reserver.start()
        self._lane_thread: threading.Thread | None = None
        if self.lane is not None:
            self._lane_thread = threading.Thread(
                target=self._lane_loop, name="pegaflow-read-lane-signals", daemon=True
            )
            self._lane_thread.start()
        log.info(
            "engine: epoch %s, policy %s, %d slabs of %d bytes, ssd %s",
            self.epoch,
            self.policy.name,
            self.allocator.total_slabs,
            self.allocator.slab_bytes,
            f"{ssd.name} ({self._store.placement.rule})" if ssd is not None else "off",
        )

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stops background work, the tiers and frees the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        self._stop.set()
        self._reserve_wanted.set()
        self._reap_wanted.set()
        for thread in (self._reaper, self._reserver, self._lane_thread):
            if thread is not None and thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=5)
        if self.lane is not None:
            self.lane.stop()
        self._close_parts()

    def _close_parts(self) -> None:
        if self.ssd is not None:
            self.ssd.close()  # queued transfers resolve CANCELLED before the pool goes
        if self._hasher is not None:
            self._hasher.close()
        if self._journal is not None:
            self._journal.close()  # what is queued is written: the next server sees it
        self.dram.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def add_session_listener(self, callback: Callable[[str], None]) -> None:
        """``callback(session_id)`` runs after a session ended for any reason (closed, its pool connection
        dropped, heartbeat timeout), outside the engine lock, once, on the thread that ended it (a
        CloseSession handler among them: it must return at once, handing slow work to a thread of its
        own). For state kept per session outside the engine (e.g. a GPU data path's CUDA IPC mappings)."""
        self._session_listeners.append(callback)

    def pool_view(self) -> np.ndarray:
        """The whole pool as a uint8 array (embedded users and a server-side copier write through it)."""
        return self.dram.pool_view()

    def namespace_at(self, index: int):
        """The namespace whose dense index is ``index`` (the first part of every block key, and what
        EngineObserver.on_lookup reports). Indices are never reused, so a namespace found is the
        right one; KeyError for one never handed out or released since (idle: see reap)."""
        return self._namespaces.at(index)

    @contextlib.contextmanager
    def _locked(self, deadline: float | None):
        if deadline is None:
            self._lock.acquire()
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._lock.acquire(timeout=remaining):
                raise DeadlineExceeded("deadline passed while waiting for the engine")
        events = None
        try:
            if self._closed:
                raise Closed("engine is closed")
            yield
        finally:
            if self._store.published:
                events, self._store.published = self._store.published, []
            self._lock.release()
        if events:
            self._publish(events)

    def _publish(self, events: list[tuple[bool, int, bytes]]) -> None:
        """DRAM copies that became readable or left, told to the metaserver (off the lock; the
        publisher only queues). Runs of the same kind and namespace go as one call."""
        publisher = self._publisher
        if publisher is None:
            return
        run: list[bytes] = []
        key = None
        for added, ns_index, block_hash in events:
            if (added, ns_index) != key:
                if run:
                    self._publish_run(publisher, key, run)
                key, run = (added, ns_index), []
            run.append(block_hash)
        if run:
            self._publish_run(publisher, key, run)

    def _publish_run(self, publisher, key: tuple[bool, int], hashes: list[bytes]) -> None:
        added, ns_index = key
        try:
            ns_id = self._namespaces.at(ns_index).id
        except KeyError:
            return
        (publisher.blocks_added if added else publisher.blocks_removed)(ns_id, hashes)

    def _live(self, session_id: str) -> Session:
        return self._registry.live_session(session_id, time.monotonic())

    # -------------------------------------------------------------- sessions

    def open_session(
        self,
        client_name: str = "",
        pid: int = 0,
        hostname: str = "",
        expires: bool = True,
        deadline: float | None = None,
        trusted: bool = False,
        read_only: bool = False,
        tenant: Tenant | None = None,
    ) -> SessionInfo:
        """A new session. ``expires=False`` (in-process users) needs no heartbeat; close it explicitly.
        ``trusted``: the server's own in-process parts (the GPU data path), which act on instances of
        other sessions; a client's session only ever reaches its own instances, leases and saves.
        ``tenant`` (clients/tenants.py): who it acts for; its instances get that tenant's namespaces."""
        if tenant is not None and tenant.region_bytes is not None and not trusted:
            self._region_of(tenant)  # refused before anything is opened
        with self._locked(deadline):
            session = self._registry.open_session(
                client_name, pid, hostname, time.monotonic(), expires, trusted
            )
            session.read_only = read_only
            session.tenant = tenant
            part = self._part_of_session(session)
            if self.lane is not None and not trusted:
                # A tenant with a lease cap over its sessions is the engine's to count: not served there.
                self.lane.add_session(
                    session.id,
                    part.base,
                    int(self.config.session_leased_fraction * part.size_bytes),
                    self.config.max_leases_per_session,
                    tenant is None or tenant.leased_bytes is None,
                )
        log.info(
            "session %s opened: %r pid %d on %r%s",
            session.id,
            client_name,
            pid,
            hostname,
            f" for tenant {tenant.name}" if tenant is not None else "",
        )
        return SessionInfo(
            session_id=session.id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            ttl_s=self.config.session_ttl_s,
            epoch=self.epoch,
            # What its client maps: the pool or its tenant's region (the server's own parts: all of it).
            pool_size_bytes=self.region.size_bytes if trusted else part.size_bytes,
            hugepages=self.region.hugepages,
            server_version=__version__,
        )

    def heartbeat(self, session_id: str, deadline: float | None = None) -> str:
        with self._locked(deadline):
            self._live(session_id)
        return self.epoch

    def close_session(self, session_id: str, deadline: float | None = None) -> None:
        """Ends the session: its leases released, its unsealed blocks freed, its instances dropped,
        and the session listeners (the GPU data path, the fd broker) told before this returns.

        The engine lock is waited for until ``deadline`` only, once. When it is not free by then the
        close is not lost: it is handed to the reaper, which ends the session (unless it ended
        otherwise first) and tells the listeners on its next pass, as soon as the lock is free, and
        DeadlineExceeded is raised. What a client can rely on: once this is called (a CloseSession
        that arrived past its deadline is refused before it), whether it returns, raises NotFound
        (already ended) or DeadlineExceeded (ending shortly), the session ends, exactly once, unless
        the engine closes first; a retry is safe (it ends the session itself, or finds it gone)."""
        locked = False
        try:
            with self._locked(deadline):
                locked = True
                self._end_session(self._live(session_id), "closed by client")
                self.counters.sessions_closed += 1
                ended = self._take_ended_sessions()
        except DeadlineExceeded:
            if not locked:
                self._hand_to_reaper(functools.partial(self._close_late, session_id))
            raise
        self._announce(ended)

    def _close_late(self, session_id: str) -> None:
        """Under the lock (the reaper): a close whose CloseSession could not take the lock by its
        deadline. A session that ended meanwhile (its client's retry, its pool connection) is left."""
        session = self._registry.sessions.get(session_id)
        if session is not None:
            self._end_session(
                session, "closed by client (by the reaper: the lock was busy until its deadline)"
            )
            self.counters.sessions_closed += 1

    def attach_session(self, session_id: str) -> dict:
        """A pool-fd connection of this session opened (fd broker). Returns the broker's header."""
        with self._locked(None):
            session = self._live(session_id)
            session.attachments += 1
            part = self._part_of_session(session)
        return {
            "epoch": self.epoch,
            "size_bytes": part.size_bytes,
            "hugepages": self.region.hugepages,
            "read_only": session.read_only,  # the broker passes a read-only fd then
            "part": part.name,  # which memfd the broker passes: the pool, or the tenant's own region
        }

    def detach_session(self, session_id: str) -> None:
        """A pool-fd connection closed: the client process is gone (or dropped the pool), end its session."""
        with self._locked(None):
            session = self._registry.sessions.get(session_id)
            if session is None:
                return
            session.attachments -= 1
            if session.attachments <= 0:
                self._end_session(session, "pool connection closed")
                self.counters.sessions_disconnected += 1
            ended = self._take_ended_sessions()
        self._announce(ended)

    # ------------------------------------------------------------- instances

    def register_instance(
        self, session_id: str, layout: KvLayout, name: str = "", deadline: float | None = None
    ) -> InstanceInfo:
        layout.validate(self.allocator.max_block_bytes)
        with self._locked(deadline):
            session = self._live(session_id)
            tenant = session.tenant.name if session.tenant is not None else DEFAULT_TENANT
            namespace, new = self._namespaces.intern(layout, tenant)
            instance = self._registry.add_instance(session, namespace, name)
            if self.lane is not None and not session.trusted:
                self.lane.add_instance(instance.id, session.id, namespace.index, namespace.block_bytes)
        if new and self._state_dirs:
            # Off the lock, before any block of it can be saved: recovery maps records to it.
            self._save_namespaces(deadline)
        log.info(
            "instance %s (%r) registered in %s (%s, %d bytes/block)",
            instance.id,
            name,
            namespace.id,
            layout.model_id,
            layout.block_bytes,
        )
        return InstanceInfo(instance.id, namespace.id, layout.block_bytes)

    def instance_namespace(self, session_id: str, instance_id: str, deadline: float | None = None):
        """The namespace of one of the session's instances."""
        with self._locked(deadline):
            return self._registry.instance(self._live(session_id), instance_id).namespace

    def unregister_instance(self, session_id: str, instance_id: str, deadline: float | None = None) -> None:
        with self._locked(deadline):
            self._registry.remove_instance(self._live(session_id), instance_id)
            if self.lane is not None:
                self.lane.remove_instance(instance_id)

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
        """The leading blocks of ``hashes`` this host holds. ``num_hits`` of them are readable in DRAM
        now; ``pending`` more are being promoted from a lower tier (this call starts what it finds).
        With ``lease`` all of them are pinned until released or expired; ``load_blocks`` waits for the
        pending ones.

        ``lease_id`` optionally names the lease (client-chosen, so it can release it after a timeout).
        ``purpose``: LOOKUP counts the hashes as block requests, LOAD only renews the hits' recency
        (see QueryPurpose). ``account=False``: the caller queries one chain in several calls and
        accounts for all of them at once with ``account_query`` (the hits are touched either way).
        """
        self._check_hashes(hashes)
        ttl = self._lease_ttl(lease_ttl_s)
        planned: list[IoBatch | None] = []
        try:
            with self._locked(deadline):
                session = self._live(session_id)
                if lease and lease_id:
                    self._registry.check_new_id(lease_id, "lease")
                namespace = self._registry.instance(session, instance_id).namespace
                ns_index = namespace.index
                scan = self._store.scan(ns_index, hashes)
                planned.append(scan.batch)  # submitted whatever happens next: its slots are taken
                entries, num_ready, taken = scan.entries, scan.ready, ""
                if lease and entries:
                    self._registry.check_lease_room(session)
                    entries, charged = self._within_lease_quota(session, entries, namespace.block_bytes)
                    num_ready = min(num_ready, len(entries))
                    taken = self._take_lease(session, instance_id, ns_index, entries, ttl, lease_id, charged)
                ready = entries[:num_ready]
                base = self._part_of_session(session).base
                offsets = [e.dram - base for e in ready]
                checksums = tuple(e.checksum or 0 for e in ready)
                if account:
                    self._count_query(purpose, len(hashes), scan.sources)
                if purpose == QueryPurpose.LOOKUP:
                    planned.append(self._store.reused(ready))
                    self._store.missed(ns_index, hashes[len(scan.entries) :])
        finally:
            self._mover.submit(planned)
        self._after_query(
            purpose, ns_index, hashes, [e.key for e in ready], len(scan.entries) if account else None
        )
        if self._foreground is not None and 0 < scan.ready == len(scan.entries):
            self._foreground.ready_hit()  # served now: SSD reads wait a moment (the pacer's own short lock)
        searching = False
        remote = self._remote
        if remote is not None and len(scan.entries) < len(hashes):
            rest = hashes[len(scan.entries) :]
            if purpose == QueryPurpose.LOOKUP:
                searching = remote.request(namespace.id, ns_index, namespace.block_bytes, rest)
            else:
                searching = remote.searching(ns_index, rest[0])
        return PrefixResult(
            num_ready,
            taken,
            offsets,
            namespace.block_bytes,
            self.epoch,
            len(entries) - num_ready,
            tuple(scan.sources[: len(entries)]),
            searching,
            checksums,
        )

    def account_query(
        self,
        session_id: str,
        instance_id: str,
        hashes: Sequence[bytes],
        num_hits: int,
        purpose: QueryPurpose,
        deadline: float | None = None,
    ) -> None:
        """Counts ``hashes`` as one query of ``purpose`` that hit its first ``num_hits`` blocks (in DRAM),
        for a caller that looked the chain up in several ``query_prefix(account=False)`` calls."""
        self._check_hashes(hashes)
        if not 0 <= num_hits <= len(hashes):
            raise InvalidArgument(f"num_hits {num_hits} is not within 0..{len(hashes)}")
        with self._locked(deadline):
            session = self._live(session_id)
            ns_index = self._registry.instance(session, instance_id).namespace.index
            self._count_query(purpose, len(hashes), [Tier.DRAM] * num_hits)
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
            session = self._live(session_id)
            ns_index = self._registry.instance(session, instance_id).namespace.index
            self._store.refresh_chain(ns_index, hashes)

    def load_blocks(
        self, session_id: str, instance_id: str, lease_id: str, deadline: float | None = None
    ) -> PrefixResult:
        """Locations of a lease's leading blocks once they are readable in DRAM: waits (until the
        deadline) for the ones still being promoted; a block whose promotion failed ends the prefix
        (the caller recomputes from there)."""
        lane_lease = self._lane_lease_id(lease_id)
        if lane_lease is not None:
            return self._load_lane_lease(session_id, instance_id, lease_id, lane_lease, deadline)
        with self._locked(deadline):
            session = self._live(session_id)
            instance = self._registry.instance(session, instance_id)
            held = self._registry.lease(session, lease_id, time.monotonic())
            if held.ns_index != instance.namespace.index:
                raise InvalidArgument(
                    f"lease {lease_id} belongs to another namespace than instance {instance_id}"
                )
            while any(e.filling_from is not None for e in held.entries) and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break  # answer what is ready: the rest is a miss for this caller
                self._changed.wait(remaining)
            if self._closed:
                raise Closed("engine is closed")
            ready = 0
            for entry in held.entries:
                if not entry.dram_ready or entry.corrupt:  # a corrupt one: a miss from there on
                    break
                ready += 1
            base = self._part_of_session(session).base
            offsets = [e.dram - base for e in held.entries[:ready]]
            checksums = tuple(e.checksum or 0 for e in held.entries[:ready])
            pending = sum(1 for e in held.entries[ready:] if e.filling_from is not None)
        return PrefixResult(
            ready, lease_id, offsets, instance.namespace.block_bytes, self.epoch, pending, checksums=checksums
        )

    def release_lease(
        self,
        session_id: str,
        lease_id: str,
        loaded_bytes: int = 0,
        deadline: float | None = None,
        corrupt_hashes: Sequence[bytes] = (),
    ) -> None:
        """Ends a lease. ``corrupt_hashes``: blocks of it whose bytes the client found not matching
        their checksum: each is hashed again here (a client's word alone drops nothing) and one
        that fails is dropped, so later queries miss it."""
        lane_lease = self._lane_lease_id(lease_id)
        if lane_lease is not None:
            self._release_lane_lease(session_id, lease_id, lane_lease, loaded_bytes, deadline, corrupt_hashes)
            return
        with self._locked(deadline):
            session = self._live(session_id)
            held = self._registry.lease(session, lease_id, time.monotonic())
            self._drop_lease(held)
            if corrupt_hashes:
                self._check_reported_corrupt(held.entries, corrupt_hashes)
            age = time.monotonic() - held.created_at
            # A client reports what it read; never more than the lease holds (review finding F6).
            loaded_bytes = min(max(int(loaded_bytes), 0), sum(e.length for e in held.entries))
            if loaded_bytes:
                self.counters.load_bytes += loaded_bytes
        if loaded_bytes:
            self.observer.on_load(loaded_bytes, age)

    def give_up_lease(self, session_id: str, lease_id: str) -> None:
        """Ends a lease whose answer cannot reach its caller (the deadline passed as QueryPrefix
        finished, or the caller cancelled), never waiting: at once if the engine lock is free, else
        by the reaper's next pass (the lease's TTL would end it too, with its blocks pinned until
        then). A lease already ended is left as it is."""

        def release() -> None:
            with contextlib.suppress(NotFound):
                self._release_now(session_id, lease_id)

        self._now_or_by_reaper(release)

    def _release_now(self, session_id: str, lease_id: str) -> None:
        """Under the lock: ends the lease (an engine or a lane lease) of a live session, nothing read."""
        session = self._live(session_id)
        lane_lease = self._lane_lease_id(lease_id)
        if lane_lease is not None:
            if self.lane.release(session_id, lane_lease, 0) is None:
                raise NotFound("lease", lease_id)
            return
        self._drop_lease(self._registry.lease(session, lease_id, time.monotonic()))

    # ------------------------------------------------------- read lane leases

    def _lane_lease_id(self, lease_id: str) -> int | None:
        """The read lane's number for a lease it took (``r-`` names); None for the engine's own."""
        return lane_wire.parse_lease_name(lease_id) if self.lane is not None else None

    def _lane_lease_entries(self, session_id: str, lease_name: str, lane_lease: int) -> list[BlockEntry]:
        """Under the lock: the entries a lane lease of this session pins, in chain order."""
        keys = self.lane.lease_keys(session_id, lane_lease)
        if keys is None:
            raise NotFound("lease", lease_name)
        get = self._store.index.get
        return [e for e in map(get, keys) if e is not None]

    def _load_lane_lease(
        self, session_id: str, instance_id: str, lease_name: str, lane_lease: int, deadline: float | None
    ) -> PrefixResult:
        """load_blocks of a lane lease: its blocks were readable when it was taken and stay so."""
        with self._locked(deadline):
            session = self._live(session_id)
            instance = self._registry.instance(session, instance_id)
            entries = self._lane_lease_entries(session_id, lease_name, lane_lease)
            if any(e.key[0] != instance.namespace.index for e in entries):
                raise InvalidArgument(
                    f"lease {lease_name} belongs to another namespace than instance {instance_id}"
                )
            ready = 0
            for entry in entries:
                if not entry.dram_ready or entry.corrupt:
                    break
                ready += 1
            base = self._part_of_session(session).base
            offsets = [e.dram - base for e in entries[:ready]]
            checksums = tuple(e.checksum or 0 for e in entries[:ready])
        return PrefixResult(
            ready, lease_name, offsets, instance.namespace.block_bytes, self.epoch, 0, checksums=checksums
        )

    def _release_lane_lease(
        self,
        session_id: str,
        lease_name: str,
        lane_lease: int,
        loaded_bytes: int,
        deadline: float | None,
        corrupt_hashes: Sequence[bytes],
    ) -> None:
        """release_lease of a lane lease (one sent to the engine: over gRPC, or reporting corrupt
        blocks, which the lane leaves to the engine). The reported blocks are checked while the lease
        still pins them."""
        with self._locked(deadline):
            self._live(session_id)
            if corrupt_hashes:
                entries = self._lane_lease_entries(session_id, lease_name, lane_lease)
                self._check_reported_corrupt(entries, corrupt_hashes)
            released = self.lane.release(session_id, lane_lease, loaded_bytes)
            if released is None:
                raise NotFound("lease", lease_name)
        nbytes, age = released
        loaded = min(max(int(loaded_bytes), 0), nbytes)
        if loaded:
            self.observer.on_load(loaded, age)

    # ------------------------------------------------------------- save path

    def allocate_blocks(
        self,
        session_id: str,
        instance_id: str,
        hashes: Sequence[bytes],
        deadline: float | None = None,
        save_id: str = "",
        whole_write: bool = False,
    ) -> AllocateResult:
        """Per hash: GRANTED (+ location to write, then seal), EXISTS, IN_PROGRESS or NO_SPACE.

        ``save_id`` optionally names the save (client-chosen, so it can abort it after a timeout).
        A granted slot that another namespace's block last held is zeroed before this returns (a
        writer that seals without writing exposes zeros: review finding F2), unless ``whole_write``:
        the caller overwrites every byte of each granted block before it seals it and aborts what it
        could not write (the server's own GPU copy, whose layout covers the whole block), so the
        memset is skipped; an aborted slot is then zeroed for whoever gets it next (BlockStore.abort).
        Only server code can ask for it: no RPC carries it.

        The zeroing runs off the lock and stops at ``deadline``; the save is this call's meanwhile
        (no seal; an abort or its session's end leaves the freeing to this call). Then the lock is
        taken again, by the deadline: if a slot was left unzeroed, the save was given up, or the lock
        is busy past the deadline, nothing is granted: every slot of the call is freed (by the
        reaper when the lock is busy), an unzeroed one marked foreign to every namespace so that its
        next grant zeroes it, and DeadlineExceeded (NotFound when its session ended) is raised. No
        partial grant: an answer at the deadline arrives too late to be used (the servicer undoes a
        late one too), and NO_SPACE would read as a full pool (metrics, the connector's dedup count).
        """
        self._check_hashes(hashes)
        with self._locked(deadline):
            session = self._live(session_id)
            if session.read_only:
                raise FailedPrecondition(f"session {session_id} is read-only (a kv_consumer): it cannot save")
            if save_id:
                self._registry.check_new_id(save_id, "save")
            namespace = self._registry.instance(session, instance_id).namespace
            ns_index, block_bytes = namespace.index, namespace.block_bytes
            save = Save(
                session.id,
                instance_id,
                ns_index,
                tuple(hashes),
                time.monotonic(),
                self.config.write_timeout_s,
                save_id,
            )
            part = self._part_of_session(session)
            if session.trusted:
                room = len(hashes)
            else:
                session_quota = int(self.config.session_unsealed_fraction * part.size_bytes)
                room_bytes = min(
                    session_quota - session.unsealed_bytes, self._tenant_room(session, "unsealed_bytes")
                )
                room = int(min(max(room_bytes, 0) // block_bytes, len(hashes)))
            statuses, offsets, _ = self._store.reserve(
                ns_index,
                block_bytes,
                hashes,
                save,
                deadline,
                room,
                self._tenant_unsealed(session),
                whole_write=whole_write,
            )
            local_offsets = [offset - part.base for offset in offsets]
            stale, save.stale_slots = save.stale_slots, []
            save.zeroing = bool(stale)  # granted only once they are zeroed (_finish_zeroing)
            session.unsealed_bytes += len(offsets) * block_bytes
            if AllocStatus.REJECTED in statuses:
                self._count_quota_refusal(session)
            save_id = ""
            if save.pending:
                self._registry.add_save(session, save)
                save_id = save.id
            else:
                # Nothing to write, so no seal will restate the chain: restate it now.
                self._store.refresh_chain(ns_index, save.chain)
            wake_reserve = self._reserver is not None and self._store.reserve_low()
        try:
            if stale:
                # Off the lock: the slots are this save's (WRITING), nobody else reads or writes them,
                # and the save is this call's until _finish_zeroing (save.zeroing), which runs even if
                # the memset failed (what it did not report zeroed is freed as unzeroed).
                zeroed = 0
                try:
                    zeroed = self.dram.zero([(offset, block_bytes) for offset in stale], deadline)
                finally:
                    self._finish_zeroing(save, stale[zeroed:], deadline)
        finally:
            # After the zeroing: its evictions are not to compete with this call's own work. Set only
            # when clear (Event.set takes a lock and notifies even when set): the reserve thread clears
            # it before each refill, so a set seen here is one whose refill is still to come.
            if wake_reserve and not self._reserve_wanted.is_set():
                self._reserve_wanted.set()
        return AllocateResult(save_id, statuses, local_offsets, block_bytes, self.epoch)

    def _finish_zeroing(self, save: Save, unzeroed: Sequence[int], deadline: float | None) -> None:
        """allocate_blocks, after zeroing the save's stale slots off the lock (``unzeroed``: those the
        deadline left): the save becomes its client's (sealable, abortable) if every slot was zeroed
        and nobody gave it up meanwhile; else it is freed and the call fails. The lock is waited for
        until ``deadline`` (tried once if it passed); busy until then, the freeing is handed to the
        reaper. Either way exactly one of this call and the reaper frees the save (_drop_zeroing)."""
        # The save is this call's (save.zeroing): nobody else reads it before _drop_zeroing frees it.
        # Foreign to every namespace, its own included: their next grant zeroes them (BlockStore.abort).
        save.unzeroed_slots.update(unzeroed)
        if not acquire_by(self._lock, deadline):
            self._hand_to_reaper(functools.partial(self._drop_zeroing, save))
            raise DeadlineExceeded(
                "deadline passed while zeroing the granted slots (the engine was busy); they are freed"
            )
        try:
            if self._closed:
                raise Closed("engine is closed")
            if not unzeroed and not save.given_up:
                save.zeroing = False  # granted: the client may write, seal or abort it from now on
                return
            given_up, session_gone = save.given_up, self._registry.sessions.get(save.session_id) is None
            self._drop_zeroing(save)
        finally:
            self._lock.release()
        if given_up and session_gone:
            raise NotFound("session", save.session_id)
        if given_up:
            raise DeadlineExceeded(f"save {save.id} was given up while its slots were zeroed; they are freed")
        raise DeadlineExceeded(
            f"deadline passed while zeroing the granted slots ({len(unzeroed)} left); they are freed"
        )

    def _drop_zeroing(self, save: Save) -> None:
        """Under the lock: frees a save whose granting call does not hand it to its client (a slot
        left unzeroed, given up meanwhile, or the lock busy past the deadline: then run by the
        reaper). Only the granting call frees a save while save.zeroing, and only once, here."""
        save.zeroing = False
        if self._registry.saves.get(save.id) is save:
            self._registry.remove_save(save)
        self._free_save(save)

    def give_up_save(self, session_id: str, save_id: str) -> None:
        """Frees a save whose grant cannot reach its caller (the deadline passed as AllocateBlocks
        finished, or the caller cancelled), never waiting: at once if the engine lock is free, else
        by the reaper's next pass. A save already sealed, aborted or freed is left as it is."""

        def drop() -> None:
            save = self._registry.saves.get(save_id)
            if save is not None and save.session_id == session_id:
                self._abort_save(save)

        self._now_or_by_reaper(drop)

    def seal_blocks(
        self,
        session_id: str,
        save_id: str,
        hashes: Sequence[bytes] = (),
        deadline: float | None = None,
        checksums: Sequence[int] = (),
    ) -> int:
        """Makes written blocks visible: the listed ones, or every pending block of the save.
        ``checksums`` (optional, one per sealed block in that order): XXH3-64 of each block's bytes
        as its writer wrote them; readers get them back with the block's location."""
        with self._locked(deadline):
            session = self._live(session_id)
            save = self._registry.save(session, save_id, time.monotonic())
            if save.zeroing:
                # Only a client that named its save before the answer could: its slots may still hold
                # another namespace's bytes (allocate_blocks zeroes them off the lock).
                raise FailedPrecondition(f"save {save_id} is not granted yet: its AllocateBlocks is running")
            if hashes:
                targets = list(dict.fromkeys(hashes))
                for block_hash in targets:
                    if block_hash not in save.pending:
                        raise InvalidArgument(
                            f"block {block_hash.hex()} is not a granted, unsealed block of save {save_id}"
                        )
            else:
                targets = list(save.pending)
            if checksums and len(checksums) != len(targets):
                raise InvalidArgument(
                    f"{len(checksums)} checksums for {len(targets)} blocks to seal (one per block, or none)"
                )
            sealing = {block_hash: save.pending.pop(block_hash) for block_hash in targets}
            for digest, block_hash in zip(checksums, targets, strict=False):
                if digest:
                    sealing[block_hash].checksum = int(digest)
            sealed_bytes, planned = self._store.seal(save, sealing)
            save.sealed_bytes += sealed_bytes
            session.unsealed_bytes -= sealed_bytes
            finished = not save.pending
            if finished:
                self._registry.remove_save(save)
            age = time.monotonic() - save.created_at
        self._mover.submit(planned)
        if finished and save.sealed_bytes:
            self.observer.on_save(save.sealed_bytes, age)
        return len(targets)

    def abort_blocks(self, session_id: str, save_id: str, deadline: float | None = None) -> int:
        """Frees a save's unsealed blocks (they never become visible). Returns how many."""
        with self._locked(deadline):
            session = self._live(session_id)
            save = self._registry.save(session, save_id, time.monotonic(), tombstone=True)
            return self._abort_save(save)

    # --------------------------------------------------- other nodes (L2)

    def attach_peers(self, remote, publisher) -> None:
        """Serve peers' transfers, pull from peers on a miss (``remote``: peers/remote_source.py) and
        publish what this node holds (``publisher``: metaserver/publisher.py). Before serving."""
        with self._locked(None):
            self._peer_session = self._registry.open_session(
                "pegaflow-peers", os.getpid(), "", time.monotonic(), expires=False, trusted=True
            )
            self._store.publishing = publisher is not None
            self._remote, self._publisher = remote, publisher
            if self.lane is not None:
                self.lane.set_fallback_on_miss(True)  # a local miss may be another node's hit

    def detach_peers(self) -> None:
        with self._locked(None):
            self._remote = self._publisher = None
            self._store.publishing = False
            self._store.published = []
            if self.lane is not None:
                self.lane.set_fallback_on_miss(self.ssd is not None)

    def open_transfer(self, namespace_id: str, hashes: Sequence[bytes], ttl_s: float):
        """A peer reads the leading DRAM blocks of ``hashes`` (server/peers/base.py, TransferSource):
        they are pinned under a lease of the peers' session that expires by itself after ``ttl_s``.
        Returns (lease id, [(pool offset, length, checksum or None)]); ("", []) on a miss."""
        self._check_hashes(hashes)
        if not 0 < ttl_s <= self.config.max_lease_ttl_s:
            raise ValueError(f"transfer ttl must be in (0, {self.config.max_lease_ttl_s}] seconds")
        with self._locked(None):
            session = self._peer_session
            if session is None:
                raise LookupError("this node serves no peers")
            namespace = self._namespaces.by_id(namespace_id)
            if namespace is None:
                raise LookupError(f"unknown namespace {namespace_id}")
            entries = self._store.dram_prefix(namespace.index, hashes)
            if not entries:
                return "", []
            lease_id = self._take_lease(session, "", namespace.index, entries, ttl_s)
            return lease_id, [(e.dram, e.length, e.checksum) for e in entries]

    def renew_transfer(self, transfer_id: str, ttl_s: float) -> bool:
        with self._locked(None):
            held = self._registry.leases.get(transfer_id)
            if held is None or self._peer_session is None or held.session_id != self._peer_session.id:
                return False
            self._registry.leases.renew(held, time.monotonic() + min(ttl_s, self.config.max_lease_ttl_s))
            return True

    def close_transfer(self, transfer_id: str) -> None:
        with self._locked(None):
            held = self._registry.leases.get(transfer_id)
            if (
                held is not None
                and self._peer_session is not None
                and held.session_id == self._peer_session.id
            ):
                self._drop_lease(held)

    def plan_fetch(self, ns_index: int, hashes: Sequence[bytes], block_bytes: int):
        """Pool slots for the leading ``hashes`` this node lacks, pending until ``fetched``; returns the
        entries and their slots as buffers a peer transport fills (peers/remote_source.py)."""
        with self._locked(None):
            entries = self._store.plan_fetch(ns_index, hashes, block_bytes)
            views = [self.dram.view(e.dram, e.length) for e in entries]
        return entries, views

    def fetched(self, entries, ok: Sequence[bool], checksums: Sequence[int | None]) -> None:
        try:
            with self._locked(None):
                self._store.fetched(entries, ok, checksums)
                self._changed.notify_all()
        except Closed:
            pass

    def dram_snapshot(self, chunk: int = 4096):
        """(namespace id, hashes) of every block readable in DRAM, in chunks: the publisher's
        re-publication after a metaserver restart. The keys are taken under the lock once; each
        chunk is re-checked under the lock, so what it yields is resident when yielded."""
        with self._locked(None):
            keys = self._store.dram_keys()
        for lo in range(0, len(keys), chunk):
            by_ns: dict[int, list[bytes]] = {}
            with self._locked(None):
                for key in keys[lo : lo + chunk]:
                    entry = self._store.index.get(key)
                    if entry is not None and entry.dram_ready:
                        by_ns.setdefault(key[0], []).append(key[1])
                ids = {i: ns.id for i in by_ns if (ns := self._namespaces.by_index(i)) is not None}
            for index, hashes in by_ns.items():
                if index in ids:
                    yield ids[index], hashes

    # ---------------------------------------------------------- introspection

    def stats(self, deadline: float | None = None) -> EngineStats:
        if self.lane is not None:
            # Every call the lane served before this one is counted in the answer, not a pass later;
            # a pass in progress is waited for at most half the time left (the rest is the answer's).
            drain_by = None if deadline is None else (time.monotonic() + deadline) / 2
            self._drain_lane(drain_by)
        with self._locked(deadline):
            alloc = self.allocator.stats()
            index, store, registry = self._store.index, self._store.counters, self._registry
            instances = registry.instances_per_namespace()
            promoting, demoting = self._store.inflight_bytes()
            stats = EngineStats(
                epoch=self.epoch,
                pool_capacity_bytes=self.region.size_bytes,
                pool_used_bytes=alloc.used_bytes,
                stranded_bytes=alloc.stranded_bytes,
                slab_bytes=alloc.slab_bytes,
                free_slabs=alloc.free_slabs,
                total_slabs=alloc.total_slabs,
                slab_moves=self.allocator.slab_moves,
                resident_blocks=index.sealed,
                dram_blocks=index.dram_ready,
                ssd_blocks=index.ssd_ready,
                pinned_blocks=index.pinned,
                writing_blocks=index.writing,
                admission_rejections=self.policy.admission_rejections,
                promoting_bytes=promoting,
                demoting_bytes=demoting,
                live_sessions=len(registry.sessions),
                live_instances=len(registry.instances),
                live_leases=len(registry.leases),
                open_saves=len(registry.saves),
                namespaces=[
                    NamespaceStats(
                        ns.id,
                        ns.model_id,
                        ns.block_bytes,
                        index.sealed_in(ns.index),
                        instances.get(ns.index, 0),
                        ns.tenant,
                    )
                    for ns in self._namespaces
                ],
            )
            stats.tenants = self._tenant_stats(stats.namespaces)
            for name in type(store).__slots__:
                setattr(stats, name, getattr(store, name))
            for name in type(self.counters).__slots__:
                setattr(stats, name, getattr(self.counters, name))
        if self.lane is not None:
            lane = self.lane.stats()
            stats.read_lane_leases = lane["leases"]
            stats.read_lane_connections = lane["connections"]
            stats.live_leases += lane["leases"]
            stats.pinned_blocks += lane["pinned_blocks"]
        stats.hits = stats.dram_hits + stats.ssd_hits + stats.remote_hits
        stats.tiers = [self.dram.stats()] + ([self.ssd.stats()] if self.ssd is not None else [])
        if self.ssd is not None:
            stats.tiers[1].recovery_seconds = stats.tiers[1].recovery_seconds or self.recovery_seconds
        return stats

    def _tenant_stats(self, namespaces: list[NamespaceStats]) -> list[TenantStats]:
        """Per tenant with sessions, namespaces or refusals: its use over all its sessions. Empty
        while only the unnamed tenant exists (no --tenant-file: nothing to split)."""
        sessions: dict[str, list[Session]] = {}
        for s in self._registry.sessions:
            sessions.setdefault(s.tenant.name if s.tenant is not None else DEFAULT_TENANT, []).append(s)
        by_ns: dict[str, list[NamespaceStats]] = {}
        for ns in namespaces:
            by_ns.setdefault(ns.tenant, []).append(ns)
        shares = self.policy.shares() if isinstance(self.policy, TenantCappedPolicy) else {}
        names = set(sessions) | set(by_ns) | set(self._tenant_refusals) | set(shares)
        if names <= {DEFAULT_TENANT}:
            return []
        cap_counts = self._store.cap_counts
        return [
            TenantStats(
                name,
                len(sessions.get(name, ())),
                len(by_ns.get(name, ())),
                sum(ns.resident_blocks for ns in by_ns.get(name, ())),
                sum(s.leased_bytes for s in sessions.get(name, ())),
                sum(s.unsealed_bytes for s in sessions.get(name, ())),
                self._tenant_refusals.get(name, 0),
                dram_bytes=shares.get(name, (0, 0))[0],
                dram_cap_bytes=shares.get(name, (0, 0))[1],
                cap_evictions=cap_counts.get(name, (0, 0))[0],
                cap_refused_blocks=cap_counts.get(name, (0, 0))[1],
                own_region=name in self._store.tenant_parts,
            )
            for name in sorted(names)
        ]

    # -------------------------------------------------------------- internals

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

    def _count_query(self, purpose: QueryPurpose, requested: int, sources: Sequence[Tier]) -> None:
        """Under the lock. Only a LOOKUP is a block request (hits by the tier each was found in); a
        LOAD's misses are blocks that vanished between the lookup that found them and the load."""
        c = self.counters
        if purpose == QueryPurpose.LOOKUP:
            c.lookup_queries += 1
            for source in sources:
                if source == Tier.DRAM:
                    c.dram_hits += 1
                elif source == Tier.SSD:
                    c.ssd_hits += 1
                else:
                    c.remote_hits += 1
            c.misses += requested - len(sources)
        else:
            c.load_queries += 1
            c.load_missed_blocks += requested - len(sources)

    def _after_query(
        self,
        purpose: QueryPurpose,
        ns_index: int,
        hashes: Sequence[bytes],
        hit_keys: Sequence[BlockKey],
        num_hits: int | None,
    ) -> None:
        """Recency, frequency and metrics signals of a query, outside the engine lock (the policy has
        its own): ``hit_keys`` are the keys of the blocks it answered as readable, touched tail first,
        so the head of the prefix ends the most recent (a key the policy no longer holds is passed over)."""
        if purpose == QueryPurpose.LOOKUP:
            self._signal(self._lookup_signals, ns_index, hashes, num_hits, hit_keys)
        else:
            self._signal(self._refresh_signals, hit_keys)

    def _signal(self, fn: Callable, *args) -> None:
        # A failure here must not fail the query (its lease is already taken): it is logged.
        try:
            fn(*args)
        except Exception:
            log.exception("query signals (policy / metrics) failed; the query itself succeeded")

    def _lookup_signals(
        self, ns_index: int, hashes: Sequence[bytes], num_hits: int | None, hit_keys: Sequence[BlockKey] = ()
    ) -> None:
        """A block request: ``hit_keys`` are accessed; with ``num_hits`` (None: accounted later) every
        hash feeds the frequency sketch, the hit-rate windows and the HLL ceiling."""
        if hit_keys:
            self.policy.on_access_many(hit_keys[::-1])
        if num_hits is not None:
            self.policy.record_lookups([(ns_index, h) for h in hashes])
            self.observer.on_lookup(ns_index, tuple(hashes), num_hits)

    def _refresh_signals(self, hit_keys: Sequence[BlockKey]) -> None:
        for key in reversed(hit_keys):
            self.policy.on_refresh(key)

    def _within_lease_quota(
        self, session: Session, entries: list[BlockEntry], block_bytes: int
    ) -> tuple[list, bool]:
        """The leading part of ``entries`` the session may still pin, and whether the read lane charged
        it (with a lane the session quota is counted there, over both lanes' leases: uncharged when the
        lease ends); ResourceExhausted if none."""
        if session.trusted:
            return entries, False
        tenant_room = self._tenant_room(session, "leased_bytes")
        tenant_fits = len(entries) if tenant_room == float("inf") else int(max(tenant_room, 0) // block_bytes)
        granted = None
        if self.lane is not None:
            want = min(len(entries), tenant_fits)
            granted = self.lane.charge(session.id, want * block_bytes, block_bytes)
            if granted is not None and granted < 0:
                raise ResourceExhausted(f"session {session.id} holds the most leases it may (the limit)")
        if granted is None:
            room = int(self.config.session_leased_fraction * self._part_of_session(session).size_bytes)
            fits = min(max(room - session.leased_bytes, 0) // block_bytes, tenant_fits)
        else:
            fits = granted // block_bytes
        if fits >= len(entries):
            return entries, granted is not None
        self._count_quota_refusal(session)
        if fits == 0:
            if tenant_fits == 0:
                raise ResourceExhausted(
                    f"tenant {session.tenant.name} already pins {session.tenant.leased_bytes - tenant_room} "
                    f"bytes under leases over all its sessions (its limit is {session.tenant.leased_bytes}); "
                    "release leases first"
                )
            raise ResourceExhausted(
                f"session {session.id} already pins its quota of "
                f"{self.config.session_leased_fraction:.0%} of the pool under leases; release leases first"
            )
        return entries[:fits], granted is not None

    def _part_of_session(self, session: Session) -> RegionPart:
        """The memory a session's client maps: its tenant's own region, else the shared pool. The
        server's own trusted sessions (the GPU path) work in the whole region's offsets: the pool's."""
        tenant = session.tenant
        if tenant is None or tenant.region_bytes is None or session.trusted:
            return self.region.parts[0]
        return self._region_of(tenant)

    def _region_of(self, tenant: Tenant) -> RegionPart:
        try:
            return self.region.part(tenant.name)
        except KeyError:
            # A tenant with region= in a file this engine was not started with (an embedder's mistake).
            raise FailedPrecondition(f"tenant {tenant.name} has no region in this server") from None

    def _tenant_of_key(self, key) -> str:
        """The tenant whose namespace a block key names (policy/tenant_caps.py asks, under the lock)."""
        ns = self._namespaces.by_index(key[0])
        return ns.tenant if ns is not None else DEFAULT_TENANT

    def _tenant_unsealed(self, session: Session) -> int:
        """Bytes granted to the saves of the session's tenant and not sealed yet (0 without a DRAM cap:
        only a capped tenant's allocations need it)."""
        tenant = session.tenant
        if tenant is None or tenant.pool_bytes is None:
            return 0
        return sum(s.unsealed_bytes for s in self._registry.sessions if s.tenant is tenant)

    def _tenant_room(self, session: Session, held: str) -> int | float:
        """Bytes the session's tenant may still add to ``held`` ("leased_bytes" | "unsealed_bytes")
        over all its sessions together; inf without a tenant limit. A sum over its sessions (a few
        per engine process): no second copy of the counts to drift."""
        tenant = session.tenant
        limit = getattr(tenant, held) if tenant is not None else None
        if limit is None:
            return float("inf")
        used = sum(getattr(s, held) for s in self._registry.sessions if s.tenant is tenant)
        return max(limit - used, 0)

    def _count_quota_refusal(self, session: Session) -> None:
        self.counters.quota_refusals += 1
        if session.tenant is not None:
            name = session.tenant.name
            self._tenant_refusals[name] = self._tenant_refusals.get(name, 0) + 1

    def _take_lease(
        self,
        session: Session,
        instance_id: str,
        ns_index: int,
        entries: list[BlockEntry],
        ttl_s: float,
        ident: str = "",
        charged: bool = False,
    ) -> str:
        held = Lease(session.id, instance_id, ns_index, list(entries), time.monotonic(), ttl_s, ident)
        held.charged = charged
        self._store.pin(held.entries)
        self._registry.add_lease(session, held)
        return held.id

    def _check_reported_corrupt(self, leased: Sequence[BlockEntry], hashes: Sequence[bytes]) -> None:
        """Under the lock: hashing a block is CPU only (XXH3 at ~18 GB/s, ~60 us per MiB), and only
        blocks of this lease, each once, at most MAX_CORRUPT_CHECKS of them (a reader stops at the
        first mismatch: more reports are not needed, and a flood of them must not hold the lock)."""
        reported = set(list(dict.fromkeys(hashes))[:MAX_CORRUPT_CHECKS])
        view = self.dram.pool_view()
        for entry in leased:
            if entry.key[1] not in reported or entry.checksum is None or not entry.dram_ready:
                continue
            reported.discard(entry.key[1])
            if checksum(view[entry.dram : entry.dram + entry.length]) == entry.checksum:
                continue
            log.warning(
                "block %s of namespace %d does not match its checksum (reported by a reader): %s",
                entry.key[1].hex()[:16],
                entry.key[0],
                "dropped" if self._store.drop_corrupt(entry) else "dropped once its other readers release it",
            )

    def _drop_lease(self, held: Lease) -> None:
        self._registry.remove_lease(held)
        self._store.unpin(held.entries)
        if held.charged:
            self.lane.uncharge(held.session_id, held.nbytes)

    def _abort_save(self, save: Save) -> int:
        """Under the lock: forgets a registered save and frees its unsealed blocks (see _give_up)."""
        self._registry.remove_save(save)
        return self._give_up(save)

    def _give_up(self, save: Save) -> int:
        """Under the lock: frees a save the registry no longer lists; returns how many blocks. One
        whose AllocateBlocks is still zeroing its slots off the lock (save.zeroing) is only marked:
        that call frees them when it finishes (_finish_zeroing), so no memset of it ever writes a
        slot granted to someone else, and nothing is freed twice."""
        if save.zeroing:
            save.given_up = True
            return sum(1 for e in save.pending.values() if e is not None)
        return self._free_save(save)

    def _free_save(self, save: Save) -> int:
        granted = sum(e.length for e in save.pending.values() if e is not None)
        freed = self._store.abort(save)
        owner = self._registry.sessions.get(save.session_id)
        if owner is not None:
            owner.unsealed_bytes -= granted
        return freed

    def _end_session(self, session: Session, reason: str) -> None:
        leases, saves, instances = self._registry.end_session(session)
        if self.lane is not None:
            self.lane.remove_session(session.id)  # its lane leases end; its quota goes with it
        if self._session_listeners:
            self._ended_sessions.append(session.id)
        for held in leases:
            self._store.unpin(held.entries)
        freed = sum(self._give_up(save) for save in saves)
        log.info(
            "session %s (%r pid %d) ended: %s; released %d leases, freed %d unsealed blocks, "
            "dropped %d instances",
            session.id,
            session.client_name,
            session.pid,
            reason,
            len(leases),
            freed,
            instances,
        )

    def _take_ended_sessions(self) -> list[str]:
        """Under the lock: the sessions ended since the last take, for the caller to _announce once
        it released the lock (in the same hold: no second wait for the lock to announce them)."""
        ended, self._ended_sessions = self._ended_sessions, []
        return ended

    def _announce(self, ended: Sequence[str]) -> None:
        """Off the lock: tells the session listeners of each ended session."""
        for session_id in ended:
            for callback in self._session_listeners:
                try:
                    callback(session_id)
                except Exception:
                    log.exception("session listener failed for %s", session_id)

    # ---------------------------------------------------------- transfers

    def _transfer_done(self, batch: IoBatch, statuses: Sequence[IoStatus]) -> None:
        """The tier mover's completion callback (a tier's thread): record it, wake load_blocks."""
        try:
            with self._locked(None):
                self._store.complete(batch, statuses)
                self._changed.notify_all()
        except Closed:
            return
        if batch.kind in ("promote", "demote"):
            ok = sum(1 for s in statuses if s == IoStatus.OK)
            self.observer.on_transfer(
                batch.kind, batch.nbytes, time.monotonic() - batch.planned_at, ok, len(statuses) - ok
            )

    def _restore_namespaces(self) -> None:
        """Before serving: the namespaces persisted beside the blocks that outlived the last server."""
        saved: dict[str, dict] = {}
        for directory in self._state_dirs:
            saved.update(persistence.load_namespaces(directory))
        for ns_id, layout in saved.items():
            try:
                fields = dict(layout)
                tenant = fields.pop("tenant", "")
                self._namespaces.restore(ns_id, KvLayout(**fields), tenant)
            except (TypeError, ValueError) as exc:
                log.warning("recovery: namespace %s not restored: %s", ns_id, exc)

    def _recover_pool(self) -> None:
        """Before serving: the sealed blocks a persistent pool still holds, each re-adopted only if its
        bytes still hash to the checksum its journal recorded (tiers/dram/journal.py)."""
        start = time.monotonic()
        layout = JournalLayout(self.region.size_bytes, self.allocator.slab_bytes, self.allocator.slot_align)
        path = os.path.join(self.region.persistent_dir, JOURNAL_FILE)
        live, problems = replay(path, layout) if self.region.reused else ({}, [])
        for problem in problems[:16]:
            log.warning("pool recovery: %s", problem)
        adopted: dict[int, JournaledBlock] = {}
        mismatched = orphaned = 0
        view = self.dram.pool_view()
        candidates = []
        for block, ok in journal_verified(view, live):
            key = persistence.namespace_of(self._namespaces, block.tag)
            if not ok:
                mismatched += 1
            elif key is None or self._namespaces.at(key[0]).block_bytes != block.length:
                orphaned += 1
            else:
                candidates.append((block, key))
        if self.region.reused:
            # What the previous process left in slots no adopted block holds is not zeros: a slot is
            # zeroed before its first grant (F2: a seal of unwritten bytes exposes nothing).
            self.allocator.forget_contents()
        refused = set(self.allocator.restore([(b.offset, b.length) for b, _ in candidates]))
        for block, (ns_index, block_hash) in candidates:
            if (block.offset, block.length) in refused:
                continue
            if self._store.recover_slot(ns_index, block_hash, block.offset, block.length, block.checksum):
                adopted[block.offset] = block
            else:
                self.allocator.free(block.offset)
        self._journal = DramJournal(path, layout, live=adopted)
        self._store.journal = self._journal
        self.dram_recovery_seconds = time.monotonic() - start
        log.info(
            "pool recovery: re-adopted %d of %d journaled blocks in %.2f s (%d failed their checksum, "
            "%d of unknown namespaces, %d slots refused)",
            len(adopted),
            len(live),
            self.dram_recovery_seconds,
            mismatched,
            orphaned,
            len(refused),
        )

    def _recover(self) -> None:
        """Before serving: every block the SSD tier still holds."""
        start = time.monotonic()
        skipped: list[tuple[str, str]] = []

        def report(where: str, why: str) -> None:
            skipped.append((where, why))
            if len(skipped) <= 16:
                log.warning("ssd recovery: skipped %s: %s", where, why)

        recovered = orphaned = 0
        for block in self.ssd.recover(report):
            ns_hash = persistence.namespace_of(self._namespaces, block.tag)
            if ns_hash is None or self._namespaces.at(ns_hash[0]).block_bytes != block.extent.length:
                self.ssd.free([block.extent])  # a record of no known namespace can never be served
                orphaned += 1
                continue
            if self._store.recover(ns_hash[0], ns_hash[1], block.extent):
                recovered += 1
            else:
                self.ssd.free([block.extent])
        self.recovery_seconds = time.monotonic() - start
        log.info(
            "ssd recovery: %d blocks in %d namespaces in %.2f s (%d records skipped, "
            "%d of unknown namespaces)",
            recovered,
            len(self._namespaces),
            self.recovery_seconds,
            len(skipped),
            orphaned,
        )

    def _reserve_loop(self) -> None:
        """Keeps the free-slot reserve (store/free_reserve.py): woken by an allocation that left it
        low, it evicts in slices of RESERVE_SLICE_BLOCKS under the lock (~0.1 ms each here), letting
        the requests waiting for the lock in between, while the client that allocated copies its bytes."""
        self.interpreter_core.pin()
        while not self._stop.is_set():
            self._reserve_wanted.wait()
            self._reserve_wanted.clear()
            more = True
            try:
                while more and not self._stop.is_set():
                    with self._locked(None):
                        more = self._store.refill_reserve(RESERVE_SLICE_BLOCKS)
                    time.sleep(0)  # the GIL to a thread that waits for it (a request that wants the lock)
                with self._locked(None):
                    slots = self._store.take_unzeroed_reserve()
                if slots:
                    zeroed = False
                    try:
                        # Off the lock: the slots are held out of the allocator, nobody reads or writes them.
                        self.dram.zero([(offset, block_bytes) for offset, block_bytes, _ in slots])
                        zeroed = True
                    finally:
                        with self._locked(None):
                            self._store.return_zeroed(slots, zeroed)
            except Closed:
                return
            except Exception:
                log.exception("free-slot reserve failed; allocations evict for themselves")

    def _lane_loop(self) -> None:
        """Applies what the read lane's served calls leave for the engine (server/read_lane/lane.py,
        "signals"): woken by the lane's first call after a pass, it waits LANE_BATCH_S so that one
        pass carries many calls."""
        fd = self.lane.signal_fd
        while not self._stop.is_set():
            select.select([fd], [], [], LANE_TICK_S)  # the interpreter lock is free while it waits
            if self._stop.is_set():
                return
            time.sleep(LANE_BATCH_S)
            try:
                self._drain_lane()
            except Closed:
                return
            except Exception:
                log.exception("applying the read lane's signals failed; continuing")

    def _drain_lane(self, deadline: float | None = None) -> None:
        """Takes the read lane's signals and applies them, one drain at a time: signals taken by one
        caller and not yet applied are invisible to the next drain, so stats() waits for a pass in
        progress instead of answering without its counts (seen in CI: a lookup served by the lane,
        drained by this loop, not yet applied when stats() drained nothing and read the counters).
        With a ``deadline``, it waits for that pass only until then (the caller then answers without
        the pass's counts rather than past its deadline)."""
        if not acquire_by(self._lane_drain_lock, deadline):
            return
        try:
            self._apply_lane_signals(self.lane.drain())
        finally:
            self._lane_drain_lock.release()

    def _apply_lane_signals(self, signals: LaneSignals) -> None:
        """What a query or release served by the engine does besides answering, for the calls the
        lane served: counts, the SSD placement's second sightings, recency and lookup sketches, load
        and RPC metrics; and the corrupt blocks whose last lane reader let go are dropped."""
        if not signals:
            return
        counts = signals.counts
        planned: list[IoBatch | None] = []
        applied = []
        with self._locked(None):
            c = self.counters
            c.lookup_queries += counts["lookup_queries"]
            c.dram_hits += counts["dram_hits"]
            c.misses += counts["misses"]
            c.load_queries += counts["load_queries"]
            c.load_missed_blocks += counts["load_missed_blocks"]
            c.load_bytes += counts["loaded_bytes"]
            c.expired_leases += counts["expired_leases"]
            c.read_lane_not_executed += counts["not_executed"]
            c.read_lane_signals_dropped += counts["signals_dropped"]
            get = self._store.index.get
            second_sightings = self._store.placement.on_reuse  # the SSD placement needs the entries
            for query in signals.queries:
                keys = [(query.ns_index, h) for h in query.hashes[: query.served]]
                if second_sightings and not query.load:
                    ready = [e for e in map(get, keys) if e is not None and e.dram_ready]
                    planned.append(self._store.reused(ready))
                applied.append((query, keys))
            for ns_index, key in signals.dead_released:
                entry = get((ns_index, key))
                if entry is not None:
                    self._store.lane_let_go(entry)
        self._mover.submit(planned)
        for query, keys in applied:
            purpose = QueryPurpose.LOAD if query.load else QueryPurpose.LOOKUP
            self._after_query(purpose, query.ns_index, query.hashes, keys, query.found)
            if self._foreground is not None and query.found and not query.load:
                self._foreground.ready_hit()
        for _, loaded, age in signals.loads:
            self.observer.on_load(loaded, age)
        for method, code, seconds in signals.calls:
            self.observer.on_rpc(method, wire_status.from_number(code).name, seconds)

    def _hand_to_reaper(self, work: Callable[[], None]) -> None:
        """``work`` (to run under the engine lock) done by the reaper's next pass, woken now: what a
        call could not finish by its deadline because the lock was busy, and must not be lost (a
        close, a save to free). Never waits: deque.append is atomic, Event.set only notifies."""
        self._handed_over.append(work)
        self._reap_wanted.set()

    def _now_or_by_reaper(self, work: Callable[[], None]) -> None:
        """Runs ``work`` under the engine lock if the lock is free now, else hands it to the reaper:
        never waits (undoing what a caller got that its answer can no longer deliver)."""
        if not self._lock.acquire(blocking=False):
            self._hand_to_reaper(work)
            return
        try:
            if not self._closed:
                work()
        finally:
            self._lock.release()

    def _run_handed_over(self) -> None:
        """Under the lock: the work _hand_to_reaper queued, each item once."""
        while self._handed_over:
            work = self._handed_over.popleft()
            try:
                work()
            except Exception:
                log.exception("work handed to the reaper failed; continuing")

    def _reap_loop(self) -> None:
        while not self._stop.is_set():
            self._reap_wanted.wait(self.config.reaper_interval_s)
            self._reap_wanted.clear()  # before the pass: work handed over after it wakes the next one
            if self._stop.is_set():
                return
            try:
                self.reap()
            except Closed:
                return
            except Exception:
                log.exception("reaper failed; continuing")

    def reap(self, now: float | None = None) -> None:
        """Does the work calls handed over (_hand_to_reaper), ends silent sessions, expires leases,
        frees saves past the write timeout."""
        now = time.monotonic() if now is None else now
        with self._locked(None):
            self._run_handed_over()
            sessions, leases, saves = self._registry.expired(now)
            for session in sessions:
                self._end_session(session, f"no heartbeat for {self.config.session_ttl_s:g} s")
                self.counters.sessions_expired += 1
            for held in leases:
                if self._registry.leases.get(held.id) is held:
                    self._drop_lease(held)
                    self.counters.expired_leases += 1
            if self.lane is not None:
                self.lane.expire()  # counted by the lane (expired_leases, applied by _lane_loop)
            for save in saves:
                if self._registry.saves.get(save.id) is not save:
                    continue
                freed = self._abort_save(save)
                self.counters.timed_out_saves += 1
                log.info(
                    "save %s timed out after %g s; freed %d unsealed blocks",
                    save.id,
                    self.config.write_timeout_s,
                    freed,
                )
            released = self._release_idle_namespaces(now)
            ended = self._take_ended_sessions()
        if released or self._namespaces_unsaved:
            self._save_namespaces()
        self._announce(ended)

    def _save_namespaces(self, deadline: float | None = None) -> None:
        """Writes the namespaces' layouts beside every persistent tier, off the engine lock. A write
        that fails (a full file system, EIO) is a warning while it lasts, never an error for the
        caller: the reaper tries again. Until it succeeds, the records of a namespace registered
        since cannot be mapped by a restarted server: orphans, freed at recovery, never served.
        ``deadline``: a caller that cannot wait (RegisterInstance) leaves the write to the reaper
        when another write (the reaper's, retrying a failing disk) holds the file past it."""
        if not acquire_by(self._persist_lock, deadline):
            self._namespaces_unsaved = True  # the reaper's next tick writes it
            return
        try:
            self._write_namespaces(deadline)
        except DeadlineExceeded:  # the engine lock was busy until then: the layouts were not read
            self._namespaces_unsaved = True
        finally:
            self._persist_lock.release()

    def _write_namespaces(self, deadline: float | None = None) -> None:
        """Under the persist lock: the layouts file in every state directory, the failure remembered.
        The engine lock (to read the layouts) is waited for until ``deadline`` (DeadlineExceeded)."""
        with self._locked(deadline):
            layouts = self._namespaces.layouts()
        try:
            for directory in self._state_dirs:
                persistence.save_namespaces(directory, layouts)
        except OSError as exc:
            if not self._namespaces_unsaved:  # one line per failing stretch
                log.warning(
                    "namespaces not saved (%s): blocks of namespaces registered from now on do not "
                    "outlive a restart until it works again (retried every reaper tick)",
                    exc,
                )
            self._namespaces_unsaved = True
            return
        if self._namespaces_unsaved:
            log.info("namespaces saved again")
        self._namespaces_unsaved = False

    def _release_idle_namespaces(self, now: float) -> bool:
        """Under the lock: forgets namespaces with no instance and no block once idle for
        namespace_idle_s. True when any was released (the layouts file is then written again)."""
        used = self._registry.instances_per_namespace()
        index, idle, released = self._store.index, self._ns_idle_since, False
        for ns in self._namespaces:
            if used.get(ns.index) or index.entries_in(ns.index):
                idle.pop(ns.index, None)
            elif now - idle.setdefault(ns.index, now) >= self.config.namespace_idle_s:
                self._namespaces.release(ns)
                del idle[ns.index]
                released = True
        return released
