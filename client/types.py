"""Value types of the client API (plain Python; no protobuf leaks out of the client)."""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import NamedTuple

# One definition with the server (it adds validation): the client never imports server code.
from pegaflow.common.kv_layout import KvLayout


class AllocStatus(enum.IntEnum):
    """Per-block answer of ``allocate`` (same numbers as the proto enum)."""

    GRANTED = 1  # write the bytes at (offset, length), then seal
    EXISTS = 2  # already stored: nothing to write
    IN_PROGRESS = 3  # another writer holds it: nothing to write
    REJECTED = 4  # the admission policy said no
    NO_SPACE = 5  # the pool is full of pinned blocks


class Tier(enum.IntEnum):
    DRAM = 1


class QueryPurpose(enum.IntEnum):
    """What a prefix query is for the server's statistics (same numbers as the proto enum).

    A block should be requested once per use, however many processes then load it.
    """

    LOOKUP = 0  # a block request: counted (hits, misses, hit rate, HLL ceiling, eviction frequency)
    LOAD = 1  # loading blocks an earlier LOOKUP counted (a worker's lease after its scheduler's lookup)


# NamedTuples, not dataclasses: a batch has hundreds of these and a tuple is ~4x cheaper to build.
class Location(NamedTuple):
    offset: int
    length: int
    tier: Tier = Tier.DRAM


class Allocation(NamedTuple):
    status: AllocStatus
    offset: int = 0  # valid when status is GRANTED
    length: int = 0  # 0 unless GRANTED

    @property
    def granted(self) -> bool:
        return self.status == AllocStatus.GRANTED


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    num_hits: int
    lease_id: str  # "" when no lease was taken (lease=False, or no hits)
    locations: list[Location]  # one per hit, in order
    epoch: str  # the pool mapping these locations belong to


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
