"""The server's statistics, defined once.

``EngineStats`` is the one list of what the server reports. Each field carries
its Prometheus metric in its metadata (kind, name, help, labels); the gRPC
GetStats answer is built from the same fields by name (proto field names equal
field names, checked by a test), and the metrics collector walks the same
fields. Adding a statistic is one field here (plus, for GetStats, one proto
field of the same name).

``StoreCounters`` and ``ClientCounters`` are the monotonic totals the block
store and the engine bump under the engine lock; ``EngineStats`` is a
snapshot of them and of the gauges, taken under the lock once per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from pegaflow.server.tiers.base import TierStats


def _metric(kind: str, name: str, doc: str, **labels: str) -> Any:
    return dataclasses.field(
        default=0, metadata={"kind": kind, "name": name, "doc": doc, "labels": tuple(labels.items())}
    )


def gauge(name: str, doc: str, **labels: str) -> Any:
    return _metric("gauge", name, doc, **labels)


def counter(name: str, doc: str, **labels: str) -> Any:
    """A monotonic total; prometheus-client exports it as ``<name>_total``."""
    return _metric("counter", name, doc, **labels)


def plain() -> Any:
    """A statistic for GetStats only (no metric of its own)."""
    return dataclasses.field(default=0)


class StoreCounters:
    """Monotonic totals of the block store (read without the lock by metrics: a torn read is one
    scrape off). Saturating by construction: Python ints do not overflow, and GetStats clamps."""

    __slots__ = (
        "sealed_blocks",
        "save_bytes",
        "aborted_blocks",
        "no_space_blocks",
        "evictions",
        "dram_drops_kept_on_ssd",
        "reserve_evictions",
        "reserve_zeroed_blocks",
        "promotions_started",
        "promoted_blocks",
        "promoted_bytes",
        "promotion_failures",
        "promotions_dropped",
        "demotions_started",
        "demoted_blocks",
        "demoted_bytes",
        "demotion_failures",
        "demotions_dropped",
        "corrupt_blocks",
        "ssd_reclaimed_blocks",
        "recovered_blocks",
        "recovered_dram_blocks",
        "fetches_started",
        "fetched_blocks",
        "fetched_bytes",
        "fetch_failures",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


class ClientCounters:
    """Monotonic totals of the request side (queries, leases, sessions)."""

    __slots__ = (
        "lookup_queries",
        "load_queries",
        "load_missed_blocks",
        "dram_hits",
        "ssd_hits",
        "remote_hits",
        "misses",
        "load_bytes",
        "expired_leases",
        "timed_out_saves",
        "sessions_closed",
        "sessions_disconnected",
        "sessions_expired",
        "quota_refusals",
        "read_lane_not_executed",
        "read_lane_signals_dropped",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


@dataclasses.dataclass(frozen=True)
class NamespaceStats:
    namespace_id: str
    model_id: str
    block_bytes: int
    resident_blocks: int
    instances: int
    tenant: str = ""


@dataclasses.dataclass(frozen=True)
class TenantStats:
    """One tenant's use, over all its sessions (server/clients/tenants.py); "" is the unnamed one."""

    name: str
    sessions: int
    namespaces: int
    resident_blocks: int
    leased_bytes: int
    unsealed_bytes: int
    quota_refusals: int
    # With a DRAM cap (--tenant-file pool=SIZE, policy/tenant_caps.py); 0 for an uncapped tenant.
    dram_bytes: int = 0  # its blocks' bytes in DRAM
    dram_cap_bytes: int = 0
    cap_evictions: int = 0  # its own blocks evicted to make room under its cap
    cap_refused_blocks: int = 0  # new blocks (saves, promotions, fetches) that did not fit its cap
    own_region: bool = False  # its blocks live in memory of its own (region=SIZE); the cap is its size


