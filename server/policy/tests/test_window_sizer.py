"""WindowSizer and GhostList: ghost hits move the window's share of capacity, ARC-style."""

import pytest

from pegaflow.server.policy.key_hash import salted_hash
from pegaflow.server.policy.window_sizer import MIN_GENERATION_KEYS, GhostList, WindowSizer


def h(key):
    return salted_hash(key, 17)


def sizer(**kw):
    kw.setdefault("min_fraction", 0.01)
    kw.setdefault("max_fraction", 0.99)
    return WindowSizer(kw.pop("initial_fraction", 0.01), **kw)


def test_a_plain_miss_changes_nothing():
    s = sizer()
    assert s.record_insert(h("new"), 10, 1000) is False
    assert s.fraction == 0.01


def test_miss_on_a_key_the_window_evicted_grows_the_window():
    s = sizer()
    s.record_eviction(h("a"), 10, from_window=True, resident_keys=100)
    assert s.record_insert(h("a"), 10, 1000) is True
    assert s.fraction == pytest.approx(0.02)
    assert s.grows == 1


def test_miss_on_a_key_the_main_region_evicted_shrinks_the_window():
    s = sizer(initial_fraction=0.5)
    s.record_eviction(h("m"), 10, from_window=False, resident_keys=100)
    assert s.record_insert(h("m"), 10, 1000) is True
    assert s.fraction == pytest.approx(0.49)
    assert s.shrinks == 1


def test_step_scales_with_the_ghost_size_ratio():
    s = sizer(initial_fraction=0.5)
    s.record_eviction(h("w"), 10, from_window=True, resident_keys=100)
    for i in range(4):
        s.record_eviction(h(("m", i)), 10, from_window=False, resident_keys=100)
    s.record_insert(h("w"), 10, 1000)  # main ghost 4x the window ghost: step 4 x 10 bytes
    assert s.fraction == pytest.approx(0.54)
    s.record_insert(h(("m", 0)), 10, 1000)  # window ghost smaller: plain step of 10 bytes
    assert s.fraction == pytest.approx(0.53)


def test_fraction_is_clamped():
    s = sizer(initial_fraction=0.98)
    s.record_eviction(h("a"), 500, from_window=True, resident_keys=10)
    assert s.record_insert(h("a"), 500, 1000) is True
    assert s.fraction == 0.99
    assert s.record_insert(h("a"), 500, 1000) is False  # already at the maximum
    s = sizer()
    s.record_eviction(h("b"), 500, from_window=False, resident_keys=10)
    assert s.record_insert(h("b"), 500, 1000) is False
    assert s.fraction == 0.01


def test_fixed_window_when_min_equals_max():
    s = sizer(max_fraction=0.01)
    s.record_eviction(h("a"), 10, from_window=True, resident_keys=10)
    assert s.record_insert(h("a"), 10, 1000) is False
    assert s.fraction == 0.01


@pytest.mark.parametrize("bounds", [(0.0, 0.01, 0.8), (0.02, 0.01, 0.8), (0.01, 0.9, 0.8), (0.01, 0.01, 1.0)])
def test_bad_bounds_are_rejected(bounds):
    lo, init, hi = bounds
    with pytest.raises(ValueError):
        WindowSizer(init, min_fraction=lo, max_fraction=hi)


def test_ghost_remembers_one_to_two_generations():
    ghost = GhostList()
    n = MIN_GENERATION_KEYS
    for i in range(n):
        ghost.add(h(("g0", i)), 1, resident_keys=n)
    for i in range(n):
        ghost.add(h(("g1", i)), 1, resident_keys=n)
    assert all(h(("g0", i)) in ghost for i in range(n))
    assert ghost.nbytes == 2 * n
    for i in range(n):
        ghost.add(h(("g2", i)), 1, resident_keys=n)
    # g0 has left (up to Bloom false positives), g1 and g2 remain.
    assert sum(h(("g0", i)) in ghost for i in range(n)) < 0.1 * n
    assert all(h(("g1", i)) in ghost for i in range(n))
    assert all(h(("g2", i)) in ghost for i in range(n))
    assert ghost.nbytes == 2 * n


def test_ghost_generations_follow_the_resident_key_count():
    ghost = GhostList()
    n = MIN_GENERATION_KEYS
    for i in range(n + 1):  # the (n+1)-th add opens a generation sized for 10n keys
        ghost.add(h(i), 1, resident_keys=10 * n)
    for i in range(n + 1, 10 * n):
        ghost.add(h(i), 1, resident_keys=10 * n)
    assert all(h(i) in ghost for i in range(10 * n))
    assert ghost.memory_bytes >= 10 * n  # ~1 byte per key per generation
