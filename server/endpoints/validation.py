"""Input checks for RPC requests: anything malformed becomes INVALID_ARGUMENT with a precise message.

Limits keep one request's work (and the engine lock hold time) bounded: at most
``max_batch_blocks`` hashes of at most ``max_hash_bytes`` each per call.
"""

from __future__ import annotations

from collections.abc import Sequence

from pegaflow.server.config import ServerConfig
from pegaflow.server.engine import QueryPurpose
from pegaflow.server.errors import InvalidArgument

MAX_ID_CHARS = 64
MAX_NAME_CHARS = 256


def ident(value: str, what: str) -> str:
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{what} is longer than {MAX_ID_CHARS} characters")
    return value


def optional_ident(value: str, what: str) -> str:
    return ident(value, what) if value else ""


def name(value: str, what: str) -> str:
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{what} is longer than {MAX_NAME_CHARS} characters")
    return value


def block_hashes(hashes: Sequence[bytes], config: ServerConfig, allow_empty: bool = False) -> list[bytes]:
    count = len(hashes)
    if count == 0 and not allow_empty:
        raise InvalidArgument("block_hashes must not be empty")
    if count > config.max_batch_blocks:
        raise InvalidArgument(
            f"{count} block hashes in one call exceed the limit of {config.max_batch_blocks}; split the batch"
        )
    limit = config.max_hash_bytes
    out = list(hashes)
    if out:
        lengths = list(map(len, out))  # C-speed scan; the slow loop below only runs to name the culprit
        if min(lengths) == 0 or max(lengths) > limit:
            for i, n in enumerate(lengths):
                if not 0 < n <= limit:
                    raise InvalidArgument(f"block_hashes[{i}] is {n} bytes; each must be 1..{limit} bytes")
    return out


def lease_ttl_s(ttl_ms: int, config: ServerConfig) -> float | None:
    if ttl_ms == 0:
        return None
    if ttl_ms > config.max_lease_ttl_s * 1000:
        raise InvalidArgument(
            f"lease_ttl_ms {ttl_ms} exceeds the maximum of {int(config.max_lease_ttl_s * 1000)}"
        )
    return ttl_ms / 1000.0


def purpose(value: int) -> QueryPurpose:
    try:
        return QueryPurpose(value)
    except ValueError:
        raise InvalidArgument(f"unknown query purpose {value}") from None
