"""Runs a whole server in this process, in background threads: engine, gRPC, local RPC socket, fd
broker, metrics.

``start_server(config)`` is what ``pegaflow-server`` (main.py) runs, and what an
embedding process (the connector's embedded mode, tests, the bench) calls to get
a real server without a second process. It returns once everything listens.

gRPC flavour: the sync ``grpc.server`` with a thread pool. Engine calls are
short and never await anything, so an asyncio server buys no concurrency, while
a handler waiting (with its deadline) for the engine lock would stall an event
loop and every other call on it. Measured on the 2-core dev box with the same
servicer run inline under grpc.aio (QueryPrefix of 128 hashes, p50 / p99):
1 client sync 0.70 / 3.1 ms vs aio 0.79 / 5.2 ms; 8 client processes sync
3.3 / 17 ms vs aio 1.9 / 26 ms - no consistent winner, as the recipes found for
grpc.aio and uvloop. bench/server_bench.py measures the chosen server.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import threading

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from pegaflow.common.auth import RefusalCollector
from pegaflow.common.grpc_server import listen, mark_serving, new_grpc_server
from pegaflow.common.metrics_http import MetricsHttpServer
from pegaflow.proto import pegaflow_pb2
from pegaflow.server.config import ServerConfig, parse_host_port
from pegaflow.server.endpoints.doorbell import DoorbellServer
from pegaflow.server.endpoints.fd_broker import FdBroker
from pegaflow.server.endpoints.grpc_servicer import EngineServicer, add_engine_servicer
from pegaflow.server.endpoints.local_rpc import LocalRpcServer
from pegaflow.server.endpoints.unix_socket import raise_open_file_limit
from pegaflow.server.engine import KVEngine
from pegaflow.server.metrics.registry import ServerMetrics
from pegaflow.server.movers.foreground_priority import ForegroundPriority
from pegaflow.server.remote_access import RemoteAccess

log = logging.getLogger(__name__)

SERVICE_NAME = pegaflow_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
MAX_MESSAGE_BYTES = 8 << 20


class RunningServer:
    """Handles of a started server. ``stop()`` shuts everything down and frees the pool."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics: ServerMetrics | None = None
        self.engine: KVEngine | None = None
        self.gpu = None  # server.gpu.service.GpuDataPath when this host has a usable GPU
        self.broker: FdBroker | None = None
        self.grpc_server: grpc.Server | None = None
        self.local_rpc: LocalRpcServer | None = None  # None when its socket could not be bound
        self.doorbell: DoorbellServer | None = None  # the GPU data path's local socket, when there is one
        self.peers = None  # server.peers.node.PeerNode with --metaserver-addr
        self.access: RemoteAccess | None = None  # who may call, what this node presents (remote_access.py)
        self.health: health.HealthServicer | None = None
        self.http: MetricsHttpServer | None = None
        self.address = ""
        self.http_address: str | None = None
        self.fd_socket_path = ""
        self.local_rpc_socket_path = ""
        self.read_lane_socket_path = ""  # "" when the read lane is off or its socket could not be bound
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    @property
    def epoch(self) -> str:
        return self.engine.epoch if self.engine else ""

    def health_check(self) -> tuple[bool, dict]:
        engine = self.engine
        ok = engine is not None and not engine.closed and not self._stopped.is_set()
        return ok, {"epoch": self.epoch, "address": self.address}

    def stop(self, grace_s: float = 2.0) -> None:
        with self._stop_lock:
            if self._stopped.is_set():
                return
            if self.health is not None:
                self.health.enter_graceful_shutdown()
            if self.peers is not None:
                self.peers.stop()  # stops pulling and publishing; peers' leases on us end with the engine
            if self.grpc_server is not None:
                self.grpc_server.stop(grace_s).wait(grace_s + 1)
            if self.local_rpc is not None:
                self.local_rpc.stop(grace_s)
            if self.read_lane_socket_path and self.engine is not None and self.engine.lane is not None:
                self.engine.lane.stop()
            if self.doorbell is not None:
                self.doorbell.stop(grace_s)
            if self.http is not None:
                self.http.stop()
            if self.broker is not None:
                self.broker.stop()
            if self.metrics is not None:
                self.metrics.close()
            if self.gpu is not None:
                self.gpu.close()
            if self.engine is not None:
                self.engine.close()
            self._stopped.set()
            log.info("server stopped")

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until stop() has finished; True if it has."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _default_fd_socket_path(epoch: str) -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"pegaflow-{os.getpid()}-{epoch}.sock")


