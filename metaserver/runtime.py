"""Runs a whole metaserver in this process, in background threads: index, gRPC, maintenance, HTTP.

``start_metaserver(config)`` is what ``pegaflow-metaserver`` (main.py) runs and
what an embedding process (a test) calls; it returns once everything listens.
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from pegaflow.common.grpc_server import listen, mark_serving, new_grpc_server
from pegaflow.common.metrics_http import MetricsHttpServer
from pegaflow.metaserver.config import MetaServerConfig, parse_host_port
from pegaflow.metaserver.index import GlobalIndex
from pegaflow.metaserver.metrics import MetaServerMetrics
from pegaflow.metaserver.service import MetaServerServicer
from pegaflow.metaserver.validation import MAX_MESSAGE_BYTES
from pegaflow.proto import metaserver_pb2, metaserver_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = metaserver_pb2.DESCRIPTOR.services_by_name["MetaServer"].full_name
# Keys whose dead-node bits one maintenance step clears (a few ms under the index lock).
SWEEP_CHUNK = 20_000


class RunningMetaServer:
    """Handles of a started metaserver; ``stop()`` shuts it down."""

    def __init__(self, config: MetaServerConfig) -> None:
        self.config = config
        self.index = GlobalIndex(config.max_entries, config.max_nodes)
        self.metrics = MetaServerMetrics(self.index)
        self.health = health.HealthServicer()
        self.grpc_server: grpc.Server | None = None
        self.http: MetricsHttpServer | None = None
        self.address = ""
        self.http_address: str | None = None
        self._stop = threading.Event()
        self._maintenance = threading.Thread(
            target=self._maintain, name="metaserver-maintenance", daemon=True
        )

    def health_check(self) -> tuple[bool, dict]:
        ok = not self._stop.is_set() and self._maintenance.is_alive()
        return ok, {
            "address": self.address,
            "nodes": len(self.index.stats().nodes),
            "entries": len(self.index),
        }

    def _maintain(self) -> None:
        """Expires leases and sweeps dead nodes' bits out of the index, in short locked steps."""
        while not self._stop.wait(self.config.maintenance_interval_s):
            try:
                for node_id in self.index.expire():
                    log.warning("metaserver: node %s missed its heartbeats; its entries expired", node_id)
                while not self._stop.is_set() and self.index.sweep_step(SWEEP_CHUNK):
                    pass
            except Exception:
                log.exception("metaserver: maintenance step failed; continuing")

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stop.is_set():
            return
        self.health.enter_graceful_shutdown()
        self._stop.set()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace_s).wait(grace_s + 1)
        if self.http is not None:
            self.http.stop()
        if self._maintenance.is_alive():
            self._maintenance.join(timeout=5)

    def wait(self) -> None:
        """Blocks until the gRPC server terminates (after ``stop``)."""
        if self.grpc_server is not None:
            self.grpc_server.wait_for_termination()


def start_metaserver(config: MetaServerConfig) -> RunningMetaServer:
    config.validate()
    running = RunningMetaServer(config)
    try:
        server = new_grpc_server(
            config.grpc_workers, "metaserver-grpc", MAX_MESSAGE_BYTES, config.max_concurrent_rpcs
        )
        metaserver_pb2_grpc.add_MetaServerServicer_to_server(
            MetaServerServicer(running.index, config, running.metrics), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(running.health, server)
        host, _ = parse_host_port(config.addr)
        running.address = listen(server, config.addr, host)
        running.grpc_server = server
        server.start()
        running._maintenance.start()
        if config.http_addr is not None:
            http_host, http_port = parse_host_port(config.http_addr)
            running.http = MetricsHttpServer(
                http_host,
                http_port,
                running.metrics.registry,
                running.health_check,
                thread_name="metaserver-http",
            )
            running.http.start()
            running.http_address = running.http.address
        mark_serving(running.health, SERVICE_NAME)
    except BaseException:
        running.stop(grace_s=0)
        raise
    return running
