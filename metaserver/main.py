"""pegaflow-metaserver: the approximate global index of which node holds which KV blocks.

    pegaflow-metaserver [--addr 0.0.0.0:50056] [--http-addr 127.0.0.1:9092] [--log-level info]
    pegaflow-metaserver --etcd-endpoints etcd-a:2379,etcd-b:2379,etcd-c:2379 --advertise-addr this-host:50056

Without --etcd-endpoints it is the only metaserver (the embedded default). With
them it is one replica of several: the one holding the etcd leadership key
serves, the others answer FAILED_PRECONDITION naming the leader.

When everything listens it prints one JSON line on stdout,
{"event": "ready", "addr": ..., "http_addr": ...}, so a supervisor (or a test)
that asked for port 0 learns the real ports. Logs go to stderr. SIGTERM /
SIGINT shut it down cleanly.
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
from pegaflow.metaserver.config import MetaServerConfig, parse_host_port
from pegaflow.metaserver.runtime import start_metaserver


def _etcd_endpoints(text: str) -> tuple[str, ...]:
    # The same rules as leadership/etcd.py (not imported here: it needs the etcd client).
    endpoints = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        host, port = parse_host_port(part)
        if not host or port == 0:
            raise ValueError(f"expected host:port[,host:port...], got {text!r}")
        endpoints.append(part)
    return tuple(endpoints)


def _leader_ttl(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 2, got {text!r}")
    return int(text)


log = logging.getLogger("pegaflow.metaserver")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    defaults = MetaServerConfig()
    p = argparse.ArgumentParser(
        prog="pegaflow-metaserver",
        description="Approximate global index of which pegaflow-server node holds which KV blocks. Nodes "
        "register with a lease kept alive by heartbeats and publish the block keys they gain and lose; "
        "a node that misses locally asks Locate which peers hold the leading blocks of a prefix. "
        "The index is a hint (it may be stale), never the authority.",
    )
    p.add_argument(
        "--addr",
        type=checked_by(parse_host_port),
        default=defaults.addr,
        help="gRPC listen address HOST:PORT (port 0 picks a free one; default %(default)s)",
    )
    p.add_argument(
        "--http-addr",
        type=checked_by(parse_host_port),
        default=defaults.http_addr,
        help="HTTP address for /metrics (Prometheus) and /health (default %(default)s)",
    )
    p.add_argument(
        "--max-entries",
        type=_positive_int,
        default=defaults.max_entries,
        metavar="N",
        help="slots of the index table (rounded down to a multiple of 8): the most distinct block keys it "
        "holds; a key whose two buckets are full evicts the longest-unpublished of their 16 slots (counted "
        "in pegaflow_meta_evicted_entries). 52 bytes of memory each with up to 64 nodes, 8 more per further "
        "64 nodes (default %(default)s)",
    )
    p.add_argument(
        "--max-nodes",
        type=_positive_int,
        default=defaults.max_nodes,
        metavar="N",
        help="nodes that may hold a lease at once; more registrations get RESOURCE_EXHAUSTED "
        "(default %(default)s)",
    )
    p.add_argument(
        "--lease-ttl",
        type=positive_seconds,
        default=defaults.lease_ttl_s,
        metavar="SECONDS",
        help="lease granted to a node that asks for none: without a heartbeat for this long a node and "
        f"its entries expire. Nodes may ask for {defaults.min_lease_ttl_s:g}..{defaults.max_lease_ttl_s:g} s "
        "(default %(default)s)",
    )
    p.add_argument(
        "--etcd-endpoints",
        type=parsed_by(_etcd_endpoints),
        default=(),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="run as one replica of several, elected through this etcd cluster (client URLs of its "
        "members). Unset: the only metaserver, no etcd (default)",
    )
    p.add_argument(
        "--etcd-prefix",
        default=defaults.etcd_prefix,
        help="etcd key prefix of this metaserver cluster; its leader key is PREFIX/leader "
        "(default %(default)s)",
    )
    p.add_argument(
        "--leader-ttl",
        type=_leader_ttl,
        default=defaults.leader_ttl_s,
        metavar="SECONDS",
        help="the leader's etcd lease: a leader that cannot renew it within this many seconds stops serving, "
        "and a dead leader is replaced about this long after it died (whole seconds >= 2; default "
        "%(default)s)",
    )
    p.add_argument(
        "--advertise-addr",
        type=checked_by(parse_host_port),
        default=None,
        metavar="HOST:PORT",
        help="the address nodes are redirected to when this replica leads (default: the address bound, a "
        "wildcard host replaced by this host's name)",
    )
    access = p.add_argument_group(
        "remote access",
        "who may call --addr (common/auth.py). None of them: plaintext gRPC open to whoever reaches --addr "
        "(every interface by default: nodes on other hosts call it); a warning at start says so. Nodes "
        "present theirs with pegaflow-server --metaserver-auth-token-file / --metaserver-tls-ca",
    )
    access.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="require one of this file's tokens (one per line, >= 16 printable characters, e.g. openssl "
        "rand -hex 32) as 'authorization: Bearer <token>' on every call but health checks; others get "
        "UNAUTHENTICATED. Re-read when it changes. Never a token on the command line: ps shows it",
    )
    access.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="serve gRPC over TLS with this PEM certificate (chain), with --tls-key; it must name the "
        "address nodes dial (and, with replicas, every --advertise-addr)",
    )
    access.add_argument("--tls-key", default=None, metavar="PATH", help="the PEM private key of --tls-cert")
    access.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PATH",
        help="mutual TLS: accept only callers with a certificate this PEM CA signed (checked in the TLS "
        "handshake, health probes included)",
    )
    add_log_level_flag(p)
    return p


def config_from_args(args: argparse.Namespace) -> MetaServerConfig:
    defaults = MetaServerConfig()
    return MetaServerConfig(
        addr=args.addr,
        http_addr=args.http_addr,
        max_entries=args.max_entries,
        max_nodes=args.max_nodes,
        lease_ttl_s=args.lease_ttl,
        min_lease_ttl_s=min(defaults.min_lease_ttl_s, args.lease_ttl),
        max_lease_ttl_s=max(defaults.max_lease_ttl_s, args.lease_ttl),
        etcd_endpoints=args.etcd_endpoints,
        etcd_prefix=args.etcd_prefix,
        leader_ttl_s=args.leader_ttl,
        advertise_addr=args.advertise_addr or "",
        auth_token_file=args.auth_token_file,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        tls_client_ca_file=args.tls_client_ca,
    )


# A thread that wants the GIL waits up to this long for the one holding it. Python's 5 ms
# default put a Locate behind a 16384-key publish for 25-30 ms at p99 (bench/metaserver_bench.py,
# "locate_under_publish"); at 0.5 ms it is a few ms.
GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    configure_logging(args.log_level)
    config = config_from_args(args)
    try:
        running = start_metaserver(config)
    except (OSError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 1

    stop = StopSignals(log)
    log.info(
        "metaserver ready: grpc %s, http %s, max %d entries, lease ttl %.1fs",
        running.address,
        running.http_address,
        config.max_entries,
        config.lease_ttl_s,
    )
    print(
        json.dumps(
            {
                "event": "ready",
                "addr": running.address,
                "http_addr": running.http_address,
                "advertise_addr": running.leadership.advertise_address,
                "etcd": bool(config.etcd_endpoints),
            }
        ),
        flush=True,
    )
    try:
        stop.wait()
    finally:
        running.stop()
    log.info("metaserver stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
