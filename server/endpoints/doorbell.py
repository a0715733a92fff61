"""The doorbell: the GPU workers' low-latency local path for SaveFromDevice / LoadToDevice.

The wire format, and why it is a codec of its own, are in ``pegaflow.common.wire.doorbell``; the
socket (greeting with the pool epoch, caps, idle timeouts, memory caps, workers) is
``unix_socket.UnixFrameServer``, as for the local RPC socket. A request runs exactly as the RPC
does: in the servicer's handler frame (``grpc_servicer.engine_handler``: the deadline, the engine
error -> status mapping with its NOT_FOUND kind, and the per-call metrics under the RPC's own
method name, so GPU calls appear in ``pegaflow_rpc_duration_seconds`` like every other call),
through the same checks and GpuDataPath calls (``server.gpu.rpc.save`` / ``load``).
"""

from __future__ import annotations

import json
import logging
import time

import grpc

from pegaflow.common.wire import doorbell as wire
from pegaflow.common.wire import status
from pegaflow.common.wire.status import NOT_FOUND_METADATA_KEY
from pegaflow.server.config import ServerConfig
from pegaflow.server.endpoints.base import FrameCodec
from pegaflow.server.endpoints.grpc_servicer import engine_handler
from pegaflow.server.endpoints.unix_socket import CallAborted, CallContext, UnixFrameServer
from pegaflow.server.gpu import rpc as gpu_rpc

log = logging.getLogger(__name__)
# The GPU data path's timing log (DEBUG, off in production): with it on, one "doorbell-op {json}"
# line per request (CLOCK_MONOTONIC seconds: frame read, decoded, handled, answer encoded, sent), which
# bench/gpu_bench.py matches with the client's clock and the data path's own "gpu-op" lines.
timing_log = logging.getLogger("pegaflow.server.gpu.timing")
_OK = status.number(grpc.StatusCode.OK)


class _DoorbellCalls:
    """The doorbell's two calls in the servicer's frame (what rpc_handler needs: _config, _metrics)."""

    def __init__(self, gpu, config: ServerConfig, metrics):
        self._gpu = gpu
        self._config = config
        self._metrics = metrics

    @engine_handler
    def SaveFromDevice(self, req: wire.Request, context, deadline: float):
        hashes, ids = req.hashes, req.block_ids
        return gpu_rpc.save(
            self._gpu, req.session_id, req.registration_id, hashes, ids, deadline, self._config
        )

    @engine_handler
    def LoadToDevice(self, req: wire.Request, context, deadline: float):
        fields = (req.session_id, req.registration_id, req.hashes, req.block_ids, req.purpose)
        return gpu_rpc.load(self._gpu, *fields, deadline, self._config)


class DoorbellCodec(FrameCodec):
    """Decodes doorbell frames, runs them on ``gpu`` (a GpuDataPath), encodes the answers."""

    name = "doorbell"
    hello_magic = wire.HELLO_MAGIC
    version = wire.VERSION

    def __init__(self, gpu, config: ServerConfig, metrics=None):
        self._calls = _DoorbellCalls(gpu, config, metrics)
        self.max_frame_bytes = wire.max_request_bytes(config.max_batch_blocks, config.max_hash_bytes)

    def refusal(self, code: grpc.StatusCode, message: str) -> bytes:
        return wire.encode_response(status.number(code), message=message, not_executed=True)

    def handle(self, body: bytes, context: CallContext) -> bytes:
        if timing_log.isEnabledFor(logging.DEBUG):
            return self._timed(body, context)
        return self._handle(body, context)

    def _timed(self, body: bytes, context: CallContext) -> bytes:
        marks = context.marks = {"read": context.arrived, "entered": time.perf_counter()}
        answer = self._handle(body, context, marks)
        marks["encoded"] = time.perf_counter()
        return answer

    def answered(self, context: CallContext) -> None:
        context.marks["sent"] = time.perf_counter()
        timing_log.debug("doorbell-op %s", json.dumps(context.marks))

    def _handle(self, body: bytes, context: CallContext, marks: dict | None = None) -> bytes:
        req = wire.decode_request(body)  # FrameError: not a doorbell request, the server refuses it
        context.set_timeout(req.timeout_s)
        if marks is not None:
            marks["decoded"] = time.perf_counter()
        try:
            if req.op == wire.OP_SAVE:
                out = self._calls.SaveFromDevice(req, context)
                if marks is not None:
                    marks["handled"] = time.perf_counter()
                return wire.encode_response(_OK, out.written, "", out.statuses)
            out = self._calls.LoadToDevice(req, context)
            if marks is not None:
                marks["handled"] = time.perf_counter()
            return wire.encode_response(_OK, out.num_hits)
        except CallAborted:
            kind = dict(context.trailing_metadata).get(NOT_FOUND_METADATA_KEY, "")
            return wire.encode_response(
                status.number(context.code), message=context.message, not_found_kind=kind
            )


class DoorbellServer(UnixFrameServer):
    """The doorbell at ``path`` over ``gpu`` (a GpuDataPath); ``epoch`` goes in every greeting.

    Binding raises OSError (path too long, directory refused, another live server on it);
    ``start()`` serves; ``stop(grace_s)``. Keyword arguments are UnixFrameServer's bounds.
    """

    def __init__(self, path: str, gpu, epoch: str, config: ServerConfig, metrics=None, **bounds):
        super().__init__(path, DoorbellCodec(gpu, config, metrics), epoch, **bounds)