@dataclasses.dataclass
class EngineStats:
    epoch: str = ""
    # ---------------------------------------------------------------- pool (DRAM)
    pool_capacity_bytes: int = gauge("pegaflow_pool_capacity_bytes", "Bytes of the shared KV pool")
    pool_used_bytes: int = gauge(
        "pegaflow_pool_used_bytes", "Bytes of the pool holding blocks (sealed, being written or filled)"
    )
    stranded_bytes: int = gauge(
        "pegaflow_pool_stranded_bytes",
        "Bytes of slabs assigned to a block size but holding no block (free slots, slot tails)",
    )
    slab_bytes: int = plain()
    free_slabs: int = gauge("pegaflow_pool_free_slabs", "Slabs not assigned to any block size")
    total_slabs: int = gauge("pegaflow_pool_slabs", "Slabs in the pool")
    slab_moves: int = counter("pegaflow_pool_slab_moves", "Slabs moved from one block size to another")
    # --------------------------------------------------------------------- blocks
    resident_blocks: int = gauge("pegaflow_resident_blocks", "Sealed blocks held by any tier of this host")
    dram_blocks: int = gauge(
        "pegaflow_tier_resident_blocks", "Sealed blocks readable in the tier", tier="dram"
    )
    ssd_blocks: int = gauge("pegaflow_tier_resident_blocks", "Sealed blocks readable in the tier", tier="ssd")
    pinned_blocks: int = gauge("pegaflow_pinned_blocks", "Blocks pinned by at least one lease")
    writing_blocks: int = gauge("pegaflow_writing_blocks", "Blocks granted and not yet sealed")
    # -------------------------------------------------------------------- lookups
    hits: int = plain()  # all tiers; the per-tier split below
    dram_hits: int = counter(
        "pegaflow_block_hits", "Requested blocks found, by the tier they were found in", tier="dram"
    )
    ssd_hits: int = counter(
        "pegaflow_block_hits", "Requested blocks found, by the tier they were found in", tier="ssd"
    )
    remote_hits: int = counter(
        "pegaflow_block_hits", "Requested blocks found, by the tier they were found in", tier="remote"
    )
    misses: int = counter("pegaflow_block_misses", "Requested blocks not found (after the prefix hit)")
    lookup_queries: int = counter("pegaflow_queries", "Prefix queries that request blocks (LOOKUP)")
    load_queries: int = counter(
        "pegaflow_load_queries", "Prefix queries that load blocks an earlier lookup counted (LOAD)"
    )
    load_missed_blocks: int = counter(
        "pegaflow_load_missed_blocks",
        "Blocks LOAD queries asked for and did not find (gone since their lookup)",
    )
    # --------------------------------------------------------------- saves, loads
    save_bytes: int = counter("pegaflow_save_bytes", "Bytes sealed (saved) into the pool")
    sealed_blocks: int = counter("pegaflow_saved_blocks", "Blocks sealed")
    load_bytes: int = counter("pegaflow_load_bytes", "Bytes clients reported loading under leases")
    aborted_blocks: int = counter(
        "pegaflow_aborted_blocks", "Granted blocks freed unsealed (abort, timeout, client death)"
    )
    no_space_blocks: int = counter("pegaflow_no_space_blocks", "Block allocations refused: nothing evictable")
    # ------------------------------------------------------------------- eviction
    evictions: int = counter("pegaflow_evictions", "Blocks dropped to make room (no copy left on this host)")
    dram_drops_kept_on_ssd: int = counter(
        "pegaflow_dram_drops_kept_on_ssd", "DRAM copies dropped to make room while an SSD copy stays"
    )
    reserve_evictions: int = counter(
        "pegaflow_reserve_evictions",
        "Of the above (both kinds), those made ahead of a save to keep the free-slot reserve",
    )
    reserve_zeroed_blocks: int = counter(
        "pegaflow_reserve_zeroed_blocks",
        "Free slots another namespace's block had held, zeroed ahead of the save that gets them",
    )
    admission_rejections: int = counter(
        "pegaflow_admission_rejections", "Blocks the admission policy refused to keep"
    )
    # ------------------------------------------------------------------- tiering
    promotions_started: int = counter(
        "pegaflow_promotions_started", "SSD blocks whose promotion to DRAM started"
    )
    promoted_blocks: int = counter("pegaflow_promoted_blocks", "SSD blocks promoted into DRAM")
    promoted_bytes: int = counter("pegaflow_promoted_bytes", "Bytes promoted from SSD into DRAM")
    promotion_failures: int = counter(
        "pegaflow_promotion_failures", "Promotions that failed (I/O error, checksum, cancelled)"
    )
    promotions_dropped: int = counter(
        "pegaflow_promotions_dropped",
        "SSD hits not promoted (in-flight bound reached or no DRAM slot): counted as misses",
    )
    demotions_started: int = counter("pegaflow_demotions_started", "DRAM blocks whose write to SSD started")
    demoted_blocks: int = counter("pegaflow_demoted_blocks", "DRAM blocks written to SSD")
    demoted_bytes: int = counter("pegaflow_demoted_bytes", "Bytes written from DRAM to SSD")
    demotion_failures: int = counter("pegaflow_demotion_failures", "Writes to SSD that failed")
    demotions_dropped: int = counter(
        "pegaflow_demotions_dropped", "Blocks not written to SSD (write queue full or no SSD space)"
    )
    corrupt_blocks: int = counter(
        "pegaflow_corrupt_blocks", "Block copies that failed their checksum: dropped, never served"
    )
    ssd_reclaimed_blocks: int = counter(
        "pegaflow_ssd_reclaimed_blocks", "SSD copies dropped to reuse their space (oldest first)"
    )
    fetches_started: int = counter(
        "pegaflow_remote_fetch_started_blocks", "Blocks whose fetch from a peer started"
    )
    fetched_blocks: int = counter(
        "pegaflow_remote_fetched_blocks", "Blocks fetched whole from peers (checksums matched)"
    )
    fetched_bytes: int = counter("pegaflow_remote_fetch_bytes", "Bytes fetched whole from peers")
    fetch_failures: int = counter(
        "pegaflow_remote_fetch_failed_blocks", "Blocks whose fetch from a peer failed (never served)"
    )
    recovered_blocks: int = gauge("pegaflow_recovered_blocks", "Blocks recovered from the SSD tier at start")
    recovered_dram_blocks: int = gauge(
        "pegaflow_recovered_dram_blocks", "Blocks a persistent pool still held at start, checksums verified"
    )
    promoting_bytes: int = gauge("pegaflow_promoting_bytes", "Bytes being promoted from SSD now")
    demoting_bytes: int = gauge("pegaflow_demoting_bytes", "Bytes being written to SSD now")
    # ------------------------------------------------------------------- clients
    live_sessions: int = gauge("pegaflow_live_sessions", "Open client sessions")
    live_instances: int = gauge("pegaflow_live_instances", "Registered instances")
    live_leases: int = gauge("pegaflow_live_leases", "Unreleased leases")
    open_saves: int = gauge("pegaflow_open_saves", "Saves with unsealed blocks")
    expired_leases: int = counter("pegaflow_expired_leases", "Leases that reached their TTL unreleased")
    timed_out_saves: int = counter("pegaflow_timed_out_saves", "Saves freed by the write timeout")
    sessions_closed: int = counter("pegaflow_sessions_ended", "Sessions ended, by cause", cause="closed")
    sessions_disconnected: int = counter(
        "pegaflow_sessions_ended", "Sessions ended, by cause", cause="disconnected"
    )
    quota_refusals: int = counter(
        "pegaflow_quota_refusals", "Leases cut short or blocks REJECTED by a session's quota"
    )
    sessions_expired: int = counter(
        "pegaflow_sessions_ended", "Sessions ended, by cause", cause="heartbeat_timeout"
    )
    # The read lane (server/read_lane/): queries and releases answered natively.
    read_lane_leases: int = gauge("pegaflow_read_lane_leases", "Live leases taken through the read lane")
    read_lane_not_executed: int = counter(
        "pegaflow_read_lane_not_executed",
        "Calls the read lane handed back to the engine (unknown session, a chain beyond DRAM, ...)",
    )
    read_lane_signals_dropped: int = counter(
        "pegaflow_read_lane_signals_dropped",
        "Records of served read lane calls dropped because the engine fell behind (recency, sketches)",
    )
    read_lane_connections: int = gauge("pegaflow_read_lane_connections", "Open read lane connections")
    # ------------------------------------------------------------------- lists
    namespaces: list[NamespaceStats] = dataclasses.field(default_factory=list)
    tiers: list[TierStats] = dataclasses.field(default_factory=list)
    tenants: list[TenantStats] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class MetricField:
    field: str
    kind: str
    name: str
    doc: str
    labels: tuple[tuple[str, str], ...]


