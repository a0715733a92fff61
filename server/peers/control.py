"""The requester's end of the peer control plane (gRPC PeerTransfer, proto/peer.proto).

Shared by every transport: the handshake differs (TCP asks where the data port is, RDMA swaps
queue pairs), the transfer calls do not. Each call carries the caller's absolute deadline as its
gRPC timeout. gRPC errors become the seam's errors (base.py) with a failure cause:
DEADLINE_EXCEEDED -> ``PeerUnavailable(TIMEOUT)`` (a partition or a stalled peer),
UNAVAILABLE / CANCELLED -> ``PeerUnavailable(PEER_GONE)``, any other code -> ``PeerRefused``;
an answer that breaks the contract (wrong column lengths, a bad transfer id) ->
``PeerError(PROTOCOL)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc

from pegaflow.common.auth import AuthConfigError, ClientAuth
from pegaflow.common.auth import channel as auth_channel
from pegaflow.common.wire import peer_frames as frames
from pegaflow.proto import peer_pb2, peer_pb2_grpc
from pegaflow.server.peers.base import (
    BlockStatus,
    PeerAddress,
    PeerError,
    PeerRefused,
    PeerUnavailable,
    RemoteExtent,
    RemoteTransfer,
)
from pegaflow.server.peers.metrics import TransportCounters

log = logging.getLogger(__name__)

# An OpenTransfer answer for 16384 blocks is ~400 KiB; the default 4 MiB limit is plenty, but a
# peer configured for more blocks must not be cut off.
MAX_MESSAGE_BYTES = 64 << 20
_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
# Peers that refused our credentials (UNAUTHENTICATED): warned about once each, not once per pull,
# until a handshake with them succeeds again. Bounded by the cluster's size.
_refused_peers: set[str] = set()
_refused_lock = threading.Lock()


def _credentials_refused(peer: str, details: str) -> None:
    with _refused_lock:
        if peer in _refused_peers or len(_refused_peers) >= 4096:
            return
        _refused_peers.add(peer)
    log.warning(
        "peer %s refuses this node's credentials (%s): every pull from it is a miss until "
        "--peer-auth-token-file (or --auth-token-file) matches its --auth-token-file",
        peer,
        details,
    )


def _credentials_accepted(peer: str) -> None:
    if peer in _refused_peers:
        with _refused_lock:
            _refused_peers.discard(peer)
        log.info("peer %s accepts this node's credentials again", peer)


class ControlClient:
    def __init__(self, peer: PeerAddress, counters: TransportCounters, auth: ClientAuth | None = None):
        """``auth``: the token / TLS this node presents to peers (server/remote_access.py); None:
        plaintext, no token. A peer refusing it answers UNAUTHENTICATED (PeerRefused) or, for TLS,
        fails the handshake (PeerUnavailable): a miss either way, counted."""
        self.peer = peer
        self._counters = counters
        try:
            self._channel = auth_channel(
                peer.control,
                auth=auth,
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    # A peer that died comes back on the same address: do not wait out a long backoff.
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                ],
            )
        except AuthConfigError as exc:  # a credential file read at start has gone or gone bad since
            counters.control_failed(BlockStatus.REFUSED)
            raise PeerRefused("UNAUTHENTICATED", f"{peer.control}: our credentials: {exc}") from None
        self._stub = peer_pb2_grpc.PeerTransferStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, deadline: float):
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            self._counters.control_failed(BlockStatus.TIMEOUT)
            raise PeerUnavailable(BlockStatus.TIMEOUT, f"{method} to {self.peer.control}: deadline passed")
        try:
            return getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self._error(method, exc) from None

    def _error(self, method: str, exc: grpc.RpcError) -> PeerError:
        code = exc.code()
        where = f"{method} to {self.peer.control}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            err: PeerError = PeerUnavailable(BlockStatus.TIMEOUT, f"{where}: deadline exceeded")
        elif code in _GONE:
            err = PeerUnavailable(BlockStatus.PEER_GONE, f"{where}: {exc.details()}")
        else:
            err = PeerRefused(code.name, f"{where}: {exc.details()}")
            if code == grpc.StatusCode.UNAUTHENTICATED:
                _credentials_refused(self.peer.control, exc.details())
        self._counters.control_failed(err.cause)
        return err

    def _protocol(self, message: str) -> PeerError:
        self._counters.control_failed(BlockStatus.PROTOCOL)
        return PeerError(
            BlockStatus.PROTOCOL, f"{self.peer.control} answered against the contract: {message}"
        )

    # ------------------------------------------------------------------ calls

    def handshake(
        self, transport: str, node_id: str, deadline: float, queue_pairs=()
    ) -> peer_pb2.HandshakeResponse:
        request = peer_pb2.HandshakeRequest(
            transport=transport, frame_version=frames.VERSION, node_id=node_id, queue_pairs=list(queue_pairs)
        )
        response = self._call("Handshake", request, deadline)
        if not response.link_id:
            raise self._protocol("Handshake answered no link id")
        _credentials_accepted(self.peer.control)
        return response

    def close_link(self, link_id: str, deadline: float) -> None:
        """Fire and forget: the peer's link TTL ends it anyway."""
        self._async("CloseLink", peer_pb2.CloseLinkRequest(link_id=link_id), deadline)

    def open_transfer(
        self,
        link_id: str,
        namespace_id: str,
        hashes: Sequence[bytes],
        ttl_s: float,
        want_checksums: bool,
        deadline: float,
    ) -> RemoteTransfer:
        request = peer_pb2.OpenTransferRequest(
            link_id=link_id,
            namespace_id=namespace_id,
            block_hashes=list(hashes),
            ttl_ms=max(1, int(ttl_s * 1000)),
            want_checksums=want_checksums,
        )
        r = self._call("OpenTransfer", request, deadline)
        n = r.num_blocks
        if n == 0:
            return RemoteTransfer(b"", [], r.ttl_ms / 1000.0)
        if n > len(hashes):
            raise self._protocol(f"{n} blocks pinned for {len(hashes)} hashes")
        if len(r.transfer_id) != frames.TRANSFER_ID_BYTES:
            raise self._protocol(f"a transfer id of {len(r.transfer_id)} bytes")
        if len(r.lengths) != n or len(r.checksums) not in (0, n) or len(r.offsets) not in (0, n):
            raise self._protocol("columns of the wrong length")
        if want_checksums and len(r.checksums) != n:
            raise self._protocol("no checksums although they were asked for")
        if min(r.lengths) <= 0:
            raise self._protocol("a block of 0 bytes")
        sums = list(r.checksums) if r.checksums else [None] * n
        offsets = list(r.offsets) if r.offsets else [0] * n
        tid = bytes(r.transfer_id)
        extents = [RemoteExtent(tid, i, r.lengths[i], sums[i], offsets[i]) for i in range(n)]
        return RemoteTransfer(tid, extents, r.ttl_ms / 1000.0)

    def renew_transfer(self, transfer_id: bytes, ttl_s: float, deadline: float) -> float:
        request = peer_pb2.RenewTransferRequest(transfer_id=transfer_id, ttl_ms=max(1, int(ttl_s * 1000)))
        return self._call("RenewTransfer", request, deadline).ttl_ms / 1000.0

    def close_transfer(self, transfer_id: bytes, deadline: float, wait: bool = True) -> bool:
        request = peer_pb2.CloseTransferRequest(transfer_id=transfer_id)
        if not wait:
            self._async("CloseTransfer", request, deadline)
            return True
        try:
            self._call("CloseTransfer", request, deadline)
            return True
        except PeerError as exc:
            log.info("could not close peer transfer (its lease will expire): %s", exc)
            return False

    def _async(self, method: str, request, deadline: float) -> None:
        timeout = max(0.001, deadline - time.monotonic())
        try:
            future = getattr(self._stub, method).future(request, timeout=timeout)
        except (grpc.RpcError, ValueError) as exc:  # the channel is closed
            log.debug("%s not sent: %s", method, exc)
            return

        def done(f):
            if f.exception() is not None:
                self._error(method, f.exception())

        future.add_done_callback(done)
