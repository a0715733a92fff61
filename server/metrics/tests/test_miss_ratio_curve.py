"""MissRatioCurve (SHARDS): exact at rate 1 against a byte-LRU simulation, accurate when sampled,
bounded memory, windows, compaction, bad input."""

from __future__ import annotations

import collections
import tracemalloc

import numpy as np
import pytest

from pegaflow.server.metrics.miss_ratio_curve import (
    EDGE_FACTORS,
    POOL_FACTORS,
    MissRatioCurve,
)

WINDOWS = {"15m": 900.0, "1h": 3600.0}


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def byte_lru_hit_rate(keys: list[bytes], sizes: list[int], capacity: int) -> float:
    """LRU of ``capacity`` bytes, blocks of mixed sizes: a miss inserts, evicting the least recently
    used blocks until the new one fits (what the pool's LRU does, slabs aside)."""
    resident: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    used = hits = 0
    for key, size in zip(keys, sizes, strict=True):
        if key in resident:
            resident.move_to_end(key)
            hits += 1
            continue
        if size > capacity:
            continue
        while used + size > capacity:
            used -= resident.popitem(last=False)[1]
        resident[key] = size
        used += size
    return hits / len(keys)


def zipf_trace(n: int, distinct: int, seed: int, skew: float = 1.1) -> tuple[list[bytes], list[int]]:
    """Block keys with Zipf popularity and two block sizes (4 KiB and 12 KiB, by key)."""
    rng = np.random.default_rng(seed)
    ranks = (rng.zipf(skew, size=n) - 1) % distinct
    keys = [(int(r) % 3).to_bytes(4, "little") + int(r).to_bytes(16, "big") for r in ranks]
    sizes = [4096 if k[0] else 12288 for k in keys]
    return keys, sizes


def distinct_bytes(keys: list[bytes], sizes: list[int]) -> int:
    return sum(dict(zip(keys, sizes, strict=True)).values())


def feed(mrc: MissRatioCurve, keys: list[bytes], sizes: list[int], batch: int = 500) -> None:
    for i in range(0, len(keys), batch):
        mrc.add(keys[i : i + batch], sizes[i : i + batch])


@pytest.mark.parametrize("max_keys", [1 << 20, 8000])  # 8000: compactions happen (4 x 8000 slots)
def test_exact_at_rate_one_against_byte_lru(max_keys):
    keys, sizes = zipf_trace(60_000, 6_000, seed=1)
    capacity = distinct_bytes(keys, sizes) // 8
    mrc = MissRatioCurve(capacity, WINDOWS, max_keys=max_keys, max_rate=1.0, max_sampled_per_s=1e12)
    feed(mrc, keys, sizes)
    assert mrc.rate == 1.0 and mrc.sampled_requests == len(keys)
    if max_keys == 8000:
        assert mrc.compactions >= 1
    predicted = mrc.predicted_hit_rates("15m")
    for factor in POOL_FACTORS:
        exact = byte_lru_hit_rate(keys, sizes, int(factor * capacity))
        assert predicted[factor] == pytest.approx(exact, abs=1e-9), factor


def test_sampled_fixed_size_stays_within_two_points_on_average_over_salts():
    # One salt's error is luck (a few hot keys in or out of the sample): bound the mean over four
    # salts, and the worst of them more loosely (bench/mrc_check.py --sweep measures the spread).
    keys, sizes = zipf_trace(200_000, 40_000, seed=2)
    capacity = distinct_bytes(keys, sizes) // 8
    exact = {f: byte_lru_hit_rate(keys, sizes, int(f * capacity)) for f in POOL_FACTORS}
    errors = []
    for salt in range(4):
        mrc = MissRatioCurve(
            capacity, WINDOWS, max_keys=2048, max_rate=1.0, max_sampled_per_s=1e12, salt=0x9E37 * (salt + 1)
        )
        feed(mrc, keys, sizes, batch=2000)
        # Fixed size: the sample shrank to 2048 keys and the rate adapted down.
        assert mrc.tracked_keys <= 2048 and mrc.rate < 0.1
        predicted = mrc.predicted_hit_rates("15m")
        errors.append(max(abs(predicted[f] - exact[f]) for f in POOL_FACTORS))
    assert sum(errors) / len(errors) < 0.02 and max(errors) < 0.03, errors


