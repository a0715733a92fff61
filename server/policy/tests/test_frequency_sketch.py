"""FrequencySketch: count-min estimates, saturation, aging, growth, and the scalar fast path."""

import numpy as np
import pytest

from pegaflow.server.policy.frequency_sketch import DEPTH, MAX_COUNT, FrequencySketch
from pegaflow.server.policy.key_hash import salted_hashes


def hashes(keys, salt=99):
    return salted_hashes(list(keys), salt)


def test_unseen_keys_estimate_zero():
    sketch = FrequencySketch(1000)
    assert sketch.estimate(hashes(range(100))).tolist() == [0] * 100


def test_estimate_is_never_below_the_true_count():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2000, size=20_000)
    sketch = FrequencySketch(2000)
    for batch in np.array_split(keys, 37):
        sketch.increment(hashes(batch.tolist()))
    truth = np.bincount(keys, minlength=2000)
    est = sketch.estimate(hashes(range(2000))).astype(np.int64)
    assert np.all(est >= np.minimum(truth, MAX_COUNT))


def test_estimates_are_mostly_exact_at_design_load():
    # 2000 keys, each seen 1..5 times, in a sketch sized for 2000 keys: collisions in all 4 rows are rare.
    rng = np.random.default_rng(1)
    truth = rng.integers(1, 6, size=2000)
    sketch = FrequencySketch(2000)
    sketch.increment(hashes(np.repeat(np.arange(2000), truth).tolist()))
    est = sketch.estimate(hashes(range(2000))).astype(np.int64)
    assert np.mean(est == truth) > 0.95


def test_counters_saturate_at_fifteen():
    sketch = FrequencySketch(100)
    h = hashes([7])
    for _ in range(40):
        sketch.increment(h)
    assert int(sketch.estimate(h)[0]) == MAX_COUNT


def test_batch_duplicates_and_explicit_counts_add_up():
    sketch = FrequencySketch(100)
    h = hashes(["a", "b"])
    sketch.increment(np.concatenate([h, h[:1], h[:1]]))
    sketch.increment(h, counts=np.array([2, 5]))
    assert sketch.estimate(h).tolist() == [5, 6]
    sketch.increment(h[:1], counts=np.array([100]))
    assert int(sketch.estimate(h[:1])[0]) == MAX_COUNT


def test_age_halves_every_counter():
    sketch = FrequencySketch(100)
    h = hashes(range(3))
    sketch.increment(h, counts=np.array([15, 6, 1]))
    sketch.age()
    assert sketch.estimate(h).tolist() == [7, 3, 0]


def test_scalar_estimate_matches_batch_estimate():
    sketch = FrequencySketch(500)
    h = hashes(range(1000))
    sketch.increment(h[:700])
    sketch.increment(h[:300])
    assert [sketch.estimate_one(int(x)) for x in h] == sketch.estimate(h).tolist()


def test_capacity_sizes_the_table_and_growth_resets_it():
    sketch = FrequencySketch(1000)
    assert sketch.width == 2048
    assert sketch.memory_bytes == DEPTH * 2048
    assert sketch.sample_size == 10_000
    h = hashes(range(10))
    sketch.increment(h)
    assert sketch.ensure_capacity(500) is False
    assert sketch.estimate(h).tolist() == [1] * 10
    assert sketch.ensure_capacity(5000) is True
    assert sketch.width == 16384
    assert sketch.sample_size == 50_000
    assert sketch.estimate(h).tolist() == [0] * 10
    assert [sketch.estimate_one(int(x)) for x in h] == [0] * 10


def test_capacity_grows_within_the_table_without_forgetting():
    sketch = FrequencySketch(1000)
    h = hashes(range(5))
    sketch.increment(h)
    assert sketch.ensure_capacity(1024) is False
    assert (sketch.capacity, sketch.sample_size, sketch.max_sample_size) == (1024, 10_240, 10_240)
    assert sketch.estimate(h).tolist() == [1] * 5
    assert sketch.ensure_capacity(1025) is True
    assert sketch.width == 4096


def test_empty_batches_are_fine():
    sketch = FrequencySketch(10)
    sketch.increment(np.zeros(0, dtype=np.uint64))
    assert sketch.estimate(np.zeros(0, dtype=np.uint64)).shape == (0,)


@pytest.mark.parametrize("capacity", [0, 1, 3])
def test_tiny_capacities_get_a_minimum_table(capacity):
    sketch = FrequencySketch(capacity)
    assert sketch.width >= 256
    sketch.increment(hashes([1]))
    assert int(sketch.estimate(hashes([1]))[0]) == 1
