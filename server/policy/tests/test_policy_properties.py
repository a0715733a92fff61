"""Property tests for both policies under random operation sequences (hypothesis).

Checked after every step: a victim is resident and not pinned; next_victim only
returns None when every resident key is pinned; the policy tracks exactly the
resident keys and their bytes.
"""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from pegaflow.server.policy.lru import LRUPolicy
from pegaflow.server.policy.tinylfu import WTinyLFUPolicy

# Hypothesis caches under ./.hypothesis by default, and tests may only write under their temp dir.
# Set at import: the cache is first written while the tests are being collected.
_HYPOTHESIS_HOME = tempfile.TemporaryDirectory(prefix="hypothesis-", dir=os.environ.get("TEST_TMPDIR"))
set_hypothesis_home_dir(_HYPOTHESIS_HOME.name)

KEYS = st.integers(min_value=0, max_value=40)
SIZES = st.integers(min_value=1, max_value=9)

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), KEYS, SIZES),
        st.tuples(st.just("access"), KEYS),
        st.tuples(st.just("remove"), KEYS),
        st.tuples(st.just("lookup"), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("evict"), st.frozensets(KEYS, max_size=12)),
    ),
    max_size=150,
)

POLICIES = {
    "lru": lambda: LRUPolicy(),
    "w-tinylfu": lambda: WTinyLFUPolicy(60, salt=3, lookup_batch=3),
    "w-tinylfu-fixed-window": lambda: WTinyLFUPolicy(60, salt=3, lookup_batch=1, adaptive_window=False),
    "w-tinylfu-large-window": lambda: WTinyLFUPolicy(60, salt=3, window_fraction=0.3),
}

# Deterministic (fixed seed), and no example database written into the working directory.
PROPERTY_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def check_consistent(policy, resident):
    assert len(policy) == len(resident)
    assert policy.resident_bytes == sum(resident.values())
    for key in resident:
        assert key in policy
    if isinstance(policy, WTinyLFUPolicy):
        policy.check_invariants()


def run(policy, operations):
    resident = {}
    for op in operations:
        kind = op[0]
        if kind == "insert":
            _, key, size = op
            policy.on_insert(key, size)
            resident[key] = size
        elif kind == "access":
            policy.on_access(op[1])
        elif kind == "remove":
            policy.on_remove(op[1])
            resident.pop(op[1], None)
        elif kind == "lookup":
            policy.record_lookups(op[1])
        else:
            pinned = op[1]
            victim = policy.next_victim(pinned.__contains__)
            if victim is None:
                assert all(key in pinned for key in resident)
            else:
                assert victim in resident
                assert victim not in pinned
                policy.on_remove(victim)
                del resident[victim]
        check_consistent(policy, resident)
    # Draining everything unpinned returns each resident key exactly once.
    drained = []
    while (victim := policy.next_victim(lambda _k: False)) is not None:
        assert victim in resident and victim not in drained
        drained.append(victim)
        policy.on_remove(victim)
    assert sorted(drained) == sorted(resident)
    check_consistent(policy, {})


@pytest.mark.parametrize("which", sorted(POLICIES))
def test_random_operation_sequences_keep_the_contract(which):
    @PROPERTY_SETTINGS
    @given(OPERATIONS)
    def check(operations):
        run(POLICIES[which](), operations)

    check()


@PROPERTY_SETTINGS
@given(st.lists(st.tuples(KEYS, SIZES), min_size=1, max_size=60), st.frozensets(KEYS))
def test_cache_fill_and_evict_loop_never_returns_pinned_keys(blocks, pinned):
    # The engine's loop: evict until the new block fits in 50 bytes, then insert.
    for policy in (LRUPolicy(), WTinyLFUPolicy(50, salt=5, lookup_batch=1)):
        resident = {}
        for key, size in blocks:
            policy.record_lookups([key])
            if key in resident:
                policy.on_access(key)
                continue
            while sum(resident.values()) + size > 50:
                victim = policy.next_victim(pinned.__contains__)
                if victim is None:
                    break
                assert victim in resident and victim not in pinned
                del resident[victim]
                policy.on_remove(victim)
            else:
                resident[key] = size
                policy.on_insert(key, size)
        check_consistent(policy, resident)


BATCHED_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.tuples(KEYS, SIZES), max_size=8)),
        st.tuples(st.just("refresh"), st.lists(KEYS, max_size=8)),
        st.tuples(st.just("access"), KEYS),
        st.tuples(st.just("remove"), KEYS),
        st.tuples(st.just("lookup"), st.lists(KEYS, max_size=6)),
    ),
    max_size=60,
)


def drain(policy) -> list:
    order = []
    while (victim := policy.next_victim(lambda _k: False)) is not None:
        order.append(victim)
        policy.on_remove(victim)
    return order


@pytest.mark.parametrize("which", sorted(POLICIES))
def test_batched_inserts_and_refreshes_equal_the_calls_one_by_one(which):
    # The block store tells a seal's chain as on_insert_many / on_refresh_many runs: a policy that
    # overrides them (LRU: one lock per run) must end in the state the single calls leave, re-inserts
    # of resident keys (a new size) and a key named twice in one run included.
    @PROPERTY_SETTINGS
    @given(BATCHED_OPERATIONS)
    def check(operations):
        batched, single = POLICIES[which](), POLICIES[which]()
        for op in operations:
            kind = op[0]
            if kind == "insert":
                batched.on_insert_many(op[1])
                for key, size in op[1]:
                    single.on_insert(key, size)
            elif kind == "refresh":
                batched.on_refresh_many(op[1])
                for key in op[1]:
                    single.on_refresh(key)
            else:
                for policy in (batched, single):
                    {"access": policy.on_access, "remove": policy.on_remove, "lookup": policy.record_lookups}[
                        kind
                    ](op[1])
            assert len(batched) == len(single) and batched.resident_bytes == single.resident_bytes
        assert drain(batched) == drain(single)

    check()


def test_lru_batched_insert_checks_sizes_like_a_single_insert():
    policy = LRUPolicy()
    with pytest.raises(ValueError):
        policy.on_insert_many([(1, 4), (2, 0)])
    with pytest.raises(TypeError):
        policy.on_insert_many([(1, True)])
    assert len(policy) == 0  # a refused batch inserts nothing