def test_curve_is_monotone_and_spans_the_edges():
    keys, sizes = zipf_trace(30_000, 5_000, seed=3)
    mrc = MissRatioCurve(distinct_bytes(keys, sizes) // 4, WINDOWS, max_rate=0.5, max_sampled_per_s=1e12)
    feed(mrc, keys, sizes)
    curve = mrc.curve("15m")
    assert [f for f, _ in curve] == list(EDGE_FACTORS)
    rates = [r for _, r in curve]
    assert all(b >= a for a, b in zip(rates, rates[1:], strict=False))
    # At 16x the pool everything fits: only first requests miss (the exact ceiling).
    ceiling = 1 - len(set(keys)) / len(keys)
    assert rates[-1] == pytest.approx(ceiling, abs=0.02)


def test_memory_is_bounded_by_max_keys():
    max_keys = 2048
    rng = np.random.default_rng(4)
    batches = [[rng.bytes(20) for _ in range(5_000)] for _ in range(12)]  # 30x what may be tracked
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        mrc = MissRatioCurve(1 << 30, WINDOWS, max_keys=max_keys, max_rate=1.0, max_sampled_per_s=1e12)
        for keys in batches:
            mrc.add(keys, [8192] * len(keys))
        del batches
        held = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert mrc.tracked_keys <= max_keys
    assert 0 < mrc.rate < 0.1
    # What the metric exports is within 2x of what is really held (keys included), and both are small.
    estimate = mrc.memory_bytes()
    assert estimate / 2 < held < 2 * estimate, (held, estimate)
    assert estimate < 2 * 1024 * 1024


def test_cpu_budget_lowers_the_rate_and_keeps_the_estimate():
    clock = FakeClock()
    keys, sizes = zipf_trace(100_000, 8_000, seed=5)
    capacity = distinct_bytes(keys, sizes) // 8
    mrc = MissRatioCurve(capacity, WINDOWS, max_rate=1.0, max_sampled_per_s=1000, clock=clock)
    for i in range(0, len(keys), 1000):
        mrc.add(keys[i : i + 1000], sizes[i : i + 1000])
        clock.now += 0.5  # 2000 requests per second offered, all sampled at R = 1
    # The budget halved R within the first period, and the sampled rate then stayed within it.
    assert 0.3 < mrc.rate <= 0.5
    assert mrc.sampled_requests <= 1000 * 50 * 1.1 + 20_000
    predicted = mrc.predicted_hit_rates("15m")
    for factor in POOL_FACTORS:
        assert abs(predicted[factor] - byte_lru_hit_rate(keys, sizes, int(factor * capacity))) < 0.03


def test_windows_forget_old_requests_but_keep_reuse_state():
    clock = FakeClock()
    mrc = MissRatioCurve(1 << 20, WINDOWS, max_rate=1.0, clock=clock)
    keys = [b"k%04d" % i for i in range(100)]
    mrc.add(keys, [4096] * 100)  # all cold
    assert mrc.predicted_hit_rates("15m")[1.0] == 0.0
    clock.now += 1000  # past the 15m window, inside 1h
    mrc.add(keys, [4096] * 100)  # all reuses at 400 KiB: misses at 0.25x (256 KiB), hits from 0.5x
    assert mrc.predicted_hit_rates("15m") == {0.25: 0.0, 0.5: 1.0, 1.0: 1.0, 2.0: 1.0, 4.0: 1.0}
    assert mrc.predicted_hit_rates("1h")[1.0] == 0.5
    clock.now += 4000
    assert mrc.predicted_hit_rates("1h") == {}


def test_distance_is_in_bytes_across_sizes():
    # Key a (4 KiB) reused after 3 distinct blocks of 64 KiB: a pool must hold 196 KiB + 4 KiB.
    mrc = MissRatioCurve(200 * 1024, WINDOWS, max_rate=1.0)
    mrc.add([b"a", b"x", b"y", b"z", b"a"], [4096, 65536, 65536, 65536, 4096])
    predicted = mrc.predicted_hit_rates("15m", factors=(0.5, 1.0))
    assert predicted == {0.5: 0.0, 1.0: pytest.approx(1 / 5)}


def test_bad_input_is_refused_and_changes_nothing():
    with pytest.raises(ValueError):
        MissRatioCurve(0, WINDOWS)
    with pytest.raises(ValueError):
        MissRatioCurve(1024, {})
    with pytest.raises(ValueError):
        MissRatioCurve(1024, WINDOWS, max_rate=0)
    mrc = MissRatioCurve(1024, WINDOWS, max_rate=1.0)
    with pytest.raises(ValueError):
        mrc.add([b"a", b"b"], [1])
    with pytest.raises(ValueError):
        mrc.add([b"a"], [0])
    with pytest.raises(TypeError):
        mrc.add(["a"], [1])
    with pytest.raises(KeyError):
        mrc.predicted_hit_rates("5m")
    with pytest.raises(ValueError):
        mrc.predicted_hit_rates("15m", factors=(3.0,))
    with pytest.raises(ValueError):
        MissRatioCurve(1024, WINDOWS, max_sampled_per_s=0)
    assert mrc.requests == 0 and mrc.tracked_keys == 0 and mrc.predicted_hit_rates("15m") == {}


def test_staged_requests_land_in_the_bucket_of_their_time_even_with_no_read_between():
    clock = FakeClock(now=0.0)
    mrc = MissRatioCurve(1 << 20, {"w": 60.0}, clock=clock)  # 15 buckets of 4 s
    mrc.add([b"a%d" % i for i in range(100)], [4096] * 100)
    clock.now = 5.0
    mrc.add([b"b%d" % i for i in range(30)], [4096] * 30)
    clock.now = 60.5  # the t=0 bucket has left the window, the t=5 one has not
    hist, requests = mrc.distance_histogram("w")
    assert requests == 30 and hist.sum() == pytest.approx(30)
