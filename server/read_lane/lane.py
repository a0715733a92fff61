"""The engine's handle on the read lane (read_lane.c): its directory of DRAM-readable blocks, its
sessions, its socket, and the signals its served calls leave behind.

Primitives, by role (all but the serving ones are called under the engine lock):

directory - the block store keeps it equal to "sealed, ready in DRAM, not corrupt"::

    publish(entries)       they became readable (seal, promotion, fetch, a recovered pool slot)
    unpublish(entry) -> bool, unpublish_many(keys) -> mask
                           they stop being readable (eviction); False / 0: a lane lease reads it,
                           the store must keep it (it stays published)
    retire(entry) -> int   hidden from queries at once (corrupt); the lane leases still reading it
                           (0: forgotten). The last one's release comes back as a ``dead_released``
                           signal, and only then may the store free the slot
    pinned(entry) -> bool  a lane lease holds it (the eviction policy skips it)
    set_checksum(entry)    its checksum became known (hashed after its seal)

sessions and quotas - the lane answers only for sessions and instances the engine registered::

    add_session / remove_session / add_instance / remove_instance
    charge(session, want, unit) -> granted | -1 | None
                           the engine's own leases count against the one lease quota kept here
    uncharge(session, bytes)

serving - ``serve(path, epoch)`` binds the socket (the local sockets' checks and permissions,
server/endpoints/unix_socket.py) and starts the native thread; ``stop()`` ends it.

signals - ``drain()`` returns what the calls served since the last drain leave for the engine
(``LaneSignals``): exact counts, and the best-effort records of each query (for recency, the
lookup sketches and the SSD placement), release (load metrics), retired block let go, and call
(RPC metrics). The engine applies them on a thread of its own (engine.py, ``_lane_loop``).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Sequence

from pegaflow.common.wire import frames
from pegaflow.common.wire import read_lane as wire
from pegaflow.server.endpoints.unix_socket import (
    FRAME_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    bind_unix_listener,
    socket_identity,
    unlink_if_ours,
)
from pegaflow.server.read_lane import native

log = logging.getLogger(__name__)

# Bytes of signal records the native side buffers between two drains (~4,000 queries of 64 32-byte
# hashes); beyond it records are dropped and counted, never waited for.
SIGNAL_BYTES = 8 << 20
# Frame bytes all the lane's connections may buffer at once (each frame is read whole before it runs).
BUFFERED_LIMIT_BYTES = 64 << 20
TOMBSTONE_TTL_S = 60.0

# take_counts() order (read_lane.c, C_*).
COUNT_NAMES = (
    "lookup_queries",
    "dram_hits",
    "misses",
    "load_queries",
    "load_missed_blocks",
    "leases",
    "releases",
    "loaded_bytes",
    "not_executed",
    "signals_dropped",
    "expired_leases",
)
_SIG_QUERY, _SIG_RELEASE, _SIG_DEAD, _SIG_CALL = 1, 2, 3, 4
_U32 = struct.Struct("<I")
_QUERY_HEAD = struct.Struct("<BBHHHI")
_RELEASE = struct.Struct("<BBHIQQ")
_DEAD_HEAD = struct.Struct("<BBHI")
_CALL = struct.Struct("<BBBBQ")
METHODS = {wire.OP_QUERY: "QueryPrefix", wire.OP_RELEASE: "ReleaseLease"}


@dataclasses.dataclass
class QuerySignal:
    load: bool  # purpose LOAD (else LOOKUP)
    ns_index: int
    hashes: list[bytes]  # as asked
    found: int  # leading hashes readable in DRAM
    served: int  # of those, answered (all of them: a lease that would not fit is the engine's)


@dataclasses.dataclass
class LaneSignals:
    counts: dict[str, int]
    queries: list[QuerySignal]
    loads: list[tuple[int, int, float]]  # (namespace index, bytes read, lease age in seconds)
    dead_released: list[tuple[int, bytes]]  # retired blocks no lane lease reads any more
    calls: list[tuple[str, int, float]]  # (method, gRPC status number, seconds in the lane)

    def __bool__(self) -> bool:
        records = self.queries or self.loads or self.dead_released or self.calls
        return bool(records or any(self.counts.values()))


def decode_signals(data: bytes) -> tuple[list[QuerySignal], list, list, list]:
    queries: list[QuerySignal] = []
    loads, dead, calls = [], [], []
    at, end = 0, len(data)
    while at + 4 <= end:
        (size,) = _U32.unpack_from(data, at)
        body = at + 4
        at = body + size
        kind = data[body]
        if kind == _SIG_QUERY:
            _, purpose, n, found, served, ns = _QUERY_HEAD.unpack_from(data, body)
            lengths = data[body + _QUERY_HEAD.size : body + _QUERY_HEAD.size + n]
            pos = body + _QUERY_HEAD.size + n
            hashes = []
            for length in lengths:
                hashes.append(data[pos : pos + length])
                pos += length
            queries.append(QuerySignal(bool(purpose), ns, hashes, found, served))
        elif kind == _SIG_RELEASE:
            _, _, _, ns, loaded, age_ns = _RELEASE.unpack_from(data, body)
            loads.append((ns, loaded, age_ns / 1e9))
        elif kind == _SIG_DEAD:
            _, klen, _, ns = _DEAD_HEAD.unpack_from(data, body)
            start = body + _DEAD_HEAD.size
            dead.append((ns, data[start : start + klen]))
        elif kind == _SIG_CALL:
            _, op, code, _, duration = _CALL.unpack_from(data, body)
            calls.append((METHODS.get(op, "?"), code, duration / 1e9))
    return queries, loads, dead, calls


class ReadLane:
    def __init__(self, lane, max_hash_bytes: int, max_batch: int):
        self._lane = lane
        self.max_hash_bytes = max_hash_bytes
        self.max_batch = max_batch
        self.path = ""
        self._identity = None
        self._listener = None
        self.signal_fd = lane.signal_fd
        # Hot calls, bound once.
        self._publish = lane.publish
        self._unpublish = lane.unpublish
        self._pins = lane.pins

    @classmethod
    def create(cls, config, fallback_on_miss: bool) -> ReadLane | None:
        """The lane for an engine of ``config``; None (logged) when it cannot run here or is off."""
        if not config.read_lane:
            return None
        if config.max_hash_bytes > wire.MAX_HASH_BYTES:
            log.info(
                "read lane off: block hashes up to %d bytes (--max-hash-bytes) exceed its %d",
                config.max_hash_bytes,
                wire.MAX_HASH_BYTES,
            )
            return None
        try:
            mod = native.load()
        except native.ReadLaneUnavailable as exc:
            log.warning("read lane unavailable (%s); every query is served by the engine", exc)
            return None
        max_batch = min(config.max_batch_blocks, wire.MAX_HASHES)
        lane = mod.Lane(
            max_hash_bytes=config.max_hash_bytes,
            max_batch=max_batch,
            default_ttl_s=config.lease_ttl_s,
            max_ttl_s=config.max_lease_ttl_s,
            fallback_on_miss=fallback_on_miss,
            signal_bytes=SIGNAL_BYTES,
            tombstone_ttl_s=max(TOMBSTONE_TTL_S, config.write_timeout_s),
        )
        return cls(lane, config.max_hash_bytes, max_batch)

    # ---------------------------------------------------------------- directory

    def publish(self, entries: Sequence) -> None:
        """Entries of one namespace and one block size, each sealed and ready in DRAM."""
        if not entries:
            return
        first = entries[0]
        self._publish(
            first.key[0],
            [e.key[1] for e in entries],
            [e.dram for e in entries],
            first.length,
            [e.checksum or 0 for e in entries],
        )

    def publish_one(self, entry) -> None:
        self._publish(entry.key[0], (entry.key[1],), (entry.dram,), entry.length, (entry.checksum or 0,))

    def unpublish(self, entry) -> bool:
        return self._unpublish(entry.key[0], entry.key[1])

    def unpublish_many(self, keys: Sequence) -> bytes:
        """``unpublish`` of each (namespace index, hash) key under one lock: per key 1 when it is no
        longer published, 0 when a lane lease reads it (it stays published)."""
        return self._lane.unpublish_many(keys)

    def retire(self, entry) -> int:
        return self._lane.retire(entry.key[0], entry.key[1])

    def pinned(self, key) -> bool:
        return self._pins(key[0], key[1]) > 0

    def set_checksum(self, entry) -> None:
        self._lane.set_checksum(entry.key[0], entry.key[1], entry.checksum or 0)

    # ------------------------------------------------------------ sessions

    def add_session(
        self, session_id: str, part_base: int, limit_bytes: int, max_leases: int, serve: bool
    ) -> None:
        self._lane.add_session(session_id, part_base, max(limit_bytes, 0), max_leases, serve)

    def remove_session(self, session_id: str) -> int:
        return self._lane.remove_session(session_id)

    def add_instance(self, instance_id: str, session_id: str, ns_index: int, block_bytes: int) -> None:
        self._lane.add_instance(instance_id, session_id, ns_index, block_bytes)

    def remove_instance(self, instance_id: str) -> None:
        self._lane.remove_instance(instance_id)

    def charge(self, session_id: str, want_bytes: int, unit_bytes: int) -> int | None:
        return self._lane.charge(session_id, want_bytes, unit_bytes)

    def uncharge(self, session_id: str, nbytes: int) -> None:
        self._lane.uncharge(session_id, nbytes)

    # ---------------------------------------------------------- lane leases

    def release(self, session_id: str, lease_id: int, loaded_bytes: int) -> tuple[int, float] | None:
        """Ends a lane lease through the engine: (its bytes, its age) or None (unknown: tombstoned)."""
        return self._lane.release(session_id, lease_id, max(int(loaded_bytes), 0))

    def lease_keys(self, session_id: str, lease_id: int) -> list[tuple[int, bytes]] | None:
        return self._lane.lease_keys(session_id, lease_id)

    def expire(self, now: float | None = None) -> int:
        return self._lane.expire() if now is None else self._lane.expire(now)

    def set_fallback_on_miss(self, value: bool) -> None:
        self._lane.set_fallback_on_miss(value)

    # ------------------------------------------------------------- signals

    def drain(self) -> LaneSignals:
        counts = dict(zip(COUNT_NAMES, self._lane.take_counts(), strict=True))
        queries, loads, dead, calls = decode_signals(self._lane.drain())
        return LaneSignals(counts, queries, loads, dead, calls)

    def stats(self) -> dict:
        return self._lane.stats()

    # -------------------------------------------------------------- serving

    def serve(
        self,
        path: str,
        epoch: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        buffered_limit_bytes: int = BUFFERED_LIMIT_BYTES,
    ) -> None:
        """Binds ``path`` (OSError: refused, in use) and starts the serving thread. The bounds are the
        other local sockets' (server/endpoints/unix_socket.py): at the connection cap a new connection
        evicts the longest idle one (GOODBYE); an idle connection gets GOODBYE after
        ``idle_timeout_s``; a frame must arrive whole within ``frame_timeout_s``; frames longer than a
        request can be, or past ``buffered_limit_bytes`` over all connections, are refused unread."""
        listener = bind_unix_listener(path)
        try:
            self._lane.serve(
                listener.fileno(),
                frames.encode_hello(wire.HELLO_MAGIC, wire.VERSION, epoch),
                max_connections,
                idle_timeout_s,
                wire.max_request_bytes(self.max_batch),
                frame_timeout_s,
                buffered_limit_bytes,
            )
        except BaseException:
            listener.close()
            unlink_if_ours(path, socket_identity(path))
            raise
        self._listener = listener
        self.path = path
        self._identity = socket_identity(path)

    def stop(self) -> None:
        """Says GOODBYE to every connection, ends the serving thread, removes the socket (if ours)."""
        self._lane.stop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            unlink_if_ours(self.path, self._identity)
