"""WTinyLFUPolicy: regions, admission duel, pinned keys, capacity tracking, lookup buffering."""

import threading

import pytest

from pegaflow.server.policy import EvictionPolicy, make_policy
from pegaflow.server.policy.tinylfu import WTinyLFUPolicy


def never(_key):
    return False


def policy(capacity=100, **kw):
    kw.setdefault("salt", 1)
    kw.setdefault("lookup_batch", 1)
    return WTinyLFUPolicy(capacity, **kw)


def test_factory_returns_wtinylfu_when_admission_is_enabled():
    p = make_policy(enable_lfu_admission=True, capacity_bytes=1 << 30)
    assert isinstance(p, WTinyLFUPolicy)
    assert isinstance(p, EvictionPolicy)
    assert p.name == "w-tinylfu"
    assert p.admission_rejections == 0


def test_new_keys_enter_the_window_and_spill_to_probation_while_there_is_room():
    p = policy(100, window_fraction=0.05)
    p.on_insert("a", 5)
    assert p.region_of("a") == "window"
    p.on_insert("b", 5)
    # The window (5 bytes) overflowed: its coldest key moved to probation for free.
    assert p.region_of("a") == "probation"
    assert p.region_of("b") == "window"
    assert p.region_bytes() == {"window": 5, "probation": 5, "protected": 0}
    p.check_invariants()


def test_a_hit_in_probation_promotes_and_protected_overflow_demotes():
    p = policy(100, window_fraction=0.05, protected_fraction=0.2)  # protected budget: int(95 * 0.2) = 19
    for k in "abcdef":
        p.on_insert(k, 10)
    p.on_access("a")
    assert p.region_of("a") == "protected"
    p.on_access("b")
    # 20 bytes > 19: the coldest protected key falls back to probation.
    assert [p.region_of(k) for k in "ab"] == ["probation", "protected"]
    p.on_access("b")
    assert p.region_of("b") == "protected"
    p.on_access("c")
    assert [p.region_of(k) for k in "abc"] == ["probation", "probation", "protected"]
    p.check_invariants()


def test_candidate_that_loses_is_evicted_and_counted_once():
    p = policy(100, window_fraction=0.1, adaptive_window=False)
    for k in range(10):  # fills the main region (90 bytes) through the window
        p.on_insert(k, 10)
        p.record_lookups([k] * 5)
    p.on_insert("new", 10)
    assert p.region_of("new") == "window"
    p.on_insert("newer", 10)  # window now 20 > 10 and main is full: "new" waits in the window
    p.record_lookups(["new"])
    victim = p.next_victim(never)
    assert victim == "new"
    assert p.admission_rejections == 1
    # Asked again before the engine removed it: same answer, not counted twice.
    assert p.next_victim(never) == "new"
    assert p.admission_rejections == 1
    p.on_remove("new")
    assert "new" not in p
    p.check_invariants()


def test_candidate_that_wins_moves_to_probation_and_the_victim_is_returned():
    p = policy(100, window_fraction=0.1, adaptive_window=False)
    for k in range(10):
        p.on_insert(k, 10)
    p.on_insert("hot", 10)
    p.on_insert("newer", 10)
    p.record_lookups(["hot"] * 6)
    victim = p.next_victim(never)
    assert victim == 0  # the coldest probation key
    assert p.region_of("hot") == "probation"
    assert p.admission_rejections == 0
    p.on_remove(victim)
    p.check_invariants()


def test_pinned_keys_are_never_returned():
    p = policy(100, window_fraction=0.1, adaptive_window=False)
    for k in range(12):
        p.on_insert(k, 10)
    pinned = {0, 1, 10}
    seen = []
    while (v := p.next_victim(pinned.__contains__)) is not None:
        assert v not in pinned
        seen.append(v)
        p.on_remove(v)
    assert set(seen) == set(range(12)) - pinned
    assert len(p) == 3
    assert p.next_victim(lambda _k: True) is None
    p.check_invariants()


def test_frequent_keys_survive_a_scan():
    p = policy(1000, adaptive_window=False)
    resident = {}

    def access(k):
        p.record_lookups([k])
        if k in resident:
            p.on_access(k)
            return True
        while sum(resident.values()) + 10 > 1000:
            v = p.next_victim(never)
            del resident[v]
            p.on_remove(v)
        resident[k] = 10
        p.on_insert(k, 10)
        return False

    for _ in range(5):
        for k in range(50):
            access(("hot", k))
    for k in range(5000):
        access(("scan", k))
    survivors = sum(("hot", k) in resident for k in range(50))
    assert survivors == 50
    assert p.admission_rejections > 4000


