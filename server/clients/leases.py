"""Read pins: a lease keeps the blocks of a prefix hit resident until released or expired.

A lease is bound to the session that took it (ids are unguessable, and the
registry answers NOT_FOUND to any other session of another tenant). It pins
blocks in the block store, never in a tier: the store keeps a pinned block's
DRAM copy and finishes promoting the ones still arriving.
"""

from __future__ import annotations

import secrets

from pegaflow.server.store.index import BlockEntry


class Lease:
    __slots__ = (
        "id",
        "session_id",
        "instance_id",
        "ns_index",
        "entries",
        "nbytes",
        "created_at",
        "expires_at",
        "charged",
    )

    def __init__(
        self,
        session_id: str,
        instance_id: str,
        ns_index: int,
        entries: list[BlockEntry],
        now: float,
        ttl_s: float,
        ident: str = "",
    ):
        self.id = ident or "l-" + secrets.token_hex(12)
        self.session_id = session_id
        self.instance_id = instance_id
        self.ns_index = ns_index
        self.entries = entries  # the leased chain, head first: ready hits, then blocks being promoted
        self.nbytes = sum(e.length for e in entries)
        self.created_at = now
        self.expires_at = now + ttl_s
        # Its bytes count against the session's quota kept by the read lane (engine._within_lease_quota).
        self.charged = False
