"""Block-level analysis of a trace: what any KV cache could get out of it, and what LRU pools of a
given size get when it is replayed in order.

Used to choose an experiment's pool budget before spending minutes of real vLLM on it, to put an
exact hit-rate ceiling next to the server's HyperLogLog estimate, and to explain measured numbers.

The model of a KV cache here is the one vLLM's connector interface imposes:
- a prompt is cut into full blocks of `block_tokens`; block i's key is a chained digest of every
  token up to the end of block i (like vLLM's block hashes), so equal keys mean equal prefixes;
- a lookup hits the longest run of leading blocks that are resident, capped at `(len - 1) //
  block_tokens` blocks because vLLM always computes at least the prompt's last token;
- after the request, the blocks it computed (every full block after the loaded prefix) are stored,
  as the connector saves them: with the loaded prefix sent along, so the save names the whole chain;
  the least recently used blocks are evicted when the pool is full, never the chain's own stored
  blocks (its tail is useless without them), and new blocks that still do not fit are dropped
  from the tail;
- like the server's engine, the blocks of one lookup or one save are used tail first, so within
  them the head is the most recent and a prefix is evicted from its tail; a save restates its
  whole chain, so a loaded head stays ahead of the continuation computed after it.
Replayed against the real server with one request at a time, this model reproduced the shared
pool's hits block for block and the isolated pools' within ~5 % (bench/README.md).
It ignores timing (requests are replayed one at a time, in trace order), decode-time blocks and
admission policies, so it predicts the regression's sequential replay and only estimates
concurrent runs.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from pegaflow.bench.harness.traces import TraceRequest

BlockKey = bytes


def block_keys(prompt: np.ndarray, block_tokens: int) -> list[BlockKey]:
    """Chained digests of the prompt's full blocks: key i covers tokens [0, (i + 1) * block_tokens)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    tokens = np.ascontiguousarray(prompt, dtype="<i4")
    keys = []
    parent = b""
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = hashlib.blake2b(
            parent + tokens[start : start + block_tokens].tobytes(), digest_size=16
        ).digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass(frozen=True)
class RequestBlocks:
    index: int
    instance_route: int
    prompt_tokens: int
    keys: tuple[BlockKey, ...]  # every full block of the prompt
    loadable: int  # how many leading blocks a cache may supply

    @classmethod
    def of(cls, request: TraceRequest, block_tokens: int) -> RequestBlocks:
        keys = tuple(block_keys(request.prompt, block_tokens))
        loadable = min(len(keys), (len(request.prompt) - 1) // block_tokens)
        return cls(request.index, request.route, len(request.prompt), keys, loadable)


def trace_blocks(requests: Iterable[TraceRequest], block_tokens: int) -> list[RequestBlocks]:
    return [RequestBlocks.of(r, block_tokens) for r in requests]


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """r* = (N - U) / N: N block lookups, U distinct blocks. No cache of any size or policy can hit
    a block the first time it is seen, so r* bounds the block hit rate (the server estimates the
    same quantity with HyperLogLog)."""

    lookups: int
    distinct: int

    @property
    def ceiling(self) -> float | None:
        return None if self.lookups == 0 else (self.lookups - self.distinct) / self.lookups


def exact_ceiling(blocks: Iterable[RequestBlocks]) -> Ceiling:
    seen: set[BlockKey] = set()
    lookups = 0
    for rb in blocks:
        lookups += len(rb.keys)
        seen.update(rb.keys)
    return Ceiling(lookups, len(seen))


@dataclasses.dataclass
class SimResult:
    requests: int = 0
    requests_with_hit: int = 0
    block_lookups: int = 0  # full prompt blocks looked up (the ceiling's N)
    loadable_blocks: int = 0
    block_hits: int = 0
    prompt_tokens: int = 0
    evictions: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.block_lookups if self.block_lookups else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.requests_with_hit / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["block_hit_rate"] = self.block_hit_rate
        d["request_hit_rate"] = self.request_hit_rate
        return d


class LRUBlockPool:
    """A pool of `capacity_blocks` blocks under LRU, with the lookup/store semantics above."""

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._resident: collections.OrderedDict[BlockKey, None] = collections.OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._resident)

    def lookup(self, rb: RequestBlocks) -> int:
        hits = 0
        while hits < rb.loadable and rb.keys[hits] in self._resident:
            hits += 1
        for key in reversed(rb.keys[:hits]):
            self._resident.move_to_end(key)
        return hits

    def store(self, rb: RequestBlocks, loaded: int = 0) -> None:
        """Stores the blocks the request computed (every full block after the `loaded` prefix),
        saved with the prefix as one chain, as the server's engine handles that save: room is made
        by evicting the least recently used blocks outside the chain, new blocks that still do not
        fit are dropped from the tail, then the chain is restated tail first (new blocks inserted,
        stored ones refreshed), leaving its head the most recent."""
        if self.capacity == 0:
            return
        chain = rb.keys
        new = [key for key in chain if key not in self._resident]
        short = len(self._resident) + len(new) - self.capacity
        if short > 0:
            kept = set(chain)
            victims = []
            for key in self._resident:  # coldest first
                if key not in kept:
                    victims.append(key)
                    if len(victims) == short:
                        break
            for key in victims:
                del self._resident[key]
            self.evictions += len(victims)
        fits = set(new[: self.capacity - len(self._resident)])
        for key in reversed(chain):
            if key in self._resident:
                self._resident.move_to_end(key)
            elif key in fits:
                self._resident[key] = None


