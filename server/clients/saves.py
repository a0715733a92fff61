"""Save reservations: blocks granted by AllocateBlocks and not yet sealed.

A save is bound to the session that allocated it. Its blocks are invisible
until sealed; whatever is still unsealed when the save is aborted, its session
dies or the write timeout passes is freed.
"""

from __future__ import annotations

import secrets

from pegaflow.server.store.index import BlockEntry


class Save:
    __slots__ = (
        "id",
        "session_id",
        "instance_id",
        "ns_index",
        "chain",
        "pending",
        "created_at",
        "expires_at",
        "sealed_bytes",
        "stale_slots",
        "unzeroed_slots",
        "zeroing",
        "given_up",
    )

    def __init__(
        self,
        session_id: str,
        instance_id: str,
        ns_index: int,
        chain: tuple[bytes, ...],
        now: float,
        timeout_s: float,
        ident: str = "",
    ):
        self.id = ident or "w-" + secrets.token_hex(12)
        self.session_id = session_id
        self.instance_id = instance_id
        self.ns_index = ns_index
        # Every hash the save was asked for, in order (granted or not): the chain it restates at seal.
        self.chain = chain
        self.pending: dict[bytes, BlockEntry | None] = {}  # block hash -> granted, unsealed block
        self.created_at = now
        self.expires_at = now + timeout_s
        self.sealed_bytes = 0
        # Granted slots that last held another namespace's block: zeroed before the answer goes out.
        self.stale_slots: list[int] = []
        # Such slots granted unzeroed to a writer that overwrites every byte before it seals (the
        # server's own GPU copy: engine.allocate_blocks(whole_write=True)). One aborted before its seal
        # may still hold part of the old bytes: the store marks it foreign to every namespace
        # (BlockStore.abort), so its next grant zeroes it.
        self.unzeroed_slots: set[int] = set()
        # True while the AllocateBlocks that granted it zeroes its stale slots off the engine lock: the
        # save is that call's until it finishes (engine._finish_zeroing). It cannot be sealed, and an
        # abort, its session's end or its write timeout only sets ``given_up``: the granting call (or
        # the reaper on its behalf) frees its slots, never while its memset may still write them.
        self.zeroing = False
        self.given_up = False
