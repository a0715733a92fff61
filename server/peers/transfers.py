"""The serving side's open transfers and links: what a wire id names, until when, who still sends.

A transfer is the block store's transfer lease (``TransferSource.open_transfer``) seen from the
wire: a 16-byte random id (a bearer token on the data plane), the pinned blocks, an expiry. It
ends at CloseTransfer or at its TTL, whichever comes first (a requester that died or went silent
never closes it). Ending it stops new sends at once, but the store's lease is released
(``close_transfer``) only when no send of it is in flight, so a slot is never reused under a
``sendfile`` still reading it. The store's own lease runs ``grace_s`` longer than the TTL here:
a backstop should this table ever fail to release it.

Links are the Handshake's: a name, the transport, an expiry renewed by every call naming it, and
for RDMA the queue pairs to destroy when it ends (``on_end``).

Concurrency: one lock per table, held for dictionary work only; the store is called outside it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable

from pegaflow.common.wire.peer_frames import TRANSFER_ID_BYTES
from pegaflow.server.peers.base import SourceBlock, TransferSource
from pegaflow.server.peers.metrics import ServeCounters

log = logging.getLogger(__name__)


class TooMany(Exception):
    """The table is at its cap (answered RESOURCE_EXHAUSTED)."""


@dataclasses.dataclass(eq=False)
class ServedTransfer:
    wire_id: bytes
    store_id: str
    blocks: list[SourceBlock]
    expires_at: float
    in_flight: int = 0  # data-plane READs sending its blocks now
    ended: bool = False  # closed or expired: no new sends
    released: bool = False  # the store's lease was closed


class TransferTable:
    def __init__(
        self,
        source: TransferSource,
        counters: ServeCounters,
        max_transfers: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._source = source
        self._counters = counters
        self._max = max_transfers
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[bytes, ServedTransfer] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def reserve(self) -> None:
        """Raises TooMany when no transfer can be added (checked before the store pins anything)."""
        with self._lock:
            if len(self._live) >= self._max:
                raise TooMany(f"{len(self._live)} transfers are open (the cap is {self._max})")

    def add(self, store_id: str, blocks: list[SourceBlock], ttl_s: float) -> ServedTransfer:
        transfer = ServedTransfer(
            secrets.token_bytes(TRANSFER_ID_BYTES), store_id, blocks, self._clock() + ttl_s
        )
        with self._lock:
            self._live[transfer.wire_id] = transfer
        self._counters.add("transfers_opened")
        self._counters.add("blocks_pinned", len(blocks))
        return transfer

    def acquire(self, wire_id: bytes) -> ServedTransfer | None:
        """The live transfer for a data-plane READ, counted in flight until ``release``."""
        with self._lock:
            transfer = self._live.get(wire_id)
            if transfer is None or transfer.ended or self._clock() >= transfer.expires_at:
                return None
            transfer.in_flight += 1
            return transfer

    def sendable(self, transfer: ServedTransfer) -> bool:
        """Checked before each block: a transfer that ended or expired sends nothing more."""
        return not transfer.ended and self._clock() < transfer.expires_at

    def release(self, transfer: ServedTransfer) -> None:
        with self._lock:
            transfer.in_flight -= 1
            free = self._take_if_done(transfer)
        if free:
            self._free(transfer)

    def renew(self, wire_id: bytes, ttl_s: float, grace_s: float) -> bool:
        """Extends the transfer here and the store's lease (``ttl_s + grace_s``) behind it."""
        with self._lock:
            transfer = self._live.get(wire_id)
            if transfer is None or transfer.ended or self._clock() >= transfer.expires_at:
                return False
            transfer.in_flight += 1  # not released under the store's renew call
        renewed = False
        try:
            renewed = bool(self._source.renew_transfer(transfer.store_id, ttl_s + grace_s))
        finally:
            with self._lock:
                transfer.in_flight -= 1
                if renewed and not transfer.ended:
                    transfer.expires_at = max(transfer.expires_at, self._clock() + ttl_s)
                free = self._take_if_done(transfer)
            if free:
                self._free(transfer)
        return renewed

    def close(self, wire_id: bytes) -> bool:
        """Ends the transfer (idempotent). True when it was live."""
        with self._lock:
            transfer = self._live.get(wire_id)
            if transfer is None or transfer.ended:
                return False
            transfer.ended = True
            free = self._take_if_done(transfer)
        self._counters.add("transfers_closed")
        self._counters.add("transfers_ended")
        if free:
            self._free(transfer)
        return True

    def expire(self) -> int:
        """Ends every transfer past its TTL; returns how many (the reaper calls this)."""
        now = self._clock()
        ended, free = [], []
        with self._lock:
            for transfer in self._live.values():
                if not transfer.ended and now >= transfer.expires_at:
                    transfer.ended = True
                    ended.append(transfer)
            for transfer in ended:
                if self._take_if_done(transfer):
                    free.append(transfer)
        for transfer in free:
            self._free(transfer)
        if ended:
            self._counters.add("transfers_expired", len(ended))
            self._counters.add("transfers_ended", len(ended))
            log.info("%d peer transfer(s) expired (their requester went silent)", len(ended))
        return len(ended)

    def close_all(self) -> None:
        with self._lock:
            ids = [t.wire_id for t in self._live.values() if not t.ended]
        for wire_id in ids:
            self.close(wire_id)

    def _take_if_done(self, transfer: ServedTransfer) -> bool:
        """Under the lock: drops an ended transfer with nothing in flight; True when the caller
        must release its store lease (outside the lock)."""
        if transfer.ended and transfer.in_flight == 0 and not transfer.released:
            transfer.released = True
            self._live.pop(transfer.wire_id, None)
            return True
        return False

    def _free(self, transfer: ServedTransfer) -> None:
        try:
            self._source.close_transfer(transfer.store_id)
        except Exception:  # the store's TTL still ends the lease
            log.exception("closing the store's transfer lease %s failed", transfer.store_id)


