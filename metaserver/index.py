"""The metaserver's index: which live node holds which (namespace, block hash), approximately.

Memory model (measured by bench/metaserver_bench.py; numbers in metaserver/README.md):
a fixed-size table of numpy arrays, ``buckets x 8`` slots, with no Python object
per entry. A slot holds

- the key: the block hash itself, zero-padded to 32 bytes (4 x uint64), or, for a
  hash longer than 32 bytes, its BLAKE2b-256 digest. Keys are compared in full,
  so two different blocks never share a slot: a Locate can never name a node
  for a block it did not publish (a 64-bit digest alone would, once in ~10^6
  tables of 10^7 entries);
- a tag (uint64): namespace ordinal, hash length and a 32-bit fingerprint, so a
  probe compares one word per slot before it touches the key; 0 = empty;
- a holder bitmap (``W`` x uint64, one bit per registered node's ordinal; ``W``
  grows from 1 when a 65th node registers, so 64 nodes cost 8 bytes a slot);
- a stamp (uint32): the publish call that last published the key.

52 bytes a slot at W = 1: 68 bytes of RSS per entry measured at 10^7 entries in a
table sized 1.25x (80% full), against 180-200 for the previous
``OrderedDict[(str, bytes), int]`` (bench/metaserver_bench.py).

Placement is two-choice bucketed hashing: a key may live in either of two
8-slot buckets, it goes to the emptier one, and when both are full the slot
with the oldest stamp of the 16 is evicted. So the cap is a true memory
bound, eviction is "the oldest of its neighbours" (the oldest hints are the
likeliest stale; the previous global LRU needed a linked list per entry), a
removal just empties its slot (no tombstones, no rehash ever), and no call
scans the table. Every operation is vectorized over a batch (one publish call,
one Locate prefix): numpy gathers and compares, the GIL is released inside
the larger ones.

A node that dies (lease expired, unregistered, or re-registered after a
restart) stops counting at once: its bit leaves the live mask that every read
is filtered through. Its bits are then cleared from the table by an
incremental sweep (``sweep_step``, run by the service's maintenance thread in
short chunks); only after that sweep is its ordinal handed to a new
registration.

Ordered replay protection: each registration records the node's
*incarnation* (a number that changes at every node start) and the last batch
*sequence* it applied. A batch with another incarnation is stale; one whose
sequence is not above the last applied is a replay (``DUPLICATE``: dropped,
reported as success); one that skips a sequence reveals a lost batch
(``SEQUENCE_GAP``: dropped; the node registers again and re-publishes).

Thread-safe: every public method takes the index lock. A publish is applied in
chunks of ``PUBLISH_CHUNK`` keys with the lock released between them, so a
Locate never waits behind more than one chunk (~1 ms). Methods called on
behalf of an RPC take its absolute ``deadline`` (``time.monotonic``) and give
up waiting for the lock when it passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from pegaflow.metaserver.types import NamespaceDelta, NodeHit, NodeStats, PublishOutcome, PublishResult

SLOTS_PER_BUCKET = 8
KEY_BYTES = 32
KEY_WORDS = KEY_BYTES // 8
# Keys applied per lock hold (~0.3 ms of numpy work on a quiet core): the longest a Locate
# waits behind a publish.
PUBLISH_CHUNK = 2048
# Namespace ordinals live in 23 bits of the tag.
MAX_NAMESPACES = (1 << 23) - 1

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_WORD_MULT = tuple(
    np.uint64(x) for x in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x87C37B91114253D5, 0x4CF5AD432745937F)
)
_S29, _S31, _S32, _S40 = np.uint64(29), np.uint64(31), np.uint64(32), np.uint64(40)
_LOW32 = np.uint64(0xFFFFFFFF)


class LeaseNotFound(KeyError):
    """The lease is unknown or expired: the node must register again (and republish)."""


class TooManyNodes(RuntimeError):
    """The metaserver already tracks its maximum number of live nodes."""


class TooManyNamespaces(RuntimeError):
    """The index already knows MAX_NAMESPACES namespaces."""


class StaleIncarnation(RuntimeError):
    """A registration from an older incarnation of a node whose newer one holds a live lease."""


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
    incarnation: int = 0
    last_sequence: int = 0
    # Filled in the snapshots heartbeat() returns: entries the index holds for the node.
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
    duplicate_batches: int = 0
    stale_batches: int = 0
    sequence_gaps: int = 0


class _Op(enum.Enum):
    ADD = 1
    REMOVE = 2


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (uint64 arithmetic wraps)."""
    x = x ^ (x >> _S31)
    x = x * _M2
    x = x ^ (x >> _S29)
    x = x * _M3
    return x ^ (x >> _S32)


