"""Value types shared by the server and its clients, with the proto's numbers.

One definition for both ends (the client never imports server code). The enums'
values are the proto enums' values (proto/pegaflow.proto), checked by
common/wire/tests/test_types.py, so a number can go on the wire as is.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class AllocStatus(enum.IntEnum):
    """Per-block answer of AllocateBlocks."""

    GRANTED = 1  # write the bytes at the granted location, then seal
    EXISTS = 2  # already stored: nothing to write (dedup)
    IN_PROGRESS = 3  # another writer holds it: nothing to write
    REJECTED = 4  # refused by a quota (the namespace or tenant is at its limit)
    NO_SPACE = 5  # nothing evictable: the pool is full of pinned or half-written blocks


class Tier(enum.IntEnum):
    """Where a block was found. Only DRAM blocks have a location a client can read; a hit in
    a lower tier is promoted into DRAM first (its location is then a DRAM one)."""

    DRAM = 1  # this host's shared pool
    SSD = 2  # this host's SSD tier
    REMOTE = 3  # another node's DRAM, fetched over a peer transport


class QueryPurpose(enum.IntEnum):
    """What a prefix query means for the statistics.

    A block is *requested* once (LOOKUP: hits, misses, hit-rate windows, HLL ceiling, the
    policy's frequency sketch) however many times it is then *loaded* (LOAD: pins and
    recency only), e.g. a scheduler's lookup followed by each worker rank's leasing query.
    """

    LOOKUP = 0
    LOAD = 1


# NamedTuples, not dataclasses: a batch has hundreds of these and a tuple is ~4x cheaper to build.
class Location(NamedTuple):
    """A block's bytes in the shared pool: [offset, offset + length)."""

    offset: int
    length: int
    tier: Tier = Tier.DRAM
    checksum: int = 0  # XXH3-64 of the block's bytes as written (common/wire/checksum.py); 0 unknown