def _local_rpc_socket_path(fd_socket_path: str) -> str:
    """Next to the fd broker's socket (a deployment that mounts that directory into a container gets
    both), e.g. pegaflow-<pid>-<epoch>.rpc.sock."""
    base, ext = os.path.splitext(fd_socket_path)
    return f"{base}.rpc{ext or '.sock'}"


def _start_local_rpc(server: RunningServer, servicer: EngineServicer) -> None:
    """The local RPC socket; without it (it cannot be bound) clients simply use gRPC."""
    path = _local_rpc_socket_path(server.fd_socket_path)
    try:
        local = LocalRpcServer(
            path,
            servicer,
            server.engine.epoch,
            MAX_MESSAGE_BYTES,
            worker_setup=server.engine.interpreter_core.pin,
        )
    except OSError as exc:
        log.warning("local rpc socket %s unavailable (%s); local clients will use gRPC", path, exc)
        return
    server.local_rpc = local
    local.start()
    server.local_rpc_socket_path = servicer.local_rpc_socket_path = path


def _start_read_lane(server: RunningServer, servicer: EngineServicer) -> None:
    """The read lane's socket (server/read_lane/), next to the others; without it (the lane is off,
    unavailable here, or its socket cannot be bound) every query goes to the engine."""
    lane = server.engine.lane
    if lane is None:
        return
    base, ext = os.path.splitext(server.fd_socket_path)
    path = f"{base}.read{ext or '.sock'}"
    try:
        lane.serve(path, server.engine.epoch)
    except OSError as exc:
        log.warning("read lane socket %s unavailable (%s); queries go to the engine", path, exc)
        return
    server.read_lane_socket_path = servicer.read_lane_socket_path = path


def _start_doorbell(server: RunningServer) -> None:
    """The GPU data path's local socket (next to the others); without it workers use the RPCs."""
    gpu = server.gpu
    if gpu is None:
        return
    base, ext = os.path.splitext(server.fd_socket_path)
    path = f"{base}.doorbell{ext or '.sock'}"
    try:
        doorbell = DoorbellServer(path, gpu, server.engine.epoch, server.config, server.metrics)
    except OSError as exc:
        log.warning("gpu doorbell socket %s unavailable (%s); GPU workers will use the RPCs", path, exc)
        return
    server.doorbell = doorbell
    doorbell.start()
    gpu.doorbell_path = path  # named in RegisterDeviceMemory's answer from now on


def _start_gpu(config: ServerConfig, engine: KVEngine):
    """The GPU data path when CuPy and a GPU are present (it pins the pool for DMA once); else None."""
    if config.gpu_copy_mode == "off":
        return None
    from pegaflow.server.gpu import service as gpu_service

    if not gpu_service.available():
        log.info("gpu: no CUDA device or no CuPy; the GPU data path is off")
        return None
    gpu = gpu_service.GpuDataPath(engine, gpu_service.GpuOptions(copy_mode=config.gpu_copy_mode))
    engine.add_session_listener(gpu.on_session_end)
    return gpu


# A request thread that returns from a wait (a socket, the GPU, a disk) needs the GIL back; while
# another thread runs Python (the metrics feeder's bursts of 5-10 ms every 100 ms, eviction) it
# gets it only when that thread is forced to switch, after the interval: 5 ms by default. Measured
# on the H200 host (bench/tail_latency.py, server/gpu/README.md): 0.2 ms cut the idle p99 of a
# 64-hash query over the local socket from 5.7 to 1.6 ms and removed the 2-4x slow GPU runs.
SWITCH_INTERVAL_S = 2e-4
GC_FREEZE = True  # benchmarks switch these off (bench/gpu_bench.py, tail_latency.py) to measure them


def tune_serving_process() -> None:
    """For the pegaflow-server daemon (not an embedding process, whose interpreter is not ours): a
    short GIL switch interval, and gc.freeze() once everything long-lived exists, so a full
    collection (which stops every thread) scans only what was made since (measured: one GPU save
    in ten stalled 16-32 ms in a collection, server/gpu/README.md)."""
    if SWITCH_INTERVAL_S < sys.getswitchinterval():
        log.info(
            "GIL switch interval %.1f ms -> %.2f ms", sys.getswitchinterval() * 1e3, SWITCH_INTERVAL_S * 1e3
        )
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    if GC_FREEZE:
        gc.collect()
        gc.freeze()


def foreground_priority(config: ServerConfig) -> ForegroundPriority | None:
    """How SSD I/O yields to requests served from DRAM (--ssd-yield-ms), or None (no SSD, or 0)."""
    if not config.ssd_cache_paths or config.ssd_yield_s <= 0:
        return None
    return ForegroundPriority(hold_s=config.ssd_yield_s, busy_depth=config.ssd_yield_depth)


