"""Saving a chain of batches with the RPCs off the copy's critical path.

A save is allocate -> copy -> seal per batch. Done one after the other, each batch waits for two
round trips, and the server's bookkeeping for them (finding 64 slots, evicting their previous
blocks, sealing 64 entries: ~0.5-0.8 ms for 16 MiB on the 2-vCPU VM) adds to the copy's ~2 ms.
``save_batches`` overlaps them: batch i+1's allocation is sent before batch i is copied, and
batch i's seal is answered while batch i+1 is copied, so the server works while the client
copies and the client waits only for what is left (client/pending_rpc.py). What a caller sees is
the sequential save's: every batch is allocated in chain order, written, sealed; errors are the
same errors.

On an error (the copy's own included) nothing is left open: the batch being written and the
allocation sent ahead (once it is answered) are aborted, a seal already sent is waited for (its
batch is sealed or not, as the server decided), and the error is raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from pegaflow.client import errors
from pegaflow.client.types import SaveBatch

# write(i, batch): copies batch i's GRANTED blocks into the pool; returns their checksums (or ()).
WriteBatch = Callable[[int, SaveBatch], Sequence[int]]


def save_batches(
    client: Any,
    inst: Any,
    chunks: Sequence[Sequence[bytes]],
    write: WriteBatch,
    timeout_s: float | None = None,
) -> tuple[list[SaveBatch], int]:
    """Saves ``chunks`` (the chain, head first, cut into batches) through ``client`` (a PegaClient);
    returns each batch as allocated and the number of blocks sealed. ``write`` is called only for
    a batch with something granted, in order, on the caller's thread."""
    batches: list[SaveBatch] = []
    sealed = 0
    if not chunks:
        return batches, sealed
    ahead = client.allocate_async(inst, chunks[0], timeout_s)
    current: SaveBatch | None = None  # allocated, written or being written, its seal not yet sent
    seal_out = None  # the previous batch's seal, answered while this one is written
    try:
        for i in range(len(chunks)):
            pending, ahead = ahead, None
            current = pending.result()
            batches.append(current)
            if i + 1 < len(chunks):
                ahead = client.allocate_async(inst, chunks[i + 1], timeout_s)
            if current.save_id and any(a.granted for a in current.allocations):
                checksums = write(i, current)
                if seal_out is not None:
                    out, seal_out = seal_out, None
                    sealed += out.result()
                seal_out = client.seal_async(current.save_id, timeout_s=timeout_s, checksums=checksums)
            current = None
        if seal_out is not None:
            out, seal_out = seal_out, None
            sealed += out.result()
    finally:
        if ahead is not None:
            # Its answer first, then the abort: an abort that overtook the allocation would find
            # nothing to free, and the allocation would then hold its slots until the save expires.
            with contextlib.suppress(errors.PegaflowError):
                unused = ahead.result()
                if unused.save_id:
                    client.abort(unused.save_id, timeout_s=timeout_s, wait=False)
        if current is not None and current.save_id:
            client.abort(current.save_id, timeout_s=timeout_s, wait=False)
        if seal_out is not None:
            with contextlib.suppress(errors.PegaflowError):
                seal_out.result()
    return batches, sealed
