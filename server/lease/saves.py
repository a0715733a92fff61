"""Save reservations: blocks granted by AllocateBlocks and not yet sealed.

A save id, like a lease id, is a bearer capability bound to the session that
allocated it. Its blocks are invisible until sealed; whatever is still unsealed
when the save is aborted, its session dies or the write timeout passes is
freed. Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

import heapq
import secrets

from pegaflow.server.index.block_index import BlockEntry


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
        self.pending: dict[bytes, BlockEntry] = {}  # block hash -> granted, unsealed block
        self.created_at = now
        self.expires_at = now + timeout_s
        self.sealed_bytes = 0


class SaveTable:
    def __init__(self) -> None:
        self._saves: dict[str, Save] = {}
        self._expiry: list[tuple[float, str]] = []

    def add(self, save: Save) -> None:
        self._saves[save.id] = save
        heapq.heappush(self._expiry, (save.expires_at, save.id))

    def get(self, save_id: str) -> Save | None:
        return self._saves.get(save_id)

    def remove(self, save_id: str) -> Save | None:
        return self._saves.pop(save_id, None)

    def expired(self, now: float) -> list[Save]:
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            _, save_id = heapq.heappop(self._expiry)
            save = self._saves.get(save_id)
            if save is not None:
                out.append(save)
        if len(self._expiry) > 4 * len(self._saves) + 1024:
            self._expiry = [(save.expires_at, save.id) for save in self._saves.values()]
            heapq.heapify(self._expiry)
        return out

    def __len__(self) -> int:
        return len(self._saves)
