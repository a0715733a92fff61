"""The metaserver's index: which live node holds which (namespace, block hash), approximately.

Memory model: one ordered map from block key to a bitmask of the nodes holding
it, each registered node owning one bit (its *ordinal*). The map is kept in
publish order (a key moves to the end whenever a node publishes it again), so
when it outgrows ``max_entries`` the keys published longest ago are dropped
first: the index is a hint, and the oldest hints are the likeliest stale.

A node that dies (lease expired, unregistered, or re-registered after a
restart) stops counting at once: its bit leaves the live mask that every read
is filtered through. Its bits are then cleared from the map by an incremental
sweep (``sweep_step``, run by the service's maintenance thread in short
chunks, so no call waits behind a scan of the whole index); only after that
sweep is its ordinal handed to a new registration.

Thread-safe: every public method takes the index lock; none does unbounded work
under it except ``publish`` and ``locate``, whose size the service caps. Methods
called on behalf of an RPC take its absolute ``deadline`` (``time.monotonic``)
and give up waiting for the lock when it passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from pegaflow.metaserver.types import NamespaceDelta, NodeHit, NodeStats, PublishResult


class LeaseNotFound(KeyError):
    """The lease is unknown or expired: the node must register again (and republish)."""


class TooManyNodes(RuntimeError):
    """The metaserver already tracks its maximum number of live nodes."""


class DeadlinePassed(TimeoutError):
    """The caller's deadline passed before the index could serve it."""


@dataclasses.dataclass
class Node:
    node_id: str
    address: str
    lease_id: str
    ordinal: int
    ttl_s: float
    expires_at: float
    entries: int = 0


@dataclasses.dataclass(frozen=True)
class IndexStats:
    nodes: list[NodeStats]
    entries: int
    max_entries: int
    evicted_entries: int
    expired_nodes: int
    published_added: int
    published_removed: int
    sweeping: bool