def open_ssd_tier(config: ServerConfig, pacer: ForegroundPriority | None = None):
    """The L3 SSD tier the flags ask for, or None. SsdConfigError (a ValueError) refuses the start."""
    if not config.ssd_cache_paths:
        return None
    from pegaflow.server.tiers.ssd.config import SsdTierOptions
    from pegaflow.server.tiers.ssd.tier import SsdTier

    options = {"paths": config.ssd_cache_paths, "capacity_bytes": config.ssd_cache_capacity_bytes}
    options["io_engine"] = config.ssd_io_engine
    if config.ssd_segment_bytes:
        options["segment_bytes"] = config.ssd_segment_bytes
    if config.ssd_queue_depth:
        options["queue_depth"] = config.ssd_queue_depth
    return SsdTier(SsdTierOptions(**options), pacer=pacer)


def start_server(config: ServerConfig) -> RunningServer:
    """Starts every part; on any failure stops what was started and re-raises."""
    server = RunningServer(config)
    try:
        raise_open_file_limit()  # every local client costs a few descriptors (issue 12 F4)
        # Before the pool exists: a credential file that cannot be used refuses the start at once.
        server.access = access = RemoteAccess.load(config)
        server.metrics = ServerMetrics(
            config.hll_windows, model_names=access.model_names, sketches=config.lookup_sketches
        )
        server.metrics.registry.register(RefusalCollector(access.server, "pegaflow_rpc_unauthenticated"))
        foreground = foreground_priority(config)
        ssd = open_ssd_tier(config, foreground)
        try:
            server.engine = engine = KVEngine(
                config,
                observer=server.metrics,
                ssd=ssd,
                foreground=foreground,
                tenant_caps=access.tenants.pool_caps() if access.tenants is not None else None,
                tenant_regions=access.tenants.regions() if access.tenants is not None else None,
            )
        except BaseException:
            if ssd is not None:
                ssd.close()
            raise
        server.metrics.bind(engine)
        server.gpu = _start_gpu(config, engine)

        server.fd_socket_path = config.fd_socket_path or _default_fd_socket_path(engine.epoch)
        server.broker = FdBroker(
            server.fd_socket_path,
            {part.name: part.fd for part in engine.region.parts},
            engine.attach_session,
            engine.detach_session,
        )
        server.broker.start()
        engine.add_session_listener(server.broker.forget_session)

        server.grpc_server = new_grpc_server(
            config.rpc_workers, "pegaflow-rpc", MAX_MESSAGE_BYTES, interceptors=access.server.interceptors
        )
        servicer = EngineServicer(
            engine, server.fd_socket_path, server.metrics, gpu=server.gpu, tenants=access.tenants
        )
        _start_local_rpc(server, servicer)  # before gRPC serves OpenSession, whose answer names it
        _start_read_lane(server, servicer)  # likewise
        _start_doorbell(server)  # before gRPC serves RegisterDeviceMemory, whose answer names it
        add_engine_servicer(servicer, server.grpc_server)
        server.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(server.health, server.grpc_server)
        host, _ = parse_host_port(config.addr)
        server.address = listen(server.grpc_server, config.addr, host, access.server.credentials)
        if config.metaserver_addr:
            from pegaflow.server.peers.node import PeerNode  # the L2 parts only load when asked for

            server.peers = PeerNode.create(config, engine, server.grpc_server, server.address)
            server.metrics.add_collector(server.peers.stats)
        server.grpc_server.start()
        if server.peers is not None:
            server.peers.start()

        if config.http_addr is not None:
            http_host, http_port = parse_host_port(config.http_addr)
            server.http = MetricsHttpServer(
                http_host,
                http_port,
                server.metrics.registry,
                server.health_check,
                thread_name="pegaflow-http",
            )
            server.http.start()
            server.http_address = server.http.address

        access.warn_exposure(config, server.address, server.http_address)
        mark_serving(server.health, SERVICE_NAME)
    except BaseException:
        server.stop(grace_s=0)
        raise
    log.info(
        "pegaflow-server ready: grpc %s (%s), metrics %s, pool fd socket %s, local rpc socket %s, "
        "read lane %s, epoch %s",
        server.address,
        access.describe(),
        server.http_address or "off",
        server.fd_socket_path,
        server.local_rpc_socket_path or "off",
        server.read_lane_socket_path or "off",
        engine.epoch,
    )
    return server
