"""Checksums of sealed blocks, computed off the engine lock.

When blocks carry checksums (a persistent pool's journal needs them, and they travel with the
block to every tier boundary), the block store plans a "checksum" batch at seal: the sealed slots
stay pinned (``BlockEntry.io``) until their digest is known, so no eviction can reuse a slot
while it is being read. One worker thread hashes each batch with XXH3-64 (GIL released: measured
18.5 GB/s on one core of this machine kind, about twice numpy's memcpy), so a save's latency does
not include the hash; its cost is server CPU, about half a core-second per 10 GB saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pegaflow.common.wire.checksum import checksum
from pegaflow.server.interpreter_core import release_thread


class BlockHasher:
    name = "hasher"

    def __init__(self) -> None:
        # Started from a sealing request's thread: not on that thread's pinned CPU (interpreter_core.py).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pegaflow-hasher", initializer=release_thread)

    def hash(self, views: Sequence[memoryview]) -> Future[list[int]]:
        return self._pool.submit(lambda: [checksum(v) for v in views])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