def _bits(mask: int) -> Iterable[int]:
    """The ordinals whose bits are set in ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class GlobalIndex:
    """Approximate (namespace, hash) -> nodes map with node leases and a cap on entries."""

    def __init__(
        self,
        max_entries: int,
        max_nodes: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
        self.max_entries = max_entries
        self.max_nodes = max_nodes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._nodes_by_lease: dict[str, Node] = {}
        self._nodes_by_id: dict[str, Node] = {}
        self._nodes_by_ordinal: dict[int, Node] = {}
        self._live_mask = 0
        self._free_ordinals: list[int] = []
        self._next_ordinal = 0
        # Ordinals of dead nodes whose bits may still be in the map: not yet in a
        # sweep (_dying), or covered by the sweep under way (_sweeping).
        self._dying_mask = 0
        self._sweeping_mask = 0
        self._sweep_keys: list[tuple[str, bytes]] | None = None
        self._sweep_pos = 0
        self.evicted_entries = 0
        self.expired_nodes = 0
        self.published_added = 0
        self.published_removed = 0

    # ------------------------------------------------------------- membership

    def register(self, node_id: str, address: str, ttl_s: float, deadline: float | None = None) -> Node:
        """A new lease for ``node_id``; an existing registration of it is dropped with its entries."""
        with self._locked(deadline):
            now = self._clock()
            self._expire_locked(now)
            old = self._nodes_by_id.get(node_id)
            if old is not None:
                self._drop_locked(old)
            elif len(self._nodes_by_id) >= self.max_nodes:
                raise TooManyNodes(f"the metaserver already tracks {self.max_nodes} nodes")
            node = Node(
                node_id=node_id,
                address=address,
                lease_id=secrets.token_hex(16),
                ordinal=self._take_ordinal(),
                ttl_s=ttl_s,
                expires_at=now + ttl_s,
            )
            self._nodes_by_lease[node.lease_id] = node
            self._nodes_by_id[node_id] = node
            self._nodes_by_ordinal[node.ordinal] = node
            self._live_mask |= 1 << node.ordinal
            return dataclasses.replace(node)

    def heartbeat(self, lease_id: str, deadline: float | None = None) -> Node:
        """Renews the lease; returns a snapshot of the node."""
        with self._locked(deadline):
            node = self._live_node_locked(lease_id)
            node.expires_at = self._clock() + node.ttl_s
            return dataclasses.replace(node)

    def unregister(self, lease_id: str, deadline: float | None = None) -> None:
        with self._locked(deadline):
            self._drop_locked(self._live_node_locked(lease_id))

    def expire(self) -> list[str]:
        """Drops every node whose lease has run out; returns their ids."""
        with self._lock:
            return self._expire_locked(self._clock())

    # ------------------------------------------------------------------ index

    def publish(
        self, lease_id: str, deltas: Sequence[NamespaceDelta], deadline: float | None = None
    ) -> PublishResult:
        """Records the node's gained and lost keys (also renews its lease)."""
        with self._locked(deadline):
            node = self._live_node_locked(lease_id)
            node.expires_at = self._clock() + node.ttl_s
            bit = 1 << node.ordinal
            entries = self._entries
            added = removed = 0
            for delta in deltas:
                namespace = sys.intern(delta.namespace)
                for block_hash in delta.added:
                    key = (namespace, block_hash)
                    mask = entries.get(key, 0)
                    if not mask & bit:
                        added += 1
                        entries[key] = mask | bit
                    # Published again: the freshest hint, last to be evicted.
                    entries.move_to_end(key)
                for block_hash in delta.removed:
                    key = (namespace, block_hash)
                    mask = entries.get(key, 0)
                    if mask & bit:
                        removed += 1
                        mask &= ~bit
                        if mask & self._live_mask:
                            entries[key] = mask
                        else:
                            del entries[key]
            node.entries += added - removed
            self.published_added += added
            self.published_removed += removed
            evicted = self._evict_over_cap_locked()
            return PublishResult(added=added, removed=removed, evicted=evicted)

    def locate(
        self,
        namespace: str,
        block_hashes: Sequence[bytes],
        exclude_node_id: str = "",
        deadline: float | None = None,
    ) -> list[NodeHit]:
        """Per live node, the number of leading ``block_hashes`` it holds; most blocks first."""
        with self._locked(deadline):
            self._expire_locked(self._clock())
            candidates = self._live_mask
            excluded = self._nodes_by_id.get(exclude_node_id) if exclude_node_id else None
            if excluded is not None:
                candidates &= ~(1 << excluded.ordinal)
            entries = self._entries
            leading: dict[int, int] = {}
            position = 0
            for position, block_hash in enumerate(block_hashes):
                holders = entries.get((namespace, block_hash), 0) & candidates
                for ordinal in _bits(candidates & ~holders):
                    leading[ordinal] = position
                candidates = holders
                if not candidates:
                    break
            else:
                for ordinal in _bits(candidates):
                    leading[ordinal] = len(block_hashes)
            hits = [
                NodeHit(node.node_id, node.address, count)
                for ordinal, count in leading.items()
                if count > 0 and (node := self._nodes_by_ordinal.get(ordinal)) is not None
            ]
        hits.sort(key=lambda hit: (-hit.num_blocks, hit.node_id))
        return hits

    def node_entries(self, lease_id: str, deadline: float | None = None) -> int:
        with self._locked(deadline):
            return self._live_node_locked(lease_id).entries

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self, deadline: float | None = None) -> IndexStats:
        with self._locked(deadline):
            now = self._clock()
            self._expire_locked(now)
            nodes = [
                NodeStats(n.node_id, n.address, n.entries, max(0.0, n.expires_at - now))
                for n in sorted(self._nodes_by_id.values(), key=lambda n: n.node_id)
            ]
            return IndexStats(
                nodes=nodes,
                entries=len(self._entries),
                max_entries=self.max_entries,
                evicted_entries=self.evicted_entries,
                expired_nodes=self.expired_nodes,
                published_added=self.published_added,
                published_removed=self.published_removed,
                sweeping=self._sweep_keys is not None or bool(self._dying_mask),
            )

    # ------------------------------------------------------------ maintenance

    def sweep_step(self, max_keys: int = 20_000) -> bool:
        """Clears dead nodes' bits from up to ``max_keys`` keys; True while work is left."""
        with self._lock:
            if self._sweep_keys is None:
                if not self._dying_mask:
                    return False
                # Keys published after this snapshot cannot carry these ordinals: they are dead.
                self._sweeping_mask, self._dying_mask = self._dying_mask, 0
                self._sweep_keys = list(self._entries)
                self._sweep_pos = 0
            dead = self._sweeping_mask | self._dying_mask
            entries = self._entries
            keys = self._sweep_keys
            end = min(len(keys), self._sweep_pos + max_keys)
            for key in keys[self._sweep_pos : end]:
                mask = entries.get(key)
                if mask is None or not mask & dead:
                    continue
                mask &= ~dead
                if mask:
                    entries[key] = mask
                else:
                    del entries[key]
            self._sweep_pos = end
            if end < len(keys):
                return True
            self._free_ordinals.extend(_bits(self._sweeping_mask))
            self._sweeping_mask = 0
            self._sweep_keys = None
            return bool(self._dying_mask)

    # -------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _locked(self, deadline: float | None) -> Iterator[None]:
        if deadline is None:
            timeout = -1.0
        else:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlinePassed("deadline passed before the call was served")
        if not self._lock.acquire(timeout=timeout):
            raise DeadlinePassed("deadline passed while waiting for the index")
        try:
            yield
        finally:
            self._lock.release()

    def _take_ordinal(self) -> int:
        if self._free_ordinals:
            return self._free_ordinals.pop()
        ordinal = self._next_ordinal
        self._next_ordinal += 1
        return ordinal

    def _live_node_locked(self, lease_id: str) -> Node:
        node = self._nodes_by_lease.get(lease_id)
        if node is None:
            raise LeaseNotFound(lease_id)
        if node.expires_at <= self._clock():
            self._drop_locked(node)
            self.expired_nodes += 1
            raise LeaseNotFound(lease_id)
        return node

    def _expire_locked(self, now: float) -> list[str]:
        expired = [node for node in self._nodes_by_lease.values() if node.expires_at <= now]
        for node in expired:
            self._drop_locked(node)
        self.expired_nodes += len(expired)
        return [node.node_id for node in expired]

    def _drop_locked(self, node: Node) -> None:
        del self._nodes_by_lease[node.lease_id]
        if self._nodes_by_id.get(node.node_id) is node:
            del self._nodes_by_id[node.node_id]
        del self._nodes_by_ordinal[node.ordinal]
        bit = 1 << node.ordinal
        self._live_mask &= ~bit
        self._dying_mask |= bit
        node.entries = 0

    def _evict_over_cap_locked(self) -> int:
        entries = self._entries
        evicted = 0
        while len(entries) > self.max_entries:
            _, mask = entries.popitem(last=False)
            evicted += 1
            for ordinal in _bits(mask & self._live_mask):
                self._nodes_by_ordinal[ordinal].entries -= 1
        self.evicted_entries += evicted
        return evicted
