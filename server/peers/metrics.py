"""The peer transports' counters, for both roles, as plain numbers the server maps to Prometheus.

Counters only grow; gauges (``open_*``) go up and down; histograms keep cumulative bucket counts,
a sum and a count (what ``prometheus_client.core.HistogramMetricFamily`` takes, so a collector
maps a snapshot without re-bucketing). Updated under a small lock of their own, never while a
socket call or a hash runs; ``snapshot()`` copies them for a scrape.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import Counter

from pegaflow.server.peers.base import BlockStatus

# Pull durations: a block of a few MiB takes ~1 ms on a 25 Gbit/s link, 1 GiB 0.1-1 s.
FETCH_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Effective throughput of a pull, GB/s (1e9 bytes): veth here ~2, 8 x 400 Gbit/s NICs ~200.
FETCH_GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


@dataclasses.dataclass(frozen=True)
class HistogramSnapshot:
    buckets: tuple[tuple[float, int], ...]  # (upper bound, cumulative count), +Inf last
    sum: float
    count: int


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:  # the caller holds the owner's lock
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self._counts, strict=True):
            total += n
            cumulative.append((bound, total))
        return HistogramSnapshot(tuple(cumulative), self._sum, total)


@dataclasses.dataclass(frozen=True)
class TransportStats:
    """The requester side of one transport (``transport`` is its metric label)."""

    transport: str
    links_opened: int
    links_closed: int
    open_links: int
    open_streams: int  # TCP streams connected now (RDMA: queue pairs in RTS)
    stream_connects: int  # data connections made (first and re-connects)
    connect_failures: dict[str, int]  # by cause label
    control_failures: dict[str, int]  # control-plane RPCs that failed, by cause label
    fetches: int
    fetches_failed: int  # fetches with at least one failed block
    blocks_ok: int
    bytes_ok: int
    blocks_failed: dict[
        str, int
    ]  # by cause label (timeout, peer_gone, checksum, protocol, refused, cancelled)
    fetch_seconds: HistogramSnapshot
    fetch_gbps: HistogramSnapshot  # pulls of at least GBPS_MIN_BYTES only


# A pull's GB/s is noise below this (a few blocks: set-up time dominates).
GBPS_MIN_BYTES = 16 << 20


class TransportCounters:
    """The requester side's counters (one per Transport instance)."""

    def __init__(self, transport: str):
        self.transport = transport
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._connect_failures: Counter[str] = Counter()
        self._control_failures: Counter[str] = Counter()
        self._blocks_failed: Counter[str] = Counter(
            {s.label: 0 for s in BlockStatus if s is not BlockStatus.OK}
        )
        self._seconds = Histogram(FETCH_SECONDS_BUCKETS)
        self._gbps = Histogram(FETCH_GBPS_BUCKETS)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def connect_failed(self, cause: BlockStatus) -> None:
        with self._lock:
            self._connect_failures[cause.label] += 1

    def control_failed(self, cause: BlockStatus) -> None:
        with self._lock:
            self._control_failures[cause.label] += 1

    def fetch_done(self, statuses, block_lengths, seconds: float) -> None:
        ok_bytes = ok_blocks = 0
        failed: Counter[str] = Counter()
        for status, length in zip(statuses, block_lengths, strict=True):
            if status is BlockStatus.OK:
                ok_blocks += 1
                ok_bytes += length
            else:
                failed[status.label] += 1
        with self._lock:
            self._c["fetches"] += 1
            self._c["fetches_failed"] += 1 if failed else 0
            self._c["blocks_ok"] += ok_blocks
            self._c["bytes_ok"] += ok_bytes
            self._blocks_failed.update(failed)
            self._seconds.observe(seconds)
            if not failed and ok_bytes >= GBPS_MIN_BYTES and seconds > 0:
                self._gbps.observe(ok_bytes / seconds / 1e9)

    def snapshot(self) -> TransportStats:
        with self._lock:
            c = self._c
            return TransportStats(
                transport=self.transport,
                links_opened=c["links_opened"],
                links_closed=c["links_closed"],
                open_links=c["links_opened"] - c["links_closed"],
                open_streams=c["streams_up"] - c["streams_down"],
                stream_connects=c["streams_up"],
                connect_failures=dict(self._connect_failures),
                control_failures=dict(self._control_failures),
                fetches=c["fetches"],
                fetches_failed=c["fetches_failed"],
                blocks_ok=c["blocks_ok"],
                bytes_ok=c["bytes_ok"],
                blocks_failed=dict(self._blocks_failed),
                fetch_seconds=self._seconds.snapshot(),
                fetch_gbps=self._gbps.snapshot(),
            )


@dataclasses.dataclass(frozen=True)
class ServeStats:
    """The serving side (one per server process)."""

    handshakes: int
    open_links: int
    links_expired: int
    transfers_opened: int  # OpenTransfer calls that pinned at least one block
    transfers_missed: int  # OpenTransfer calls that pinned nothing (the index was stale)
    open_transfers: int
    transfers_closed: int  # by CloseTransfer
    transfers_expired: int  # by their TTL (the requester died or went silent)
    blocks_pinned: int
    blocks_sent: int
    bytes_sent: int
    open_connections: int
    connections_refused: int  # over the connection cap
    error_frames: dict[str, int]  # data-plane ERROR frames sent, by PeerStatus name (lower case)
    rpc_errors: dict[str, int]  # control-plane calls answered with an error, by gRPC code name


class ServeCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._bad: Counter[str] = Counter()
        self._rpc: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def error_frame(self, status_name: str) -> None:
        with self._lock:
            self._bad[status_name.lower()] += 1

    def observe_rpc(self, method: str, code_name: str, seconds: float) -> None:
        """The rpc_handler frame's hook (common/rpc_handler.py)."""
        if code_name != "OK":
            with self._lock:
                self._rpc[code_name] += 1

    def snapshot(self) -> ServeStats:
        with self._lock:
            c = self._c
            return ServeStats(
                handshakes=c["handshakes"],
                open_links=c["links_opened"] - c["links_closed"],
                links_expired=c["links_expired"],
                transfers_opened=c["transfers_opened"],
                transfers_missed=c["transfers_missed"],
                open_transfers=c["transfers_opened"] - c["transfers_ended"],
                transfers_closed=c["transfers_closed"],
                transfers_expired=c["transfers_expired"],
                blocks_pinned=c["blocks_pinned"],
                blocks_sent=c["blocks_sent"],
                bytes_sent=c["bytes_sent"],
                open_connections=c["connections_opened"] - c["connections_closed"],
                connections_refused=c["connections_refused"],
                error_frames=dict(self._bad),
                rpc_errors=dict(self._rpc),
            )
