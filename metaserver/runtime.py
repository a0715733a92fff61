"""Runs a whole metaserver in this process, in background threads: index, gRPC, leadership, maintenance, HTTP.

``start_metaserver(config)`` is what ``pegaflow-metaserver`` (main.py) runs and
what an embedding process (a test) calls; it returns once everything listens.
Without ``etcd_endpoints`` the process is the only replica (``SoleLeader``);
with them it is one of several (``EtcdLeadership``): it serves only while it
leads, and every term it wins starts with a fresh, empty index that the nodes
fill again by re-publishing (the per-block index is never stored in etcd).
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from pegaflow.common.addresses import format_host_port
from pegaflow.common.auth import RefusalCollector, ServerSecurity, exposure_warning
from pegaflow.common.grpc_server import listen, mark_serving, new_grpc_server
from pegaflow.common.metrics_http import MetricsHttpServer
from pegaflow.metaserver.config import MetaServerConfig, parse_host_port
from pegaflow.metaserver.index import GlobalIndex
from pegaflow.metaserver.leadership.base import Leadership
from pegaflow.metaserver.leadership.static import SoleLeader
from pegaflow.metaserver.metrics import MetaServerMetrics
from pegaflow.metaserver.service import MetaServerServicer
from pegaflow.metaserver.validation import MAX_MESSAGE_BYTES
from pegaflow.proto import metaserver_pb2, metaserver_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = metaserver_pb2.DESCRIPTOR.services_by_name["MetaServer"].full_name
# Slots whose dead-node bits one maintenance step clears (~2 ms of numpy work under the index lock).
SWEEP_CHUNK = 1 << 18


def _leadership(config: MetaServerConfig) -> Leadership:
    if not config.etcd_endpoints:
        return SoleLeader()
    # Imported here: a metaserver without etcd does not need the etcd client.
    from pegaflow.metaserver.leadership.etcd import EtcdLeadership

    return EtcdLeadership(list(config.etcd_endpoints), prefix=config.etcd_prefix, ttl_s=config.leader_ttl_s)


def advertised(config: MetaServerConfig, bound: str) -> str:
    if config.advertise_addr:
        return config.advertise_addr
    host, port = parse_host_port(bound)
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return format_host_port(host, port)


class RunningMetaServer:
    """Handles of a started metaserver; ``stop()`` shuts it down."""

    def __init__(self, config: MetaServerConfig) -> None:
        self.config = config
        self.leadership = _leadership(config)
        self.servicer: MetaServerServicer | None = None
        self._index = self._new_index()
        self.metrics = MetaServerMetrics(lambda: self.index, self.leadership)
        self.health = health.HealthServicer()
        self.grpc_server: grpc.Server | None = None
        self.http: MetricsHttpServer | None = None
        self.address = ""
        self.http_address: str | None = None
        self.security: ServerSecurity | None = None  # who may call (common/auth.py)
        self._stop = threading.Event()
        self._maintenance = threading.Thread(
            target=self._maintain, name="metaserver-maintenance", daemon=True
        )

    def _new_index(self) -> GlobalIndex:
        return GlobalIndex(self.config.max_entries, self.config.max_nodes)

    @property
    def index(self) -> GlobalIndex:
        return self._index

    def _install(self, index: GlobalIndex) -> None:
        self._index = index
        if self.servicer is not None:
            self.servicer.index = index

    def _on_elected(self, term: int) -> None:
        # A new term starts empty: the previous term's leases and entries mean nothing here.
        self._install(self._new_index())
        log.info("metaserver: serving term %d with an empty index; nodes re-publish into it", term)

    def _on_deposed(self, term: int) -> None:
        self._install(self._new_index())
        log.warning("metaserver: term %d ended; this replica stands by", term)

    def health_check(self) -> tuple[bool, dict]:
        ok = not self._stop.is_set() and self._maintenance.is_alive()
        view = self.leadership.view()
        return ok, {
            "address": self.address,
            "role": "leader" if view.serving() else "standby",
            "term": view.term,
            "leader": view.leader_address,
            "nodes": len(self.index.stats().nodes),
            "entries": len(self.index),
        }

    def _maintain(self) -> None:
        """Expires leases and sweeps dead nodes' bits out of the index, in short locked steps."""
        while not self._stop.wait(self.config.maintenance_interval_s):
            try:
                index = self.index
                for node_id in index.expire():
                    log.warning("metaserver: node %s missed its heartbeats; its entries expired", node_id)
                while not self._stop.is_set() and index.sweep_step(SWEEP_CHUNK):
                    pass
            except Exception:
                log.exception("metaserver: maintenance step failed; continuing")

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stop.is_set():
            return
        self.health.enter_graceful_shutdown()
        self._stop.set()
        # Resign first: a standby takes over while this process drains.
        self.leadership.stop()
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


def _warn_exposure(
    config: MetaServerConfig, running: RunningMetaServer, security: ServerSecurity
) -> list[str]:
    """One warning at start per surface other hosts reach with nothing authenticating its callers: gRPC
    (a node's heartbeats and publishes are its lease and its index entries: any caller could drop or
    forge them), and HTTP, which never authenticates (/metrics names every node by its address;
    namespaces are digests, no model names)."""
    warnings = []
    host, _ = parse_host_port(config.addr)
    text = exposure_warning("pegaflow-metaserver gRPC", running.address, host, security.authenticates, True)
    if text is not None:
        warnings.append(
            text + " Any caller can register as a node, publish or withdraw index entries and read where "
            "blocks live. Set --auth-token-file and/or --tls-cert/--tls-key/--tls-client-ca."
        )
    if config.http_addr is not None and running.http_address is not None:
        http_host, _ = parse_host_port(config.http_addr)
        text = exposure_warning(
            "pegaflow-metaserver /metrics and /health (HTTP)", running.http_address, http_host, False, False
        )
        if text is not None:
            warnings.append(
                text + " They name every node by its address (HTTP has no authentication: keep it "
                "behind a network policy, or listen on 127.0.0.1)."
            )
    for text in warnings:
        log.warning("%s", text)
    return warnings


def start_metaserver(config: MetaServerConfig) -> RunningMetaServer:
    config.validate()
    security = config.auth().open("pegaflow-metaserver")  # AuthConfigError (a ValueError): no start
    running = RunningMetaServer(config)
    running.security = security
    running.metrics.registry.register(RefusalCollector(security, "pegaflow_meta_rpc_unauthenticated"))
    try:
        server = new_grpc_server(
            config.grpc_workers,
            "metaserver-grpc",
            MAX_MESSAGE_BYTES,
            config.max_concurrent_rpcs,
            interceptors=security.interceptors,
        )
        running.servicer = MetaServerServicer(running.index, config, running.metrics, running.leadership)
        metaserver_pb2_grpc.add_MetaServerServicer_to_server(running.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(running.health, server)
        host, _ = parse_host_port(config.addr)
        running.address = listen(server, config.addr, host, security.credentials)
        running.leadership.advertise_address = advertised(config, running.address)
        running.grpc_server = server
        server.start()
        running._maintenance.start()
        running.leadership.start(running._on_elected, running._on_deposed)
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
        _warn_exposure(config, running, security)
        mark_serving(running.health, SERVICE_NAME)
    except BaseException:
        running.stop(grace_s=0)
        raise
    return running
