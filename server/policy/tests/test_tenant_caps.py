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
