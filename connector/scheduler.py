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


@dataclasses.dataclass(frozen=True)
class LookupAnswer:
    """What the store said about a chain: ``ready`` leading blocks readable now; ``waiting`` when more
    are on their way into the server's DRAM (promoted from its SSD, pulled from another node) or
    being searched for on other nodes; ``sources`` where each found block was (the first lookup's
    answer: pegaflow.client.Tier names "DRAM" / "SSD" / "REMOTE")."""

    ready: int
    waiting: bool = False
    sources: tuple[str, ...] = ()


# The store's answer for a chain (an int: that many ready blocks, nothing waiting), or None when it
# cannot say now. ``poll=True``: a repeat for a chain an earlier call already asked about (the
# server counts it as a load, not as new block requests).
PrefixLookup = Callable[..., "LookupAnswer | int | None"]


def _answer(value) -> LookupAnswer | None:
    if value is None or isinstance(value, LookupAnswer):
        return value
    return LookupAnswer(int(value))


@dataclasses.dataclass
class _Lookup:
    """What the last lookup for a request saw, consumed when vLLM allocates its blocks."""

    local_blocks: int  # leading blocks vLLM's own prefix cache already holds
    stored_blocks: int | None  # leading blocks in pegaflow, None when unknown
    num_hashes: int = 0  # how many block hashes were asked about
    at: float = 0.0  # when (monotonic seconds)
    sources: tuple[str, ...] = ()  # per block, where the lookups first saw it
    waiting_since: float | None = None  # blocks were on their way since then (asked again later)
    polled_at: float = 0.0


# While blocks are on their way into the server's DRAM (from its SSD, from another node), vLLM is
# told "ask again" ((None, False): the request waits, the batch does not). vLLM asks again every
# engine step, which is a busy loop when nothing else runs, so the server is polled at most every
# POLL_INTERVAL_S per request, and no request waits longer than the connector's max wait (then it
# takes what is ready and computes the rest).
POLL_INTERVAL_S = 0.004

# ... but when the engine's last step scheduled nothing (every request waits), vLLM's EngineCore
# loop runs empty steps back to back, a busy core the server may need to bring the blocks in on a
# small host. Then the lookup sleeps until the poll is due (at most POLL_INTERVAL_S, once per step)
# and polls: the engine had nothing else to do in that time. (A peer pull of 78 MiB ran at ~1 GB/s
# beside the waiting engine, against 2.2 GB/s for bulk pulls; this sleep alone did not measurably
# change that, bench/README.md "Remote read".)


# The lookup runs inside vLLM's schedule(), which the whole engine waits for, while EngineCore's
# input thread may be busy in Python (a new 10K-token prompt's block hashes): sent and waited for
# this long with the interpreter lock kept, the read lane's answer (~0.1 ms) is not held up by
# taking the lock back, up to a switch interval (5 ms) each time; past it the wait lets go.
# Measured with a busy Python thread beside the caller: 5-10 ms per round trip -> 22 us median.
LOOKUP_HOLD_LOCK_S = 0.002


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
    load_first_block: int = 0  # the planned load's first block (for hit_sources)
    load_sources: tuple[str, ...] = ()
    saves_off: bool = False  # our bookkeeping failed for it: none of its blocks is saved any more


