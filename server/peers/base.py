"""The peer seam: moving sealed blocks' bytes from another node's DRAM into this node's pool.

A remote node is not a tier (it owns no space here, server/tiers/base.py): it is a read-through
source, and this package is the part that moves its bytes. It knows nothing of the index, the
metaserver or what a block means; the remote source of the block store (the caller) decides what
to pull, gives it local pool slots to land in, and seals what arrived whole.

Two roles, two processes:

* the **requester** (this node, missing a prefix): ``Transport.connect(peer)`` -> ``PeerLink``;
  per pull ``link.open_transfer(...)`` (the peer pins the leading blocks it holds and says their
  lengths and checksums), ``link.fetch(extents, slots, deadline)`` (the bytes land in the slots),
  then ``link.close_transfer(...)``.
* the **serving side** (the peer holding the blocks): ``server/peers/serve.py`` answers the control
  plane (gRPC, proto/peer.proto) and runs the data planes, reading blocks through a
  ``TransferSource`` (below) that the block store implements.

Primitives, by role (in the spirit of vLLM's kv_connector/v1/base.py: who calls, may it block,
how failures are reported):

``Transport.connect(peer, deadline) -> PeerLink``
    Called by the remote source, off the request path, once per peer (links are kept and
    reused). Blocks up to ``deadline`` (time.monotonic): the handshake RPC, then the data plane
    (TCP streams, or RDMA queue pairs brought to RTS). Raises ``PeerUnavailable`` (peer down,
    unreachable, deadline) or ``PeerRefused`` (it will not serve this transport).
``PeerLink.open_transfer(namespace_id, hashes, ttl_s, deadline) -> RemoteTransfer``
    Blocks up to ``deadline`` (one RPC). The peer pins the leading blocks of ``hashes`` it holds
    under a lease that expires by itself after ``ttl_s`` (a requester that dies leaks nothing).
    ``num_blocks`` may be 0: the index was stale, a miss, not an error. Raises like ``connect``.
``PeerLink.fetch(remote, into, deadline) -> Future[FetchResult]``
    Returns at once; never raises for a transfer failure (it is a status). ``into[i]`` is a
    writable, contiguous buffer of at least ``remote[i].length`` bytes (a local pool slot:
    IO_ALIGN-aligned, io_bytes(length) long, tiers/base.py). The future resolves with one
    ``BlockStatus`` per extent, in order; a block is OK only when all of its bytes arrived and
    their XXH3-64 equals the checksum the peer announced (at OpenTransfer, or in the block's
    frame over TCP when the store keeps none: then the frame's must also match the announced one
    whenever there is one). **When the future resolves (success,
    failure or deadline) no byte can land in any of ``into`` later**: the caller may free or
    reuse the slots at once. Failures are per block and per stream: a bad frame or a dead stream
    never tears down other links, and another fetch on this link may still succeed. Raises
    ``ValueError`` at once for a caller bug (mismatched lengths, a buffer too small, over the
    link's ``max_fetch_bytes``), ``LinkClosed`` after ``close()``.
``PeerLink.renew_transfer(transfer_id, ttl_s, deadline)`` / ``close_transfer(transfer_id, deadline)``
    One RPC each. ``close_transfer`` never raises: a peer that cannot be told lets the lease
    expire (returns False then). ``wait=False`` sends it without waiting for the answer.
``PeerLink.close()``
    Ends the link's streams and queue pairs. A fetch in flight resolves (CANCELLED for what did
    not arrive) before ``close`` returns, with the same no-late-bytes guarantee. Idempotent.
``Transport.stats()`` / ``PeerLink.healthy``
    Read by metrics at any time, without blocking.

Failure causes (``BlockStatus``), each a label of the failures counter:
``TIMEOUT`` the deadline passed (a partition, a slow or silent peer); ``PEER_GONE`` the peer
closed or reset the connection (killed, restarted) or refused it; ``CHECKSUM`` the bytes arrived
but did not match (never handed over as good); ``PROTOCOL`` the peer sent something that is not a
well-formed answer (that stream is closed and reopened for the next fetch); ``REFUSED`` the peer
answered an error (unknown or expired transfer, bad request); ``CANCELLED`` the link was closed.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple, Protocol

# ------------------------------------------------------------------ addresses and extents


class PeerAddress(NamedTuple):
    """Where a peer's control plane listens: its pegaflow-server gRPC address (the node's
    ``--addr``, as the metaserver names it), ``host:port``."""

    control: str
    node_id: str = ""  # for logs and metrics


class RemoteExtent(NamedTuple):
    """One block of an open transfer on the peer."""

    transfer_id: bytes  # 16 bytes, from OpenTransfer
    index: int  # the block's position in the transfer (0 .. num_blocks - 1)
    length: int  # its bytes
    checksum: int | None  # XXH3-64 of its bytes as OpenTransfer announced it (None: TCP frames carry it)
    offset: int = 0  # RDMA: the block's offset in the peer's registered region (TCP: unused)


class RemoteTransfer(NamedTuple):
    """The peer's answer to OpenTransfer: the leading blocks it pinned, in prefix order."""

    transfer_id: bytes  # b"" when num_blocks is 0
    extents: list[RemoteExtent]
    ttl_s: float  # granted; the lease expires this long after the answer unless renewed

    @property
    def num_blocks(self) -> int:
        return len(self.extents)


# ------------------------------------------------------------------ results


class BlockStatus(enum.IntEnum):
    """One block's outcome. Everything but OK is a failure cause (a metric label by ``label``)."""

    OK = 0
    TIMEOUT = 1
    PEER_GONE = 2
    CHECKSUM = 3
    PROTOCOL = 4
    REFUSED = 5
    CANCELLED = 6

    @property
    def label(self) -> str:
        return self.name.lower()


