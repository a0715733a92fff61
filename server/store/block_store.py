"""The block store: which blocks exist, which tiers hold them, and moving them between tiers.

It owns the block index, the DRAM tier's space (and its eviction policy), the
SSD tier's space (FIFO, see below) and the decisions to demote (write a DRAM
block to SSD), drop and promote (read an SSD block back into a DRAM slot). It
does no I/O itself: every method runs under the engine lock and returns the
transfers it planned as ``IoBatch`` objects; the tier mover
(server/movers/tier_io.py) runs them after the lock is released and hands each
completion back to ``complete`` (under the lock again). So no disk or network
I/O ever happens under the engine lock, and a transfer's slots and extents are
pinned (``BlockEntry.io``) from planning to completion.

Concurrency: the engine lock guards everything here. The DRAM policy has its
own lock and is entered only after the engine lock.

Eviction (DRAM): the policy names victims; a victim with a ready SSD copy only
loses its DRAM copy (it stays a hit, from SSD), one without is dropped. Pinned
blocks (leases), blocks being written, filled or read by a transfer are never
victims. Slab moves (tiers/dram/README.md) evict a whole slab of another size.

Tiering (SSD): a block reaches the SSD tier by a demotion write, when the
placement rule (policy/placement.py) says so: at seal (write-through) or at its
first reuse (second sighting: a block asked for again, found in DRAM or lost and
saved again, is worth keeping; a one-off is not written). Space on the SSD tier
is reclaimed FIFO, in the order it was allocated (which is the log order the tier writes in): the oldest SSD
copy goes first, so the tier's oldest segment empties and is reused. A block
the SSD tier drops keeps its DRAM copy if it has one.

Promotion: a prefix query that reaches blocks held only on SSD allocates DRAM
slots for them and plans their reads (bounded bytes in flight; over the bound
the rest of the chain is a miss, counted, never an error). Until its read
completes such a block is *pending*: part of the hit, not yet readable. A read
that fails its checksum drops that SSD copy: never a wrong byte.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from pegaflow.common.wire.types import AllocStatus, Tier
from pegaflow.server.policy.base import EvictionPolicy
from pegaflow.server.policy.placement import SsdPlacement
from pegaflow.server.policy.tenant_caps import TenantCappedPolicy
from pegaflow.server.store.free_reserve import ZERO_AHEAD_MAX_BYTES, FreeSlotReserve
from pegaflow.server.store.index import NO_SLOT, SEALED, WRITING, BlockEntry, BlockIndex, BlockKey
from pegaflow.server.store.namespace import NamespaceTable, block_tag
from pegaflow.server.store.stats import StoreCounters
from pegaflow.server.tiers.base import Extent, IoStatus, ReadRequest, WriteRequest
from pegaflow.server.tiers.base import Tier as TierBase
from pegaflow.server.tiers.dram.journal import JournaledBlock
from pegaflow.server.tiers.dram.tier import DramTier

log = logging.getLogger(__name__)

# Victims asked of the policy at once (policy.next_victims): a save batch's worth, so that evicting
# for 64 blocks takes the policy's lock twice, not 128 times.
VICTIM_BATCH = 64
# The owner of a slot whose bytes may be anyone's (_slot_owner): no namespace has this index.
NO_NAMESPACE = -1


@dataclasses.dataclass
class IoBatch:
    """Transfers planned under the lock, run by the tier mover after it."""

    kind: str  # "promote" (SSD -> DRAM) | "demote" (DRAM -> SSD) | "checksum" (hash sealed DRAM blocks)
    tier: TierBase
    entries: list[BlockEntry]
    requests: list  # ReadRequest | WriteRequest, one per entry
    nbytes: int
    planned_at: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class PrefixScan:
    """The leading blocks of a chain that some tier holds, head first."""

    entries: list[BlockEntry]  # ready in DRAM first, then pending (being promoted / fetched)
    ready: int  # leading entries readable in DRAM now
    sources: list[Tier]  # where each entry was found by this scan
    batch: IoBatch | None  # promotions this scan started
    dropped: int = 0  # SSD hits not promoted (in-flight bound or no DRAM slot): misses

    @property
    def pending(self) -> int:
        return len(self.entries) - self.ready


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    promote_inflight_bytes: int = 1 << 30  # bytes being promoted at once; beyond it a hit is a miss
    demote_inflight_bytes: int = 256 << 20  # bytes being written to SSD at once; beyond it, not written


class BlockStore:
    def __init__(
        self,
        dram: DramTier,
        policy: EvictionPolicy,
        namespaces: NamespaceTable,
        ssd: TierBase | None = None,
        placement: SsdPlacement | None = None,
        limits: StoreLimits = StoreLimits(),
        hasher=None,
        journal=None,
        free_reserve: FreeSlotReserve | None = None,
        lane=None,
    ):
        self.dram = dram
        self.allocator = dram.allocator
        self.policy = policy
        self.namespaces = namespaces
        self.ssd = ssd
        self.placement = placement or SsdPlacement("off")
        self.limits = limits
        self.index = BlockIndex()
        self.counters = StoreCounters()
        # SSD copies in allocation order (the tier's log order); stale pairs are skipped.
        self._ssd_fifo: deque[tuple[BlockEntry, Extent]] = deque()
        self._promoting_bytes = 0
        self._demoting_bytes = 0
        # With a hasher every sealed block gets its checksum off the lock (movers/block_hasher.py);
        # with a journal (a persistent pool) the hashed blocks are journaled (tiers/dram/journal.py).
        self.hasher = hasher
        self.journal = journal
        # With a metaserver: (added?, namespace index, hash) of every DRAM copy that became ready or
        # left, drained by the engine after its lock (peers only read DRAM copies: only those count).
        self.publishing = False
        self.published: list[tuple[bool, int, bytes]] = []
        # The namespace whose block a DRAM slot last held, and the slab's assignment then (allocator
        # .assignment): (ns_index, assignment). A slot granted to a namespace that is not its owner in
        # this assignment of its slab (another namespace's, or a slot of a slab re-cut since: its bytes
        # straddle the old slots) is zeroed before the writer gets it (off the lock, by the engine), so
        # a writer that seals without writing exposes zeros, never another namespace's bytes (review
        # finding F2). Only a fresh pool's first cut of a slab is known zero.
        self._slot_owner: dict[int, tuple[int, int]] = {}
        # (block_bytes, part) -> (namespace, the allocator's cuts of that size) for which every free
        # slot of that size was last found to be the namespace's own: take_unzeroed_reserve skips
        # the size until a slot of another owner is freed there (_note_freed) or a slab is cut for
        # it. Without it each refill took the whole reserve out of the allocator and put it back,
        # one slot at a time, to find nothing to zero (measured: 12% of the server's GIL time
        # under a 16 MiB save stream of one model). Only what is zeroed ahead depends on it: a grant
        # still zeroes any foreign slot it gets (reserve -> _claim_slot).
        self._clean_reserve: dict[tuple[int, int], tuple[int, int]] = {}
        # Per capped tenant (policy/tenant_caps.py): [its own blocks evicted to stay under its cap,
        # new blocks refused at its cap]. Monotonic.
        self.cap_counts: dict[str, list[int]] = {}
        # Tenant -> its region's allocator part (tiers/dram/region.py); tenants not named: the pool (0).
        self.tenant_parts: dict[str, int] = {p.name: i for i, p in enumerate(dram.region.parts) if i}
        # Free slots kept ahead of the saves (store/free_reserve.py); 0 bytes: evict on allocation only.
        self.free_reserve = free_reserve or FreeSlotReserve(0)
        # The read lane (server/read_lane/lane.py): its directory is kept equal to the blocks sealed,
        # ready in DRAM and not corrupt, and a block its leases read is never evicted (None: no lane).
        self.lane = lane
        # Corrupt blocks the lane's leases still read (retired there): freed once the last lets go.
        self._lane_dead: set[BlockKey] = set()

    # ============================================================== save path

    def reserve(
        self,
        ns_index: int,
        block_bytes: int,
        hashes: Sequence[bytes],
        save,
        deadline: float | None,
        max_grant: int | None = None,
        cap_pending_bytes: int = 0,
        whole_write: bool = False,
    ) -> tuple[list[AllocStatus], list[int], list[BlockEntry]]:
        """DRAM slots for the hashes not stored yet, at most ``max_grant`` of them and as many as the
        tenant's DRAM cap lets in (the rest REJECTED: quotas; ``cap_pending_bytes``: the tenant's
        blocks granted and not sealed yet, see ``cap_room``). Returns (status per hash, offsets of the
        granted ones, the chain's stored entries). Granted entries are WRITING and listed in
        save.pending. A granted slot that another namespace's block last held is listed in
        save.stale_slots (to be zeroed before the writer gets it), or, with ``whole_write`` (the
        writer overwrites every byte before it seals, and aborts what it could not write), in
        save.unzeroed_slots."""
        statuses: list[AllocStatus] = []
        new_hashes: list[bytes] = []
        new_positions: list[int] = []
        stored: list[BlockEntry] = []
        get = self.index.get
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
            elif max_grant is not None and len(new_hashes) >= max_grant:
                statuses.append(AllocStatus.REJECTED)
            else:
                save.pending[block_hash] = None  # placeholder, keeps request order
                statuses.append(AllocStatus.GRANTED)
                new_hashes.append(block_hash)
                new_positions.append(position)
        # The chain's stored blocks are not evicted to make room for its own tail, useless without them.
        capped = self.cap_room(ns_index, block_bytes, len(new_hashes), stored, cap_pending_bytes)
        for position, block_hash in zip(new_positions[capped:], new_hashes[capped:], strict=True):
            statuses[position] = AllocStatus.REJECTED
            del save.pending[block_hash]
        del new_positions[capped:], new_hashes[capped:]
        offsets = self._allocate_slots(
            block_bytes, len(new_hashes), deadline, keep=stored, ns_index=ns_index, zero_ahead=not whole_write
        )
        for position, block_hash in zip(
            new_positions[len(offsets) :], new_hashes[len(offsets) :], strict=True
        ):
            statuses[position] = AllocStatus.NO_SPACE
            del save.pending[block_hash]
            self.counters.no_space_blocks += 1
        pending = save.pending
        for entry in self.index.add_writing_many(ns_index, new_hashes, block_bytes, offsets, save.id):
            entry.held = True  # the allocation held its slab
            pending[entry.key[1]] = entry
        foreign = self._claim_slots(offsets, ns_index)
        if whole_write:
            save.unzeroed_slots.update(foreign)
        else:
            save.stale_slots.extend(foreign)
        return statuses, offsets, stored

    @staticmethod
    def _foreign(last: tuple[int, int] | None, owner: tuple[int, int]) -> bool:
        """Whether a slot whose _slot_owner record is ``last`` (None: none) may hold bytes that are not
        ``owner``'s, (namespace, slab assignment): only a fresh pool's first cut is known zero."""
        return owner[1] > 1 if last is None else last != owner

    def _slot_is_foreign(self, offset: int, ns_index: int) -> bool:
        """Whether the slot's bytes may be another namespace's (see _slot_owner)."""
        return self._foreign(self._slot_owner.get(offset), (ns_index, self.allocator.assignment(offset)))

    def _claim_slot(self, offset: int, ns_index: int) -> bool:
        """Records the slot as ``ns_index``'s; True when it must be zeroed first."""
        return bool(self._claim_slots((offset,), ns_index))

    def _claim_slots(self, offsets: Sequence[int], ns_index: int) -> list[int]:
        """``_claim_slot`` of each, in one pass (a grant's hot path); the slots to zero first."""
        owners, assignment, foreign_to = self._slot_owner, self.allocator.assignment, self._foreign
        foreign = []
        for offset in offsets:
            owner = (ns_index, assignment(offset))
            if foreign_to(owners.get(offset), owner):
                foreign.append(offset)
            owners[offset] = owner
        return foreign

    def seal(self, save, sealing: dict[bytes, BlockEntry]) -> tuple[int, IoBatch | None]:
        """Seals ``sealing`` and restates the save's chain, tail first; returns (bytes sealed, the
        demotion writes the placement rule asks for).

        A save is an ordered chain (a prefix); its blocks are useless without the ones before them.
        Walking it from the tail, each block is inserted (being sealed now) or refreshed (stored
        already), so the chain ends ordered head > ... > tail in the policy, and under pressure a
        prefix loses its tail first."""
        get, pending, seal_entry = self.index.get, save.pending, self.index.seal
        sealed: list[BlockEntry] = []
        # What the policy hears, in chain order (tail first): runs of inserts and of refreshes, each
        # run one call (a policy takes its lock once per call, not once per block).
        runs: list[tuple[bool, list]] = []
        for block_hash in reversed(save.chain):
            entry = sealing.pop(block_hash, None)
            if entry is not None:
                seal_entry(entry)
                sealed.append(entry)
                if runs and runs[-1][0]:
                    runs[-1][1].append((entry.key, entry.length))
                else:
                    runs.append((True, [(entry.key, entry.length)]))
            elif block_hash not in pending:
                entry = get((save.ns_index, block_hash))
                if entry is not None and entry.state == SEALED and entry.dram_ready:
                    if runs and not runs[-1][0]:
                        runs[-1][1].append(entry.key)
                    else:
                        runs.append((False, [entry.key]))
        # _rehold of each, one unhold call: a sealed slot stays held only while tiers or leases use it.
        released = []
        needs_hold = self._needs_hold
        for entry in sealed:
            if entry.held and not needs_hold(entry):
                entry.held = False
                released.append(entry.dram)
        self.allocator.unhold_many(released)
        policy = self.policy
        for inserting, items in runs:
            if inserting:
                policy.on_insert_many(items)
            else:
                policy.on_refresh_many(items)
        if self.publishing:
            self.published.extend((True, e.key[0], e.key[1]) for e in sealed)
        sealed.reverse()
        if self.lane is not None:
            self.lane.publish(sealed)
        self.counters.sealed_blocks += len(sealed)
        nbytes = sum(e.length for e in sealed)
        self.counters.save_bytes += nbytes
        batches = [self._plan_checksums(sealed)]
        if self.ssd is not None and sealed:
            write = self.placement.write_at_seal([e.key for e in sealed])
            batches.append(self._plan_demotions([e for e, w in zip(sealed, write, strict=True) if w]))
        return nbytes, batches

    def abort(self, save) -> int:
        """Frees a save's unsealed blocks (they never become visible). Returns how many."""
        freed = 0
        unzeroed = save.unzeroed_slots
        for entry in save.pending.values():
            if entry is None:
                continue
            if entry.dram in unzeroed:
                # Granted unzeroed and never sealed: part of the old namespace's bytes may be left.
                # Foreign to every namespace now, so whoever is granted it next gets it zeroed.
                self._slot_owner[entry.dram] = (NO_NAMESPACE, self.allocator.assignment(entry.dram))
            self.index.remove(entry)
            if entry.held:
                self.allocator.unhold(entry.dram)
            self.allocator.free(entry.dram)
            self._note_freed(entry.dram, entry.length)
            freed += 1
        save.pending.clear()
        unzeroed.clear()
        self.counters.aborted_blocks += freed
        return freed

    def refresh_chain(self, ns_index: int, chain: Sequence[bytes]) -> None:
        """Renews the recency of the chain's DRAM blocks, tail first, so its head ends the most recent."""
        policy, get = self.policy, self.index.get
        for block_hash in reversed(chain):
            entry = get((ns_index, block_hash))
            if entry is not None and entry.state == SEALED and entry.dram_ready:
                policy.on_refresh(entry.key)

    # ============================================================== load path

    def scan(self, ns_index: int, hashes: Sequence[bytes], promote: bool = True) -> PrefixScan:
        """The leading blocks of ``hashes`` that a tier holds; with ``promote`` the ones held only on
        SSD get DRAM slots and their reads are planned (returned in ``batch``)."""
        get = self.index.get
        entries: list[BlockEntry] = []
        sources: list[Tier] = []
        to_promote: list[BlockEntry] = []
        ready = 0
        ssd_ok = promote and self.ssd is not None
        budget = self.limits.promote_inflight_bytes - self._promoting_bytes
        dropped = 0
        for block_hash in hashes:
            entry = get((ns_index, block_hash))
            if entry is None or entry.state != SEALED or entry.corrupt:
                break
            if entry.dram_ready:
                if ready == len(entries):
                    ready += 1
                source = Tier.DRAM
            elif entry.filling_from is not None:
                source = entry.filling_from
            elif entry.ssd_ready and ssd_ok and entry.io == 0:
                if entry.length > budget:
                    dropped = 1
                    break
                budget -= entry.length
                to_promote.append(entry)
                source = Tier.SSD
            else:
                break
            entries.append(entry)
            sources.append(source)
        batch = None
        if to_promote:
            got = self._plan_promotions(to_promote, keep=entries)
            if got < len(to_promote):
                # the chain ends before the first SSD block that got no DRAM slot
                cut = entries.index(to_promote[got])
                dropped += len(to_promote) - got
                del entries[cut:], sources[cut:]
                to_promote = to_promote[:got]
            if to_promote:
                batch = self._promotion_batch(to_promote)
        if dropped:
            self.counters.promotions_dropped += dropped
        return PrefixScan(entries, ready, sources, batch, dropped)

    def pin(self, entries: Sequence[BlockEntry]) -> None:
        # What _rehold does for a first pin (a pinned slot must not move), for the whole lease at once:
        # one allocator call instead of one per block (a 64-block lease is taken on every lookup).
        holds = []
        for entry in self.index.pin_many(entries):
            if not entry.held and entry.dram != NO_SLOT:
                entry.held = True
                holds.append(entry.dram)
        if holds:
            self.allocator.hold_many(holds)

    def unpin(self, entries: Sequence[BlockEntry]) -> None:
        released = self.index.unpin_many(entries)
        unholds = []
        for entry in released:
            # As _rehold: the slot stays held while it is written, filled or read by the tiers.
            if entry.held and entry.state != WRITING and entry.io == 0 and entry.filling_from is None:
                entry.held = False
                unholds.append(entry.dram)
            else:
                self._rehold(entry)
        if unholds:
            self.allocator.unhold_many(unholds)
        for entry in released:
            if entry.corrupt and self.index.get(entry.key) is entry:
                self._drop_if_free(entry)  # its last reader let go: now nobody holds it

    def missed(self, ns_index: int, hashes: Sequence[bytes]) -> None:
        """A lookup found none of these blocks in any tier (the placement rule may remember them)."""
        if self.ssd is not None and hashes:
            self.placement.missed([(ns_index, h) for h in hashes])

    def reused(self, entries: Sequence[BlockEntry]) -> IoBatch | None:
        """A lookup hit these DRAM blocks: the second-sighting placement writes them to SSD now."""
        if not self.placement.on_reuse:
            return None
        return self._plan_demotions([e for e in entries if e.dram_ready and e.ssd is None])

    # ============================================================ completions

    def complete(self, batch: IoBatch, statuses: Sequence) -> None:
        """A batch's transfers finished (the tier mover calls this under the engine lock). For a
        "checksum" batch the results are the digests (None where hashing did not happen)."""
        if batch.kind == "checksum":
            for entry, digest in zip(batch.entries, statuses, strict=True):
                self._hashed(entry, digest)
        elif batch.kind == "promote":
            self._promoting_bytes -= batch.nbytes
            for entry, status in zip(batch.entries, statuses, strict=True):
                self._promoted(entry, status)
        else:
            self._demoting_bytes -= batch.nbytes
            for entry, status in zip(batch.entries, statuses, strict=True):
                self._demoted(entry, status)

    def _promoted(self, entry: BlockEntry, status: IoStatus) -> None:
        entry.io -= 1
        live = self.index.get(entry.key) is entry
        if status == IoStatus.OK and live:
            self.index.slot_filled(entry)
            if self.lane is not None:
                self.lane.publish_one(entry)
            self.policy.on_insert(entry.key, entry.length)
            self.counters.promoted_blocks += 1
            self.counters.promoted_bytes += entry.length
            self._rehold(entry)
            if self.publishing:
                self.published.append((True, entry.key[0], entry.key[1]))
            return
        self.counters.promotion_failures += 1
        if status == IoStatus.CORRUPT:
            self.counters.corrupt_blocks += 1
        slot = self.index.detach_slot(entry) if entry.dram != NO_SLOT else NO_SLOT
        if slot != NO_SLOT:
            self._release_slot(entry, slot)
        if status in (IoStatus.CORRUPT, IoStatus.IO_ERROR) and entry.ssd is not None:
            self._drop_ssd_copy(entry)
        self._forget_if_gone(entry)

    def _hashed(self, entry: BlockEntry, digest) -> None:
        entry.io -= 1
        if isinstance(digest, int) and self.index.get(entry.key) is entry and entry.dram_ready:
            if entry.checksum is not None and entry.checksum != digest:
                # Its writer hashed other bytes than the pool holds now: changed after the write.
                log.warning("block %s changed after its writer hashed it: dropped", entry.key[1].hex()[:16])
                self._rehold(entry)
                self.drop_corrupt(entry)
                return
            entry.checksum = digest
            if self.lane is not None:
                self.lane.set_checksum(entry)
            if self.journal is not None:
                ns = self.namespaces.at(entry.key[0])
                self.journal.sealed(
                    JournaledBlock(entry.dram, entry.length, digest, block_tag(ns.id, entry.key[1]))
                )
        self._rehold(entry)

    def drop_corrupt(self, entry: BlockEntry) -> bool:
        """A DRAM copy that failed its checksum: counted once, and dropped with its SSD copy (written
        from the same bytes) so no query finds it again. While leases or transfers still hold it
        (False), it is marked: no query, load or peer is served it from now on, and it is dropped
        when the last of them lets go (``unpin``, ``_rehold_or_drop``)."""
        if not entry.corrupt:
            entry.corrupt = True
            self.counters.corrupt_blocks += 1
            if self.lane is not None and entry.dram_ready and self.lane.retire(entry):
                self._lane_dead.add(entry.key)  # hidden from lane queries; its lane readers finish
        return self._drop_if_free(entry)

    def lane_let_go(self, entry: BlockEntry) -> None:
        """The last lane lease reading a retired (corrupt) block ended: it may be dropped now."""
        self._lane_dead.discard(entry.key)
        if entry.corrupt:
            self._drop_if_free(entry)

    def _drop_if_free(self, entry: BlockEntry) -> bool:
        if not self._evictable(entry) or not self._evict_dram(entry):
            return False
        if entry.ssd is not None and entry.io == 0:
            self._drop_ssd_copy(entry)
            self._forget_if_gone(entry)
        return True

    def _demoted(self, entry: BlockEntry, status: IoStatus) -> None:
        entry.io -= 1
        if status == IoStatus.OK and entry.ssd is not None:
            self.index.ssd_written(entry)
            self.counters.demoted_blocks += 1
            self.counters.demoted_bytes += entry.length
        else:
            self.counters.demotion_failures += 1
            if entry.ssd is not None:
                self._drop_ssd_copy(entry)
        self._rehold(entry)
        if entry.corrupt and self.index.get(entry.key) is entry:
            self._drop_if_free(entry)  # marked while this write ran: its copy goes too
            return
        self._forget_if_gone(entry)

    # ============================================================== recovery

    def recover(self, ns_index: int, block_hash: bytes, extent: Extent) -> bool:
        """A block the SSD tier still holds after a restart (called in the tier's FIFO order)."""
        key: BlockKey = (ns_index, block_hash)
        existing = self.index.get(key)
        if existing is not None:
            if existing.ssd is not None or existing.length != extent.length:
                return False
            self.index.attach_ssd(existing, extent)  # the persistent pool re-adopted it too
            self.index.ssd_written(existing)
            self._ssd_fifo.append((existing, extent))
            return True
        entry = self.index.add_recovered(key, extent.length, extent)
        self._ssd_fifo.append((entry, extent))
        self.counters.recovered_blocks += 1
        return True

    # ================================================================ helpers

    @staticmethod
    def _needs_hold(entry: BlockEntry) -> bool:
        """Whether the entry's DRAM slot must not move: written, filled, read by the tiers or pinned."""
        return entry.dram != NO_SLOT and (
            entry.state == WRITING or entry.pins > 0 or entry.io > 0 or entry.filling_from is not None
        )

    def _rehold(self, entry: BlockEntry) -> None:
        """Keeps the allocator's hold on the entry's slab in step with whether its DRAM slot may move
        (a slab move evicts every block in a slab): held while written, filled, read or pinned."""
        want = self._needs_hold(entry)
        if want != entry.held:
            if want:
                self.allocator.hold(entry.dram)
            else:
                self.allocator.unhold(entry.dram)
            entry.held = want

    def _release_slot(self, entry: BlockEntry, slot: int) -> None:
        self._release_slots((entry,), (slot,))

    def _release_slots(self, entries: Sequence[BlockEntry], slots: Sequence[int]) -> None:
        """Gives each entry's detached DRAM slot back to the allocator, in order: its hold first (a
        slab that empties must have none), then the frees, per size (each slab's slots freed in the
        order given, as one by one)."""
        allocator = self.allocator
        by_size: dict[int, list[int]] = {}
        for entry, slot in zip(entries, slots, strict=True):
            if entry.held:
                allocator.unhold(slot)
                entry.held = False
            by_size.setdefault(entry.length, []).append(slot)
        if self.journal is not None:
            for slot in slots:
                self.journal.dropped(slot)  # the journal ignores a slot it never named
        for length, freed in by_size.items():
            allocator.free_many(freed, length)
            self._note_freed_many(freed, length)

    def _note_freed(self, slot: int, length: int) -> None:
        self._note_freed_many((slot,), length)

    def _note_freed_many(self, slots: Sequence[int], length: int) -> None:
        """Slots of ``length`` went back to the allocator: unless each was the namespace's that its
        size's free slots are known to belong to, they no longer are (see _clean_reserve)."""
        clean_reserve = self._clean_reserve
        if not clean_reserve:
            return
        allocator, owner_of = self.allocator, self._slot_owner.get
        assignment, part_of = allocator.assignment, allocator.part_of
        single_part = allocator.parts == 1
        for slot in slots:
            key = (length, 0 if single_part else part_of(slot))
            clean = clean_reserve.get(key)
            if clean is not None and owner_of(slot) != (clean[0], assignment(slot)):
                del clean_reserve[key]
                if not clean_reserve:
                    return

    def _evictable(self, entry: BlockEntry | None) -> bool:
        return (
            entry is not None
            and entry.state == SEALED
            and entry.dram_ready
            and entry.pins == 0
            and entry.io == 0
            and (not self._lane_dead or entry.key not in self._lane_dead)
        )

    def _lane_pinned(self, key: BlockKey) -> bool:
        """A lease of the read lane reads it (the policy skips it as it skips the engine's pinned ones)."""
        return self.lane is not None and self.lane.pinned(key)

    def _evict_dram(self, entry: BlockEntry, tell_policy: bool = True, unpublished: bool = False) -> bool:
        """Drops the entry's DRAM copy; the block stays (from SSD) if its SSD copy is ready.
        ``tell_policy=False``: the caller tells the policy itself, for a batch (on_remove_many).
        False, and nothing done, when a lease of the read lane reads the block: the lane's unpublish
        is the one atomic check against its leases, which pin without the engine lock (``unpublished``:
        the caller made it already, for a batch)."""
        lane = self.lane
        if lane is not None and (
            entry.key in self._lane_dead
            or (not unpublished and entry.dram_ready and not entry.corrupt and not lane.unpublish(entry))
        ):
            return False
        self._evict_dram_many((entry,))
        if tell_policy:
            self.policy.on_remove(entry.key)
        return True

    def _evict_dram_many(self, entries: Sequence[BlockEntry]) -> None:
        """Drops the DRAM copy of each, in order, in one pass: blocks the read lane no longer publishes
        (or there is no lane) and nobody uses, the policy told by the caller (``_evict_dram`` of each).
        The eviction stream's hot path: a full pool evicts a block for every block saved, and a call
        for each step of each victim was ~4 us (under a 16 MiB save stream, about half of the
        server's interpreter time)."""
        index = self.index
        self._release_slots(entries, index.detach_slots(entries))
        if self.publishing:
            self.published.extend((False, entry.key[0], entry.key[1]) for entry in entries)
        kept_on_ssd = sum(1 for entry in entries if entry.ssd_ready)
        self.counters.dram_drops_kept_on_ssd += kept_on_ssd
        self.counters.evictions += len(entries) - kept_on_ssd
        # _forget_if_gone of each: a block with no copy left leaves the index.
        get = index.get
        index.forget_many(
            [
                entry
                for entry in entries
                if entry.state == SEALED and entry.ssd is None and entry.io == 0 and get(entry.key) is entry
            ]
        )

    def _forget_if_gone(self, entry: BlockEntry) -> None:
        if (
            entry.state == SEALED
            and entry.dram == NO_SLOT
            and entry.ssd is None
            and entry.io == 0
            and self.index.get(entry.key) is entry
        ):
            self.index.remove(entry)

    def _allocate_slots(
        self,
        block_bytes: int,
        count: int,
        deadline: float | None,
        keep: Sequence[BlockEntry] = (),
        ns_index: int | None = None,
        zero_ahead: bool = True,
    ) -> list[int]:
        """Up to ``count`` held DRAM slots for blocks of this size (of namespace ``ns_index``: in its
        tenant's region when it has one), evicting as the policy says when the pool (or that region) is
        full (never a block of ``keep``); fewer only when nothing evictable is left or the deadline
        passed. Offsets ascend when the call evicted, so a batch that replaces an evicted batch stays
        contiguous. ``zero_ahead=False``: these slots need no zeroing (a whole_write save), so the
        allocation does not count as ``ns_index``'s toward the reserve zeroing slots ahead for it.
        """
        allocator = self.allocator
        part, tenant = self._part_of(ns_index)
        offsets = allocator.allocate_many(block_bytes, count, hold=True, part=part)
        need = count - len(offsets)
        if self.free_reserve.bytes:
            saver = NO_NAMESPACE if ns_index is None or not zero_ahead else ns_index
            self.free_reserve.used(block_bytes, part, tenant, need > 0, saver)
        if need:
            self._evict_for(block_bytes, need, part, tenant, keep, deadline)
            offsets += allocator.allocate_many(block_bytes, need, hold=True, part=part)
            # The slots free before (the reserve's: the policy's next victims) and those just evicted
            # (the victims after them) are mostly one address range, but were taken in that order:
            # ascending, a batch's blocks form long runs, and a long copy is a fast one (measured: a
            # 512 MiB save split in a few runs of 2 MiB blocks copied 18% slower than one run).
            offsets.sort()
        return offsets

    def _evict_for(
        self,
        block_bytes: int,
        need: int,
        part: int,
        tenant: str,
        keep: Sequence[BlockEntry] = (),
        deadline: float | None = None,
        max_victims: int | None = None,
    ) -> bool:
        """Evicts the policy's victims (whatever their size) until ``need`` slots of this size are free
        in ``part``; True when they are. It stops early (False) when nothing evictable is left, the
        deadline passed or ``max_victims`` were evicted.

        A victim of this size frees one slot, and a slab that empties can go to any size. Victims of
        other sizes leave free slots there that this size cannot use; whenever a slab's worth of those
        has piled up, a whole slab of another size (no held blocks, the emptiest) is evicted and moves
        to this size.
        """
        allocator = self.allocator
        get = self.index.get
        kept = {entry.key for entry in keep}
        refused: set[BlockKey] = set()  # victims a read lane lease reads: kept, and not offered again

        evictable = self._evictable

        def skip(key: BlockKey) -> bool:
            return key in kept or key in refused or not evictable(get(key))

        def skip_lane_pinned(key: BlockKey) -> bool:  # victims asked one by one: the lane asked per key
            return skip(key) or self._lane_pinned(key)

        # The shared pool's victims come from the policy's one order; a tenant region's from the
        # tenant's own recency (policy/tenant_caps.py), the only blocks whose eviction frees room there.
        # Victims come in batches (policy.next_victims: one lock and one pass over the recency order
        # for up to VICTIM_BATCH of them, then one on_remove_many), not one call each.
        policy = self.policy
        next_victim_of = partial(policy.next_victim_of, tenant) if part else None
        freed_elsewhere = 0
        victims = 0
        while (available := allocator.available(block_bytes, part)) < need:
            if deadline is not None and time.monotonic() > deadline:
                return False  # grant what is free; the RPC layer undoes everything if the caller has left
            want = min(need - available, VICTIM_BATCH)
            if max_victims is not None:
                want = min(want, max_victims - victims)
                if want <= 0:
                    return False
            if freed_elsewhere >= allocator.slab_bytes:
                freed_elsewhere = 0
                if self._move_slab(block_bytes, part):
                    continue
            if next_victim_of is None:
                batch = policy.next_victims(want, skip)
            else:
                victim = next_victim_of(skip_lane_pinned)
                batch = [] if victim is None else [victim]
            if not batch:
                if not self._move_slab(block_bytes, part):
                    return False  # nothing evictable is left
                continue
            # The read lane's leases pin without the engine lock: one atomic call takes the batch out of
            # its directory, all but what a lane lease reads now (that one stays: it is in use).
            taken = self.lane.unpublish_many(batch) if self.lane is not None else None
            entries = self._evictable_batch(batch) if taken is None or 0 not in taken else None
            if entries is not None:
                # The usual batch, every victim evictable and let go by the lane: the victims the loop
                # below would evict (up to the one after which the slots are there) go in one pass.
                stop = self._victims_until_enough(entries, block_bytes, part, available, need)
                gone = entries[:stop]
                self._evict_dram_many(gone)
                if taken is not None and stop < len(entries):
                    self._republish(entries[stop:])
                freed_elsewhere += sum(entry.length for entry in gone if entry.length != block_bytes)
                victims += stop
                policy.on_remove_many(batch[:stop])
                continue
            evicted = []
            part_of = allocator.part_of
            for i, victim in enumerate(batch):
                entry = get(victim)
                if taken is not None and not taken[i]:
                    refused.add(victim)
                    policy.on_refresh(victim)  # being read: recently used, and out of the victims' way
                    continue
                if not self._evictable(entry):
                    # The policy tracks a key the store no longer holds in DRAM: resync and go on.
                    log.warning("policy offered a non-evictable key %r; dropping it from the policy", victim)
                    policy.on_remove(victim)
                    if taken is not None:
                        self._republish([entry])
                    continue
                length, slot = entry.length, entry.dram
                if not self._evict_dram(entry, tell_policy=False, unpublished=taken is not None):
                    continue
                evicted.append(victim)
                victims += 1
                if length == block_bytes and part_of(slot) == part:
                    available += 1  # its slot, exactly (a slab it emptied counts as its free slots did)
                else:
                    if length != block_bytes:
                        freed_elsewhere += length
                    available = allocator.available(block_bytes, part)
                if available >= need:
                    # Enough (a slab that emptied may free more than one slot): keep the rest.
                    if taken is not None:
                        self._republish([get(v) for j, v in enumerate(batch) if j > i and taken[j]])
                    break
            policy.on_remove_many(evicted)
        return True

    def _evictable_batch(self, batch: Sequence[BlockKey]) -> list[BlockEntry] | None:
        """The entries of ``batch`` when every one is evictable, else None (taken one by one)."""
        get, evictable = self.index.get, self._evictable
        entries = [get(key) for key in batch]
        return entries if all(map(evictable, entries)) else None

    def _victims_until_enough(
        self, entries: Sequence[BlockEntry], block_bytes: int, part: int, available: int, need: int
    ) -> int:
        """How many of ``entries`` (evictable, in order) _evict_for's loop evicts one by one: all, or up
        to the first after which ``need`` slots of ``block_bytes`` are available in ``part``. Each
        victim of that size there frees one; one of another size (or part) frees a slab's worth when
        it empties its slab in ``part``, else none (allocator.available, step by step, without the
        frees)."""
        allocator = self.allocator
        part_of = allocator.part_of
        freed_in: dict[int, int] = {}  # slab index -> this batch's victims there so far
        per_slab = 0
        for i, entry in enumerate(entries):
            slot = entry.dram
            if entry.length == block_bytes and part_of(slot) == part:
                available += 1
            else:
                slab, used, slab_part = allocator.slab_usage(slot)
                freed = freed_in[slab] = freed_in.get(slab, 0) + 1
                if freed == used and slab_part == part:
                    per_slab = per_slab or allocator.slots_per_slab(block_bytes)
                    available += per_slab
            if available >= need:
                return i + 1
        return len(entries)

    def _republish(self, entries) -> None:
        """Entries the lane's unpublish_many took out that stay readable after all: published again."""
        for entry in entries:
            if entry is not None and entry.state == SEALED and entry.dram_ready and not entry.corrupt:
                self.lane.publish_one(entry)

    def refill_reserve(self, max_victims: int) -> bool:
        """Evicts ahead, at most ``max_victims`` blocks, so that every block size saved lately has its
        reserve of free slots (store/free_reserve.py); True when that slice was used up and more is
        to do (the caller lets requests in first), False when every reserve is full or nothing
        evictable is left."""
        counters = self.counters
        budget = max_victims
        for block_bytes, part, tenant in self.free_reserve.sizes():
            target = self.free_reserve.slots(block_bytes, self.allocator.part_bytes(part))
            before = counters.evictions + counters.dram_drops_kept_on_ssd
            done = self._evict_for(block_bytes, target, part, tenant, max_victims=budget)
            evicted = counters.evictions + counters.dram_drops_kept_on_ssd - before
            counters.reserve_evictions += evicted
            budget -= evicted
            if not done and budget <= 0:
                return True
        return False

    def take_unzeroed_reserve(self) -> list[tuple[int, int, int]]:
        """The reserve's free slots that another namespace's block last held, taken out of the allocator
        (held, so no allocation gets them) to be zeroed off the lock and handed back with
        ``return_zeroed``: (offset, block bytes, the namespace they are zeroed for). They are the slots
        the next save of that size gets, zeroed only when one namespace made the last saves of that
        size (FreeSlotReserve.sole_saver): after another model's blocks filled the pool, its saves are
        granted slots already zeroed (engine.allocate_blocks zeroes a foreign slot on the request path
        otherwise), the memset done while the previous save's client copies."""
        allocator, out = self.allocator, []
        for block_bytes, part, _ in self.free_reserve.sizes():
            ns_index = self.free_reserve.sole_saver(block_bytes, part)
            if ns_index < 0:
                continue
            key, cuts = (block_bytes, part), allocator.cuts(block_bytes, part)
            if self._clean_reserve.get(key) == (ns_index, cuts):
                continue  # nothing freed by another owner nor cut since every free slot was ns_index's
            # Only slots of slabs already cut for this size: taking a free slab would re-cut it.
            free = allocator.free_slots(block_bytes, part)
            target = min(
                self.free_reserve.slots(block_bytes, allocator.part_bytes(part)),
                free,
                max(1, ZERO_AHEAD_MAX_BYTES // block_bytes),
            )
            for offset in allocator.allocate_many(block_bytes, target, hold=True, part=part):
                if self._slot_is_foreign(offset, ns_index):
                    out.append((offset, block_bytes, ns_index))
                else:
                    allocator.unhold(offset)
                    allocator.free(offset)
            if target == free:
                # Every free slot was seen: the foreign ones are out, to come back zeroed and claimed
                # for ns_index (return_zeroed; back unzeroed, they make the size unclean again).
                self._clean_reserve[key] = (ns_index, cuts)
            else:
                self._clean_reserve.pop(key, None)
        return out

    def return_zeroed(self, slots: Sequence[tuple[int, int, int]], zeroed: bool = True) -> None:
        """Slots of ``take_unzeroed_reserve`` back to the allocator; ``zeroed``: they were, so they are
        their namespace's now (else they keep their last owner and a grant zeroes them)."""
        for offset, block_bytes, ns_index in slots:
            if zeroed:
                self._claim_slot(offset, ns_index)
            self.allocator.unhold(offset)
            self.allocator.free(offset)
            self._note_freed(offset, block_bytes)
        if zeroed:
            self.counters.reserve_zeroed_blocks += len(slots)

    def reserve_low(self) -> bool:
        """Whether a size saved lately has fewer free slots than its reserve (cheap: per size one sum)."""
        for block_bytes, part, _ in self.free_reserve.sizes():
            if self.allocator.available(block_bytes, part) < self.free_reserve.slots(
                block_bytes, self.allocator.part_bytes(part)
            ):
                return True
        return False

    def _part_of(self, ns_index: int | None) -> tuple[int, str]:
        """(the allocator part, the tenant) of a namespace's blocks: 0 and "" unless its tenant has a
        region of its own (tiers/dram/region.py)."""
        if ns_index is None or self.allocator.parts == 1:
            return 0, ""
        ns = self.namespaces.by_index(ns_index)
        tenant = ns.tenant if ns is not None else ""
        return self.tenant_parts.get(tenant, 0), tenant

    def cap_room(
        self,
        ns_index: int,
        block_bytes: int,
        count: int,
        keep: Sequence[BlockEntry] = (),
        pending_bytes: int = 0,
    ) -> int:
        """How many of ``count`` new DRAM blocks of namespace ``ns_index`` its tenant's DRAM cap lets
        in (all of them for a tenant without one: policy/tenant_caps.py), after evicting the tenant's
        own least recently used blocks to make room (never one of ``keep`` nor a pinned one).
        ``pending_bytes``: the tenant's blocks granted and not sealed yet, which land under the cap
        too when they are sealed."""
        caps = self.policy
        if count == 0 or not isinstance(caps, TenantCappedPolicy):
            return count
        ns = self.namespaces.by_index(ns_index)
        cap = caps.cap_of(ns.tenant) if ns is not None else None
        if cap is None:
            return count
        tenant = ns.tenant
        want = pending_bytes + count * block_bytes
        get = self.index.get
        kept = {entry.key for entry in keep}

        def skip(key: BlockKey) -> bool:
            return key in kept or not self._evictable(get(key)) or self._lane_pinned(key)

        while caps.resident_bytes_of(tenant) + want > cap:
            victim = caps.next_victim_of(tenant, skip)
            if victim is None:
                break  # the rest of its share is pinned or kept: what does not fit is refused
            if not self._evict_dram(get(victim)):
                continue  # a read lane lease took it since skip() looked: skipped from now on
            counts = self.cap_counts.setdefault(tenant, [0, 0])
            counts[0] += 1
        room = cap - pending_bytes - caps.resident_bytes_of(tenant)
        fits = max(0, min(count, room // block_bytes))
        if fits < count:
            counts = self.cap_counts.setdefault(tenant, [0, 0])
            counts[1] += count - fits
        return fits

    def _move_slab(self, block_bytes: int, part: int = 0) -> bool:
        """Evicts every block of the emptiest movable slab of another size (in ``part``); False if there
        is none."""
        refused: set[int] = set()  # slabs a read lane lease reads a block of: they stay this time
        while True:
            slab = self.allocator.reclaimable_slab(block_bytes, part, refused)
            if slab is None:
                return False
            entries = [self.index.at_slot(slot) for slot in self.allocator.used_offsets(slab)]
            if self.lane is None or self._unpublish_all(entries):
                break
            refused.add(slab)
        for entry in entries:
            self._evict_dram(entry)
        self.allocator.note_slab_move()
        return True

    def _unpublish_all(self, entries: Sequence[BlockEntry]) -> bool:
        """Takes every one of ``entries`` out of the read lane, or none of them (False: a lane lease
        reads one; the ones taken out are published again)."""
        done = []
        for entry in entries:
            if entry.key in self._lane_dead:
                break
            if entry.dram_ready and not entry.corrupt:
                if not self.lane.unpublish(entry):
                    break
                done.append(entry)
        else:
            return True
        for entry in done:
            self.lane.publish_one(entry)
        return False

    # ---------------------------------------------------------- checksums

    def _plan_checksums(self, entries: Sequence[BlockEntry]) -> IoBatch | None:
        """Hashes of freshly sealed blocks, their slots pinned until known."""
        if self.hasher is None or not entries:
            return None
        view = self.dram.pool_view()
        requests = []
        for entry in entries:
            entry.io += 1
            self._rehold(entry)
            requests.append(memoryview(view[entry.dram : entry.dram + entry.length]))
        return IoBatch("checksum", self.hasher, list(entries), requests, sum(e.length for e in entries))

    def recover_slot(self, ns_index: int, block_hash: bytes, slot: int, length: int, digest: int) -> bool:
        """A block a persistent pool still holds after a restart (slot already restored in the allocator)."""
        key: BlockKey = (ns_index, block_hash)
        if key in self.index:
            return False
        entry = self.index.add_recovered_slot(key, length, slot, digest)
        if self.lane is not None:
            self.lane.publish_one(entry)
        self.policy.on_insert(key, length)
        self.counters.recovered_dram_blocks += 1
        return True

    # ---------------------------------------------------------- promotion

    def _plan_promotions(self, entries: list[BlockEntry], keep: Sequence[BlockEntry]) -> int:
        """DRAM slots for SSD-only blocks, in chain order; returns how many got one. Blocks of one
        size share one allocation (chains are single-namespace, so they do)."""
        block_bytes = entries[0].length
        fits = self.cap_room(entries[0].key[0], block_bytes, len(entries), keep)
        slots = self._allocate_slots(block_bytes, fits, None, keep=keep, ns_index=entries[0].key[0])
        for entry, slot in zip(entries, slots, strict=False):
            self.index.attach_slot(entry, slot, Tier.SSD)
            entry.held = True  # the allocation held its slab
            entry.io += 1
        return len(slots)

    def _promotion_batch(self, entries: list[BlockEntry]) -> IoBatch:
        requests = []
        for entry in entries:
            ns = self.namespaces.at(entry.key[0])
            requests.append(
                ReadRequest(
                    entry.ssd, block_tag(ns.id, entry.key[1]), self.dram.view(entry.dram, entry.length)
                )
            )
        nbytes = sum(e.length for e in entries)
        self._promoting_bytes += nbytes
        self.counters.promotions_started += len(entries)
        return IoBatch("promote", self.ssd, entries, requests, nbytes)

    # ----------------------------------------------------------- demotion

    def _plan_demotions(self, entries: Sequence[BlockEntry]) -> IoBatch | None:
        """SSD extents and writes for DRAM blocks without an SSD copy, within the in-flight bound."""
        if self.ssd is None or not entries:
            return None
        planned: list[BlockEntry] = []
        requests: list[WriteRequest] = []
        room = self.limits.demote_inflight_bytes - self._demoting_bytes
        max_block = self.ssd.max_block_bytes
        for entry in entries:
            if entry.ssd is not None or not entry.dram_ready or entry.corrupt or entry.length > max_block:
                continue
            if entry.length > room:
                self.counters.demotions_dropped += 1
                continue
            extents = self._allocate_ssd(entry.length, 1)
            if not extents:
                self.counters.demotions_dropped += 1
                continue
            room -= entry.length
            extent = extents[0]
            self.index.attach_ssd(entry, extent)
            self._ssd_fifo.append((entry, extent))
            entry.io += 1
            self._rehold(entry)
            ns = self.namespaces.at(entry.key[0])
            requests.append(
                WriteRequest(
                    extent,
                    block_tag(ns.id, entry.key[1]),
                    self.dram.view(entry.dram, entry.length),
                    checksum=entry.checksum,
                )
            )
            planned.append(entry)
        if not planned:
            return None
        nbytes = sum(e.length for e in planned)
        self._demoting_bytes += nbytes
        self.counters.demotions_started += len(planned)
        return IoBatch("demote", self.ssd, planned, requests, nbytes)

    def _allocate_ssd(self, block_bytes: int, count: int) -> list[Extent]:
        """SSD extents, reclaiming the oldest SSD copies (FIFO) while the tier is full. A copy being
        read (a promotion) blocks reclamation: the write is then not done (counted by the caller)."""
        ssd = self.ssd
        got = ssd.allocate(block_bytes, count)
        fifo = self._ssd_fifo
        while len(got) < count and fifo:
            entry, extent = fifo[0]
            if entry.ssd != extent:  # stale: that copy was dropped already
                fifo.popleft()
                continue
            if entry.io:
                break
            fifo.popleft()
            self._drop_ssd_copy(entry)
            self.counters.ssd_reclaimed_blocks += 1
            self._forget_if_gone(entry)
            got += ssd.allocate(block_bytes, count - len(got))
        return got

    def _drop_ssd_copy(self, entry: BlockEntry) -> None:
        extent = self.index.detach_ssd(entry)
        self.ssd.free([extent])

    # ======================================================= other nodes (L2)

    def plan_fetch(self, ns_index: int, hashes: Sequence[bytes], block_bytes: int) -> list[BlockEntry]:
        """DRAM slots for the leading ``hashes`` this node does not hold, to be filled from a peer;
        stops at the first one it holds or cannot get a slot for. The entries are pending
        (``filling_from`` REMOTE) until ``fetched``; their slots are pinned meanwhile."""
        get = self.index.get
        wanted: list[bytes] = []
        for block_hash in hashes:
            if get((ns_index, block_hash)) is not None:
                break
            wanted.append(block_hash)
        if not wanted:
            return []
        fits = self.cap_room(ns_index, block_bytes, len(wanted))
        slots = self._allocate_slots(block_bytes, fits, None, ns_index=ns_index)
        entries = []
        for block_hash, slot in zip(wanted, slots, strict=False):
            entry = self.index.add_fetching((ns_index, block_hash), block_bytes, slot)
            entry.held = True  # the allocation held its slab
            entry.io += 1
            entries.append(entry)
        self.counters.fetches_started += len(entries)
        return entries

    def fetched(
        self, entries: Sequence[BlockEntry], ok: Sequence[bool], checksums: Sequence[int | None]
    ) -> None:
        """A peer fetch resolved: the blocks that arrived whole become readable (and are published as
        held here too), the others leave. No byte can still land in a slot when this is called."""
        for entry, good, digest in zip(entries, ok, checksums, strict=True):
            entry.io -= 1
            if self.index.get(entry.key) is not entry:
                continue
            if good:
                self.index.slot_filled(entry)
                entry.checksum = digest
                if self.lane is not None:
                    self.lane.publish_one(entry)
                self.policy.on_insert(entry.key, entry.length)
                self.counters.fetched_blocks += 1
                self.counters.fetched_bytes += entry.length
                self._rehold(entry)
                if self.publishing:
                    self.published.append((True, entry.key[0], entry.key[1]))
                if self.journal is not None and digest is not None:
                    ns = self.namespaces.at(entry.key[0])
                    self.journal.sealed(
                        JournaledBlock(entry.dram, entry.length, digest, block_tag(ns.id, entry.key[1]))
                    )
            else:
                self.counters.fetch_failures += 1
                self._release_slot(entry, self.index.detach_slot(entry))
                self.index.remove(entry)

    def dram_prefix(self, ns_index: int, hashes: Sequence[bytes]) -> list[BlockEntry]:
        """The leading blocks of ``hashes`` readable in DRAM now (what a peer's transfer may read)."""
        get = self.index.get
        out = []
        for block_hash in hashes:
            entry = get((ns_index, block_hash))
            if entry is None or entry.state != SEALED or not entry.dram_ready or entry.corrupt:
                break
            out.append(entry)
        return out

    def dram_keys(self) -> list[BlockKey]:
        """Every block readable in DRAM (the publisher's snapshot, taken under the lock)."""
        return [key for key, entry in self.index.items() if entry.dram_ready]

    # ================================================================ stats

    def ssd_fifo_len(self) -> int:
        return len(self._ssd_fifo)

    def inflight_bytes(self) -> tuple[int, int]:
        return self._promoting_bytes, self._demoting_bytes


NotEvictable = Callable[[BlockKey], bool]