def _unique(ids: np.ndarray) -> np.ndarray:
    """Sorted distinct values (np.unique's hash path measured 7x slower on 4096 slot ids)."""
    if len(ids) < 2:
        return ids
    ordered = np.sort(ids)
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class GlobalIndex:
    """Approximate (namespace, hash) -> nodes map with node leases and a memory-bounded table."""

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
        self.max_nodes = max_nodes
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets = max(1, max_entries // SLOTS_PER_BUCKET)
        self.max_entries = self._buckets * SLOTS_PER_BUCKET
        shape = (self._buckets, SLOTS_PER_BUCKET)
        slots = self.max_entries
        # np.zeros maps pages lazily: memory is touched as the table fills. A bucket's tags are
        # one 64-byte row (one cache line); the other arrays are indexed by flat slot id.
        # Rows are read and written through void views of their whole width: numpy's fancy
        # indexing of 2-D rows goes element by element (15 ms to write 4096 keys, measured),
        # of 1-D void items it is one memcpy each (36 us).
        self._tag = np.zeros(shape, dtype=np.uint64)
        self._tag_flat = self._tag.reshape(-1)
        self._tag_rows = self._tag.view(np.dtype((np.void, 8 * SLOTS_PER_BUCKET))).reshape(-1)
        self._key = np.zeros((slots, KEY_WORDS), dtype=np.uint64)
        self._key_rows = self._key.view(np.dtype((np.void, KEY_BYTES))).reshape(-1)
        self._set_mask(np.zeros((slots, 1), dtype=np.uint64))
        self._stamp = np.zeros(shape, dtype=np.uint32)
        self._stamp_flat = self._stamp.reshape(-1)
        self._fill = np.zeros(self._buckets, dtype=np.uint8)
        # Scratch for picking one inserting key per bucket per round (a scatter, not a sort).
        self._claim = np.zeros(self._buckets, dtype=np.int32)
        self._entries = 0
        self._publish_clock = 0
        self._namespaces: dict[str, int] = {}
        self._nodes_by_lease: dict[str, Node] = {}
        self._nodes_by_id: dict[str, Node] = {}
        self._nodes_by_ordinal: dict[int, Node] = {}
        self._node_entries = np.zeros(64, dtype=np.int64)
        self._live_mask = 0
        self._free_ordinals: list[int] = []
        self._next_ordinal = 0
        # Ordinals of dead nodes whose bits may still be in the table: not yet in a
        # sweep (_dying), or covered by the sweep under way (_sweeping, from bucket _sweep_pos on).
        self._dying_mask = 0
        self._sweeping_mask = 0
        self._sweep_pos: int | None = None
        self.evicted_entries = 0
        self.expired_nodes = 0
        self.published_added = 0
        self.published_removed = 0
        self.duplicate_batches = 0
        self.stale_batches = 0
        self.sequence_gaps = 0

    # ------------------------------------------------------------- membership

    def register(
        self,
        node_id: str,
        address: str,
        ttl_s: float,
        deadline: float | None = None,
        incarnation: int = 0,
    ) -> Node:
        """A new lease for ``node_id``; an existing registration of it is dropped with its entries.

        ``incarnation`` (0: not given) must not be older than that of a live
        registration of the same node: StaleIncarnation (a zombie of a node
        that has restarted since must not erase the new one's entries).
        """
        with self._locked(deadline):
            now = self._clock()
            self._expire_locked(now)
            old = self._nodes_by_id.get(node_id)
            if old is not None:
                if incarnation and old.incarnation and incarnation < old.incarnation:
                    raise StaleIncarnation(
                        f"node {node_id}: incarnation {incarnation} is older than the registered "
                        f"{old.incarnation}"
                    )
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
                incarnation=incarnation,
            )
            self._nodes_by_lease[node.lease_id] = node
            self._nodes_by_id[node_id] = node
            self._nodes_by_ordinal[node.ordinal] = node
            self._live_mask |= 1 << node.ordinal
            self._ensure_words(node.ordinal)
            self._node_entries[node.ordinal] = 0
            return dataclasses.replace(node)

    def heartbeat(self, lease_id: str, deadline: float | None = None) -> Node:
        """Renews the lease; returns a snapshot of the node."""
        with self._locked(deadline):
            node = self._live_node_locked(lease_id)
            node.expires_at = self._clock() + node.ttl_s
            return dataclasses.replace(node, entries=int(self._node_entries[node.ordinal]))

    def unregister(self, lease_id: str, deadline: float | None = None) -> None:
        with self._locked(deadline):
            self._drop_locked(self._live_node_locked(lease_id))

    def expire(self) -> list[str]:
        """Drops every node whose lease has run out; returns their ids."""
        with self._lock:
            return self._expire_locked(self._clock())

    # ------------------------------------------------------------------ index

    def publish(
        self,
        lease_id: str,
        deltas: Sequence[NamespaceDelta],
        deadline: float | None = None,
        incarnation: int = 0,
        sequence: int = 0,
    ) -> PublishResult:
        """Records the node's gained and lost keys (also renews its lease), delta by delta, in order.

        ``sequence`` 0 is an unsequenced batch (a tool's call: applied, no replay
        check); the publisher numbers its batches 1, 2, ... per registration.
        """
        with self._locked(deadline):
            node = self._live_node_locked(lease_id)
            node.expires_at = self._clock() + node.ttl_s
            if incarnation and node.incarnation and incarnation != node.incarnation:
                self.stale_batches += 1
                return PublishResult(0, 0, 0, PublishOutcome.STALE_INCARNATION, node.last_sequence + 1)
            if sequence:
                if sequence <= node.last_sequence:
                    self.duplicate_batches += 1
                    return PublishResult(0, 0, 0, PublishOutcome.DUPLICATE, node.last_sequence + 1)
                if sequence != node.last_sequence + 1:
                    self.sequence_gaps += 1
                    return PublishResult(0, 0, 0, PublishOutcome.SEQUENCE_GAP, node.last_sequence + 1)
            # Namespaces first: a refusal (TooManyNamespaces) must not spend the sequence number.
            work = []
            for delta in deltas:
                ns = self._namespace_locked(delta.namespace)
                for op, hashes in ((_Op.ADD, delta.added), (_Op.REMOVE, delta.removed)):
                    for start in range(0, len(hashes), PUBLISH_CHUNK):
                        work.append((ns, op, hashes[start : start + PUBLISH_CHUNK]))
            if sequence:
                # Claimed before the chunks are applied: a retry of this batch is a duplicate.
                node.last_sequence = sequence
            self._publish_clock += 1
            stamp = self._publish_clock & 0xFFFFFFFF
        added = removed = evicted = 0
        for ns, op, hashes in work:
            # Digests are computed outside the lock (they depend on nothing it guards).
            keys = self._keys(ns, hashes)
            # One chunk per lock hold, so readers interleave. The node must still be the same
            # registration: once dropped, its ordinal may be swept and handed to another node.
            with self._lock:
                if self._nodes_by_lease.get(lease_id) is not node:
                    break
                if op is _Op.ADD:
                    a, e = self._add_locked(keys, node.ordinal, stamp)
                    added += a
                    evicted += e
                else:
                    removed += self._remove_locked(keys, node.ordinal)
        with self._lock:
            self.published_added += added
            self.published_removed += removed
        return PublishResult(added, removed, evicted, PublishOutcome.APPLIED, node.last_sequence + 1)

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
            ns = self._namespaces.get(namespace)
            if ns is None or not block_hashes or not self._live_mask:
                return []
            candidates = self._live_mask
            excluded = self._nodes_by_id.get(exclude_node_id) if exclude_node_id else None
            if excluded is not None:
                candidates &= ~(1 << excluded.ordinal)
            keys = self._keys(ns, block_hashes)
            ids = self._find_locked(keys)
            words = self._mask.shape[1]
            held = np.zeros((len(block_hashes), words), dtype=np.uint64)
            found = ids >= 0
            held[found] = self._masks_of(ids[found])
            held &= self._words(candidates, words)
            # A node's leading count: how many prefix positions its bit survives the running AND.
            running = np.bitwise_and.accumulate(held, axis=0)
            counts = np.unpackbits(running.view(np.uint8), axis=1, bitorder="little").sum(axis=0)
            hits = [
                NodeHit(node.node_id, node.address, int(counts[ordinal]))
                for ordinal in np.flatnonzero(counts).tolist()
                if (node := self._nodes_by_ordinal.get(ordinal)) is not None
            ]
        hits.sort(key=lambda hit: (-hit.num_blocks, hit.node_id))
        return hits

    def node_entries(self, lease_id: str, deadline: float | None = None) -> int:
        with self._locked(deadline):
            return int(self._node_entries[self._live_node_locked(lease_id).ordinal])

    def __len__(self) -> int:
        return self._entries

    def memory_bytes(self) -> int:
        """Bytes of the table's arrays (reserved; pages are touched as it fills)."""
        return sum(a.nbytes for a in (self._tag, self._key, self._mask, self._stamp, self._fill, self._claim))

    def stats(self, deadline: float | None = None) -> IndexStats:
        with self._locked(deadline):
            now = self._clock()
            self._expire_locked(now)
            nodes = [
                NodeStats(
                    n.node_id, n.address, int(self._node_entries[n.ordinal]), max(0.0, n.expires_at - now)
                )
                for n in sorted(self._nodes_by_id.values(), key=lambda n: n.node_id)
            ]
            return IndexStats(
                nodes=nodes,
                entries=self._entries,
                max_entries=self.max_entries,
                evicted_entries=self.evicted_entries,
                expired_nodes=self.expired_nodes,
                published_added=self.published_added,
                published_removed=self.published_removed,
                sweeping=self._sweep_pos is not None or bool(self._dying_mask),
                duplicate_batches=self.duplicate_batches,
                stale_batches=self.stale_batches,
                sequence_gaps=self.sequence_gaps,
            )

    # ------------------------------------------------------------ maintenance

    def sweep_step(self, max_keys: int = 1 << 18) -> bool:
        """Clears dead nodes' bits from up to ``max_keys`` slots; True while work is left."""
        with self._lock:
            if self._sweep_pos is None:
                if not self._dying_mask:
                    return False
                # Slots written after this point cannot carry these ordinals: they are dead.
                self._sweeping_mask, self._dying_mask = self._dying_mask, 0
                self._sweep_pos = 0
            start = self._sweep_pos
            end = min(self._buckets, start + max(1, max_keys // SLOTS_PER_BUCKET))
            lo, hi = start * SLOTS_PER_BUCKET, end * SLOTS_PER_BUCKET
            dead = self._words(self._sweeping_mask, self._mask.shape[1])
            masks = self._mask[lo:hi]
            masks &= ~dead
            empty = (self._tag_flat[lo:hi] != 0) & ~masks.any(axis=1)
            if empty.any():
                self._tag_flat[lo:hi][empty] = 0
                freed = empty.reshape(-1, SLOTS_PER_BUCKET).sum(axis=1).astype(np.uint8)
                self._fill[start:end] -= freed
                self._entries -= int(freed.sum())
            self._sweep_pos = end
            if end < self._buckets:
                return True
            for ordinal in range(self._sweeping_mask.bit_length()):
                if self._sweeping_mask >> ordinal & 1:
                    self._free_ordinals.append(ordinal)
            self._sweeping_mask = 0
            self._sweep_pos = None
            return bool(self._dying_mask)

    # ------------------------------------------------------- table internals

    def _namespace_locked(self, namespace: str) -> int:
        ns = self._namespaces.get(namespace)
        if ns is None:
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise TooManyNamespaces(f"the index already knows {MAX_NAMESPACES} namespaces")
            ns = self._namespaces[namespace] = len(self._namespaces) + 1
        return ns

    def _keys(
        self, ns: int, hashes: Sequence[bytes]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(key words (n, 4), tag (n,), first bucket (n,), second bucket (n,)) of the hashes."""
        n = len(hashes)
        raw = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        lengths = np.empty(n, dtype=np.uint64)
        first = len(hashes[0]) if n else 0
        if n and first <= KEY_BYTES and min(map(len, hashes)) == max(map(len, hashes)):
            # The common case (every hash of a batch one length): one join, one copy.
            raw[:, :first] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, first)
            lengths[:] = first
        else:
            for i, value in enumerate(hashes):
                if len(value) > KEY_BYTES:
                    # Length code 0: a digest (raw keys are 1..32 bytes).
                    value = hashlib.blake2b(value, digest_size=KEY_BYTES).digest()
                    lengths[i] = 0
                else:
                    lengths[i] = len(value)
                raw[i, : len(value)] = np.frombuffer(value, dtype=np.uint8)
        words = raw.view(np.uint64)
        seed = np.uint64((ns * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        h = np.full(n, seed, dtype=np.uint64) ^ (lengths * _M2)
        for w in range(KEY_WORDS):
            h = _mix(h ^ (words[:, w] * _WORD_MULT[w]))
        h2 = _mix(h ^ _M3)
        buckets = np.uint64(self._buckets)
        tag = (np.uint64(ns) << _S40) | (lengths << _S32) | (h2 >> _S32)
        return words, tag, (h % buckets).astype(np.intp), ((h2 & _LOW32) % buckets).astype(np.intp)

    def _set_mask(self, mask: np.ndarray) -> None:
        self._mask = mask
        self._mask_rows = mask.view(np.dtype((np.void, 8 * mask.shape[1]))).reshape(-1)

    def _bucket_tags(self, buckets: np.ndarray) -> np.ndarray:
        return self._tag_rows[buckets].view(np.uint64).reshape(-1, SLOTS_PER_BUCKET)

    def _masks_of(self, ids: np.ndarray) -> np.ndarray:
        return self._mask_rows[ids].view(np.uint64).reshape(-1, self._mask.shape[1])

    def _find_locked(self, keys) -> np.ndarray:
        """The flat slot id of each key; -1 where the key is not in the table."""
        words, tag, b1, b2 = keys
        ids = np.full(len(tag), -1, dtype=np.intp)
        for choice in (b1, b2):
            rows, slots = np.nonzero(self._bucket_tags(choice) == tag[:, None])
            if len(rows):
                candidates = choice[rows] * SLOTS_PER_BUCKET + slots
                same = (self._key[candidates] == words[rows]).all(axis=1)
                ids[rows[same]] = candidates[same]
        return ids

    def _add_locked(self, keys, ordinal: int, stamp: int) -> tuple[int, int]:
        """Sets ``ordinal``'s bit on every key, inserting missing ones; returns (added, evicted)."""
        self._ensure_words(ordinal)
        words, tag, b1, b2 = keys
        w, bit = ordinal // 64, np.uint64(1 << (ordinal % 64))
        added = evicted = 0
        pending = np.arange(len(tag))
        while len(pending):
            ids = self._find_locked((words[pending], tag[pending], b1[pending], b2[pending]))
            found = ids >= 0
            if found.any():
                hit = _unique(ids[found])  # a key twice in one batch counts once
                old = self._mask[hit, w]
                added += int(np.count_nonzero((old & bit) == 0))
                self._mask[hit, w] = old | bit
                self._stamp_flat[hit] = stamp
                pending = pending[~found]
                if not len(pending):
                    break
            # Insert at most one key per bucket this round (the last to claim it wins); the rest,
            # and second copies of a key, go round again and find what this round wrote.
            p1, p2 = b1[pending], b2[pending]
            target = np.where(self._fill[p1] <= self._fill[p2], p1, p2)
            order = np.arange(len(pending), dtype=np.int32)
            self._claim[target] = order
            win = self._claim[target] == order
            chosen, t = pending[win], target[win]
            full = self._fill[t] >= SLOTS_PER_BUCKET
            ids = t * SLOTS_PER_BUCKET + np.argmax(self._bucket_tags(t) == 0, axis=1)
            if full.any():
                # Both buckets full: evict the oldest-stamped of their 16 slots.
                fi = np.flatnonzero(full)
                c1, c2 = b1[chosen[fi]], b2[chosen[fi]]
                pick = np.argmin(np.concatenate([self._stamp[c1], self._stamp[c2]], axis=1), axis=1)
                victims = (
                    np.where(pick < SLOTS_PER_BUCKET, c1, c2) * SLOTS_PER_BUCKET + pick % SLOTS_PER_BUCKET
                )
                # Two chosen keys may pick the same victim slot: the first keeps it, the other waits.
                _, once = np.unique(victims, return_index=True)
                keep = np.zeros(len(fi), dtype=bool)
                keep[once] = True
                self._count_evicted(self._masks_of(victims[keep]))
                evicted += int(keep.sum())
                ids[fi] = victims
                stay = np.ones(len(chosen), dtype=bool)
                stay[fi[~keep]] = False
                chosen, t, ids, full = chosen[stay], t[stay], ids[stay], full[stay]
            self._tag_flat[ids] = tag[chosen]
            self._key_rows[ids] = np.ascontiguousarray(words[chosen]).view(self._key_rows.dtype).reshape(-1)
            self._mask_rows[ids] = np.zeros(1, dtype=self._mask_rows.dtype)[0]
            self._mask[ids, w] = bit
            self._stamp_flat[ids] = stamp
            grown = t[~full]
            self._fill[grown] += 1
            self._entries += len(grown)
            added += len(chosen)
        self._node_entries[ordinal] += added
        self.evicted_entries += evicted
        return added, evicted

    def _remove_locked(self, keys, ordinal: int) -> int:
        words_count = self._mask.shape[1]
        w = ordinal // 64
        if w >= words_count:
            return 0
        bit = np.uint64(1 << (ordinal % 64))
        ids = self._find_locked(keys)
        ids = ids[ids >= 0]
        if not len(ids):
            return 0
        ids = _unique(ids)
        old = self._mask[ids, w]
        had = (old & bit) != 0
        ids = ids[had]
        self._mask[ids, w] = old[had] & ~bit
        live = self._words(self._live_mask, words_count)
        nobody = ~(self._masks_of(ids) & live).any(axis=1)
        if nobody.any():
            gone = ids[nobody]
            self._tag_flat[gone] = 0
            np.subtract.at(self._fill, gone // SLOTS_PER_BUCKET, 1)
            self._entries -= len(gone)
        removed = len(ids)
        self._node_entries[ordinal] -= removed
        return removed

    def _count_evicted(self, masks: np.ndarray) -> None:
        """Lowers the entry counts of the live holders of evicted slots."""
        live = self._words(self._live_mask, masks.shape[1])
        bits = np.unpackbits((masks & live).view(np.uint8), axis=1, bitorder="little")
        counts = bits.sum(axis=0, dtype=np.int64)
        self._node_entries[: len(counts)] -= counts

    def _ensure_words(self, ordinal: int) -> None:
        words = ordinal // 64 + 1
        if words > self._mask.shape[1]:
            # A 65th (129th, ...) node: one more word per slot, copied once.
            grown = np.zeros((self._mask.shape[0], words), dtype=np.uint64)
            grown[:, : self._mask.shape[1]] = self._mask
            self._set_mask(grown)
        if words * 64 > len(self._node_entries):
            self._node_entries = np.concatenate(
                [self._node_entries, np.zeros(words * 64 - len(self._node_entries), dtype=np.int64)]
            )

    @staticmethod
    def _words(mask: int, words: int) -> np.ndarray:
        return np.array([(mask >> (64 * i)) & 0xFFFFFFFFFFFFFFFF for i in range(words)], dtype=np.uint64)

    # ------------------------------------------------------ lock and leases

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
        if node.ordinal < len(self._node_entries):
            self._node_entries[node.ordinal] = 0
