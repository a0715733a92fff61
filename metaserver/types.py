"""Values both ends of the metaserver API use: the index takes and returns them in-process, the
client builds them from the replies (plain Python; no protobuf leaks out of either)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class NamespaceDelta:
    """Block keys of one namespace a node gained (``added``) and lost (``removed``)."""

    namespace: str
    added: Sequence[bytes] = ()
    removed: Sequence[bytes] = ()


@dataclasses.dataclass(frozen=True)
class PublishResult:
    added: int
    removed: int
    evicted: int  # keys the index dropped to stay within max_entries


@dataclasses.dataclass(frozen=True)
class NodeHit:
    """A node that holds the leading ``num_blocks`` blocks of a located prefix."""

    node_id: str
    address: str
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class NodeStats:
    node_id: str
    address: str
    entries: int
    lease_remaining_s: float
