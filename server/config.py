"""Server configuration: one frozen dataclass shared by the CLI, the runtime and embedded users.

Sizes and durations from the command line are parsed strictly (common/units.py: "512mb", "30gb",
"1tb"; "15m", "1h", "24h"): a typo is an error, never a silent default.
"""

from __future__ import annotations

import dataclasses

# Sizes, durations and addresses are parsed by common/units.py (the connector reads the same
# spellings); re-exported here for the server's modules.
from pegaflow.common.units import (  # noqa: F401
    GIB,
    KIB,
    MIB,
    TIB,
    format_size,
    parse_duration,
    parse_host_port,
    parse_size,
)
from pegaflow.server import interpreter_core

MIN_POOL_BYTES = 4 * MIB  # one slab of the smallest size (tiers/dram/allocator.py)


def parse_windows(text: str) -> dict[str, float]:
    """'15m,1h,24h' -> {'15m': 900.0, '1h': 3600.0, '24h': 86400.0} (names kept as written)."""
    windows: dict[str, float] = {}
    for part in text.split(","):
        name = part.strip()
        if not name:
            raise ValueError(f"invalid window list {text!r}: empty entry")
        if name in windows:
            raise ValueError(f"invalid window list {text!r}: {name!r} given twice")
        windows[name] = parse_duration(name)
    return windows


