"""The gRPC Engine service: validates, applies the deadline, calls the KVEngine, maps errors to codes.

Every handler runs under ``_handler`` (pegaflow.common.rpc_handler): the
caller's deadline (or the server's default when a call arrives without one) is
turned into an absolute engine deadline; engine errors become their status
codes (NOT_FOUND with trailing metadata naming what was unknown); anything
unexpected is logged and answered INTERNAL, so no request can take the server
down. A call whose deadline passes while it is being served is undone (a lease
released, a save aborted) and answered DEADLINE_EXCEEDED, so a client that gave
up leaks nothing; CloseSession's is finished instead (the engine's reaper ends
the session), since undoing a close would leak the session.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import grpc

from pegaflow.common.rpc_handler import rpc_handler
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.server.clients.tenants import TenantTable
from pegaflow.server.config import ServerConfig
from pegaflow.server.endpoints import validation as check
from pegaflow.server.engine import KVEngine
from pegaflow.server.errors import DeadlineExceeded, EngineError, InvalidArgument, NotFound
from pegaflow.server.gpu import rpc as gpu_rpc
from pegaflow.server.metrics.model_names import SHOWN, ModelNames
from pegaflow.server.metrics.registry import ServerMetrics
from pegaflow.server.store.namespace import KvLayout
from pegaflow.server.store.stats import EngineStats, scalar_fields

log = logging.getLogger(__name__)

NOT_FOUND_METADATA_KEY = "pegaflow-not-found"
ANSWER_MARGIN_S = 0.25


def _status_of(exc: Exception, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
    """An engine error's status code (its ``status``); None for anything else (a bug: INTERNAL)."""
    if not isinstance(exc, EngineError):
        return None
    if isinstance(exc, NotFound):
        context.set_trailing_metadata(((NOT_FOUND_METADATA_KEY, exc.kind),))
    return grpc.StatusCode[exc.status], str(exc)


_rpc_frame = rpc_handler(_status_of, DeadlineExceeded)


def _handler(fn):
    """The handler frame of every engine call: rpc_handler's, inside the metrics' ForegroundActivity
    (server/metrics/foreground.py), so background work waits for the calls in flight."""
    framed = _rpc_frame(fn)

    @functools.wraps(fn)
    def wrapper(self, request, context):
        metrics = self._metrics
        if metrics is None:
            return framed(self, request, context)
        with metrics.foreground:
            return framed(self, request, context)

    return wrapper


def _leaving_time_to_answer(deadline: float) -> float:
    """A deadline for a part of a handler that may wait (a child process, a lock): the caller's,
    less a fifth of the time left (at most 0.25 s) to build and send the answer."""
    return deadline - min(ANSWER_MARGIN_S, 0.2 * max(deadline - time.monotonic(), 0.0))


# The same frame around the calls of the local endpoints that have no servicer method (the doorbell).
engine_handler = _handler


class UndecodableRequest:
    """What ``request_deserializer`` hands a handler for bytes that are not its request message."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def request_deserializer(message_type):
    """A request deserializer that never raises: bytes that do not parse become an UndecodableRequest,
    answered INVALID_ARGUMENT by ``EngineServicer.refuse_undecodable`` (grpc answers a raising
    deserializer INTERNAL; issue 12 F12). Used by gRPC and the local RPC socket alike."""
    parse = message_type.FromString
    name = message_type.DESCRIPTOR.name

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, and whatever else the parser raises for garbage
            return UndecodableRequest(f"the request is not a valid {name}: {exc}")

    return deserialize


def add_engine_servicer(servicer: EngineServicer, server: grpc.Server) -> None:
    """Registers ``servicer`` like ``pb_grpc.add_EngineServicer_to_server``, with request
    deserializers that turn undecodable bytes into INVALID_ARGUMENT answers."""
    service = pb.DESCRIPTOR.services_by_name["Engine"]
    handlers = {}
    for method in service.methods:
        bound = getattr(servicer, method.name)

        def handle(request, context, _bound=bound, _name=method.name):
            if type(request) is UndecodableRequest:
                return servicer.refuse_undecodable(_name, request, context)
            return _bound(request, context)

        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=request_deserializer(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)  # as the generated code does


def stats_response(stats: EngineStats, model_names: ModelNames = SHOWN) -> pb.GetStatsResponse:
    """GetStats from the one definition of the statistics: proto fields have the EngineStats names.
    ``model_names``: each namespace's model id as shown (its digest with --metrics-hide-models)."""
    resp = pb.GetStatsResponse(**{name: _uint(getattr(stats, name)) for name in _SCALAR_STATS})
    for ns in stats.namespaces:
        fields = dataclasses.asdict(ns)
        fields["model_id"] = model_names(ns.model_id)
        resp.namespaces.append(pb.NamespaceStats(**fields))
    for tenant in stats.tenants:
        resp.tenants.append(pb.TenantStats(**dataclasses.asdict(tenant)))
    for tier in stats.tiers:
        fields = dataclasses.asdict(tier)
        resp.tiers.append(
            pb.TierStats(**{k: v if isinstance(v, str | float) else _uint(v) for k, v in fields.items()})
        )
    return resp


