"""Read pins: a lease keeps the blocks of a prefix hit resident until released or expired.

A lease id is a bearer capability (unguessable): any live session may load
through it or release it, so a scheduler process can take the lease and the
worker process that copies the bytes can release it. Its lifetime is bound to
the session that took it. Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import heapq
import secrets

from pegaflow.server.index.block_index import BlockEntry


class Lease:
    __slots__ = ("id", "session_id", "instance_id", "entries", "created_at", "expires_at")

    def __init__(
        self,
        session_id: str,
        instance_id: str,
        entries: list[BlockEntry],
        now: float,
        ttl_s: float,
        ident: str = "",
    ):
        self.id = ident or "l-" + secrets.token_hex(12)
        self.session_id = session_id
        self.instance_id = instance_id
        self.entries = entries
        self.created_at = now
        self.expires_at = now + ttl_s


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []

    def add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.id))

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def remove(self, lease_id: str) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def expired(self, now: float) -> list[Lease]:
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None:
                out.append(lease)
        if len(self._expiry) > 4 * len(self._leases) + 1024:
            # Released leases leave stale heap entries behind; rebuild before they pile up.
            self._expiry = [(lease.expires_at, lease.id) for lease in self._leases.values()]
            heapq.heapify(self._expiry)
        return out

    def __len__(self) -> int:
        return len(self._leases)
