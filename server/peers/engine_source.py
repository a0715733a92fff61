"""The serving side's TransferSource (server/peers/base.py) over this node's engine: a peer's
OpenTransfer pins leading DRAM blocks under a lease of the engine's peers session, which expires
by itself (the engine's reaper), so a requester that dies leaks nothing."""

from __future__ import annotations

from collections.abc import Sequence

from pegaflow.server.peers.base import SourceBlock


class EngineTransferSource:
    def __init__(self, engine):
        self._engine = engine

    @property
    def pool_fd(self) -> int:
        return self._engine.region.fd

    def pool_file(self, offset: int) -> tuple[int, int]:
        """(fd, offset in it) of a pool byte: with tenant regions the pool is several memfds."""
        return self._engine.region.file_at(offset)

    @property
    def pool_view(self) -> memoryview:
        return memoryview(self._engine.region.buffer)

    def open_transfer(self, namespace_id: str, hashes: Sequence[bytes], ttl_s: float):
        lease_id, blocks = self._engine.open_transfer(namespace_id, list(hashes), ttl_s)
        return lease_id, [SourceBlock(offset, length, digest) for offset, length, digest in blocks]

    def renew_transfer(self, transfer_id: str, ttl_s: float) -> bool:
        return self._engine.renew_transfer(transfer_id, ttl_s)

    def close_transfer(self, transfer_id: str) -> None:
        self._engine.close_transfer(transfer_id)
