"""Shared by the sync and asyncio clients: protobuf <-> client types, gRPC errors -> client exceptions."""

from __future__ import annotations

import dataclasses
import secrets
from itertools import repeat

import grpc

from pegaflow.client import errors
from pegaflow.client.types import (
    Allocation,
    AllocStatus,
    KvLayout,
    Location,
    PrefixHit,
    SaveBatch,
    ServerLimits,
    Tier,
)
from pegaflow.proto import pegaflow_pb2 as pb

NOT_FOUND_METADATA_KEY = "pegaflow-not-found"

MAX_MESSAGE_BYTES = 8 << 20  # the server's limit too; the local RPC socket applies the same one

# Reconnect fast after a server restart: grpc's own default backoff grows to 120 s.
# (Not grpc.min_reconnect_backoff_ms: it is also the connect timeout, and a low one
# aborts TCP/HTTP2 handshakes on a loaded machine - "tcp handshaker shutdown".)
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
]

_TRANSPORT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNIMPLEMENTED,
}


def new_id(prefix: str) -> str:
    """A client-chosen lease / save id: unguessable, since ids are bearer capabilities."""
    return prefix + secrets.token_hex(12)


def layout_message(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(**dataclasses.asdict(layout))


def limits_from(msg: pb.ServerLimits) -> ServerLimits:
    return ServerLimits(
        max_batch_blocks=msg.max_batch_blocks,
        max_hash_bytes=msg.max_hash_bytes,
        max_block_bytes=msg.max_block_bytes,
        default_lease_ttl_ms=msg.default_lease_ttl_ms,
        max_lease_ttl_ms=msg.max_lease_ttl_ms,
        write_timeout_ms=msg.write_timeout_ms,
    )


_STATUS = {s.value: s for s in AllocStatus}
_TIER = {t.value: t for t in Tier}


def locations(cols: pb.BlockLocations) -> list[Location]:
    length = cols.block_bytes
    n = len(cols.offsets)
    tiers = list(map(_TIER.get, cols.tiers, repeat(Tier.DRAM))) if cols.tiers else repeat(Tier.DRAM, n)
    sums = cols.checksums if len(cols.checksums) == n else repeat(0, n)
    if cols.tiers and len(tiers) != n:
        raise errors.ServerError(f"{len(tiers)} tiers for {n} block locations")
    # tuple.__new__ builds each Location in C: a 64-block answer's Python calls were ~1/3 of the
    # client's decoding (the NamedTuple constructor is a Python-level function).
    return list(map(tuple.__new__, repeat(Location), zip(cols.offsets, repeat(length), tiers, sums)))


def prefix_hit(resp: pb.QueryPrefixResponse) -> PrefixHit:
    return PrefixHit(
        num_hits=resp.num_hits,
        lease_id=resp.lease_id,
        locations=locations(resp.locations),
        epoch=resp.epoch,
        pending=resp.pending,
        sources=tuple(map(_TIER.get, resp.sources, repeat(Tier.DRAM))),
        searching=resp.searching,
    )


def save_batch(resp: pb.AllocateBlocksResponse) -> SaveBatch:
    granted = iter(resp.granted.offsets)
    length = resp.granted.block_bytes
    allocations = []
    for value in resp.statuses:
        status = _STATUS.get(value)
        if status is None:
            raise errors.ServerError(f"AllocateBlocks: unknown allocation status {value}")
        if status is AllocStatus.GRANTED:
            allocations.append(Allocation(status, next(granted), length))
        else:
            allocations.append(Allocation(status))
    return SaveBatch(save_id=resp.save_id, allocations=allocations, epoch=resp.epoch)


def check_hashes(hashes, limits: ServerLimits | None) -> list[bytes]:
    """Client-side check, so an oversized batch fails before it reaches the wire."""
    out = list(hashes)
    if not all(map(bytes.__instancecheck__, out)):
        out = [bytes(h) for h in out]
    if limits is not None and out:
        if len(out) > limits.max_batch_blocks:
            raise errors.InvalidArgument(
                f"{len(out)} block hashes exceed the server's limit of {limits.max_batch_blocks} per call"
            )
        lengths = list(map(len, out))
        if min(lengths) == 0 or max(lengths) > limits.max_hash_bytes:
            raise errors.InvalidArgument(f"every block hash must be 1..{limits.max_hash_bytes} bytes")
    return out


def not_found_kind(err: grpc.RpcError) -> str:
    try:
        for key, value in err.trailing_metadata() or ():
            if key == NOT_FOUND_METADATA_KEY:
                return value
    except Exception:  # aio errors may lack metadata on cancellation
        return ""
    return ""


def translate(err: grpc.RpcError, method: str) -> errors.PegaflowError:
    """The client exception for a failed call."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    message = f"{method}: {details or code.name}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded(message)
    if code in _TRANSPORT_CODES:
        return errors.ServerUnavailable(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(message)
    if code == grpc.StatusCode.NOT_FOUND:
        kind = not_found_kind(err)
        if kind == "session":
            return errors.SessionLost(message)
        return errors.NotFound(message, kind)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.ResourceExhausted(message)
    return errors.ServerError(message)


def needs_reconnect(exc: errors.PegaflowError) -> bool:
    """Transport failures and lost sessions; a plain deadline miss does not (the server may just be busy)."""
    return isinstance(exc, errors.ServerUnavailable) and not isinstance(exc, errors.DeadlineExceeded)
