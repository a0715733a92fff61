"""BloomFilter: no false negatives, bounded false positives, batch and single-key paths agree."""

import numpy as np

from pegaflow.server.policy.bloom import BloomFilter
from pegaflow.server.policy.key_hash import salted_hashes


def hashes(keys, salt=5):
    return salted_hashes(list(keys), salt)


def test_put_reports_prior_presence():
    bloom = BloomFilter(100)
    h = hashes(["x", "y"])
    assert bloom.put(h).tolist() == [False, False]
    assert bloom.put(h).tolist() == [True, True]
    assert bloom.contains(h).tolist() == [True, True]


def test_no_false_negatives():
    bloom = BloomFilter(10_000)
    h = hashes(range(10_000))
    bloom.put(h)
    assert bloom.contains(h).all()


def test_false_positive_rate_at_design_load_is_small():
    bloom = BloomFilter(10_000)
    bloom.put(hashes(range(10_000)))
    fp = bloom.contains(hashes(range(10_000, 60_000))).mean()
    assert fp < 0.05


def test_clear_forgets_everything():
    bloom = BloomFilter(100)
    h = hashes(range(50))
    bloom.put(h)
    bloom.clear()
    assert not bloom.contains(h).any()


def test_single_key_paths_agree_with_batch_paths():
    bloom = BloomFilter(1000)
    h = hashes(range(2000))
    bloom.put(h[:500])
    for x in h[500:1000]:
        bloom.add_one(int(x))
    assert [bloom.contains_one(int(x)) for x in h] == bloom.contains(h).tolist()
    assert bloom.contains(h[:1000]).all()


def test_memory_is_eight_bits_per_expected_key():
    bloom = BloomFilter(100_000)
    assert bloom.num_bits == 1 << 20
    assert bloom.memory_bytes == (1 << 20) // 8


def test_empty_batches():
    bloom = BloomFilter(10)
    empty = np.zeros(0, dtype=np.uint64)
    assert bloom.put(empty).shape == (0,)
    assert bloom.contains(empty).shape == (0,)