def metric_fields() -> Iterator[MetricField]:
    """Every EngineStats field that is a metric, in declaration order."""
    for f in dataclasses.fields(EngineStats):
        meta = f.metadata
        if "kind" in meta:
            yield MetricField(f.name, meta["kind"], meta["name"], meta["doc"], meta["labels"])


def scalar_fields() -> list[str]:
    """The EngineStats fields GetStats carries as plain proto fields of the same name."""
    lists = ("namespaces", "tiers", "tenants")
    return [f.name for f in dataclasses.fields(EngineStats) if f.name not in lists]


# Per-tier metrics: TierStats field -> (kind, metric name, help). Labelled by tier name.
TIER_METRICS: dict[str, tuple[str, str, str]] = {
    "capacity_bytes": ("gauge", "pegaflow_tier_capacity_bytes", "Bytes the tier can hold"),
    "used_bytes": ("gauge", "pegaflow_tier_used_bytes", "Bytes of the tier holding blocks"),
    "health": ("gauge", "pegaflow_tier_health", "Tier health: 0 ok, 1 degraded, 2 off"),
    "reads": ("counter", "pegaflow_tier_reads", "Block reads from the tier"),
    "read_bytes": ("counter", "pegaflow_tier_read_bytes", "Bytes read from the tier"),
    "writes": ("counter", "pegaflow_tier_writes", "Block writes to the tier"),
    "write_bytes": ("counter", "pegaflow_tier_write_bytes", "Bytes written to the tier"),
    "read_errors": ("counter", "pegaflow_tier_read_errors", "Reads that failed with an I/O error"),
    "write_errors": ("counter", "pegaflow_tier_write_errors", "Writes that failed with an I/O error"),
    "corrupt_records": (
        "counter",
        "pegaflow_tier_corrupt_records",
        "Records whose header or checksum failed",
    ),
    "queue_depth": ("gauge", "pegaflow_tier_queue_depth", "Tier I/O requests queued or in flight"),
    "queue_full_drops": ("counter", "pegaflow_tier_queue_full_drops", "Tier I/O refused: its queue was full"),
    "recovered_blocks": ("gauge", "pegaflow_tier_recovered_blocks", "Records recovered at start"),
    "recovery_skipped": (
        "gauge",
        "pegaflow_tier_recovery_skipped",
        "Records skipped at start (torn, corrupt)",
    ),
    "recovery_seconds": (
        "gauge",
        "pegaflow_tier_recovery_seconds",
        "Seconds the tier's start-up recovery took",
    ),
    "paced_seconds": (
        "counter",
        "pegaflow_tier_paced_seconds",
        "Seconds new tier I/O was held back for requests served from DRAM (--ssd-yield-ms)",
    ),
}