class SchedulerConnector:
    def __init__(
        self,
        *,
        block_size: int,
        lookup: PrefixLookup | None,
        loads: bool,
        saves: bool,
        steps_in_flight: int = 1,
        max_wait_s: float = 3.0,
    ):
        """steps_in_flight: engine steps scheduled before the output of a step is seen (1
        without vLLM's async scheduling, 2 with it): how long saves wait after a load.
        max_wait_s: the longest a request waits for blocks on their way into the server (from its
        SSD, from another node) before it takes what is ready (0: never waits)."""
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
        self.max_wait_s = max_wait_s
        self.lookups = 0
        self.lookups_reused = 0
        self.lookups_waited = 0  # answered "ask again": blocks were on their way
        self.lookups_polled = 0
        self.idle_waits = 0  # slept until a poll was due: the engine's last step was empty
        self._last_step_idle = False  # the last build_meta's step scheduled no token
        self._idle_wait_step = -1
        self.waits_given_up = 0  # waited max_wait_s, then took what was ready
        self.hit_blocks = 0
        self.saved_blocks = 0

    def set_lookup(self, lookup: PrefixLookup) -> None:
        """Start looking up (the workers reported the namespaces they store under)."""
        self._lookup = lookup

    # ----------------------------------------------------------- admission
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond vLLM's local hit that pegaflow holds. Side-effect free towards vLLM
        (it may ask again for the same request); only remembers what it saw for
        update_state_after_alloc. It runs inside vLLM's schedule(): an error of ours here is a
        request without external hits, as when the server is away, never an engine failure."""
        try:
            return self._matched_tokens(request, num_computed_tokens)
        except Exception:
            log.warning(
                "pegaflow: looking request %s up failed; no external hits", request.request_id, exc_info=True
            )
            self._lookups[request.request_id] = _Lookup(num_computed_tokens // self.block_size, None)
            return 0, False

    def _matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
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
        rid = request.request_id
        seen = self._lookups.get(rid)
        sources: tuple[str, ...] = ()
        waiting_since = None
        if seen is not None and seen.waiting_since is not None and seen.num_hashes == len(hashes):
            # blocks were on their way: ask again (as a load), at most every POLL_INTERVAL_S
            if t0 - seen.polled_at < POLL_INTERVAL_S:
                if not self._idle_wait(seen.polled_at + POLL_INTERVAL_S - t0):
                    return None, False
                t0 = time.monotonic()
            answer = _answer(self._lookup(hashes, poll=True))
            self.lookups_polled += 1
            waiting_since = seen.waiting_since
            # Each block keeps where it was first seen: a block that was arriving from SSD or a peer
            # reads as DRAM once it landed. A first lookup that was still searching saw nothing:
            # the polls name the blocks found since.
            sources = seen.sources
            if answer is not None and len(answer.sources) > len(sources):
                sources = sources + answer.sources[len(sources) :]
            if answer is not None and answer.waiting and t0 - waiting_since < self.max_wait_s:
                seen.polled_at, seen.sources = t0, sources
                return None, False
            if answer is not None and answer.waiting:
                self.waits_given_up += 1
            stored = None if answer is None else answer.ready
        elif (
            seen is not None
            and seen.stored_blocks is not None
            and seen.num_hashes == len(hashes)
            and t0 - seen.at < LOOKUP_REUSE_S
        ):
            stored = seen.stored_blocks  # a repeat for a request still waiting: same answer
            sources = seen.sources
            self.lookups_reused += 1
        else:
            self.lookups += 1
            # ask for every full block: knowing the whole stored prefix also spares saving
            # blocks that are there already
            answer = _answer(self._lookup(hashes))
            stored = None if answer is None else answer.ready
            t1 = time.monotonic()
            self._count_lookup(len(hashes), stored, t1 - t0)
            if _trace.enabled:
                _trace.span("lookup", t0, t1, req=rid, blocks=len(hashes), stored=stored)
            log.debug(
                "pegaflow: lookup of %d blocks for %s: %s stored%s (%.1f ms)",
                len(hashes),
                rid,
                stored,
                ", more on their way" if answer is not None and answer.waiting else "",
                (time.monotonic() - t0) * 1e3,
            )
            if answer is not None:
                sources = answer.sources
                if answer.waiting and self.max_wait_s > 0:
                    self._lookups[rid] = _Lookup(local_blocks, stored, len(hashes), t0, sources, t0, t0)
                    self.lookups_waited += 1
                    return None, False
        self._lookups[rid] = _Lookup(local_blocks, stored, len(hashes), t0, sources)
        if stored is None:
            return 0, False
        loadable = min(stored, usable_blocks)
        if loadable <= local_blocks:
            return 0, False
        return (loadable - local_blocks) * bs, False

    def _idle_wait(self, seconds: float) -> bool:
        """Sleeps ``seconds`` (<= POLL_INTERVAL_S) if the engine's last step was empty and no lookup
        slept in this step yet; False (no sleep) otherwise."""
        if not self._last_step_idle or self._idle_wait_step == self._step:
            return False
        self._idle_wait_step = self._step
        self.idle_waits += 1
        time.sleep(min(max(seconds, 0.0), POLL_INTERVAL_S))
        return True

    def _count_lookup(self, asked: int, stored: int | None, seconds: float) -> None:
        m = self.metrics
        m.add("lookups")
        m.observe("lookup_seconds", seconds)
        if stored is not None:  # a failed or skipped lookup is counted by the lookup itself
            m.add("lookup_blocks", asked)
            m.add("lookup_hit_blocks", min(stored, asked))

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the last planned load by where the lookups first found each block ("DRAM", "SSD",
        "REMOTE"); what is unknown is "DRAM". Sums to ``num_external_tokens``. Statistics only: an
        error of ours counts them all as DRAM."""
        try:
            return self._hit_sources(request, num_external_tokens)
        except Exception:
            log.warning(
                "pegaflow: splitting request %s's hits by tier failed", request.request_id, exc_info=True
            )
            return {"DRAM": num_external_tokens} if num_external_tokens > 0 else {}

    def _hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        state = self._reqs.get(request.request_id)
        load = state.pending_load if state is not None else None
        if num_external_tokens <= 0:
            return {}
        first = state.load_first_block if state is not None else 0
        sources = state.load_sources if state is not None else ()
        out: dict[str, int] = {}
        left = num_external_tokens
        n_blocks = len(load.block_ids) if load is not None else -(-num_external_tokens // self.block_size)
        for i in range(n_blocks):
            source = sources[first + i] if first + i < len(sources) else "DRAM"
            tokens = min(self.block_size, left)
            out[source] = out.get(source, 0) + tokens
            left -= tokens
        if left > 0:
            out["DRAM"] = out.get("DRAM", 0) + left
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks, counting ``num_external_tokens`` as ours to load.
        An error of ours here must not reach vLLM's schedule(), and must not leave vLLM counting
        on tokens nobody loads: the request's external blocks are then reported failed (vLLM
        recomputes them) and none of its blocks is saved."""
        seen = self._lookups.get(request.request_id)
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        except Exception:
            log.error(
                "pegaflow: planning %s's load failed; recomputing its %d external tokens, not saving it",
                request.request_id,
                num_external_tokens,
                exc_info=True,
            )
            self._give_up_after_alloc(request, blocks, num_external_tokens, seen)

    def _give_up_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, seen: Any) -> None:
        rid = request.request_id
        self._lookups.pop(rid, None)
        state = self._reqs.get(rid)
        if state is None:
            state = self._reqs[rid] = _RequestState(request)
        state.saves_off = True
        state.pending_load = None
        state.pending_failed_ids = []
        if num_external_tokens <= 0:
            return
        # Only the external blocks: a failed block id rolls back every running request holding it,
        # and the local prefix before them may be shared through vLLM's prefix cache.
        first = seen.local_blocks if seen is not None else 0
        block_ids = blocks.get_block_ids()[0]
        last = min(first + -(-num_external_tokens // self.block_size), len(block_ids))
        state.pending_failed_ids = list(block_ids[first:last])

    def _after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
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
        state.load_first_block, state.load_sources = first, seen.sources
        self.hit_blocks += n_load
        self.metrics.add("hit_tokens", num_external_tokens)

    # ---------------------------------------------------------------- steps
    def build_meta(self, scheduler_output: Any) -> PegaConnectorMetadata:
        """This step's loads, saves and hand-backs for the workers. An error of ours here must not
        reach vLLM's schedule(): the step then carries what keeps vLLM's KV right (every load
        promised is reported failed, blocks kept for saves are handed back, preemptions are
        passed on) and no saves (see _fallback_meta)."""
        self._step += 1
        meta = PegaConnectorMetadata()
        try:
            return self._fill_meta(meta, scheduler_output)
        except Exception:
            log.error(
                "pegaflow: building step %d's metadata failed; no saves this step", self._step, exc_info=True
            )
            return self._fallback_meta(meta, scheduler_output)

    def _fallback_meta(self, partial: PegaConnectorMetadata, scheduler_output: Any) -> PegaConnectorMetadata:
        """What a step must carry whatever failed while building it, built from the partial
        metadata and the requests' states alone. Loads become failed loads: vLLM recomputes those
        blocks rather than reading blocks nobody filled. A request that was to load saves nothing
        any more: its roll-back (if a load failed) is what the step's bookkeeping would have
        tracked. Saves already planned are dropped (each is a future miss, never a wrong block;
        their requests' blocks are still handed back through delayed_free_req_ids)."""
        meta = PegaConnectorMetadata()
        failed: dict[str, list[int]] = dict(partial.failed_loads)
        loading = list(partial.loads)
        for rid, state in self._reqs.items():
            if state.pending_load is not None:
                loading.append(state.pending_load)
                state.pending_load = None
            if state.pending_failed_ids:
                failed.setdefault(rid, []).extend(state.pending_failed_ids)
                state.pending_failed_ids = []
        for transfer in loading:
            failed.setdefault(transfer.req_id, []).extend(transfer.block_ids)
        for rid in failed:
            state = self._reqs.get(rid)
            if state is not None:
                state.saves_off = True
        meta.failed_loads = failed
        self._finish_saves = []
        delayed = list(partial.delayed_free_req_ids) + self._delayed_free
        meta.delayed_free_req_ids, self._delayed_free = list(dict.fromkeys(delayed)), []
        try:
            meta.preempted_req_ids = sorted(scheduler_output.preempted_req_ids or ())
        except Exception:
            # Unknown: every request we track counts as preempted, so no save can still be reading
            # blocks this step reuses (the workers settle those saves first; a wait, not a wrong block).
            log.error("pegaflow: step %d's preempted requests are unreadable", self._step, exc_info=True)
            meta.preempted_req_ids = sorted(self._reqs)
        return meta

    def _fill_meta(self, meta: PegaConnectorMetadata, scheduler_output: Any) -> PegaConnectorMetadata:
        self._last_step_idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
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
        for rid, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs.get(rid)
            prompt_left = state.request.num_prompt_tokens - state.computed_before_step if state else 0
            prefill = max(0, min(n_scheduled, prompt_left))
            meta.prefill_tokens += prefill
            meta.decode_tokens += n_scheduled - prefill

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
        if self._step < state.saves_held_until or state.saves_off:
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
        they are saved now, from the blocks it keeps for us. After an error of ours the blocks
        are kept all the same (the workers may still be copying from them) and handed back once
        the workers have no save of the request left: a late hand-back, never a block freed
        under a copy."""
        rid = request.request_id
        try:
            return self._finished(request)
        except Exception:
            log.error(
                "pegaflow: finishing request %s failed; its blocks wait for its saves", rid, exc_info=True
            )
            self._reqs.pop(rid, None)
            if rid not in self._delayed_free:
                self._delayed_free.append(rid)
            return True

    def _finished(self, request: Any) -> bool:
        rid = request.request_id
        self._lookups.pop(rid, None)
        state = self._reqs.pop(rid, None)
        if state is None:
            return False
        if self._saves and state.expected_computed is not None and not state.saves_off:
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
        self._logged_bug = False  # an unexpected error's traceback is logged once

    def __call__(self, hashes: Sequence[bytes], poll: bool = False) -> LookupAnswer | None:
        """The chain's leading blocks every rank can load now, and whether more are on their way into
        the server (``waiting``) for every rank. ``poll``: a repeat (counted by the server as a load)."""
        from pegaflow.client import QueryPurpose, errors

        usable = self._link.usable()
        if usable is None:
            self._metrics.add("lookups_skipped")
            return None
        client, instances = usable
        purpose = QueryPurpose.LOAD if poll else QueryPurpose.LOOKUP
        # one deadline for the whole lookup, however many ranks and batches it takes
        deadline = time.monotonic() + self._timeout_s
        n = len(hashes)
        available = n  # ready or arriving on every rank
        searching = False
        sources: tuple[str, ...] = ()
        for rank, inst in enumerate(instances):
            try:
                ready, arriving, rank_searching, found = self._leading_hits(
                    client, inst, hashes[:available], deadline, purpose
                )
            except errors.ServerUnavailable as exc:
                self._link.report_failure(exc, "prefix lookup")
                self._metrics.add("lookup_failures")
                return None
            except errors.PegaflowError as exc:
                log.warning("pegaflow: prefix lookup rejected: %s", exc)
                self._metrics.add("lookup_failures")
                return None
            except Exception as exc:  # a bug of ours, or the OS (no file descriptor left): not vLLM's
                log.warning("pegaflow: prefix lookup failed unexpectedly", exc_info=not self._logged_bug)
                self._logged_bug = True
                self._link.report_failure(exc, "prefix lookup")
                self._metrics.add("lookup_failures")
                return None
            n = min(n, ready)
            available = min(available, ready + arriving)
            searching = searching or rank_searching
            if rank == 0:
                sources = found
            if available == 0 and not searching:
                break
        # Worth waiting for only what would extend the prefix every rank can load now.
        return LookupAnswer(n, available > n or searching, sources)

    @staticmethod
    def _leading_hits(client: Any, inst: Any, hashes: Sequence[bytes], deadline: float, purpose):
        """(ready, arriving, searching, sources) of one rank's namespace, batch by batch."""
        from pegaflow.client import errors
        from pegaflow.connector.server_link import batches

        ready = arriving = 0
        searching = False
        sources: list[str] = []
        for chunk in batches(hashes, client):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("prefix lookup: deadline passed")
            hit = client.query_prefix(
                inst, chunk, lease=False, timeout_s=remaining, purpose=purpose, hold_lock_s=LOOKUP_HOLD_LOCK_S
            )
            got = min(int(hit.num_hits), len(chunk))
            pending = min(int(hit.pending), len(chunk) - got)
            sources += [s.name for s in hit.sources[: got + pending]]
            if arriving == 0:
                ready += got
            else:
                arriving += got  # readable, but after blocks still arriving: not leading yet
            arriving += pending
            if got + pending < len(chunk):
                searching = searching or hit.searching
                break
        return ready, arriving, searching, tuple(sources)
