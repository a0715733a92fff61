"""AsyncPegaClient: the pegaflow client for asyncio code, a thin wrapper over ``PegaClient``.

Every call is the sync client's, run in a worker thread (``asyncio.to_thread``), so both clients
behave identically by construction: the local RPC socket and the GPU doorbell where the server
offers them, a deadline on every call, ServerUnavailable at once on transport failure, and the
sync client's background thread for heartbeats and reconnects. (It was a separate asyncio copy
of the client until 2026-12; that copy had drifted: no local socket, no GPU calls.) The thread
hop costs tens of microseconds per call, small beside a local call (~0.05-0.08 ms) and far below
a gRPC round trip. A coroutine cancelled while its call runs stops waiting at once; the call
itself ends at its deadline at the latest. ``pool_view`` stays a plain call (no I/O).

    async with AsyncPegaClient("127.0.0.1:50055", timeout_s=2.0) as c:
        inst = await c.register_instance(layout)
        hit = await c.query_prefix(inst, hashes, lease=True)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from pegaflow.client.sync import PegaClient
from pegaflow.client.types import InstanceHandle, KvLayout, Location, PrefixHit, QueryPurpose, SaveBatch


class AsyncPegaClient:
    def __init__(self, *args, **kwargs):
        """Arguments as ``PegaClient``'s (address, timeout_s, name, map_pool, backoff, auth, local_rpc,
        read_lane)."""
        self.sync = PegaClient(*args, **kwargs)

    # ------------------------------------------------------------- state (no I/O)

    @property
    def address(self) -> str:
        return self.sync.address

    @property
    def timeout_s(self) -> float:
        return self.sync.timeout_s

    @property
    def connected(self) -> bool:
        return self.sync.connected

    @property
    def session_id(self) -> str:
        return self.sync.session_id

    @property
    def epoch(self) -> str:
        return self.sync.epoch

    @property
    def limits(self):
        return self.sync.limits

    @property
    def sessions_opened(self) -> int:
        return self.sync.sessions_opened

    @property
    def local_rpc_socket(self) -> str:
        return self.sync.local_rpc_socket

    @property
    def local_rpc_calls(self) -> dict[str, int]:
        return self.sync.local_rpc_calls

    def pool_view(self, epoch: str | None = None) -> np.ndarray:
        return self.sync.pool_view(epoch)

    # ------------------------------------------------------------- lifecycle

    async def connect(self, timeout_s: float | None = None) -> None:
        """Session + pool fd + heartbeat thread; raises ServerUnavailable (and keeps trying)."""
        await asyncio.to_thread(self.sync.connect, timeout_s)

    async def close(self, timeout_s: float | None = None) -> None:
        await asyncio.to_thread(self.sync.close, timeout_s)

    async def __aenter__(self) -> AsyncPegaClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_pool_populated(self, timeout_s: float | None = None) -> bool:
        return await asyncio.to_thread(self.sync.wait_pool_populated, timeout_s)

    # ------------------------------------------------------------- calls (PegaClient's, documented there)

    async def register_instance(
        self, layout: KvLayout, name: str = "", timeout_s: float | None = None
    ) -> InstanceHandle:
        return await asyncio.to_thread(self.sync.register_instance, layout, name, timeout_s)

    async def unregister_instance(self, handle: InstanceHandle, timeout_s: float | None = None) -> None:
        await asyncio.to_thread(self.sync.unregister_instance, handle, timeout_s)

    async def query_prefix(
        self,
        inst: InstanceHandle,
        hashes: Sequence[bytes],
        lease: bool = False,
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
    ) -> PrefixHit:
        return await asyncio.to_thread(
            self.sync.query_prefix, inst, hashes, lease, lease_ttl_s, timeout_s, purpose
        )

    async def load_blocks(
        self, inst: InstanceHandle, lease_id: str, timeout_s: float | None = None
    ) -> list[Location]:
        return await asyncio.to_thread(self.sync.load_blocks, inst, lease_id, timeout_s)

    async def release(
        self,
        lease_id: str,
        loaded_bytes: int = 0,
        timeout_s: float | None = None,
        wait: bool = True,
        corrupt_hashes: Sequence[bytes] = (),
    ) -> None:
        await asyncio.to_thread(self.sync.release, lease_id, loaded_bytes, timeout_s, wait, corrupt_hashes)

    async def allocate(
        self, inst: InstanceHandle, hashes: Sequence[bytes], timeout_s: float | None = None
    ) -> SaveBatch:
        return await asyncio.to_thread(self.sync.allocate, inst, hashes, timeout_s)

    async def seal(
        self,
        save_id: str,
        hashes: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
        checksums: Sequence[int] = (),
    ) -> int:
        return await asyncio.to_thread(self.sync.seal, save_id, hashes, timeout_s, checksums)

    async def abort(self, save_id: str, timeout_s: float | None = None) -> int:
        return await asyncio.to_thread(self.sync.abort, save_id, timeout_s)

    async def stats(self, timeout_s: float | None = None):
        return await asyncio.to_thread(self.sync.stats, timeout_s)

    async def register_device_memory(
        self, inst: InstanceHandle, registration, timeout_s: float | None = None
    ):
        return await asyncio.to_thread(self.sync.register_device_memory, inst, registration, timeout_s)

    async def unregister_device_memory(self, handle, timeout_s: float | None = None) -> None:
        await asyncio.to_thread(self.sync.unregister_device_memory, handle, timeout_s)

    async def save_from_device(
        self, handle, hashes: Sequence[bytes], block_ids: Sequence[int], timeout_s: float | None = None
    ):
        return await asyncio.to_thread(self.sync.save_from_device, handle, hashes, block_ids, timeout_s)

    async def load_to_device(
        self,
        handle,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        timeout_s: float | None = None,
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
    ) -> int:
        return await asyncio.to_thread(
            self.sync.load_to_device, handle, hashes, block_ids, timeout_s, purpose
        )