def routable(host: str) -> bool:
    """Whether another node could dial ``host``: not a wildcard, loopback or localhost."""
    import ipaddress

    if host in ("localhost", "") or host.startswith("localhost."):
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return True  # a host name: the operator's DNS decides
    return not (ip.is_unspecified or ip.is_loopback)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything a running server needs. Defaults are the production defaults."""

    pool_size_bytes: int
    addr: str = "127.0.0.1:50055"
    http_addr: str | None = "127.0.0.1:9091"  # None: no metrics/health HTTP endpoint (embedded use)
    use_hugepages: bool = False
    # Back the pool with a file in this tmpfs / hugetlbfs mount instead of an anonymous memfd.
    pool_dir: str | None = None
    # Keep that file (and a journal of its sealed blocks) across restarts: the next server re-adopts
    # the blocks whose bytes still match their checksums (tiers/dram/journal.py).
    persist_pool: bool = False
    # Every sealed block is hashed (XXH3-64) off the request path; needed by persist_pool (None: on
    # exactly when the pool persists).
    block_checksums: bool | None = None
    enable_lfu_admission: bool = False
    hll_windows: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"15m": 900.0, "1h": 3600.0, "24h": 86400.0}
    )
    # Where the lookup sketches (HLL ceiling, miss-ratio curve) run: "process", a child of the server
    # (metrics/sketch_process.py; the CLI's default), or "thread", the metrics feeder thread.
    lookup_sketches: str = "thread"
    # Prefix queries and releases of DRAM blocks answered by native code out of the interpreter
    # (server/read_lane/); off, or unavailable here: every query runs in the engine.
    read_lane: bool = True
    # Unix socket that passes the pool fd; None = a fresh path under the system temp dir.
    fd_socket_path: str | None = None
    # Liveness: a client heartbeats every session_ttl_s / 5; silence for session_ttl_s kills its session.
    session_ttl_s: float = 5.0
    lease_ttl_s: float = 30.0  # default when the client asks for 0
    max_lease_ttl_s: float = 600.0
    write_timeout_s: float = 60.0  # granted-but-unsealed blocks are freed after this
    # Allocator slab size; None picks one from the pool size (see tiers/dram/README.md).
    slab_bytes: int | None = None
    # Free DRAM slots kept ahead of saves, evicted in the background (store/free_reserve.py); 0: a
    # save evicts for itself. The CLI's default is free_reserve.default_reserve_bytes(pool).
    free_reserve_bytes: int = 0
    # The CPU the threads running the save and query path's Python share (server/interpreter_core.py):
    # "auto" (one, on hosts of at most 2 CPUs), "off", or a CPU number.
    interpreter_cpu: str | int = "auto"
    max_batch_blocks: int = 4096  # hashes per QueryPrefix / AllocateBlocks / SealBlocks
    # Per session: bounds what one buggy client can pile up (leases and saves also expire).
    max_instances_per_session: int = 1024
    max_leases_per_session: int = 65536
    max_hash_bytes: int = 64
    rpc_workers: int = 16
    # Deadline applied to calls that arrive without one (the protocol requires one; health probes may not).
    default_rpc_deadline_s: float = 10.0
    reaper_interval_s: float = 0.2
    # GPU data path (server/gpu), used when CuPy and a GPU are present: auto | direct | staged; off = no CUDA.
    gpu_copy_mode: str = "auto"
    # ---- L3: the SSD tier (server/tiers/ssd). No paths: no SSD tier, the server is DRAM only.
    ssd_cache_paths: tuple[str, ...] = ()  # files or directories; several are striped
    ssd_cache_capacity_bytes: int = 0  # total over the paths (required with paths)
    ssd_write_policy: str = "on-reuse"  # policy/placement.py: on-seal | on-reuse | off
    ssd_io_engine: str = "auto"  # auto | io_uring | threads
    ssd_segment_bytes: int = 0  # 0: the tier's default
    ssd_queue_depth: int = 0  # I/Os in flight over all paths; 0: the tier's default
    # SSD reads yield to requests served from DRAM (server/movers/foreground_priority.py): no new read
    # for ssd_yield_s after such a query (0: never yield), at most ssd_yield_depth in flight for a
    # second after one.
    ssd_yield_s: float = 0.03
    ssd_yield_depth: int = 2
    # Bytes being promoted (SSD -> DRAM) / written (DRAM -> SSD) at once; beyond them a hit is a miss /
    # a block is not written (counted), never a wait.
    promote_inflight_bytes: int = 1 << 30
    demote_inflight_bytes: int = 256 << 20
    # Namespaces no instance uses and no block belongs to are forgotten after this long (bounded
    # memory and metric series however many layouts clients cycle through); at most max_namespaces.
    namespace_idle_s: float = 60.0
    max_namespaces: int = 4096
    # Per-session quotas, as fractions of the pool (review finding F8: one client pinning or reserving
    # the whole pool starved the others). A lease is cut to what fits; a save beyond its room gets
    # REJECTED for the blocks over it. The server's own in-process sessions are exempt.
    session_leased_fraction: float = 0.5
    session_unsealed_fraction: float = 0.5
    # ---- L2: other nodes' DRAM (server/peers/). No metaserver: this node neither publishes nor pulls.
    metaserver_addr: str | None = None  # host:port[,host:port...] | etcd://host:port[,...][/prefix]
    nics: tuple[str, ...] = ()  # RDMA devices; none (or none usable): TCP
    peer_transport: str = "auto"  # auto | tcp | rdma
    peer_streams: int = 4  # TCP streams per peer
    peer_data_addr: str | None = None  # where the peer data plane listens (default: --addr's host, port 0)
    peer_fetch_deadline_s: float = 10.0  # one pull from a peer, end to end
    peer_transfer_ttl_s: float = 30.0  # how long a peer keeps blocks pinned for one of our pulls
    peer_max_fetch_bytes: int = 4 << 30  # the most one pull moves
    peer_inflight_bytes: int = 8 << 30  # bytes being pulled at once
    # ---- Remote access (common/auth.py, server/remote_access.py). All unset: plaintext gRPC that any
    # caller who reaches --addr may use, exactly as before (the default --addr is loopback).
    auth_token_file: str | None = None  # tokens accepted on --addr (Engine and PeerTransfer alike)
    # Tenants (server/clients/tenants.py): NAME TOKEN [limits] per line; a session opened with a
    # tenant's token acts for it, in namespaces of its own. Its tokens are accepted on --addr too.
    tenant_file: str | None = None
    tls_cert_file: str | None = None  # TLS on --addr; also this node's client certificate to peers
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # mutual TLS: callers need a certificate this CA signed
    peer_auth_token_file: str | None = None  # the token sent to peers (default: auth_token_file's)
    peer_tls_ca_file: str | None = None  # TLS to peers, verified against this CA
    metaserver_auth_token_file: str | None = None  # the token sent to the metaserver
    metaserver_tls_ca_file: str | None = None  # TLS to the metaserver, verified against this CA
    # /metrics labels and GetStats name models by a digest (server/metrics/model_names.py); the key
    # file makes it a keyed digest (and implies hiding).
    metrics_hide_models: bool = False
    metrics_model_key_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pool_size_bytes, int) or self.pool_size_bytes <= 0:
            raise ValueError(f"pool_size_bytes must be a positive int, got {self.pool_size_bytes!r}")
        if self.pool_size_bytes < MIN_POOL_BYTES:
            raise ValueError(f"the pool must be at least {format_size(MIN_POOL_BYTES)} (one allocator slab)")
        reserve = self.free_reserve_bytes
        if not isinstance(reserve, int) or not 0 <= reserve <= self.pool_size_bytes // 4:
            raise ValueError(
                "--free-reserve (free_reserve_bytes) must be between 0 and a quarter of the pool"
            )
        object.__setattr__(self, "interpreter_cpu", interpreter_core.parse_setting(self.interpreter_cpu))
        if self.slab_bytes is not None and not 0 < self.slab_bytes <= self.pool_size_bytes:
            raise ValueError("slab_bytes must be positive and no larger than the pool")
        if self.persist_pool and not self.pool_dir:
            raise ValueError("--persist-pool needs --pool-dir (a tmpfs or hugetlbfs mount)")
        if self.persist_pool and self.block_checksums is False:
            raise ValueError("--persist-pool needs block checksums: a restarted server verifies every block")
        if self.use_hugepages and self.pool_dir:
            raise ValueError("--use-hugepages and --pool-dir exclude each other (mount hugetlbfs for both)")
        parse_host_port(self.addr)
        if self.http_addr is not None:
            parse_host_port(self.http_addr)
        if self.lookup_sketches not in ("process", "thread"):
            raise ValueError(f"lookup_sketches must be process or thread, got {self.lookup_sketches!r}")
        for name, seconds in self.hll_windows.items():
            if seconds <= 0:
                raise ValueError(f"hll window {name!r} must be positive")
        for field in ("session_ttl_s", "lease_ttl_s", "max_lease_ttl_s", "write_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError("lease_ttl_s must not exceed max_lease_ttl_s")
        if not 1 <= self.max_batch_blocks <= 1 << 16:
            raise ValueError("max_batch_blocks must be in 1..65536")
        if not 1 <= self.max_hash_bytes <= 1024:
            raise ValueError("max_hash_bytes must be in 1..1024")
        if not isinstance(self.ssd_cache_paths, tuple):
            object.__setattr__(self, "ssd_cache_paths", tuple(self.ssd_cache_paths))
        if self.ssd_cache_paths and self.ssd_cache_capacity_bytes <= 0:
            raise ValueError("--ssd-cache-capacity is required with --ssd-cache-path (e.g. 512gb)")
        if self.ssd_cache_capacity_bytes and not self.ssd_cache_paths:
            raise ValueError("--ssd-cache-capacity needs at least one --ssd-cache-path")
        if self.ssd_write_policy not in ("on-seal", "on-reuse", "off"):
            raise ValueError(f"ssd_write_policy must be on-seal, on-reuse or off: {self.ssd_write_policy!r}")
        if not 0 <= self.ssd_yield_s <= 1:
            raise ValueError(f"--ssd-yield-ms must be in 0..1000, got {self.ssd_yield_s * 1e3:g}")
        if self.ssd_yield_depth < 1:
            raise ValueError(f"--ssd-yield-depth must be >= 1, got {self.ssd_yield_depth}")
        if self.ssd_io_engine not in ("auto", "io_uring", "threads"):
            raise ValueError(f"ssd_io_engine must be auto, io_uring or threads, got {self.ssd_io_engine!r}")
        if not isinstance(self.nics, tuple):
            object.__setattr__(self, "nics", tuple(self.nics))
        if self.metaserver_addr is not None:
            host, _ = parse_host_port(self.addr)
            if not routable(host):
                raise ValueError(
                    f"--addr {self.addr}: with --metaserver-addr, peers dial this address to fetch blocks, "
                    "so it must be this node's routable address (not 0.0.0.0, ::, 127.x or localhost)"
                )
            if self.peer_transfer_ttl_s <= self.peer_fetch_deadline_s:
                raise ValueError("--peer-transfer-ttl must be longer than --peer-fetch-deadline")
        if self.peer_transport not in ("auto", "tcp", "rdma"):
            raise ValueError(f"peer_transport must be auto, tcp or rdma: {self.peer_transport!r}")
        if self.peer_data_addr is not None:
            parse_host_port(self.peer_data_addr)
        for field in ("session_leased_fraction", "session_unsealed_fraction"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"{field} must be in (0, 1]")
        for field in ("promote_inflight_bytes", "demote_inflight_bytes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")
        from pegaflow.server.remote_access import check_config  # flag combinations; no file is read

        check_config(self)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.session_ttl_s / 5.0
