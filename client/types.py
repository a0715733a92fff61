"""Value types of the client API (plain Python; no protobuf leaks out of the client)."""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

# One definition with the server (it adds validation): the client never imports server code.
from pegaflow.common.kv_layout import KvLayout
from pegaflow.common.wire.types import AllocStatus, Location, QueryPurpose, Tier

__all__ = ["AllocStatus", "Location", "QueryPurpose", "Tier", "KvLayout"]


class Allocation(NamedTuple):
    status: AllocStatus
    offset: int = 0  # valid when status is GRANTED
    length: int = 0  # 0 unless GRANTED

    @property
    def granted(self) -> bool:
        return self.status == AllocStatus.GRANTED


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    num_hits: int  # leading blocks readable in the pool now
    lease_id: str  # "" when no lease was taken (lease=False, or no hits)
    locations: list[Location]  # one per readable hit, in order
    epoch: str  # the pool mapping these locations belong to
    # Blocks after the readable ones that the server is making resident (SSD promotion, a peer's
    # fetch). With a lease, ``load_blocks`` waits for them; without one, ask again later (LOAD).
    pending: int = 0
    sources: tuple[Tier, ...] = ()  # where each of the num_hits + pending blocks was found
    # The server is asking other nodes for the blocks after these (ask again, with LOAD).
    searching: bool = False


@dataclasses.dataclass(frozen=True)
class SaveBatch:
    save_id: str  # "" when nothing was granted (nothing to seal)
    allocations: list[Allocation]  # one per requested hash, same order
    epoch: str

    @property
    def granted(self) -> list[int]:
        """Indices of the hashes whose bytes must be written."""
        return [i for i, a in enumerate(self.allocations) if a.status == AllocStatus.GRANTED]


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_batch_blocks: int
    max_hash_bytes: int
    max_block_bytes: int
    default_lease_ttl_ms: int
    max_lease_ttl_ms: int
    write_timeout_ms: int


class InstanceHandle:
    """A registered KV cache. Stays valid across reconnects: the client re-registers it
    under a new session and updates ``instance_id`` / ``namespace_id`` in place."""

    def __init__(self, layout: KvLayout, name: str):
        self.layout = layout
        self.name = name
        self._lock = threading.Lock()
        self._instance_id = ""
        self._namespace_id = ""
        self.rejection = ""  # why the server refused it after a reconnect (then it stays unregistered)

    @property
    def instance_id(self) -> str:
        """The server's id for this instance, or "" while it is not registered (server unreachable)."""
        return self._instance_id

    @property
    def namespace_id(self) -> str:
        return self._namespace_id

    @property
    def registered(self) -> bool:
        return bool(self._instance_id)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def _set(self, instance_id: str, namespace_id: str) -> None:
        with self._lock:
            self._instance_id = instance_id
            self._namespace_id = namespace_id

    def _clear(self) -> None:
        with self._lock:
            self._instance_id = ""

    def __repr__(self) -> str:
        ident = self._instance_id or "<unregistered>"
        return f"InstanceHandle({self.name!r}, id={ident}, ns={self._namespace_id})"
