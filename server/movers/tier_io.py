"""The tier mover: runs the transfers the block store planned, outside the engine lock.

The block store plans promotions and demotions under the engine lock and
returns them as ``IoBatch`` objects; the engine hands them here once its lock
is released. ``submit`` queues each batch on its tier (``Tier.read`` /
``Tier.write`` return at once with a future) and, when the future resolves,
calls the engine's completion callback, which takes the lock for a moment to
record the outcome (a slot filled, an SSD copy written) and wake waiters. The
bytes themselves move in the tier's own threads or io_uring, out of the GIL.

A tier whose queue is full refuses the batch (``TierFull``): every transfer in
it then completes as CANCELLED at once, which the store counts and undoes
(the DRAM slot of a promotion is freed, the block is a miss; a demotion is
simply not done). Nothing here raises into the request path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from pegaflow.server.store.block_store import IoBatch
from pegaflow.server.tiers.base import IoStatus, TierFull

log = logging.getLogger(__name__)

Completion = Callable[[IoBatch, Sequence[IoStatus]], None]


class TierMover:
    def __init__(self, on_complete: Completion):
        self._on_complete = on_complete
        self.submitted = 0
        self.refused = 0

    def submit(self, batches: Sequence[IoBatch | None]) -> None:
        for batch in batches:
            if batch is None or not batch.requests:
                continue
            self.submitted += 1
            try:
                if batch.kind == "promote":
                    future = batch.tier.read(batch.requests)
                elif batch.kind == "demote":
                    future = batch.tier.write(batch.requests)
                else:  # "checksum": the block hasher
                    future = batch.tier.hash(batch.requests)
            except TierFull:
                self.refused += 1
                self._finish(batch, [IoStatus.CANCELLED] * len(batch.requests))
                continue
            except Exception:
                log.exception("tier %s refused a %s batch", batch.tier.name, batch.kind)
                self._finish(batch, [IoStatus.IO_ERROR] * len(batch.requests))
                continue
            future.add_done_callback(lambda f, b=batch: self._resolved(b, f))

    def _resolved(self, batch: IoBatch, future) -> None:
        try:
            statuses = future.result()
        except Exception:
            log.exception("tier %s: a %s batch failed", batch.tier.name, batch.kind)
            statuses = [IoStatus.IO_ERROR] * len(batch.requests)
        if statuses is None or len(statuses) != len(batch.requests):
            log.error(
                "tier %s answered %d statuses for %d requests",
                batch.tier.name,
                len(statuses or ()),
                len(batch.requests),
            )
            statuses = [IoStatus.IO_ERROR] * len(batch.requests)
        self._finish(batch, statuses)

    def _finish(self, batch: IoBatch, statuses: Sequence[IoStatus]) -> None:
        try:
            self._on_complete(batch, statuses)
        except Exception:
            log.exception("recording a %s batch's completion failed", batch.kind)
