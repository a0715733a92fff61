"""Scheduler-side bookkeeping of PegaKVConnector (runs in vLLM's EngineCore process).

Per request it decides which of its blocks come from pegaflow (a prefix lookup when the
request is admitted), which freshly computed full blocks go to pegaflow (each block
once, in the step that completes it), and whether its blocks must outlive it until the
workers' saves are done. It never touches KV bytes and never blocks longer than one
lookup deadline; the lookup itself is injected (`PrefixLookup`), the server-backed one
is `ServerPrefixLookup`.

Loads are synchronous in vLLM's terms (the step that admits the request loads its hit
before its layers read it) but layer-pipelined in the worker. Block ids are KV cache
group 0's: the connector only runs on single-group engines (see namespace.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata
from pegaflow.connector.stats import StatsRecorder
from pegaflow.connector.trace import tracer

log = logging.getLogger("vllm.pegaflow.connector.scheduler")
_trace = tracer("scheduler")  # PEGAFLOW_TRACE: per-phase spans (trace.py); off by default

# Number of leading hashes present in the store, or None when the store cannot say now.
PrefixLookup = Callable[[Sequence[bytes]], "int | None"]


@dataclasses.dataclass
class _Lookup:
    """What the last lookup for a request saw, consumed when vLLM allocates its blocks."""

    local_blocks: int  # leading blocks vLLM's own prefix cache already holds
    stored_blocks: int | None  # leading blocks in pegaflow, None when unknown
    num_hashes: int = 0  # how many block hashes were asked about
    at: float = 0.0  # when (monotonic seconds)


# vLLM asks again, every step, about a request it could not admit yet (no free KV blocks).
# One answer serves those repeats for this long: a waiting queue then costs the server one
# lookup per request and second, not one per step, and is not counted as new block requests.
LOOKUP_REUSE_S = 1.0


@dataclasses.dataclass
class _RequestState:
    request: Any  # vLLM Request: its block_hashes grow as tokens are generated
    block_ids: list[int] = dataclasses.field(default_factory=list)
    next_save_block: int = 0  # blocks before this are stored, being saved, or not ours to save
    computed_before_step: int = 0
    expected_computed: int | None = None  # what this step leaves computed if nothing is rolled back
    pending_load: BlockTransfer | None = None
    pending_failed_ids: list[int] = dataclasses.field(default_factory=list)
    had_saves: bool = False
    saves_held_until: int = 0  # no saves planned before this step (see _plan_saves)


class SchedulerConnector:
    def __init__(
        self,
        *,
        block_size: int,
        lookup: PrefixLookup | None,
        loads: bool,
        saves: bool,
        steps_in_flight: int = 1,
    ):
        """steps_in_flight: engine steps scheduled before the output of a step is seen (1
        without vLLM's async scheduling, 2 with it): how long saves wait after a load."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if steps_in_flight < 1:
            raise ValueError(f"steps_in_flight must be at least 1, got {steps_in_flight}")
        self.block_size = block_size
        self.steps_in_flight = steps_in_flight
        self._step = 0  # build_meta calls so far
        self._lookup = lookup
        self._loads = loads
        self._saves = saves
        self._lookups: dict[str, _Lookup] = {}
        self._reqs: dict[str, _RequestState] = {}
        self._delayed_free: list[str] = []
        self._finish_saves: list[BlockTransfer] = []  # saves of requests that just finished
        # counters for logs and tests
        self.metrics = StatsRecorder()  # vLLM's connector stats (stats.py), scheduler side
        self.lookups = 0
        self.lookups_reused = 0
        self.hit_blocks = 0
        self.saved_blocks = 0

    def set_lookup(self, lookup: PrefixLookup) -> None:
        """Start looking up (the workers reported the namespaces they store under)."""
        self._lookup = lookup

    # ----------------------------------------------------------- admission
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond vLLM's local hit that pegaflow holds. Side-effect free towards vLLM
        (it may ask again for the same request); only remembers what it saw for
        update_state_after_alloc."""
        bs = self.block_size
        local_blocks = num_computed_tokens // bs
        if not self._loads or self._lookup is None:
            self._lookups[request.request_id] = _Lookup(local_blocks, None)
            return 0, False
        hashes = request.block_hashes
        # the last token is always computed: it produces the next token's logits
        usable_blocks = min(len(hashes), max(request.num_tokens - 1, 0) // bs)
        if usable_blocks <= local_blocks:
            self._lookups[request.request_id] = _Lookup(local_blocks, None)
            return 0, False
        t0 = time.monotonic()
        seen = self._lookups.get(request.request_id)
        if (
            seen is not None
            and seen.stored_blocks is not None
            and seen.num_hashes == len(hashes)
            and t0 - seen.at < LOOKUP_REUSE_S
        ):
            stored = seen.stored_blocks  # a repeat for a request still waiting: same answer
            self.lookups_reused += 1
        else:
            self.lookups += 1
            # ask for every full block: knowing the whole stored prefix also spares saving
            # blocks that are there already
            stored = self._lookup(hashes)
            t1 = time.monotonic()
            self._count_lookup(len(hashes), stored, t1 - t0)
            if _trace.enabled:
                _trace.span("lookup", t0, t1, req=request.request_id, blocks=len(hashes), stored=stored)
            log.debug(
                "pegaflow: lookup of %d blocks for %s: %s stored (%.1f ms)",
                len(hashes),
                request.request_id,
                stored,
                (time.monotonic() - t0) * 1e3,
            )
        self._lookups[request.request_id] = _Lookup(local_blocks, stored, len(hashes), t0)
        if stored is None:
            return 0, False
        loadable = min(stored, usable_blocks)
        if loadable <= local_blocks:
            return 0, False
        return (loadable - local_blocks) * bs, False

    def _count_lookup(self, asked: int, stored: int | None, seconds: float) -> None:
        m = self.metrics
        m.add("lookups")
        m.observe("lookup_seconds", seconds)
        if stored is not None:  # a failed or skipped lookup is counted by the lookup itself
            m.add("lookup_blocks", asked)
            m.add("lookup_hit_blocks", min(stored, asked))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        state = self._reqs.get(rid)
        if state is None:
            state = self._reqs[rid] = _RequestState(request)
        state.request = request
        seen = self._lookups.pop(rid, None)
        local_blocks = seen.local_blocks if seen is not None else 0
        # Saves start at the first block not known to be stored. Local hits with no lookup
        # behind them are assumed stored: they were saved when first computed.
        if seen is not None and seen.stored_blocks is not None:
            state.next_save_block = seen.stored_blocks
        else:
            state.next_save_block = local_blocks
        state.expected_computed = None
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        n_load = -(-num_external_tokens // self.block_size)
        first, last = local_blocks, local_blocks + n_load
        stored = seen.stored_blocks if seen is not None else None
        if stored is None or last > stored or last > len(block_ids) or last > len(request.block_hashes):
            # vLLM counts on tokens we never offered; the worker reports these blocks failed
            # so vLLM recomputes them instead of reading garbage.
            log.error(
                "pegaflow: request %s: %d external tokens without a matching lookup; recomputing",
                rid,
                num_external_tokens,
            )
            state.pending_failed_ids = list(block_ids[first : min(last, len(block_ids))])
            return
        state.pending_load = BlockTransfer(
            rid, list(block_ids[first:last]), [bytes(h) for h in request.block_hashes[first:last]]
        )
        self.hit_blocks += n_load
        self.metrics.add("hit_tokens", num_external_tokens)

    # ---------------------------------------------------------------- steps
    def build_meta(self, scheduler_output: Any) -> PegaConnectorMetadata:
        self._step += 1
        meta = PegaConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0]) if new.block_ids else []
            state.computed_before_step = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            state = self._reqs.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            state.computed_before_step = cached.num_computed_tokens[i]

        loading: set[str] = set(meta.failed_loads)
        for state in self._reqs.values():
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                loading.add(state.pending_load.req_id)
                state.pending_load = None
            if state.pending_failed_ids:
                meta.failed_loads[state.request.request_id] = state.pending_failed_ids
                loading.add(state.request.request_id)
                state.pending_failed_ids = []

        if self._saves:
            for rid, n_scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._reqs.get(rid)
                if state is None:
                    continue
                if rid in loading:
                    state.saves_held_until = self._step + self.steps_in_flight
                self._plan_saves(state, n_scheduled, meta)
        meta.saves.extend(self._finish_saves)
        self._finish_saves = []

        meta.preempted_req_ids = sorted(scheduler_output.preempted_req_ids or ())
        meta.delayed_free_req_ids, self._delayed_free = self._delayed_free, []
        if _trace.enabled:
            _trace.point(
                "build_meta",
                step=self._step,
                new_reqs=len(scheduler_output.scheduled_new_reqs),
                tokens=sum(scheduler_output.num_scheduled_tokens.values()),
                load_blocks=sum(len(t.block_ids) for t in meta.loads),
                save_blocks=sum(len(t.block_ids) for t in meta.saves),
            )
        return meta

    def _plan_saves(self, state: _RequestState, n_scheduled: int, meta: PegaConnectorMetadata) -> None:
        """Save the full blocks this step completes, unless the request loaded recently.

        When a request loads in step N and any rank's load fails, what every rank computes
        from step N on is wrong (under tensor parallelism the all-reduce mixes the ranks).
        vLLM reports that as a roll-back, which the scheduler sees once step N's output is
        processed: before building step N+1 without async scheduling, before step N+2 with
        it (step N+1 is scheduled while step N runs). Saves wait until then
        (`saves_held_until`), and are planned from the roll-back point or dropped with it:
        no rank ever stores a block computed over missing KV."""
        bs = self.block_size
        before = state.computed_before_step
        if state.expected_computed is not None and before < state.expected_computed:
            # a failed load rolled the request back: blocks from there on are recomputed
            # (and may be missing from the store), so they are saved again
            state.next_save_block = min(state.next_save_block, before // bs)
        state.expected_computed = before + n_scheduled
        if self._step < state.saves_held_until:
            return
        transfer = self._unsaved_blocks(state, state.expected_computed)
        if transfer is not None:
            meta.saves.append(transfer)

    def _unsaved_blocks(self, state: _RequestState, computed: int) -> BlockTransfer | None:
        """The full blocks among the first `computed` tokens not yet saved (and mark them).

        While prompt blocks are saved, the transfer also carries the chain before them (its
        head): the server then keeps the head ahead of the new blocks for eviction, instead
        of evicting a shared prompt before the continuation that is useless without it. The
        stored head costs no copy. Output blocks, saved one at a time while decoding, go
        alone: resending a long prompt with each would cost more than the order is worth."""
        hashes = state.request.block_hashes
        full = min(computed // self.block_size, len(hashes), len(state.block_ids))
        first = state.next_save_block
        if full <= first:
            return None
        state.next_save_block = full
        state.had_saves = True
        self.saved_blocks += full - first
        head = first if first < state.request.num_prompt_tokens // self.block_size else 0
        return BlockTransfer(
            state.request.request_id,
            list(state.block_ids[first:full]),
            [bytes(h) for h in hashes[first:full]],
            head_block_ids=list(state.block_ids[:head]),
            head_hashes=[bytes(h) for h in hashes[:head]],
        )

    # ---------------------------------------------------------- completion
    def request_finished(self, request: Any) -> bool:
        """True when the request's blocks must stay until the workers' saves are done.
        A request that finished in the step that loaded it still has that step's blocks to
        save (deferred, see _plan_saves): vLLM finishing it means no rank's load failed, so
        they are saved now, from the blocks it keeps for us."""
        rid = request.request_id
        self._lookups.pop(rid, None)
        state = self._reqs.pop(rid, None)
        if state is None:
            return False
        if self._saves and state.expected_computed is not None:
            transfer = self._unsaved_blocks(state, state.expected_computed)
            if transfer is not None:
                self._finish_saves.append(transfer)
        if state.had_saves:
            self._delayed_free.append(rid)
        return state.had_saves

    @property
    def num_tracked_requests(self) -> int:
        return len(self._reqs)


class ServerPrefixLookup:
    """PrefixLookup over pegaflow-server: the minimum over this engine's rank namespaces of
    the leading sealed hits (a block is usable only if every rank can load its shard)."""

    def __init__(self, link: Any, timeout_s: float, metrics: StatsRecorder | None = None):
        """metrics: where lookups that were skipped (breaker open) or failed are counted."""
        self._link = link
        self._timeout_s = timeout_s
        self._metrics = metrics or StatsRecorder()

    def __call__(self, hashes: Sequence[bytes]) -> int | None:
        from pegaflow.client import errors

        usable = self._link.usable()
        if usable is None:
            self._metrics.add("lookups_skipped")
            return None
        client, instances = usable
        # one deadline for the whole lookup, however many ranks and batches it takes
        deadline = time.monotonic() + self._timeout_s
        n = len(hashes)
        for inst in instances:
            try:
                n = min(n, self._leading_hits(client, inst, hashes[:n], deadline))
            except errors.ServerUnavailable as exc:
                self._link.report_failure(exc, "prefix lookup")
                self._metrics.add("lookup_failures")
                return None
            except errors.PegaflowError as exc:
                log.warning("pegaflow: prefix lookup rejected: %s", exc)
                self._metrics.add("lookup_failures")
                return None
            if n == 0:
                break
        return n

    @staticmethod
    def _leading_hits(client: Any, inst: Any, hashes: Sequence[bytes], deadline: float) -> int:
        from pegaflow.client import errors
        from pegaflow.connector.server_link import batches

        total = 0
        for chunk in batches(hashes, client):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("prefix lookup: deadline passed")
            hit = client.query_prefix(inst, chunk, lease=False, timeout_s=remaining)
            got = min(int(hit.num_hits), len(chunk))
            total += got
            if got < len(chunk):
                break
        return total