def test_effective_capacity_follows_the_engine_when_it_is_full_early():
    # The policy was told 1000 bytes but the engine is full at 500 (fragmentation):
    # the window must shrink to ~1% of 500, so admission still filters.
    p = policy(1000, adaptive_window=False)
    for k in range(50):
        p.on_insert(k, 10)
    assert p.region_bytes()["window"] <= 10
    for k in range(50, 60):
        p.record_lookups([k])
        v = p.next_victim(never)
        p.on_remove(v)
        p.on_insert(k, 10)
    assert p._effective_capacity == 500
    assert p.admission_rejections >= 1
    p.check_invariants()


def test_effective_capacity_grows_back_with_inserts():
    p = policy(100, adaptive_window=False)
    for k in range(10):
        p.on_insert(k, 10)
    p.on_remove(p.next_victim(never))
    assert p._effective_capacity == 100
    for k in range(10, 15):
        p.on_insert(k, 10)
    assert p._effective_capacity == 140


def test_lookups_are_buffered_until_a_batch_or_a_decision():
    p = policy(1000, lookup_batch=4)
    p.record_lookups(["a", "a"])
    assert p._admission.samples == 0
    p.record_lookups(["a", "b"])
    assert p._admission.samples == 4
    assert p.frequency("a") == 3
    p.record_lookups(["b"])
    assert p.frequency("b") == 2  # frequency() drains the buffer first


def test_reinsert_and_unknown_keys():
    p = policy(100)
    p.on_insert("a", 5)
    p.on_insert("a", 7)
    assert len(p) == 1 and p.resident_bytes == 7
    p.on_access("zzz")
    p.on_remove("zzz")
    assert len(p) == 1
    p.check_invariants()


def test_empty_policy_and_empty_lookups():
    p = policy(100)
    p.record_lookups([])
    assert p.next_victim(never) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_bytes": 0},
        {"capacity_bytes": 100, "window_fraction": 0.0},
        {"capacity_bytes": 100, "window_fraction": 1.0},
        {"capacity_bytes": 100, "protected_fraction": 1.5},
        {"capacity_bytes": 100, "lookup_batch": 0},
    ],
)
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises((TypeError, ValueError)):
        WTinyLFUPolicy(**kwargs)


def test_bad_sizes_are_rejected():
    p = policy(100)
    for bad in (0, -1, 2.5, None):
        with pytest.raises((TypeError, ValueError)):
            p.on_insert("a", bad)
    assert len(p) == 0


def test_concurrent_use_keeps_bookkeeping_consistent():
    p = WTinyLFUPolicy(10_000, salt=3, lookup_batch=64)
    resident = set()
    engine_lock = threading.Lock()
    errors = []

    def engine(worker):
        try:
            for i in range(3000):
                key = (worker, i % 700)
                p.record_lookups([key, (worker, i % 13)])
                with engine_lock:
                    if key in resident:
                        p.on_access(key)
                        continue
                    while len(resident) >= 500:
                        v = p.next_victim(never)
                        assert v in resident
                        resident.discard(v)
                        p.on_remove(v)
                    resident.add(key)
                    p.on_insert(key, 20)
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    def reader():
        for i in range(20_000):
            p.record_lookups([("r", i % 50)])

    threads = [threading.Thread(target=engine, args=(w,)) for w in range(3)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    p.check_invariants()
    assert {k for k in resident} == {k for r in (p._window, p._probation, p._protected) for k in r}


def test_a_refresh_renews_recency_within_the_region_without_promoting():
    p = policy(100, window_fraction=0.05, adaptive_window=False)
    for k in "abcdef":
        p.on_insert(k, 10)
    assert p.region_of("a") == "probation"
    p.on_refresh("a")
    assert p.region_of("a") == "probation"  # a hit would have promoted it
    # ... but it is now the most recent of probation: the next main victim is "b", not "a"
    assert p._probation.coldest() == "b"
    p.on_refresh("not-resident")  # ignored
    p.check_invariants()
