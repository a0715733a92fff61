"""Eviction and admission policies; the engine picks one with ``make_policy``."""

from __future__ import annotations

from pegaflow.server.policy.base import EvictionPolicy
from pegaflow.server.policy.lru import LRUPolicy
from pegaflow.server.policy.validation import positive_int

__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy"]


def make_policy(enable_lfu_admission: bool, capacity_bytes: int) -> EvictionPolicy:
    """The policy for ``--enable-lfu-admission``: W-TinyLFU when set, LRU otherwise.

    ``capacity_bytes`` is the pool's capacity; W-TinyLFU sizes its regions from it.
    """
    capacity_bytes = positive_int(capacity_bytes, "capacity_bytes")
    if enable_lfu_admission:
        # Imported lazily so the default LRU path does not pay for numpy start-up.
        from pegaflow.server.policy.tinylfu import WTinyLFUPolicy

        return WTinyLFUPolicy(capacity_bytes)
    return LRUPolicy()
