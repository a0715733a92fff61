"""Checks of every field a metaserver request carries; a failure is INVALID_ARGUMENT.

The client runs the same checks before sending, so a bad call fails fast with
the same message the server would give.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NODE_ID_CHARS = 128
MAX_ADDRESS_CHARS = 256
MAX_NAMESPACE_CHARS = 128
MAX_LEASE_ID_CHARS = 64
MAX_HASH_BYTES = 64
# Hashes per call, summed over a publish's deltas; also the longest prefix Locate takes.
MAX_KEYS_PER_CALL = 16_384
MAX_DELTAS_PER_CALL = 1024
# gRPC message cap on both ends: the largest valid request, with framing, fits with room to spare;
# anything bigger is refused by gRPC before it is parsed.
MAX_MESSAGE_BYTES = 4 * MAX_KEYS_PER_CALL * MAX_HASH_BYTES


class InvalidRequest(ValueError):
    """A request field is malformed; the message names the field."""


def _text(value: str, field: str, max_chars: int) -> str:
    if not value:
        raise InvalidRequest(f"{field} must not be empty")
    if len(value) > max_chars:
        raise InvalidRequest(f"{field} is longer than {max_chars} characters")
    if not value.isprintable() or value != value.strip():
        raise InvalidRequest(f"{field} must be printable, without surrounding whitespace")
    return value


def node_id(value: str) -> str:
    return _text(value, "node_id", MAX_NODE_ID_CHARS)


def namespace(value: str) -> str:
    return _text(value, "namespace", MAX_NAMESPACE_CHARS)


def lease_id(value: str) -> str:
    return _text(value, "lease_id", MAX_LEASE_ID_CHARS)


def address(value: str) -> str:
    """A gRPC ``host:port`` (``[v6]:port`` for IPv6) that peers can dial."""
    _text(value, "address", MAX_ADDRESS_CHARS)
    host, sep, port = value.rpartition(":")
    if not sep or not host or host in ("[]",):
        raise InvalidRequest(f"address must be host:port, got {value!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"address port must be 1..65535, got {value!r}")
    return value


def block_hashes(values: Sequence[bytes], field: str, limit: int = MAX_KEYS_PER_CALL) -> Sequence[bytes]:
    if len(values) > limit:
        raise InvalidRequest(f"{field} has {len(values)} hashes, more than {limit}")
    # min/max over map(len) run in C: 16384 hashes checked in ~0.3 ms instead of ~2 ms.
    if values and (min(map(len, values)) < 1 or max(map(len, values)) > MAX_HASH_BYTES):
        for i, value in enumerate(values):
            if not 0 < len(value) <= MAX_HASH_BYTES:
                raise InvalidRequest(f"{field}[{i}] must be 1..{MAX_HASH_BYTES} bytes, got {len(value)}")
    return values


def lease_ttl_ms(value: int, min_s: float, max_s: float, default_s: float) -> float:
    """The TTL to grant in seconds: the default for 0, else the request clamped to [min_s, max_s]."""
    if value == 0:
        return default_s
    return min(max_s, max(min_s, value / 1000.0))