# Per-tenant metrics: TenantStats field -> (kind, metric name, help). Labelled by tenant name.
TENANT_METRICS: dict[str, tuple[str, str, str]] = {
    "sessions": ("gauge", "pegaflow_tenant_sessions", "Live sessions of the tenant"),
    "namespaces": ("gauge", "pegaflow_tenant_namespaces", "Namespaces of the tenant"),
    "resident_blocks": ("gauge", "pegaflow_tenant_resident_blocks", "Sealed blocks of the tenant, any tier"),
    "leased_bytes": ("gauge", "pegaflow_tenant_leased_bytes", "Bytes the tenant's leases pin"),
    "unsealed_bytes": (
        "gauge",
        "pegaflow_tenant_unsealed_bytes",
        "Bytes granted to the tenant's saves, not sealed yet",
    ),
    "quota_refusals": (
        "counter",
        "pegaflow_tenant_quota_refusals",
        "Leases cut short and saves refused blocks by a quota, per tenant",
    ),
    "dram_bytes": (
        "gauge",
        "pegaflow_tenant_dram_bytes",
        "Bytes of the tenant's blocks in DRAM (capped tenants)",
    ),
    "dram_cap_bytes": (
        "gauge",
        "pegaflow_tenant_dram_cap_bytes",
        "The tenant's DRAM cap (--tenant-file pool=SIZE); 0: uncapped",
    ),
    "cap_evictions": (
        "counter",
        "pegaflow_tenant_cap_evictions",
        "The tenant's own blocks evicted to make room under its DRAM cap",
    ),
    "cap_refused_blocks": (
        "counter",
        "pegaflow_tenant_cap_refused_blocks",
        "New blocks of the tenant (saves, promotions, fetches) that did not fit under its DRAM cap",
    ),
}
