"""pegaflow-server: the per-host KV cache daemon.

    pegaflow-server --pool-size 30gb [--use-hugepages] [--addr 127.0.0.1:50055] [--http-addr 127.0.0.1:9091]

When everything listens it prints one JSON line on stdout,
{"event": "ready", "addr": ..., "http_addr": ..., "fd_socket_path": ...,
 "local_rpc_socket_path": ..., "epoch": ...},
so a supervisor (or a test) that asked for port 0 learns the real ports. Logs
go to stderr. SIGTERM / SIGINT shut it down cleanly (leases dropped, pool freed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pegaflow.common.cli import (
    StopSignals,
    add_log_level_flag,
    checked_by,
    configure_logging,
    parsed_by,
    positive_seconds,
)
from pegaflow.server import interpreter_core
from pegaflow.server.config import ServerConfig, parse_host_port, parse_size, parse_windows
from pegaflow.server.errors import PoolCapacityError
from pegaflow.server.store.free_reserve import default_reserve_bytes

log = logging.getLogger("pegaflow.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pegaflow-server",
        description="Per-host external KV cache for vLLM: owns a shared host-memory pool, serves it to local "
        "engines over gRPC (control) and fd passing (data).",
    )
    p.add_argument(
        "--pool-size",
        type=parsed_by(parse_size),
        required=True,
        help="size of the shared KV pool, e.g. 512mb, 30gb, 1tb (binary units). Allocated and "
        "pre-faulted at start; refused if this machine cannot back it",
    )
    p.add_argument(
        "--addr",
        type=checked_by(parse_host_port),
        default="127.0.0.1:50055",
        help="gRPC listen address HOST:PORT (port 0 picks a free one; default %(default)s)",
    )
    p.add_argument(
        "--http-addr",
        type=checked_by(parse_host_port),
        default="127.0.0.1:9091",
        help="HTTP address for /metrics (Prometheus) and /health (default %(default)s)",
    )
    p.add_argument(
        "--use-hugepages",
        action="store_true",
        help="back the pool with 2 MiB huge pages (they must be reserved beforehand, "
        "e.g. /proc/sys/vm/nr_hugepages)",
    )
    p.add_argument(
        "--pool-dir",
        default=None,
        metavar="DIR",
        help="back the pool with a file in DIR, a tmpfs or hugetlbfs mount, instead of an anonymous memfd; "
        "a tmpfs mounted with huge=always gives 2 MiB transparent huge pages without a hugetlb reservation",
    )
    p.add_argument(
        "--persist-pool",
        action="store_true",
        help="with --pool-dir: keep the pool file and a journal of its sealed blocks across restarts, so a "
        "restarted server (crash or upgrade) serves the blocks it held again, each verified by its checksum",
    )
    p.add_argument(
        "--interpreter-cpu",
        type=parsed_by(interpreter_core.parse_setting),
        default="auto",
        metavar="auto|off|CPU",
        help="the CPU shared by the threads that run the save and query path's Python (the local RPC "
        "socket's workers, the free-slot reserve): one interpreter lock, so one CPU saves its hand-offs "
        "between CPUs. auto: the highest CPU this process may use, on hosts of at most 2 CPUs; off elsewhere",
    )
    p.add_argument(
        "--free-reserve",
        type=parsed_by(_size_or_zero),
        default=None,
        metavar="SIZE",
        help="free pool memory kept ahead of saves: the policy's next victims are evicted in the background, "
        "so a save into a full pool does not wait for its own evictions (0: it does). Default: 1/64 of the "
        "pool, at most 512mb",
    )
    p.add_argument(
        "--enable-lfu-admission",
        action="store_true",
        help="W-TinyLFU admission and eviction instead of plain LRU (protects against scans)",
    )
    p.add_argument(
        "--metric-hll-windows",
        type=parsed_by(parse_windows),
        default=parse_windows("15m,1h,24h"),
        metavar="WINDOWS",
        help="comma-separated windows for the hit-rate metrics and the HyperLogLog hit-rate ceiling "
        "(units ms, s, m, h, d; default 15m,1h,24h)",
    )
    p.add_argument(
        "--lookup-sketches",
        choices=("process", "thread"),
        default="process",
        help="where the HyperLogLog ceiling and the miss-ratio curve run: a child process (default: "
        "their per-key Python stays off the request path's GIL) or the server's metrics thread",
    )
    p.add_argument(
        "--read-lane",
        choices=("on", "off"),
        default="on",
        help="answer prefix queries and lease releases of DRAM blocks from native code, out of the "
        "server's interpreter (server/read_lane/; default on: built with the system's C compiler on "
        "first use, proven in a child process, off with a warning if that fails); its socket is next "
        "to the fd socket (.read before the extension)",
    )
    p.add_argument(
        "--fd-socket-path",
        default=None,
        help="Unix socket on which local clients receive the pool's fd "
        "(default: a fresh path under $XDG_RUNTIME_DIR or the temp dir, removed at exit); the local "
        "RPC socket is created next to it (its name with .rpc before the extension)",
    )
    p.add_argument(
        "--session-ttl",
        type=positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help="a client that sends no request or heartbeat for this long loses its leases and "
        "unsealed blocks (default %(default)s)",
    )
    p.add_argument(
        "--write-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="granted blocks not sealed within this many seconds are freed (default %(default)s)",
    )
    p.add_argument(
        "--gpu-copy-mode",
        default="auto",
        choices=["auto", "direct", "staged", "off"],
        help="GPU data path, used when CuPy and a CUDA GPU are present: workers register their KV "
        "tensors by CUDA IPC and the server copies with batched kernels (direct), through device "
        "staging and the copy engine (staged), or picks per request (auto, default); off: never use CUDA",
    )
    ssd = p.add_argument_group(
        "L3 SSD tier",
        "blocks spill to local SSD files (O_DIRECT, io_uring) and are promoted back on a prefix hit; "
        "checksummed, and served again after a restart. Without --ssd-cache-path the server is DRAM only",
    )
    ssd.add_argument(
        "--ssd-cache-path",
        action="append",
        default=[],
        metavar="PATH",
        help="a file or a directory for the SSD tier (repeatable: several paths, e.g. one per disk, are "
        "striped so their bandwidth adds up); refused at start if it cannot be opened for O_DIRECT writing",
    )
    ssd.add_argument(
        "--ssd-cache-capacity",
        type=parsed_by(parse_size),
        default=0,
        metavar="SIZE",
        help="total SSD tier capacity over all paths, e.g. 512gb; preallocated at start and refused if the "
        "file systems cannot hold it",
    )
    ssd.add_argument(
        "--ssd-write-policy",
        choices=["on-reuse", "on-seal", "off"],
        default="on-reuse",
        help="when a DRAM block is written to SSD: on-reuse (default) at its second sighting: a lookup hits "
        "it in DRAM, or it is saved again after lookups missed it twice (lost before its reuse); one-off "
        "blocks never wear the disk. on-seal: every sealed block (write-through). off: never (serve only "
        "what was recovered)",
    )
    ssd.add_argument(
        "--ssd-io-engine",
        choices=["auto", "io_uring", "threads"],
        default="auto",
        help="io_uring (probed in a child process at start) or a thread pool of preadv/pwritev; auto picks "
        "the faster one that works on this machine (default)",
    )
    ssd.add_argument(
        "--ssd-segment-size",
        type=parsed_by(parse_size),
        default=0,
        metavar="SIZE",
        help="the SSD log's segment size, its unit of reuse (default: the tier's, see server/tiers/ssd)",
    )
    ssd.add_argument(
        "--ssd-queue-depth",
        type=int,
        default=0,
        metavar="N",
        help="SSD I/Os in flight over all paths together (default: the tier's, 32)",
    )
    ssd.add_argument(
        "--ssd-yield-ms",
        type=float,
        default=30.0,
        metavar="MS",
        help="after a query served wholly from DRAM, start no SSD read for this long, so that request's "
        "prefill does not compete with the disk (at most half the time under steady DRAM hits; promotions "
        "are slowed, never stopped; writes are not held back); 0 turns it off (default 30)",
    )
    ssd.add_argument(
        "--ssd-yield-depth",
        type=int,
        default=2,
        metavar="N",
        help="SSD reads in flight for a second after a query served from DRAM, so a yield takes effect "
        "at once (default 2)",
    )
    ssd.add_argument(
        "--promote-inflight",
        type=parsed_by(parse_size),
        default=parse_size("1gb"),
        metavar="SIZE",
        help="bytes being promoted from SSD into DRAM at once; an SSD hit beyond it is a miss, counted "
        "(default 1gb)",
    )
    ssd.add_argument(
        "--demote-inflight",
        type=parsed_by(parse_size),
        default=parse_size("256mb"),
        metavar="SIZE",
        help="bytes being written to SSD at once; a block beyond it is not written, counted (default 256mb)",
    )
    peers = p.add_argument_group(
        "L2 other nodes' DRAM",
        "publish this node's blocks to pegaflow-metaserver and pull a prefix another node holds on a "
        "local miss (TCP streams, or RDMA one-sided READ with --nics). Without --metaserver-addr this "
        "node works alone",
    )
    peers.add_argument(
        "--metaserver-addr",
        default=None,
        metavar="ADDR",
        help="pegaflow-metaserver: host:port (the seed's http://host:port too), several host:port,... "
        "replicas, or etcd://host:port[,...][/prefix] to find the leader through etcd. With it, --addr must "
        "be this node's routable address: peers dial it",
    )
    peers.add_argument(
        "--nics",
        nargs="+",
        action="extend",
        default=[],
        metavar="DEV",
        help="RDMA devices to pull over (e.g. mlx5_0 mlx5_1; repeatable). None, or none usable: TCP, said "
        "once in the log",
    )
    peers.add_argument(
        "--peer-transport",
        choices=["auto", "tcp", "rdma"],
        default="auto",
        help="auto: RDMA when --nics names usable devices, else TCP (default); rdma refuses to start without",
    )
    peers.add_argument(
        "--peer-streams", type=int, default=4, metavar="N", help="TCP streams per peer (default %(default)s)"
    )
    peers.add_argument(
        "--peer-data-addr",
        type=checked_by(parse_host_port),
        default=None,
        metavar="HOST:PORT",
        help="where the peer data plane listens (default: --addr's host, a free port, told at handshake)",
    )
    peers.add_argument(
        "--peer-fetch-deadline",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="one pull from a peer, end to end; past it the pull is a miss (default %(default)s)",
    )
    peers.add_argument(
        "--peer-transfer-ttl",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long a peer keeps blocks pinned for one of our pulls; must outlive the fetch deadline "
        "(default %(default)s)",
    )
    peers.add_argument(
        "--peer-max-fetch-bytes",
        type=parsed_by(parse_size),
        default=parse_size("4gb"),
        metavar="SIZE",
        help="the most one pull moves (default 4gb)",
    )
    access = p.add_argument_group(
        "remote access",
        "who may call --addr, and what this node presents to the peers and the metaserver it calls "
        '(server/remote_access.py; ARCHITECTURE.md, "Trust model"). None of them: plaintext gRPC open '
        "to whoever reaches --addr (loopback by default); a warning at start when other hosts can. "
        "Tokens are read from files, never from the command line (ps shows it to every local user)",
    )
    access.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="require one of this file's tokens (one per line, >= 16 printable characters, e.g. openssl "
        "rand -hex 32) as 'authorization: Bearer <token>' on every gRPC call but health checks, Engine and "
        "PeerTransfer alike; others get UNAUTHENTICATED. Re-read when it changes (rotation: add the new "
        "token as a second line, move the clients, drop the old one). Clients: PEGAFLOW_AUTH_TOKEN_FILE",
    )
    access.add_argument(
        "--tenant-file",
        default=None,
        metavar="PATH",
        help="tenants, one per line: NAME TOKEN [leased=SIZE] [unsealed=SIZE] [pool=SIZE | region=SIZE]. "
        "A session opened with a tenant's token acts for that tenant: its namespaces are its own (no hits, "
        "dedup or probing across tenants), leased/unsealed cap what all its sessions pin and hold unsealed "
        "together, pool caps the DRAM its blocks hold in the shared pool (at the cap it evicts its own "
        "blocks, never another tenant's), region gives it memory of its own beside the pool (a memfd of "
        "that size holding only its blocks, the only memory its sessions can map; not with --pool-dir). "
        "Its tokens are accepted on gRPC beside --auth-token-file's (an --auth-token-file token opens "
        "sessions of no "
        "tenant). Read at start; must not be readable by others",
    )
    access.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="serve gRPC over TLS with this PEM certificate (chain); with --tls-key. Also this node's "
        "client certificate towards peers and the metaserver when TLS to them is on",
    )
    access.add_argument("--tls-key", default=None, metavar="PATH", help="the PEM private key of --tls-cert")
    access.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PATH",
        help="mutual TLS: accept only callers with a certificate this PEM CA signed (checked in the TLS "
        "handshake, health probes included: a caller without one sees UNAVAILABLE)",
    )
    access.add_argument(
        "--peer-auth-token-file",
        default=None,
        metavar="PATH",
        help="with --metaserver-addr: the token (first line) sent to peers, whose --addr checks it "
        "(default: --auth-token-file's, the cluster's one token)",
    )
    access.add_argument(
        "--peer-tls-ca",
        default=None,
        metavar="PATH",
        help="with --metaserver-addr: dial peers over TLS, verifying their certificates against this PEM CA "
        "(a certificate must name the address its node advertises, --addr); this node's --tls-cert is "
        "presented for peers that require mutual TLS",
    )
    access.add_argument(
        "--metaserver-auth-token-file",
        default=None,
        metavar="PATH",
        help="with --metaserver-addr: the token (first line) sent to the metaserver (no default: it is "
        "another service)",
    )
    access.add_argument(
        "--metaserver-tls-ca",
        default=None,
        metavar="PATH",
        help="with --metaserver-addr: dial the metaserver over TLS, verifying it against this PEM CA; "
        "--tls-cert is presented when it requires mutual TLS",
    )
    access.add_argument(
        "--metrics-hide-models",
        action="store_true",
        help="name models by a stable digest (model-<16 hex>, SHA-256 of the id) in /metrics labels and "
        "GetStats, for every caller; the id stays in this server's logs",
    )
    access.add_argument(
        "--metrics-model-key-file",
        default=None,
        metavar="PATH",
        help="as --metrics-hide-models (implies it), with a digest keyed by this file (HMAC-SHA-256; the "
        "same file on every node gives the same labels), so a guessed model name cannot be confirmed",
    )
    add_log_level_flag(p)
    return p


def _size_or_zero(text: str) -> int:
    """A size, or "0" for none (a bare 0 is unambiguous, unlike a bare 30)."""
    return 0 if text.strip() == "0" else parse_size(text)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        pool_size_bytes=args.pool_size,
        addr=args.addr,
        http_addr=args.http_addr,
        use_hugepages=args.use_hugepages,
        pool_dir=args.pool_dir,
        persist_pool=args.persist_pool,
        interpreter_cpu=args.interpreter_cpu,
        free_reserve_bytes=(
            default_reserve_bytes(args.pool_size) if args.free_reserve is None else args.free_reserve
        ),
        enable_lfu_admission=args.enable_lfu_admission,
        hll_windows=args.metric_hll_windows,
        lookup_sketches=args.lookup_sketches,
        read_lane=args.read_lane == "on",
        fd_socket_path=args.fd_socket_path,
        session_ttl_s=args.session_ttl,
        write_timeout_s=args.write_timeout,
        gpu_copy_mode=args.gpu_copy_mode,
        ssd_cache_paths=tuple(args.ssd_cache_path),
        ssd_cache_capacity_bytes=args.ssd_cache_capacity,
        ssd_write_policy=args.ssd_write_policy,
        ssd_io_engine=args.ssd_io_engine,
        ssd_segment_bytes=args.ssd_segment_size,
        ssd_queue_depth=args.ssd_queue_depth,
        ssd_yield_s=args.ssd_yield_ms / 1e3,
        ssd_yield_depth=args.ssd_yield_depth,
        promote_inflight_bytes=args.promote_inflight,
        demote_inflight_bytes=args.demote_inflight,
        metaserver_addr=args.metaserver_addr,
        nics=tuple(args.nics),
        peer_transport=args.peer_transport,
        peer_streams=args.peer_streams,
        peer_data_addr=args.peer_data_addr,
        peer_fetch_deadline_s=args.peer_fetch_deadline,
        peer_transfer_ttl_s=args.peer_transfer_ttl,
        peer_max_fetch_bytes=args.peer_max_fetch_bytes,
        auth_token_file=args.auth_token_file,
        tenant_file=args.tenant_file,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        tls_client_ca_file=args.tls_client_ca,
        peer_auth_token_file=args.peer_auth_token_file,
        peer_tls_ca_file=args.peer_tls_ca,
        metaserver_auth_token_file=args.metaserver_auth_token_file,
        metaserver_tls_ca_file=args.metaserver_tls_ca,
        metrics_hide_models=args.metrics_hide_models,
        metrics_model_key_file=args.metrics_model_key_file,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line, like any other bad flag
    configure_logging(args.log_level)
    from pegaflow.server.runtime import start_server  # after logging is set up: start-up logs matter

    try:
        server = start_server(config)
    except (PoolCapacityError, ValueError) as exc:  # ValueError: SsdConfigError, a tier refusing its flags
        log.error("%s", exc)
        print(f"pegaflow-server: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        log.error("cannot start: %s", exc)
        print(f"pegaflow-server: error: {exc}", file=sys.stderr)
        return 1

    from pegaflow.server.runtime import tune_serving_process

    tune_serving_process()
    stop = StopSignals(log)
    print(
        json.dumps(
            {
                "event": "ready",
                "addr": server.address,
                "http_addr": server.http_address,
                "fd_socket_path": server.fd_socket_path,
                "local_rpc_socket_path": server.local_rpc_socket_path,
                "read_lane_socket_path": server.read_lane_socket_path,
                "epoch": server.epoch,
                "pool_size_bytes": server.engine.region.size_bytes,
                "prefault_s": round(server.engine.region.prefault_s, 3),
            }
        ),
        flush=True,
    )
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
