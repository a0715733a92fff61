"""TinyLFUAdmission: doorkeeper absorbs first sightings, aging schedule, the admit decision."""

import numpy as np

from pegaflow.server.policy.admission import TinyLFUAdmission
from pegaflow.server.policy.key_hash import salted_hashes


def hashes(keys, salt=11):
    return salted_hashes(list(keys), salt)


def freq(adm, key):
    return int(adm.frequency(hashes([key]))[0])


def test_first_sighting_goes_to_the_doorkeeper_later_ones_to_the_sketch():
    adm = TinyLFUAdmission(1000)
    adm.record(hashes(["a"]))
    assert freq(adm, "a") == 1
    assert adm._sketch.estimate(hashes(["a"])).tolist() == [0]
    adm.record(hashes(["a"]))
    assert freq(adm, "a") == 2
    assert adm._sketch.estimate(hashes(["a"])).tolist() == [1]


def test_repeats_within_one_batch_are_all_counted():
    adm = TinyLFUAdmission(1000)
    adm.record(hashes(["a", "b", "a", "a"]))
    assert freq(adm, "a") == 3
    assert freq(adm, "b") == 1
    assert freq(adm, "c") == 0


def test_ages_exactly_at_the_sample_size_and_clears_the_doorkeeper():
    adm = TinyLFUAdmission(100)
    period = adm.sample_size
    assert period == 1000
    hot = hashes(["hot"] * 9)
    adm.record(hot)
    assert freq(adm, "hot") == 9
    fillers = hashes(range(period - 9 - 1))
    adm.record(fillers)
    assert adm.agings == 0
    # This batch crosses the boundary: aging happens after its first sample, then the rest is counted.
    adm.record(hashes(["x", "late", "late"]))
    assert adm.agings == 1
    # 9 = 1 (doorkeeper) + 8 (sketch); after aging: sketch 8 -> 4, doorkeeper cleared.
    assert freq(adm, "hot") == 4
    # "late" was seen twice after the aging: 1 in the fresh doorkeeper + 1 in the sketch.
    assert freq(adm, "late") == 2
    assert adm.samples == period // 2 + 2


def test_admit_prefers_the_more_frequent_key_and_ties_keep_the_victim():
    adm = TinyLFUAdmission(1000)
    adm.record(hashes(["popular"] * 5 + ["rare"]))
    popular, rare, unseen = (int(h) for h in hashes(["popular", "rare", "unseen"]))
    assert adm.admit(popular, rare) is True
    assert adm.admit(rare, popular) is False
    assert adm.admit(rare, rare) is False
    assert adm.admit(unseen, rare) is False


def test_scalar_frequency_matches_batch():
    adm = TinyLFUAdmission(500)
    rng = np.random.default_rng(3)
    adm.record(hashes(rng.integers(0, 300, size=3000).tolist()))
    h = hashes(range(400))
    assert [adm.frequency_one(int(x)) for x in h] == adm.frequency(h).tolist()


def test_growing_capacity_restarts_the_counts():
    adm = TinyLFUAdmission(100)
    adm.record(hashes(["a", "a"]))
    adm.ensure_capacity(50)
    assert freq(adm, "a") == 2
    adm.ensure_capacity(10_000)
    assert freq(adm, "a") == 0
    assert adm.sample_size >= 100_000
    assert adm.memory_bytes > 0
