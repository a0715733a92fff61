"""TenantCappedPolicy: the inner policy sees every call unchanged, and each capped tenant's resident
keys are mirrored in recency order, so the tenant's own least recently used key is its victim."""

import pytest

from pegaflow.server.policy import LRUPolicy, make_policy
from pegaflow.server.policy.tenant_caps import TenantCappedPolicy


def tenant_of(key):
    return key[0]


def never(_key):
    return False


def test_a_capped_tenants_victim_is_its_own_least_recently_used_key():
    inner = LRUPolicy()
    policy = TenantCappedPolicy(inner, {"a": 300}, tenant_of)
    for key in [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]:
        policy.on_insert(key, 100)
    policy.on_access(("a", 1))  # a's order is now 2, 3, 1
    assert policy.resident_bytes_of("a") == 300 and policy.resident_bytes_of("b") == 0
    assert policy.next_victim_of("a", never) == ("a", 2)
    assert policy.next_victim_of("a", lambda k: k == ("a", 2)) == ("a", 3)
    assert policy.next_victim_of("b", never) is None  # b has no cap: no share of its own
    # The global order is the inner policy's, untouched by the mirror: b's first key is coldest.
    assert policy.next_victim(never) == ("b", 1)
    policy.on_remove(("a", 3))
    assert policy.resident_bytes_of("a") == 200 and len(policy) == 4 and ("a", 3) not in policy
    assert policy.shares() == {"a": (200, 300)}


def test_a_re_seal_keeps_one_entry_with_the_new_size():
    policy = TenantCappedPolicy(LRUPolicy(), {"a": 1000}, tenant_of)
    policy.on_insert(("a", 1), 100)
    policy.on_insert(("a", 1), 250)
    assert policy.resident_bytes_of("a") == 250
    policy.on_remove(("a", 1))
    policy.on_remove(("a", 1))  # unknown keys are ignored, as by every policy
    assert policy.resident_bytes_of("a") == 0 and policy.next_victim_of("a", never) is None


def test_w_tinylfu_inside_keeps_its_own_attributes():
    inner = make_policy(True, 1 << 20)
    policy = TenantCappedPolicy(inner, {"a": 1 << 20}, tenant_of)
    policy.record_lookups([("a", 1)])
    policy.on_insert(("a", 1), 4096)
    assert policy.name == inner.name
    assert policy.region_of(("a", 1)) == inner.region_of(("a", 1))
    assert policy.admission_rejections == inner.admission_rejections


def test_a_negative_cap_is_refused():
    with pytest.raises(ValueError, match="negative"):
        TenantCappedPolicy(LRUPolicy(), {"a": -1}, tenant_of)


def test_an_isolated_tenants_keys_never_reach_the_inner_policy():
    """A tenant with a region of its own: evicting its blocks frees nothing in the shared pool, so the
    inner policy never sees them (the shared pool's victims are never its keys), and its own share is
    its whole eviction order."""
    inner = LRUPolicy()
    policy = TenantCappedPolicy(inner, {"a": 300}, tenant_of, isolated={"r": 1000})
    for key in [("r", 1), ("b", 1), ("r", 2), ("a", 1)]:
        policy.on_insert(key, 100)
    policy.on_access(("r", 1))
    assert len(inner) == 2 and ("r", 1) not in inner and ("r", 1) in policy and len(policy) == 4
    assert policy.next_victim(never) == ("b", 1)
    assert policy.next_victim(lambda k: k == ("b", 1)) == ("a", 1)  # never an isolated key
    assert policy.next_victim_of("r", never) == ("r", 2)  # r's own recency: 2, then 1
    assert policy.cap_of("r") is None and policy.cap_of("a") == 300 and policy.is_isolated("r")
    assert policy.shares() == {"a": (100, 300), "r": (200, 1000)}
    policy.on_remove(("r", 2))
    assert policy.resident_bytes_of("r") == 100 and len(policy) == 3 and ("r", 2) not in policy


def test_a_tenant_cannot_have_a_cap_and_a_region():
    with pytest.raises(ValueError, match="either"):
        TenantCappedPolicy(LRUPolicy(), {"a": 1}, tenant_of, isolated={"a": 2})
