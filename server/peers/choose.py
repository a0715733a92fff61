"""Picking the transport by name at start: ``--peer-transport auto|tcp|rdma`` and ``--nics``.

``auto`` (the default) is RDMA when ``--nics`` names devices and ``detect_rdma`` finds every one
of them with an active port, TCP otherwise, with one log line saying why. ``rdma`` insists (start
fails with the reason); ``tcp`` ignores ``--nics``. The serving side follows the same choice: it
always serves TCP, and RDMA too when the NICs are usable. The fetch logic only sees ``Transport``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from pegaflow.server.peers.base import Transport
from pegaflow.server.peers.tcp import DEFAULT_MAX_FETCH_BYTES, DEFAULT_STREAMS, TcpTransport

log = logging.getLogger(__name__)

TRANSPORT_CHOICES = ("auto", "tcp", "rdma")


class TransportUnavailable(RuntimeError):
    """``--peer-transport rdma`` on a node where RDMA cannot work (the message says why)."""


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    name: str  # "tcp" | "rdma": what runs
    reason: str  # why, in words (logged once at start)
    rdma_nics: tuple[str, ...] = ()  # the NICs the serving side registers the pool on (rdma only)


def choose(requested: str, nics: Sequence[str]) -> TransportChoice:
    """Decides once at start. Raises TransportUnavailable for ``rdma`` without usable NICs."""
    if requested not in TRANSPORT_CHOICES:
        raise ValueError(f"--peer-transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {requested!r}")
    if requested == "tcp" or (requested == "auto" and not nics):
        return TransportChoice(
            "tcp", "tcp (--peer-transport tcp)" if requested == "tcp" else "tcp (no --nics)"
        )
    from pegaflow.server.peers.rdma import detect_rdma  # pyverbs stays unimported without --nics

    ok, why = detect_rdma(nics)
    if ok:
        return TransportChoice("rdma", why, tuple(nics))
    if requested == "rdma":
        raise TransportUnavailable(f"--peer-transport rdma: {why}")
    return TransportChoice("tcp", f"tcp: RDMA unavailable ({why}); falling back to TCP")


def make_transport(
    choice: TransportChoice,
    *,
    node_id: str,
    streams: int = DEFAULT_STREAMS,
    max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES,
    local_pool: memoryview | None = None,
    control_auth=None,
) -> Transport:
    """The requester's transport; ``local_pool`` (the mapped pool) is needed for RDMA only;
    ``control_auth`` (a common.auth.ClientAuth): what it presents to peers' control plane."""
    log.info("peer transport: %s", choice.reason)
    if choice.name == "rdma":
        from pegaflow.server.peers.rdma import RdmaTransport

        if local_pool is None:
            raise ValueError("the RDMA transport needs the local pool to register")
        return RdmaTransport(
            choice.rdma_nics,
            local_pool,
            node_id=node_id,
            max_fetch_bytes=max_fetch_bytes,
            control_auth=control_auth,
        )
    return TcpTransport(
        streams=streams, node_id=node_id, max_fetch_bytes=max_fetch_bytes, control_auth=control_auth
    )


def make_responder(choice: TransportChoice, pool_view: memoryview):
    """The serving side's RDMA responder (``PeerServer(rdma=...)``), None for TCP."""
    if choice.name != "rdma":
        return None
    from pegaflow.server.peers.rdma import RdmaResponder

    return RdmaResponder(choice.rdma_nics, pool_view)