_SCALAR_STATS = scalar_fields()
_UINT64_MAX = (1 << 64) - 1


def _uint(value):
    """Counters saturate at the proto's uint64 (a client reporting absurd byte counts cannot make
    GetStats fail: review finding F6)."""
    if isinstance(value, str):
        return value
    return min(max(int(value), 0), _UINT64_MAX)


def _locations(offsets: list[int], block_bytes: int, checksums=()) -> pb.BlockLocations:
    # Every block is in DRAM today: the tiers column stays empty (= all TIER_DRAM). The checksums
    # column only when one is known (a writer that sends none pays no bytes for them).
    return pb.BlockLocations(
        offsets=offsets, block_bytes=block_bytes, checksums=checksums if any(checksums) else ()
    )


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(
        self,
        engine: KVEngine,
        fd_socket_path: str,
        metrics: ServerMetrics | None = None,
        gpu=None,
        tenants: TenantTable | None = None,
    ):
        self._engine = engine
        self._tenants = tenants  # --tenant-file: OpenSession's token names the session's tenant
        self._gpu = gpu  # server.gpu.service.GpuDataPath, or None without a GPU data path
        self._config: ServerConfig = engine.config
        self._fd_socket_path = fd_socket_path
        self._metrics = metrics
        # Named in OpenSessionResponse once the runtime's local RPC socket listens; "" = none.
        self.local_rpc_socket_path = ""
        self.read_lane_socket_path = ""

    @staticmethod
    def _caller_gone(context: grpc.ServicerContext, deadline: float) -> bool:
        # The deadline is measured from when this server read the call; if the process was stalled
        # before reading it, the client may have given up (and cancelled) earlier than that.
        return time.monotonic() > deadline or not context.is_active()

    def refuse_undecodable(self, method: str, request: UndecodableRequest, context):
        """INVALID_ARGUMENT for a request that does not parse, counted like every other call."""
        if self._metrics is not None:
            self._metrics.observe_rpc(method, grpc.StatusCode.INVALID_ARGUMENT.name, 0.0)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    # -------------------------------------------------------------- sessions

    @_handler
    def OpenSession(self, request: pb.OpenSessionRequest, context, deadline: float) -> pb.OpenSessionResponse:
        client_name = check.name(request.client_name, "client_name")
        hostname = check.name(request.hostname, "hostname")
        # The local RPC socket never carries OpenSession (common/wire/local_rpc.py): the metadata
        # here is gRPC's, and the interceptor already refused a call without an accepted token.
        tenant = self._tenants.identify(context.invocation_metadata()) if self._tenants is not None else None
        info = self._engine.open_session(
            client_name, request.pid, hostname, deadline=deadline, read_only=request.read_only, tenant=tenant
        )
        cfg = self._config
        return pb.OpenSessionResponse(
            session_id=info.session_id,
            heartbeat_interval_ms=int(info.heartbeat_interval_s * 1000),
            ttl_ms=int(info.ttl_s * 1000),
            pool=pb.PoolInfo(
                epoch=info.epoch,
                size_bytes=info.pool_size_bytes,
                fd_socket_path=self._fd_socket_path,
                hugepages=info.hugepages,
            ),
            server_version=info.server_version,
            limits=pb.ServerLimits(
                max_batch_blocks=cfg.max_batch_blocks,
                max_hash_bytes=cfg.max_hash_bytes,
                max_block_bytes=self._engine.allocator.max_block_bytes,
                default_lease_ttl_ms=int(cfg.lease_ttl_s * 1000),
                max_lease_ttl_ms=int(cfg.max_lease_ttl_s * 1000),
                write_timeout_ms=int(cfg.write_timeout_s * 1000),
            ),
            local_rpc_socket_path=self.local_rpc_socket_path,
            read_lane_socket_path=self.read_lane_socket_path,
        )

    @_handler
    def Heartbeat(self, request: pb.HeartbeatRequest, context, deadline: float) -> pb.HeartbeatResponse:
        epoch = self._engine.heartbeat(check.ident(request.session_id, "session_id"), deadline=deadline)
        return pb.HeartbeatResponse(epoch=epoch)

    @_handler
    def CloseSession(
        self, request: pb.CloseSessionRequest, context, deadline: float
    ) -> pb.CloseSessionResponse:
        self._engine.close_session(check.ident(request.session_id, "session_id"), deadline=deadline)
        return pb.CloseSessionResponse()

    # ------------------------------------------------------------- instances

    @_handler
    def RegisterInstance(self, request: pb.RegisterInstanceRequest, context, deadline: float):
        session_id = check.ident(request.session_id, "session_id")
        if not request.HasField("layout"):
            raise InvalidArgument("layout is required")
        layout = KvLayout.from_fields(request.layout)
        info = self._engine.register_instance(
            session_id, layout, check.name(request.instance_name, "instance_name"), deadline=deadline
        )
        return pb.RegisterInstanceResponse(
            instance_id=info.instance_id, namespace_id=info.namespace_id, block_bytes=info.block_bytes
        )

    @_handler
    def UnregisterInstance(self, request: pb.UnregisterInstanceRequest, context, deadline: float):
        self._engine.unregister_instance(
            check.ident(request.session_id, "session_id"),
            check.ident(request.instance_id, "instance_id"),
            deadline=deadline,
        )
        return pb.UnregisterInstanceResponse()

    # ------------------------------------------------------------- load path

    @_handler
    def QueryPrefix(self, request: pb.QueryPrefixRequest, context, deadline: float) -> pb.QueryPrefixResponse:
        session_id = check.ident(request.session_id, "session_id")
        instance_id = check.ident(request.instance_id, "instance_id")
        hashes = check.block_hashes(request.block_hashes, self._config)
        ttl = check.lease_ttl_s(request.lease_ttl_ms, self._config)
        result = self._engine.query_prefix(
            session_id,
            instance_id,
            hashes,
            lease=request.lease,
            lease_ttl_s=ttl,
            deadline=deadline,
            lease_id=check.optional_ident(request.lease_id, "lease_id"),
            purpose=check.purpose(request.purpose),
        )
        if result.lease_id and self._caller_gone(context, deadline):
            self._engine.give_up_lease(session_id, result.lease_id)  # never waits for the lock
            raise DeadlineExceeded("deadline passed while querying; the lease is released")
        return pb.QueryPrefixResponse(
            num_hits=result.num_hits,
            lease_id=result.lease_id,
            locations=_locations(result.offsets, result.block_bytes, result.checksums),
            epoch=result.epoch,
            pending=result.pending,
            sources=result.sources,
            searching=result.searching,
        )

    @_handler
    def LoadBlocks(self, request: pb.LoadBlocksRequest, context, deadline: float) -> pb.LoadBlocksResponse:
        result = self._engine.load_blocks(
            check.ident(request.session_id, "session_id"),
            check.ident(request.instance_id, "instance_id"),
            check.ident(request.lease_id, "lease_id"),
            deadline=deadline,
        )
        return pb.LoadBlocksResponse(
            locations=_locations(result.offsets, result.block_bytes, result.checksums),
            epoch=result.epoch,
            pending=result.pending,
        )

    @_handler
    def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context, deadline: float
    ) -> pb.ReleaseLeaseResponse:
        self._engine.release_lease(
            check.ident(request.session_id, "session_id"),
            check.ident(request.lease_id, "lease_id"),
            loaded_bytes=request.loaded_bytes,
            deadline=deadline,
            corrupt_hashes=check.block_hashes(request.corrupt_block_hashes, self._config, allow_empty=True),
        )
        return pb.ReleaseLeaseResponse()

    # ------------------------------------------------------------- save path

    @_handler
    def AllocateBlocks(self, request: pb.AllocateBlocksRequest, context, deadline: float):
        session_id = check.ident(request.session_id, "session_id")
        instance_id = check.ident(request.instance_id, "instance_id")
        hashes = check.block_hashes(request.block_hashes, self._config)
        result = self._engine.allocate_blocks(
            session_id,
            instance_id,
            hashes,
            deadline=deadline,
            save_id=check.optional_ident(request.save_id, "save_id"),
        )
        if result.save_id and self._caller_gone(context, deadline):
            self._engine.give_up_save(session_id, result.save_id)  # never waits for the lock
            raise DeadlineExceeded("deadline passed while allocating; the granted blocks are freed")
        return pb.AllocateBlocksResponse(
            save_id=result.save_id,
            statuses=result.statuses,
            granted=_locations(result.offsets, result.block_bytes),
            epoch=result.epoch,
        )

    @_handler
    def SealBlocks(self, request: pb.SealBlocksRequest, context, deadline: float) -> pb.SealBlocksResponse:
        hashes = check.block_hashes(request.block_hashes, self._config, allow_empty=True)
        if len(request.checksums) > self._config.max_batch_blocks:
            raise InvalidArgument(f"more than {self._config.max_batch_blocks} checksums")
        sealed = self._engine.seal_blocks(
            check.ident(request.session_id, "session_id"),
            check.ident(request.save_id, "save_id"),
            hashes,
            deadline=deadline,
            checksums=list(request.checksums),
        )
        return pb.SealBlocksResponse(sealed=sealed)

    @_handler
    def AbortBlocks(self, request: pb.AbortBlocksRequest, context, deadline: float) -> pb.AbortBlocksResponse:
        freed = self._engine.abort_blocks(
            check.ident(request.session_id, "session_id"),
            check.ident(request.save_id, "save_id"),
            deadline=deadline,
        )
        return pb.AbortBlocksResponse(freed=freed)

    # ---------------------------------------------------------- GPU data path

    @_handler
    def RegisterDeviceMemory(self, request, context, deadline: float):
        return gpu_rpc.handle_register(self._gpu, request, deadline)

    @_handler
    def UnregisterDeviceMemory(self, request, context, deadline: float):
        return gpu_rpc.handle_unregister(self._gpu, request, deadline)

    @_handler
    def SaveFromDevice(self, request, context, deadline: float):
        return gpu_rpc.handle_save(self._gpu, request, deadline, self._config)

    @_handler
    def LoadToDevice(self, request, context, deadline: float):
        return gpu_rpc.handle_load(self._gpu, request, deadline, self._config)

    # ---------------------------------------------------------- introspection

    @_handler
    def ReportPrefill(self, request: pb.ReportPrefillRequest, context, deadline: float):
        ns = self._engine.instance_namespace(
            check.ident(request.session_id, "session_id"),
            check.ident(request.instance_id, "instance_id"),
            deadline=deadline,
        )
        if self._metrics is not None:
            try:
                self._metrics.insights.report_prefill(
                    ns.id, ns.model_id, int(request.computed_tokens), float(request.prefill_seconds)
                )
            except ValueError as exc:
                raise InvalidArgument(f"prefill report: {exc}") from exc
        return pb.ReportPrefillResponse()

    @_handler
    def GetStats(self, request: pb.GetStatsRequest, context, deadline: float) -> pb.GetStatsResponse:
        names = self._metrics.model_names if self._metrics is not None else SHOWN
        resp = stats_response(self._engine.stats(deadline=deadline), names)
        if self._metrics is not None:
            # The sketches may be seconds behind on a busy host: never wait for them past the time the
            # answer needs (sketch_process.py waits briefly when a recent snapshot can stand in).
            measured, ceiling = self._metrics.window_rates(_leaving_time_to_answer(deadline))
            for name, value in measured.items():
                if value is not None:
                    resp.measured_hit_rate[name] = value
            for name, value in ceiling.items():
                if value is not None:
                    resp.hll_ceiling[name] = value
        return resp