FAILURE_CAUSES = tuple(s for s in BlockStatus if s is not BlockStatus.OK)


class FetchResult(NamedTuple):
    statuses: list[BlockStatus]  # one per extent, in the fetch's order
    bytes_ok: int  # bytes of the OK blocks
    seconds: float  # from fetch() to resolution
    error: str = ""  # the first failure, in words ("" when every block is OK)

    @property
    def ok(self) -> bool:
        return all(s is BlockStatus.OK for s in self.statuses)

    @property
    def leading_ok(self) -> int:
        """How many leading blocks arrived whole: the prefix the caller may seal."""
        for i, status in enumerate(self.statuses):
            if status is not BlockStatus.OK:
                return i
        return len(self.statuses)

    @property
    def cause(self) -> BlockStatus | None:
        """The first failed block's status, None when every block is OK."""
        return next((s for s in self.statuses if s is not BlockStatus.OK), None)


# ------------------------------------------------------------------ errors


class PeerError(Exception):
    """A control-plane call or a connect failed. ``cause`` is the failures counter's label."""

    def __init__(self, cause: BlockStatus, message: str):
        super().__init__(message)
        self.cause = cause


class PeerUnavailable(PeerError):
    """The peer could not be reached or did not answer in time (``cause`` TIMEOUT / PEER_GONE)."""


class PeerRefused(PeerError):
    """The peer answered with an error (``code`` the gRPC status code's name): bad input, an unknown
    or expired transfer or link, a transport it does not serve, too many transfers."""

    def __init__(self, code: str, message: str, cause: BlockStatus = BlockStatus.REFUSED):
        super().__init__(cause, f"{code}: {message}")
        self.code = code


class LinkClosed(PeerError):
    def __init__(self, message: str = "the peer link is closed"):
        super().__init__(BlockStatus.CANCELLED, message)


# ------------------------------------------------------------------ the seam


class PeerLink(abc.ABC):
    """A connection to one peer over one transport; see the module docstring for the contract."""

    peer: PeerAddress
    transport: str  # the Transport's name
    max_fetch_bytes: int  # the most one fetch may move

    @abc.abstractmethod
    def open_transfer(
        self, namespace_id: str, hashes: Sequence[bytes], ttl_s: float, deadline: float
    ) -> RemoteTransfer: ...

    @abc.abstractmethod
    def renew_transfer(self, transfer_id: bytes, ttl_s: float, deadline: float) -> float: ...

    @abc.abstractmethod
    def close_transfer(self, transfer_id: bytes, deadline: float, wait: bool = True) -> bool: ...

    @abc.abstractmethod
    def fetch(
        self, remote: Sequence[RemoteExtent], into: Sequence[memoryview], deadline: float
    ) -> Future[FetchResult]: ...

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """False once the link is closed or its control plane failed; the caller reconnects."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """Moves bytes host to host; knows nothing of the index. One instance per server process."""

    name: str  # "tcp" | "rdma": the metric label and the Handshake's transport

    @abc.abstractmethod
    def connect(self, peer: PeerAddress, deadline: float) -> PeerLink: ...

    @abc.abstractmethod
    def stats(self):
        """A ``metrics.TransportStats`` snapshot (monotonic counters, gauges, histograms)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Closes every link it made. Idempotent."""


# ------------------------------------------------------------------ the serving side's source


class SourceBlock(NamedTuple):
    """One block a ``TransferSource`` pinned: where its bytes are in the pool."""

    offset: int  # byte offset in the pool (pool_view / pool_fd)
    length: int
    checksum: int | None = None  # XXH3-64 of the bytes when the store keeps it; None: hashed here


class TransferSource(Protocol):
    """What the serving side reads blocks through; the block store implements it.

    ``open_transfer``
        Called on a gRPC thread, for one OpenTransfer. Pins the *leading* blocks of ``hashes``
        (in ``namespace_id``) that are sealed and resident in DRAM under one transfer lease, and
        returns ``(transfer_id, blocks)``: ``blocks[i]`` is ``hashes[i]``'s, stopping at the
        first block not held (``("", [])`` when the first is not). Must not block on I/O (a block
        only on SSD ends the prefix). The lease must expire by itself ``ttl_s`` after the call:
        a backstop, since the serving side closes it earlier (at CloseTransfer, or at its own TTL,
        which is ``ttl_s`` minus the grace it keeps: server/peers/transfers.py). Pinned blocks are
        neither evicted nor rewritten until the lease ends. Raise ``ValueError`` for input it
        rejects (answered INVALID_ARGUMENT), ``LookupError`` for an unknown namespace (a miss).
    ``renew_transfer``
        Called on a gRPC thread (RenewTransfer): the lease now expires ``ttl_s`` from the call.
        False when it is unknown or already expired. Must not block.
    ``close_transfer``
        Called by the serving side once no send of the transfer is in flight (so the pool slots
        can be reused at once). Idempotent: an unknown or expired id is ignored. Must not block.
    ``pool_fd`` / ``pool_file`` / ``pool_view``
        The pool: an fd ``os.sendfile`` can read from (the memfd; with tenant regions the pool is
        several memfds, and ``pool_file(offset)`` names the one holding a block and the offset in
        it), and the whole pool mapped (for hashing, ``sendmsg`` and RDMA registration). Block
        offsets index the view.
    """

    pool_fd: int
    pool_view: memoryview

    def pool_file(self, offset: int) -> tuple[int, int]: ...

    def open_transfer(
        self, namespace_id: str, hashes: Sequence[bytes], ttl_s: float
    ) -> tuple[str, list[SourceBlock]]: ...

    def renew_transfer(self, transfer_id: str, ttl_s: float) -> bool: ...

    def close_transfer(self, transfer_id: str) -> None: ...
