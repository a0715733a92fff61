"""The remote source: on a local miss, find the node that holds the rest of a prefix and pull it here.

A remote node is a read-through source, not a tier (it owns no space here): this module decides
what to pull, gives the transport local pool slots to land in, and hands back to the engine the
blocks that arrived whole. It knows nothing of how bytes move (server/peers/base.py: Transport,
PeerLink) nor where blocks live on this node (the engine's plan_fetch / fetched).

Flow, per request (a LOOKUP whose local prefix ended early), all off the request path on the
source's own worker threads:

1. ``locate``: ask the metaserver which other live node holds the longest prefix of the rest
   (a hint: it may be stale or partial; no answer is a miss for this request only, while "nobody
   holds it" is remembered for ``negative_ttl_s``);
2. ``open_transfer`` on that node's link (links are cached per peer): the peer pins the leading
   blocks it really holds under a transfer lease with a TTL, and names their lengths and
   checksums (0 blocks: the index was stale, a miss);
3. ``plan_fetch``: the engine allocates slots for them (pending: a query counts them, LoadBlocks
   waits for them);
4. ``fetch`` into those slots with a deadline; when it resolves no byte can land any more;
5. ``fetched``: the blocks that arrived whole and matched their checksums become readable (and
   are published as held here too); the others leave; then ``close_transfer`` (not waited for).

A request for a chain already being pulled (or looked up) joins it; a chain nobody holds is not
asked about again for ``negative_ttl_s``; requests beyond ``max_inflight`` or the bytes bound are
misses, counted. The engine's query answers ``searching`` while step 1-3 run for its chain.
Nothing here raises into the request path: every failure is a miss and a counter.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pegaflow.server.interpreter_core import release_thread
from pegaflow.server.peers.base import BlockStatus, PeerAddress, PeerError, PeerLink, Transport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    # The metaserver lookup. It runs on the source's worker while the request waits ("searching", up
    # to the connector's max wait), so it need not be short to protect the request; 50 ms was too
    # short on a loaded 2-core host (a lookup that timed out left a prefix A held unpulled).
    locate_timeout_s: float = 0.5
    connect_timeout_s: float = 2.0
    fetch_deadline_s: float = 10.0  # one pull, end to end (open, fetch, seal)
    transfer_ttl_s: float = 30.0  # the peer's pin; must outlive the fetch deadline
    max_fetch_bytes: int = 4 << 30  # the most one pull moves
    inflight_bytes: int = 8 << 30  # bytes being pulled at once over all peers
    max_inflight: int = 8  # chains being looked up or pulled at once
    workers: int = 4
    negative_ttl_s: float = 1.0  # a chain no node holds is not asked about again for this long
    min_blocks: int = 1  # a peer holding fewer leading blocks than this is not worth a pull

    def __post_init__(self):
        if self.transfer_ttl_s <= self.fetch_deadline_s:
            raise ValueError("--peer-transfer-ttl must be longer than --peer-fetch-deadline")


@dataclasses.dataclass
class RemoteStats:
    requests: int = 0
    joined: int = 0  # a request for a chain already in flight
    negative_hits: int = 0  # skipped: no node held it a moment ago
    dropped: int = 0  # over max_inflight or the bytes bound
    located: int = 0  # the metaserver named a peer
    not_located: int = 0
    locate_failed: int = 0  # the metaserver did not answer (not remembered as a miss: ask again)
    stale: int = 0  # the peer held less than the index said
    fetches: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    failed_blocks: int = 0
    failures: dict[str, int] = dataclasses.field(default_factory=lambda: collections.Counter())
    inflight: int = 0
    inflight_bytes: int = 0


class RemoteSource:
    def __init__(self, engine, publisher, transport: Transport, options: RemoteOptions = RemoteOptions()):
        self._engine = engine
        self._publisher = publisher
        self._transport = transport
        self.options = options
        self._lock = threading.Lock()
        self._links: dict[str, PeerLink] = {}
        self._inflight: dict[tuple[int, bytes], float] = {}  # (ns index, first hash) -> started
        self._negative: dict[tuple[int, bytes], float] = {}  # -> until
        self._stats = RemoteStats()
        # Its threads start from a query's thread: not on that thread's pinned CPU (interpreter_core.py).
        self._pool = ThreadPoolExecutor(
            options.workers, thread_name_prefix="pegaflow-remote", initializer=release_thread
        )
        self._closed = False

    # ------------------------------------------------------------ the engine's side

    def request(self, namespace_id: str, ns_index: int, block_bytes: int, hashes: Sequence[bytes]) -> bool:
        """Called after a LOOKUP whose local prefix ended before ``hashes`` (the rest). Starts a pull
        in the background unless one runs; True while one runs for this chain. Never blocks."""
        if not hashes or self._closed:
            return False
        key = (ns_index, bytes(hashes[0]))
        now = time.monotonic()
        with self._lock:
            s = self._stats
            s.requests += 1
            if key in self._inflight:
                s.joined += 1
                return True
            until = self._negative.get(key)
            if until is not None:
                if until > now:
                    s.negative_hits += 1
                    return False
                del self._negative[key]
            if len(self._inflight) >= self.options.max_inflight:
                s.dropped += 1
                return False
            self._inflight[key] = now
            s.inflight = len(self._inflight)
        try:
            self._pool.submit(self._pull, key, namespace_id, ns_index, block_bytes, list(hashes))
        except RuntimeError:  # shut down meanwhile
            self._done(key)
            return False
        return True

    def searching(self, ns_index: int, first_hash: bytes) -> bool:
        with self._lock:
            return (ns_index, bytes(first_hash)) in self._inflight

    # ------------------------------------------------------------------ the pull

    def _pull(self, key, namespace_id: str, ns_index: int, block_bytes: int, hashes: list[bytes]) -> None:
        opts = self.options
        deadline = time.monotonic() + opts.fetch_deadline_s
        reserved = 0
        try:
            hits = self._publisher.try_locate(namespace_id, hashes, timeout_s=opts.locate_timeout_s)
            if hits is None:
                self._count("locate_failed")  # no answer is not "nobody holds it": no negative entry
                return
            best = max(hits, key=lambda h: h.num_blocks, default=None)
            if best is None or best.num_blocks < opts.min_blocks:
                self._count("not_located")
                self._remember_miss(key)
                return
            self._count("located")
            want = min(best.num_blocks, len(hashes), max(opts.max_fetch_bytes // block_bytes, 1))
            reserved = self._reserve(want * block_bytes)
            if not reserved:
                self._count("dropped")
                return
            link = self._link(best.address, best.node_id, deadline)
            transfer = link.open_transfer(namespace_id, hashes[:want], opts.transfer_ttl_s, deadline)
            try:
                self._fetch(link, transfer, ns_index, block_bytes, hashes, deadline)
            finally:
                if transfer.num_blocks:
                    link.close_transfer(transfer.transfer_id, deadline, wait=False)
        except PeerError as exc:
            self._failed(exc.cause, f"{exc}")
        except Exception:
            log.exception("remote source: a pull from a peer failed")
            self._failed(BlockStatus.PROTOCOL, "unexpected error")
        finally:
            if reserved:
                self._release(reserved)
            self._done(key)

    def _fetch(self, link: PeerLink, transfer, ns_index: int, block_bytes: int, hashes, deadline) -> None:
        extents = list(transfer.extents)
        if not extents:
            self._count("stale")  # the index named a peer that holds none of it any more: a miss
            return
        if any(x.length != block_bytes for x in extents):
            self._failed(BlockStatus.PROTOCOL, "the peer's blocks do not have this namespace's block size")
            return
        entries, views = self._engine.plan_fetch(ns_index, hashes[: len(extents)], block_bytes)
        if not entries:
            return  # this node got the blocks meanwhile (or no slot): nothing to pull
        extents = extents[: len(entries)]
        with self._lock:
            self._stats.fetches += 1
        result = None
        try:
            result = link.fetch(extents, views, deadline).result()
        finally:
            # Resolution means no byte can land in a slot any more (base.py): now they may be reused.
            statuses = result.statuses if result is not None else [BlockStatus.CANCELLED] * len(entries)
            ok = [s is BlockStatus.OK for s in statuses]
            lead = ok.index(False) if False in ok else len(ok)
            ok = [i < lead for i in range(len(ok))]  # a block after a failed one is useless: not sealed
            self._engine.fetched(entries, ok, [x.checksum for x in extents])
        with self._lock:
            s = self._stats
            s.fetched_blocks += lead
            s.fetched_bytes += lead * block_bytes
            s.failed_blocks += len(entries) - lead
            for status in statuses[lead:]:
                if status is not BlockStatus.OK:
                    s.failures[status.label] += 1
                    break

    def _link(self, address: str, node_id: str, deadline: float) -> PeerLink:
        with self._lock:
            link = self._links.get(address)
        if link is not None and link.healthy:
            return link
        if link is not None:
            link.close()
        connect_by = min(deadline, time.monotonic() + self.options.connect_timeout_s)
        link = self._transport.connect(PeerAddress(address, node_id), connect_by)
        with self._lock:
            old = self._links.get(address)
            self._links[address] = link
        if old is not None and old is not link:
            old.close()
        return link

    # ---------------------------------------------------------------- bookkeeping

    def _reserve(self, nbytes: int) -> int:
        with self._lock:
            if self._stats.inflight_bytes + nbytes > self.options.inflight_bytes:
                return 0
            self._stats.inflight_bytes += nbytes
            return nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._stats.inflight_bytes -= nbytes

    def _done(self, key) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            self._stats.inflight = len(self._inflight)

    def _remember_miss(self, key) -> None:
        with self._lock:
            if len(self._negative) > 65536:
                now = time.monotonic()
                self._negative = {k: t for k, t in self._negative.items() if t > now}
            self._negative[key] = time.monotonic() + self.options.negative_ttl_s

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def _failed(self, cause: BlockStatus, why: str) -> None:
        log.debug("remote source: pull failed (%s): %s", cause.label, why)
        with self._lock:
            self._stats.failures[cause.label] += 1

    def stats(self) -> RemoteStats:
        with self._lock:
            snap = dataclasses.replace(self._stats, failures=collections.Counter(self._stats.failures))
        return snap

    def close(self) -> None:
        """Stops pulling: pulls in flight end at their deadlines, then the links close."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
