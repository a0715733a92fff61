"""LRUPolicy: recency order, pinned keys, bookkeeping, and the make_policy factory."""

import numpy as np
import pytest

from pegaflow.server.policy import EvictionPolicy, LRUPolicy, make_policy


def never(_key):
    return False


def evict_all(policy, skip=never):
    order = []
    while (victim := policy.next_victim(skip)) is not None:
        order.append(victim)
        policy.on_remove(victim)
    return order


def test_evicts_in_insertion_order_without_hits():
    policy = LRUPolicy()
    for i in range(5):
        policy.on_insert(i, 100)
    assert evict_all(policy) == [0, 1, 2, 3, 4]
    assert len(policy) == 0
    assert policy.resident_bytes == 0


def test_hit_makes_key_most_recent():
    policy = LRUPolicy()
    for i in range(4):
        policy.on_insert(i, 10)
    policy.on_access(0)
    policy.on_access(2)
    assert evict_all(policy) == [1, 3, 0, 2]


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "tinylfu"])
def test_a_batch_of_accesses_is_the_same_accesses_one_by_one(lfu):
    """on_access_many (a lookup's hits in one call) leaves the policy as on_access per key would."""
    rng = np.random.default_rng(7)
    one, batch = make_policy(lfu, capacity_bytes=1000), make_policy(lfu, capacity_bytes=1000)
    assert isinstance(one, LRUPolicy) != lfu
    for policy in (one, batch):
        for i in range(40):
            policy.on_insert(i, 10)
    for _ in range(30):
        keys = [int(k) for k in rng.integers(0, 50, size=int(rng.integers(1, 12)))]  # 40..49: absent
        for key in keys:
            one.on_access(key)
        batch.on_access_many(keys)
    assert evict_all(batch) == evict_all(one)


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "w-tinylfu"])
def test_victims_in_batches_are_the_victims_one_by_one(lfu):
    """next_victims + on_remove_many (the store's batched eviction) evict in the order next_victim +
    on_remove would, skipping the same pinned keys; W-TinyLFU gives one at a time."""
    rng = np.random.default_rng(11)
    one, batch = make_policy(lfu, capacity_bytes=1000), make_policy(lfu, capacity_bytes=1000)
    hits = [int(k) for k in rng.integers(0, 60, size=40)]
    for policy in (one, batch):
        for i in range(60):
            policy.on_insert(i, 10)
        for key in hits:
            policy.on_access(key)
    pinned = {3, 4, 5, 17, 40}.__contains__
    got, want = [], evict_all(one, skip=pinned)
    while victims := batch.next_victims(7, pinned):
        assert len(victims) <= (1 if lfu else 7)
        got += victims
        batch.on_remove_many(victims)
    assert got == want and len(got) == 55
    assert batch.next_victims(3, pinned) == [] and len(batch) == 5


def test_a_batch_of_victims_does_not_remove_them_and_rotates_the_skipped():
    policy = LRUPolicy()
    for i in range(6):
        policy.on_insert(i, 1)
    assert policy.next_victims(3, {0, 2}.__contains__) == [1, 3, 4]
    assert policy.next_victims(3, never) == [1, 3, 4] and len(policy) == 6  # none removed
    policy.on_remove_many([1, 3, 4])
    assert policy.next_victims(3, never) == [5, 0, 2]  # 0 and 2, passed over, went to the recent end
    assert len(policy) == 3 and policy.next_victims(0, never) == []


def test_next_victim_does_not_remove():
    policy = LRUPolicy()
    policy.on_insert("a", 1)
    assert policy.next_victim(never) == "a"
    assert policy.next_victim(never) == "a"
    assert "a" in policy


def test_skipped_keys_are_never_returned():
    policy = LRUPolicy()
    for i in range(10):
        policy.on_insert(i, 1)
    pinned = {0, 1, 2, 7}
    order = evict_all(policy, skip=pinned.__contains__)
    assert set(order) == set(range(10)) - pinned
    assert order == [3, 4, 5, 6, 8, 9]
    assert set(iter(policy._recency)) == pinned


def test_everything_pinned_returns_none():
    policy = LRUPolicy()
    for i in range(3):
        policy.on_insert(i, 1)
    assert policy.next_victim(lambda _k: True) is None
    assert len(policy) == 3


def test_empty_policy_returns_none():
    assert LRUPolicy().next_victim(never) is None


def test_many_pinned_keys_at_cold_end_are_not_rescanned():
    # 5000 pinned keys sit at the cold end; evicting the 5000 unpinned ones behind them
    # must not rescan the pinned run each time (that would be 25M skip calls).
    policy = LRUPolicy()
    pinned_count, free_count = 5000, 5000
    for i in range(pinned_count + free_count):
        policy.on_insert(i, 1)
    calls = 0

    def skip(key):
        nonlocal calls
        calls += 1
        return key < pinned_count

    order = evict_all(policy, skip)
    assert order == list(range(pinned_count, pinned_count + free_count))
    # Each pinned key is passed over a bounded number of times; the final None sweep adds one pass.
    assert calls <= 3 * (pinned_count + free_count)


def test_unpinned_key_becomes_evictable_again():
    policy = LRUPolicy()
    for i in range(3):
        policy.on_insert(i, 1)
    pinned = {0}
    assert policy.next_victim(pinned.__contains__) == 1
    pinned.clear()
    victims = evict_all(policy)
    assert sorted(victims) == [0, 1, 2]


def test_unknown_keys_are_ignored_by_access_and_remove():
    policy = LRUPolicy()
    policy.on_insert("a", 5)
    policy.on_access("zzz")
    policy.on_remove("zzz")
    assert len(policy) == 1
    assert policy.resident_bytes == 5


def test_reinsert_updates_size_and_recency():
    policy = LRUPolicy()
    policy.on_insert("a", 5)
    policy.on_insert("b", 5)
    policy.on_insert("a", 7)
    assert len(policy) == 2
    assert policy.resident_bytes == 12
    assert policy.next_victim(never) == "b"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", None, True])
def test_bad_sizes_are_rejected(bad):
    policy = LRUPolicy()
    with pytest.raises((TypeError, ValueError)):
        policy.on_insert("a", bad)
    assert len(policy) == 0


def test_numpy_sizes_are_accepted():
    policy = LRUPolicy()
    policy.on_insert("a", np.int64(4096))
    assert policy.resident_bytes == 4096
    assert type(policy.resident_bytes) is int


def test_record_lookups_does_not_change_order():
    policy = LRUPolicy()
    for i in range(3):
        policy.on_insert(i, 1)
    policy.record_lookups([0, 0, 0, 99])
    assert policy.next_victim(never) == 0


def test_factory_returns_lru_by_default():
    policy = make_policy(enable_lfu_admission=False, capacity_bytes=1 << 20)
    assert isinstance(policy, LRUPolicy)
    assert isinstance(policy, EvictionPolicy)
    assert policy.name == "lru"
    assert policy.admission_rejections == 0


@pytest.mark.parametrize("bad", [0, -5, "1gb"])
def test_factory_rejects_bad_capacity(bad):
    with pytest.raises((TypeError, ValueError)):
        make_policy(enable_lfu_admission=False, capacity_bytes=bad)


def test_abc_cannot_be_instantiated_without_methods():
    class Partial(EvictionPolicy):
        name = "partial"

    with pytest.raises(TypeError):
        Partial()
