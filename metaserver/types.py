"""Values both ends of the metaserver API use: the index takes and returns them in-process, the
client builds them from the replies (plain Python; no protobuf leaks out of either)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

# Trailing metadata of a FAILED_PRECONDITION "this replica does not serve" answer: the leader
# the replica knows ("" if none) and its term, so a node redirects itself.
LEADER_ADDRESS_KEY = "pegaflow-leader-address"
LEADER_TERM_KEY = "pegaflow-leader-term"


@dataclasses.dataclass(frozen=True)
class NamespaceDelta:
    """Block keys of one namespace a node gained (``added``) and lost (``removed``)."""

    namespace: str
    added: Sequence[bytes] = ()
    removed: Sequence[bytes] = ()


class PublishOutcome(enum.IntEnum):
    """What the metaserver did with a publish batch (values of proto PublishOutcome)."""

    APPLIED = 1
    # sequence not above the last applied one: a replay or a retry of an applied batch; dropped
    DUPLICATE = 2
    # the batch names another incarnation of the node than the registered one; dropped
    STALE_INCARNATION = 3
    # the batch skips sequence numbers (one was lost); dropped: register again and re-publish
    SEQUENCE_GAP = 4


@dataclasses.dataclass(frozen=True)
class PublishResult:
    added: int
    removed: int
    evicted: int  # keys the index dropped to stay within max_entries
    outcome: PublishOutcome = PublishOutcome.APPLIED
    # the sequence number the metaserver expects next from this registration
    expected_sequence: int = 0


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