@dataclasses.dataclass(eq=False)
class PeerLinkEntry:
    link_id: str
    transport: str
    node_id: str
    expires_at: float
    on_end: Callable[[], None] | None = None  # RDMA: destroys the link's queue pairs


class LinkTable:
    def __init__(
        self,
        counters: ServeCounters,
        max_links: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._counters = counters
        self._max = max_links
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, PeerLinkEntry] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def add(self, transport: str, node_id: str, on_end: Callable[[], None] | None = None) -> PeerLinkEntry:
        entry = PeerLinkEntry(secrets.token_hex(12), transport, node_id, self._clock() + self.ttl_s, on_end)
        with self._lock:
            if len(self._live) >= self._max:
                raise TooMany(f"{len(self._live)} peer links are open (the cap is {self._max})")
            self._live[entry.link_id] = entry
        self._counters.add("links_opened")
        return entry

    def touch(self, link_id: str) -> PeerLinkEntry | None:
        """The live link, its expiry renewed; None when unknown or expired."""
        with self._lock:
            entry = self._live.get(link_id)
            if entry is None or self._clock() >= entry.expires_at:
                return None
            entry.expires_at = self._clock() + self.ttl_s
            return entry

    def remove(self, link_id: str) -> bool:
        with self._lock:
            entry = self._live.pop(link_id, None)
        if entry is None:
            return False
        self._end(entry)
        return True

    def expire(self) -> int:
        now = self._clock()
        with self._lock:
            gone = [e for e in self._live.values() if now >= e.expires_at]
            for entry in gone:
                del self._live[entry.link_id]
        for entry in gone:
            self._counters.add("links_expired")
            self._end(entry)
        return len(gone)

    def close_all(self) -> None:
        with self._lock:
            gone = list(self._live.values())
            self._live.clear()
        for entry in gone:
            self._end(entry)

    def _end(self, entry: PeerLinkEntry) -> None:
        self._counters.add("links_closed")
        if entry.on_end is not None:
            try:
                entry.on_end()
            except Exception:
                log.exception("ending peer link %s failed", entry.link_id)
