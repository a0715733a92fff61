"""The numpy HyperLogLog behind the hit-rate ceiling: accuracy, union, determinism, input checks."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pegaflow.server.metrics.hll_sketch import HyperLogLog, estimate_registers, hash_bytes_keys


def block_keys(start, stop, namespace=7):
    """Keys shaped like the server's: a 4-byte namespace prefix + a 32-byte block hash."""
    prefix = namespace.to_bytes(4, "little")
    return [prefix + i.to_bytes(32, "big") for i in range(start, stop)]


def test_empty_sketch_estimates_zero():
    assert HyperLogLog().estimate() == 0.0


@pytest.mark.parametrize("n", [1, 2, 10, 100])
def test_small_counts_are_nearly_exact(n):
    sketch = HyperLogLog()
    sketch.add_keys(block_keys(0, n))
    assert abs(sketch.estimate() - n) <= max(1.0, 0.01 * n)


def test_one_million_distinct_keys_within_two_percent():
    n = 1_000_000
    sketch = HyperLogLog(14)
    keys = block_keys(0, n)
    for i in range(0, n, 65_536):
        sketch.add_keys(keys[i : i + 65_536])
    error = (sketch.estimate() - n) / n
    assert abs(error) < 0.02, error


def test_error_spread_matches_theory():
    # 10 disjoint key sets of 100k: the rms relative error should be near 1.04/sqrt(2**14) = 0.81%.
    errors = []
    for s in range(10):
        sketch = HyperLogLog(14)
        sketch.add_keys(block_keys(s * 100_000, (s + 1) * 100_000, namespace=s))
        errors.append(sketch.estimate() / 100_000 - 1)
    rms = float(np.sqrt(np.mean(np.square(errors))))
    assert rms < 0.0125, errors
    assert abs(float(np.mean(errors))) < 0.006, errors  # no visible bias


@pytest.mark.parametrize("n", [3_000, 20_000, 40_000, 80_000])
def test_no_bias_gap_in_the_mid_range(n):
    # Plain HLL switches estimators around 2.5 * 2**p (~41k here) and is biased there; this one is not.
    sketch = HyperLogLog(14)
    sketch.add_keys(block_keys(0, n))
    assert abs(sketch.estimate() / n - 1) < 0.03


def test_repeats_do_not_count_and_batching_does_not_matter():
    keys = block_keys(0, 5000)
    once = HyperLogLog()
    once.add_keys(keys)
    repeated = HyperLogLog()
    for i in range(0, 5000, 300):
        repeated.add_keys(keys[i : i + 300])
        repeated.add_keys(keys[: i + 1])
    assert np.array_equal(once.registers, repeated.registers)


def test_register_max_is_the_union():
    a, b, both = HyperLogLog(), HyperLogLog(), HyperLogLog()
    a.add_keys(block_keys(0, 30_000))
    b.add_keys(block_keys(20_000, 50_000))
    both.add_keys(block_keys(0, 50_000))
    a.merge_registers(b.registers)
    assert np.array_equal(a.registers, both.registers)
    assert abs(estimate_registers(a.registers, 14) / 50_000 - 1) < 0.03


def test_keys_of_mixed_lengths_and_trailing_zero_bytes_are_distinct():
    keys = [b"", b"\x00", b"\x00\x00", b"ab", b"ab\x00", b"x" * 100, b"x" * 99]
    hashes = hash_bytes_keys(keys)
    assert len(set(hashes.tolist())) == len(keys)
    assert hash_bytes_keys(keys[3:4]).tolist() == hashes[3:4].tolist()  # batch-independent


def test_hashes_are_the_same_in_every_process():
    code = (
        "from pegaflow.server.metrics.hll_sketch import hash_bytes_keys;"
        "print(hash_bytes_keys([b'abc', b'\\x00' * 40, bytes(range(36))]).tolist())"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outputs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert len(outputs) == 1
    expected = hash_bytes_keys([b"abc", b"\x00" * 40, bytes(range(36))]).tolist()
    assert outputs.pop().strip() == str(expected)


@pytest.mark.parametrize("bad", [["abc"], [1, 2], [b"ok", "no"], [None]])
def test_non_bytes_keys_are_rejected(bad):
    sketch = HyperLogLog()
    with pytest.raises(TypeError):
        sketch.add_keys(bad)
    assert not sketch.registers.any()


@pytest.mark.parametrize("precision", [3, 19, 14.0, "14", True])
def test_bad_precision_is_rejected(precision):
    with pytest.raises((TypeError, ValueError)):
        HyperLogLog(precision)


def test_memory_is_one_byte_per_register():
    assert HyperLogLog(14).memory_bytes == 16384
    assert HyperLogLog(10).memory_bytes == 1024


def test_small_and_large_batches_give_the_same_registers():
    """register_updates computes in Python ints up to 64 keys and in numpy beyond: one answer."""
    from pegaflow.server.metrics.hll_sketch import register_updates

    hashes = hash_bytes_keys([f"k{i}".encode() for i in range(200)])
    hashes[0] = 0  # the all-zero rest: the capped rank
    hashes[1] = np.uint64(1 << 63)
    for precision in (4, 14, 18):
        big_index, big_rank = register_updates(hashes, precision)
        small = [register_updates(hashes[i : i + 50], precision) for i in range(0, 200, 50)]
        assert [int(i) for i in big_index] == [i for index, _ in small for i in index]
        assert [int(r) for r in big_rank] == [r for _, rank in small for r in rank]
        assert int(big_rank[0]) == 65 - precision


def test_the_python_fold_gives_the_registers_of_the_vectorised_updates():
    # HitRateCeiling stages through fold_keys_into; HyperLogLog (and the estimate's tests) use
    # register_updates: both must put every key in the same register with the same rank.
    from pegaflow.server.metrics.hll_sketch import fold_keys_into, register_updates

    keys = [f"key-{i}".encode() for i in range(3000)] + [b"", b"\x00" * 64]
    for precision in (4, 14, 18):
        want = np.zeros(1 << precision, dtype=np.uint8)
        np.maximum.at(want, *register_updates(hash_bytes_keys(keys), precision))
        got = bytearray(1 << precision)
        for i in range(0, len(keys), 16):
            fold_keys_into(got, keys[i : i + 16], precision)
        assert np.array_equal(np.frombuffer(got, dtype=np.uint8), want), precision
    with pytest.raises(TypeError):
        fold_keys_into(bytearray(16), ["str"], 4)
