"""Doorkeeper: first sightings are absorbed, later ones pass; cleared on aging."""

from pegaflow.server.policy.doorkeeper import Doorkeeper
from pegaflow.server.policy.key_hash import salted_hashes


def hashes(keys, salt=5):
    return salted_hashes(list(keys), salt)


def test_first_sighting_is_absorbed_later_ones_pass():
    door = Doorkeeper(100)
    h = hashes(["x", "y"])
    assert door.admit_first_sightings(h).tolist() == [False, False]
    assert door.admit_first_sightings(hashes(["x", "z"])).tolist() == [True, False]


def test_seen_has_no_false_negatives_and_matches_single_key_path():
    door = Doorkeeper(5000)
    h = hashes(range(10_000))
    door.admit_first_sightings(h[:5000])
    seen = door.seen(h)
    assert seen[:5000].all()
    assert seen[5000:].mean() < 0.05
    assert [door.seen_one(int(x)) for x in h[4990:5010]] == seen[4990:5010].tolist()


def test_clear_forgets_all_sightings():
    door = Doorkeeper(100)
    h = hashes(range(20))
    door.admit_first_sightings(h)
    door.clear()
    assert not door.seen(h).any()
    assert door.admit_first_sightings(h[:1]).tolist() == [False]


def test_memory_scales_with_expected_keys():
    assert Doorkeeper(1_000_000).memory_bytes == (1 << 23) // 8
