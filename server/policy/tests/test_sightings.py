"""Lookup sightings: a key counts as seen again only after two lookups missed it, never from one."""

from pegaflow.server.policy.sightings import LookupSightings


def test_one_miss_is_not_enough_two_are():
    s = LookupSightings(1000)
    keys = [(0, f"k{i}".encode()) for i in range(50)]
    s.missed(keys)
    assert not s.seen_again(keys).any()  # a request's own lookup before its save
    s.missed(keys[:10])
    assert s.seen_again(keys[:10]).all()
    assert s.seen_again(keys[10:]).mean() < 0.1


def test_a_key_repeated_in_one_lookup_is_one_sighting():
    s = LookupSightings(1000)
    key = (1, b"x")
    s.missed([key, key, key])
    assert not s.seen_again([key]).any()


def test_sightings_fade_after_the_aging_period():
    s = LookupSightings(100)
    old = [(0, b"old")]
    s.missed(old)
    s.missed(old)
    assert s.seen_again(old).all()
    s.missed([(0, f"new{i}".encode()) for i in range(100)])  # one period of distinct misses later
    assert not s.seen_again(old).any()
    assert s.memory_bytes <= 2 * 4096 // 8 + 64
