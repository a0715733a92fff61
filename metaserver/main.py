"""pegaflow-metaserver: the approximate global index of which node holds which KV blocks.

    pegaflow-metaserver [--addr 0.0.0.0:50056] [--http-addr 127.0.0.1:9092] [--log-level info]

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
    positive_seconds,
)
from pegaflow.metaserver.config import MetaServerConfig, parse_host_port
from pegaflow.metaserver.runtime import start_metaserver

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
        help="distinct block keys the index holds; beyond it the longest-unpublished keys are evicted "
        "(counted in pegaflow_meta_evicted_entries). About 250 bytes of memory each (default %(default)s)",
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
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
        json.dumps({"event": "ready", "addr": running.address, "http_addr": running.http_address}),
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
