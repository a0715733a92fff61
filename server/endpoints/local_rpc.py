"""The local RPC socket: the Engine service's unary RPCs for clients on this host, without gRPC.

The wire format, and why this path exists, are in ``pegaflow.common.wire.local_rpc``; the socket
itself (greeting, caps, idle timeouts, memory caps, workers) is ``unix_socket.UnixFrameServer``.
Each request runs through the servicer's own method (the one gRPC calls) with a ``CallContext``
standing in for grpc's context, so validation, engine calls, deadlines, error -> status mapping
(with the NOT_FOUND metadata) and per-call metrics are the gRPC path's, byte for byte; a request
message that does not parse is INVALID_ARGUMENT on both (grpc_servicer.request_deserializer).
Bad input never takes the server down: a frame that is malformed or larger than the server's
message limit is answered (not executed) and its connection closed.
"""

from __future__ import annotations

import logging

import grpc

from pegaflow.common.wire import local_rpc as wire
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.endpoints.base import FrameCodec
from pegaflow.server.endpoints.grpc_servicer import UndecodableRequest, request_deserializer
from pegaflow.server.endpoints.unix_socket import CallAborted, CallContext, UnixFrameServer

log = logging.getLogger(__name__)


class LocalRpcCodec(FrameCodec):
    """Runs ``servicer``'s methods named in ``LOCAL_METHODS`` for protobuf request frames."""

    name = "local-rpc"
    hello_magic = wire.HELLO_MAGIC
    version = wire.VERSION

    def __init__(self, servicer, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES):
        self._servicer = servicer
        self._max_message_bytes = max_message_bytes
        self.max_frame_bytes = wire.max_frame_bytes(max_message_bytes)
        service = pb.DESCRIPTOR.services_by_name["Engine"]
        self._methods = {
            name: (
                getattr(servicer, name),
                request_deserializer(getattr(pb, service.methods_by_name[name].input_type.name)),
            )
            for name in sorted(wire.LOCAL_METHODS)
        }

    def refusal(self, code: grpc.StatusCode, message: str) -> bytes:
        return wire.encode_response(code, message, not_executed=True)

    def handle(self, body: bytes, context: CallContext) -> bytes | None:
        """The response frame (None for a oneway request): what gRPC would have answered."""
        request = wire.decode_request(body)  # FrameError: not this protocol, the server refuses it
        entry = self._methods.get(request.method)
        if entry is None:
            message = f"method {request.method!r} is not served on the local RPC socket"
            if request.oneway:  # nobody reads an answer to it; the next call's answer must stay its own
                log.warning("local rpc: dropped a oneway request: %s", message)
                return None
            return wire.encode_response(grpc.StatusCode.UNIMPLEMENTED, message, not_executed=True)
        handler, deserialize = entry
        context.set_timeout(request.timeout_s)
        message = deserialize(request.payload)
        try:
            if type(message) is UndecodableRequest:
                response = self._servicer.refuse_undecodable(request.method, message, context)
            else:
                response = handler(message, context)
        except CallAborted:
            return self._answer(request, context.code, context.message, context.trailing_metadata)
        except Exception:  # the servicer's frame maps every error; this is a bug in it
            log.exception("local rpc: %s failed outside the servicer's error mapping", request.method)
            return self._answer(request, grpc.StatusCode.INTERNAL, f"internal error in {request.method}")
        payload = response.SerializeToString()
        if len(payload) > self._max_message_bytes:
            message = f"Sent message larger than max ({len(payload)} vs. {self._max_message_bytes})"
            return self._answer(request, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return None if request.oneway else wire.encode_response(grpc.StatusCode.OK, payload=payload)

    @staticmethod
    def _answer(request: wire.Request, code: grpc.StatusCode, message: str, metadata=()) -> bytes | None:
        if request.oneway:
            return None
        return wire.encode_response(code, message, metadata)


class LocalRpcServer(UnixFrameServer):
    """The local RPC socket at ``path`` over ``servicer`` (a grpc_servicer.EngineServicer).

    ``epoch`` is sent in every connection's greeting, so a client checks it reached the server its
    session belongs to. Binding raises OSError (path too long, directory refused, another live server
    on it); ``start()`` serves; ``stop(grace_s)``. Keyword arguments are UnixFrameServer's bounds.
    """

    def __init__(
        self,
        path: str,
        servicer,
        epoch: str,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        **bounds,
    ):
        super().__init__(path, LocalRpcCodec(servicer, max_message_bytes), epoch, **bounds)