def simulate(blocks: Sequence[RequestBlocks], num_pools: int, capacity_blocks: int) -> SimResult:
    """Replays the trace in order over `num_pools` LRU pools of `capacity_blocks` each, request i
    going to pool `route % num_pools`: num_pools=1 is one shared pool, num_pools=N the isolated
    per-instance pools of a fleet of N."""
    pools = [LRUBlockPool(capacity_blocks) for _ in range(num_pools)]
    res = SimResult()
    for rb in blocks:
        pool = pools[rb.instance_route % num_pools]
        hits = pool.lookup(rb)
        pool.store(rb, hits)
        res.requests += 1
        res.requests_with_hit += hits > 0
        res.block_lookups += len(rb.keys)
        res.loadable_blocks += rb.loadable
        res.block_hits += hits
        res.prompt_tokens += rb.prompt_tokens
    res.evictions = sum(p.evictions for p in pools)
    return res


def simulate_fleet(
    blocks: Sequence[RequestBlocks], num_instances: int, budget_blocks: int
) -> tuple[SimResult, SimResult]:
    """(shared, isolated) for one total budget: one pool of `budget_blocks` seen by every instance,
    versus `num_instances` pools of budget_blocks // num_instances, each seen by one instance."""
    shared = simulate([_reroute(rb, 0) for rb in blocks], 1, budget_blocks)
    isolated = simulate(blocks, num_instances, budget_blocks // num_instances)
    return shared, isolated


def _reroute(rb: RequestBlocks, route: int) -> RequestBlocks:
    return dataclasses.replace(rb, instance_route=route)


def per_instance_ceilings(blocks: Sequence[RequestBlocks], num_instances: int) -> list[Ceiling]:
    """The ceiling of the block stream each isolated instance sees: what its own pool could reach
    even with unlimited capacity, because it never sees the blocks other instances stored."""
    streams: list[list[RequestBlocks]] = [[] for _ in range(num_instances)]
    for rb in blocks:
        streams[rb.instance_route % num_instances].append(rb)
    return [exact_ceiling(s) for s in streams]


def budget_for_shared_hit_rate(
    blocks: Sequence[RequestBlocks], fraction_of_unbounded: float, max_blocks: int | None = None
) -> int:
    """The smallest shared-pool capacity (blocks) whose simulated block hit rate reaches
    `fraction_of_unbounded` of what an unbounded pool gets on this trace (binary search; the hit
    rate of LRU with prefix lookups is monotone in capacity for a fixed trace in practice, and the
    search only needs a point where it is reached)."""
    if not 0 < fraction_of_unbounded <= 1:
        raise ValueError(f"fraction_of_unbounded must be in (0, 1], got {fraction_of_unbounded}")
    total = exact_ceiling(blocks).distinct
    hi = total if max_blocks is None else min(total, max_blocks)
    one_pool = [_reroute(rb, 0) for rb in blocks]
    target = fraction_of_unbounded * simulate(one_pool, 1, total).block_hit_rate
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if simulate(one_pool, 1, mid).block_hit_rate >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
