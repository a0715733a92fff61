"""Per-tenant DRAM caps (``--tenant-file`` ``pool=SIZE``): a decorator over the eviction policy.

A tenant with a cap may hold at most that many bytes of blocks in DRAM. Under its cap it competes in
the one eviction order like everyone else; at its cap it makes room by evicting its own least
recently used blocks, never another tenant's, and what still does not fit is refused as a quota. So a
tenant that saves without end (or a hostile one re-saving junk) churns its own share, and the others
keep the pool minus that cap.

The inner policy keeps deciding the global order (LRU or W-TinyLFU) and sees every call as before.
This class only mirrors, per capped tenant, the recency of that tenant's resident keys (a ByteLRU
each): picking a tenant's own victim is then amortised O(1), where asking the global order to skip
every other tenant's keys would scan it (and reorder it: ``ByteLRU.coldest_unskipped`` rotates what
it skips). Recency alone orders a tenant's share, whatever the global policy: a capped tenant's
victims are its least recently used blocks.

A tenant with memory of its own (``--tenant-file`` ``region=SIZE``, tiers/dram/region.py) is
*isolated*: its keys are mirrored only, never shown to the inner policy, because evicting them frees
nothing in the shared pool; its share's recency is its whole eviction order, and its cap is its
region's size.

Which tenant a key belongs to is the owner's business (``tenant_of``: the block store maps a key's
namespace to its tenant); the caps are fixed at start, so every resident key of a capped tenant is
mirrored from its insertion on (SSD recovery included).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence

from pegaflow.server.policy.base import EvictionPolicy
from pegaflow.server.policy.lru_list import ByteLRU


class TenantCappedPolicy(EvictionPolicy):
    def __init__(
        self,
        inner: EvictionPolicy,
        caps: Mapping[str, int],
        tenant_of: Callable[[Hashable], str],
        isolated: Mapping[str, int] | None = None,
    ) -> None:
        """``caps``: tenant -> DRAM cap in the shared pool; ``isolated``: tenant -> the size of its own
        region (its keys never reach ``inner``)."""
        isolated = dict(isolated or {})
        for tenant, cap in {**caps, **isolated}.items():
            if cap < 0:
                raise ValueError(f"tenant {tenant!r}: a DRAM cap cannot be negative ({cap})")
        if set(caps) & set(isolated):
            raise ValueError("a tenant either has a cap in the pool or a region of its own")
        self.inner = inner
        self.name = inner.name
        self._isolated = frozenset(isolated)
        self._caps = {**caps, **isolated}
        self._tenant_of = tenant_of
        self._shares: dict[str, ByteLRU] = {tenant: ByteLRU() for tenant in self._caps}
        self._owner: dict[Hashable, ByteLRU] = {}  # mirrored key -> its tenant's share
        self._isolated_keys: set[Hashable] = set()  # mirrored keys the inner policy never sees
        self._lock = threading.Lock()

    # ------------------------------------------------------------- the caps

    def cap_of(self, tenant: str) -> int | None:
        """The tenant's DRAM cap in the shared pool in bytes, or None (uncapped, or a region of its own)."""
        return None if tenant in self._isolated else self._caps.get(tenant)

    def is_isolated(self, tenant: str) -> bool:
        return tenant in self._isolated

    def capped_tenant(self, key: Hashable) -> str | None:
        """The key's tenant when that tenant has a cap, else None."""
        tenant = self._tenant_of(key)
        return tenant if tenant in self._caps else None

    def resident_bytes_of(self, tenant: str) -> int:
        """Bytes of the capped tenant's resident keys (0 for a tenant without a cap)."""
        share = self._shares.get(tenant)
        return share.nbytes if share is not None else 0

    def shares(self) -> dict[str, tuple[int, int]]:
        """Capped or isolated tenant -> (resident bytes, cap or region size)."""
        with self._lock:
            return {tenant: (self._shares[tenant].nbytes, cap) for tenant, cap in self._caps.items()}

    def next_victim_of(self, tenant: str, skip: Callable[[Hashable], bool]) -> Hashable | None:
        """The capped tenant's least recently used resident key for which ``skip`` is false."""
        with self._lock:
            share = self._shares.get(tenant)
            return share.coldest_unskipped(skip) if share is not None else None

    # ------------------------------------------------- EvictionPolicy, forwarded

    @property
    def admission_rejections(self) -> int:  # type: ignore[override]
        return self.inner.admission_rejections

    def __getattr__(self, attr: str):
        # What only one policy has (W-TinyLFU's regions and window, the stats read them). Only called
        # for attributes not found on self; "inner" itself is refused so a half-built object cannot
        # recurse.
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __len__(self) -> int:
        return len(self.inner) + len(self._isolated_keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.inner or key in self._owner

    def record_lookups(self, keys: Sequence[Hashable]) -> None:
        self.inner.record_lookups(keys)

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        tenant = self.capped_tenant(key)
        isolated = tenant in self._isolated
        if not isolated:
            self.inner.on_insert(key, nbytes)
        if tenant is None:
            return
        with self._lock:
            share = self._shares[tenant]
            if key in share:  # a re-seal: one entry, the new size
                share.remove(key)
            share.add(key, nbytes)
            self._owner[key] = share
            if isolated:
                self._isolated_keys.add(key)

    def on_access(self, key: Hashable) -> None:
        if key not in self._isolated_keys:
            self.inner.on_access(key)
        self._touch(key)

    def on_refresh(self, key: Hashable) -> None:
        if key not in self._isolated_keys:
            self.inner.on_refresh(key)
        self._touch(key)

    def on_remove(self, key: Hashable) -> None:
        if key not in self._isolated_keys:
            self.inner.on_remove(key)
        with self._lock:
            self._isolated_keys.discard(key)
            share = self._owner.pop(key, None)
            if share is not None:
                share.remove(key)

    def next_victim(self, skip: Callable[[Hashable], bool]) -> Hashable | None:
        return self.inner.next_victim(skip)

    def next_victims(self, n: int, skip: Callable[[Hashable], bool]) -> list[Hashable]:
        return self.inner.next_victims(n, skip)

    def on_remove_many(self, keys: Sequence[Hashable]) -> None:
        isolated = self._isolated_keys
        self.inner.on_remove_many([key for key in keys if key not in isolated])
        with self._lock:
            for key in keys:
                isolated.discard(key)
                share = self._owner.pop(key, None)
                if share is not None:
                    share.remove(key)

    def _touch(self, key: Hashable) -> None:
        with self._lock:
            share = self._owner.get(key)
            if share is not None:
                share.touch(key)
