import numpy as np
import pytest

from pegaflow.bench.harness import cachesim
from pegaflow.bench.harness.traces import TraceRequest, TraceSpec, generate

BT = 4  # tokens per block in these hand-made cases


def req(index, tokens, route=0):
    return TraceRequest(index, "session", 0, 0, 0, np.asarray(tokens, dtype=np.int32), 1, route, None)


def test_block_keys_are_chained_prefix_digests():
    a = cachesim.block_keys(np.arange(12), BT)
    b = cachesim.block_keys(np.r_[np.arange(4), 99, np.arange(5, 12)], BT)
    assert len(a) == 3
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # a change poisons every later block
    assert cachesim.block_keys(np.arange(11), BT) == a[:2]  # partial blocks have no key


def test_lookup_stops_at_first_miss_and_never_supplies_the_last_token():
    exact = cachesim.RequestBlocks.of(req(0, range(8)), BT)
    assert exact.loadable == 1  # 2 full blocks, but vLLM computes at least one token
    longer = cachesim.RequestBlocks.of(req(1, range(9)), BT)
    assert longer.loadable == 2
    pool = cachesim.LRUBlockPool(10)
    assert pool.lookup(longer) == 0
    pool.store(exact)
    assert pool.lookup(longer) == 2
    other = cachesim.RequestBlocks.of(req(2, [50, 51, 52, 53, *range(4, 9)]), BT)
    assert pool.lookup(other) == 0  # block 1's tokens match, but its prefix does not


def test_lru_evicts_the_least_recently_used_block():
    pool = cachesim.LRUBlockPool(2)
    a = cachesim.RequestBlocks.of(req(0, [1, 1, 1, 1, 0]), BT)
    b = cachesim.RequestBlocks.of(req(1, [2, 2, 2, 2, 0]), BT)
    c = cachesim.RequestBlocks.of(req(2, [3, 3, 3, 3, 0]), BT)
    pool.store(a)
    pool.store(b)
    assert pool.lookup(a) == 1  # a is now more recent than b
    pool.store(c)
    assert pool.evictions == 1
    assert pool.lookup(a) == 1 and pool.lookup(b) == 0 and pool.lookup(c) == 1


def test_a_prefix_is_evicted_from_its_tail_and_a_save_keeps_its_loaded_head():
    pool = cachesim.LRUBlockPool(3)
    prefix = cachesim.RequestBlocks.of(req(0, [*range(12), 0]), BT)  # 3 blocks
    pool.store(prefix)
    other = cachesim.RequestBlocks.of(req(1, [9, 9, 9, 9, 0]), BT)
    pool.store(other)  # evicts one block of the prefix: its tail, not its head
    assert pool.lookup(prefix) == 2
    # a request that loaded 2 blocks saves what it computed after them, with the loaded head
    longer = cachesim.RequestBlocks.of(req(2, [*range(16), 0]), BT)
    assert pool.lookup(longer) == 2
    pool.store(longer, loaded=2)
    # Room for the computed blocks comes from outside the chain ("other"), never from the loaded
    # head; the last block does not fit and is dropped; the head stays the most recent (what the
    # real connector + engine do, server/engine.py).
    assert pool.evictions == 2 and len(pool) == 3
    assert pool.lookup(longer) == 3
    pool.store(other)  # pressure: the chain loses its tail first
    assert pool.lookup(longer) == 2 and pool.lookup(prefix) == 2


def test_exact_ceiling_counts_first_sightings_as_unavoidable_misses():
    blocks = [cachesim.RequestBlocks.of(req(i, range(9)), BT) for i in range(4)]
    c = cachesim.exact_ceiling(blocks)
    assert (c.lookups, c.distinct) == (8, 2)
    assert c.ceiling == pytest.approx(6 / 8)
    assert cachesim.exact_ceiling([]).ceiling is None


def test_one_shared_pool_beats_isolated_pools_when_routing_spreads_a_shared_prefix():
    spec = TraceSpec(
        seed=1,
        num_requests=120,
        num_system_prompts=3,
        system_prompt_tokens=256,
        concurrent_sessions=4,
        turns_min=2,
        turns_max=3,
        user_turn_tokens=32,
        assistant_turn_tokens=16,
        one_off_share=0.0,
        one_off_tokens=64,
        max_prompt_tokens=1000,
    )
    blocks = cachesim.trace_blocks(generate(spec), 32)
    budget = cachesim.budget_for_shared_hit_rate(blocks, 0.9)
    shared, isolated = cachesim.simulate_fleet(blocks, 3, budget)
    assert shared.block_hit_rate > isolated.block_hit_rate + 0.2
    assert shared.block_hit_rate <= cachesim.exact_ceiling(blocks).ceiling
    # unbounded isolated pools are still capped by what each instance alone has seen
    per_instance = cachesim.per_instance_ceilings(blocks, 3)
    assert all(c.ceiling < cachesim.exact_ceiling(blocks).ceiling for c in per_instance)


def test_budget_search_returns_the_smallest_capacity_reaching_the_target():
    spec = TraceSpec(
        seed=2,
        num_requests=80,
        num_system_prompts=2,
        system_prompt_tokens=128,
        concurrent_sessions=3,
        turns_min=2,
        turns_max=3,
        user_turn_tokens=32,
        assistant_turn_tokens=0,
        one_off_share=0.1,
        one_off_tokens=64,
        max_prompt_tokens=1000,
    )
    blocks = [
        cachesim.RequestBlocks(b.index, 0, b.prompt_tokens, b.keys, b.loadable)
        for b in cachesim.trace_blocks(generate(spec), 32)
    ]
    unbounded = cachesim.simulate(blocks, 1, 10**6).block_hit_rate
    cap = cachesim.budget_for_shared_hit_rate(blocks, 0.8)
    assert cachesim.simulate(blocks, 1, cap).block_hit_rate >= 0.8 * unbounded
    assert cachesim.simulate(blocks, 1, cap - 1).block_hit_rate < 0.8 * unbounded
    with pytest.raises(ValueError):
        cachesim.budget_for_shared_hit_rate(blocks, 0.0)
