"""The client end of the local RPC socket (its wire format, and why it exists: common/wire/local_rpc.py).

``LocalRpcClient`` belongs to one session (``Connection``): it encodes a call's protobuf request,
sends it over the session's ``FrameLink`` (client/frame_link.py: connections, deadlines, the
greeting's epoch check, retries that never run a request twice) and decodes the answer. What
the caller sees matches the gRPC call it replaces: an answer, or a ``LocalRpcError`` (a
``grpc.RpcError`` with the same code, details and trailing metadata, so the client maps it with
the same code), or None: "not sent, use gRPC" - only when the server surely did not run it.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc

from pegaflow.client.frame_link import FrameLink, LinkFailed, LocalRpcError, NotSent, PendingAnswer
from pegaflow.common.wire import local_rpc as wire
from pegaflow.common.wire.frames import FrameError
from pegaflow.proto import pegaflow_pb2 as pb

__all__ = ["LocalRpcClient", "LocalRpcError", "PendingCall"]

# How long a caller polls for its answer before sleeping in the kernel. On the 2-vCPU VM we
# measured, waking a sleeping thread adds ~50-70 us to a round trip (~110 us instead of ~60 us;
# bench/server_bench.py-like loop: 300 -> 240 us a call); most answers come within this budget.
# The poll yields the CPU to any other runnable thread each turn, so it takes only idle time.
SPIN_S = 0.001

_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"]
_RESPONSE_TYPES = {
    name: getattr(pb, _SERVICE.methods_by_name[name].output_type.name) for name in wire.LOCAL_METHODS
}


class PendingCall:
    """A local call whose answer is still out (LocalRpcClient.start)."""

    __slots__ = ("_client", "_method", "_pending", "_done")

    def __init__(self, client: LocalRpcClient, method: str, pending: PendingAnswer):
        self._client, self._method, self._pending, self._done = client, method, pending, False

    def result(self):
        """The response message, as ``LocalRpcClient.call`` gives it (None: not run, use gRPC)."""
        if self._done:
            raise RuntimeError("PendingCall.result() called twice")
        self._done = True
        return self._client._answer(self._method, self._pending)

    def abandon(self) -> None:
        """Stops waiting for the answer (the request may still run)."""
        if not self._done:
            self._done = True
            self._client._link.abandon(self._pending)


class LocalRpcClient:
    def __init__(
        self,
        path: str,
        epoch: str,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        spin_s: float = SPIN_S,
    ):
        self._max_message_bytes = max_message_bytes
        self._link = FrameLink(
            path,
            wire.HELLO_MAGIC,
            wire.VERSION,
            epoch,
            wire.max_frame_bytes(max_message_bytes),
            spin_s,
            yield_cpu=True,
            what="local RPC socket",
        )
        self._lock = threading.Lock()
        # Requests the server ran from this socket (answered, or sent oneway), by method.
        self.calls: collections.Counter[str] = collections.Counter()

    @property
    def path(self) -> str:
        return self._link.path

    @path.setter
    def path(self, value: str) -> None:
        self._link.path = value

    @property
    def epoch(self) -> str:
        return self._link.epoch

    @property
    def usable(self) -> bool:
        return self._link.usable

    def call(self, method: str, request, deadline: float):
        """The response message; None if the request was not sent (use gRPC); raises LocalRpcError."""
        pending = self.start(method, request, deadline)
        return None if pending is None else pending.result()

    def start(self, method: str, request, deadline: float) -> PendingCall | None:
        """Sends the request and returns at once (``PendingCall.result`` waits for the answer); None
        if it was not sent (use gRPC); raises LocalRpcError."""
        if method not in wire.LOCAL_METHODS or not self._link.usable:
            return None
        payload = request.SerializeToString()
        if len(payload) > self._max_message_bytes:
            return None  # gRPC refuses it with the status callers already know
        left = deadline - time.monotonic()
        if left <= 0:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            return PendingCall(
                self, method, self._link.start(wire.encode_request(method, payload, left), deadline)
            )
        except NotSent:
            return None
        except TimeoutError:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def _answer(self, method: str, pending: PendingAnswer):
        try:
            answer = wire.decode_response(self._link.finish(pending))
        except NotSent:
            return None
        except TimeoutError:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (LinkFailed, FrameError) as exc:
            # Sent, so it may have run: report what gRPC reports when a connection dies mid-call.
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        if answer.not_executed:
            self._link.rest(f"the server did not run {method}: {answer.message}")
            return None
        with self._lock:
            self.calls[method] += 1
        if answer.code != grpc.StatusCode.OK:
            raise LocalRpcError(answer.code, answer.message, answer.metadata)
        try:
            return _RESPONSE_TYPES[method].FromString(answer.payload)
        except Exception:  # DecodeError: a server bug, reported as gRPC would
            raise LocalRpcError(grpc.StatusCode.INTERNAL, "Exception deserializing response!") from None

    def send(self, method: str, request, timeout_s: float) -> bool:
        """Sends without awaiting an answer (the server runs it, answers nothing); False if not sent
        (use gRPC)."""
        if method not in wire.LOCAL_METHODS or not self._link.usable:
            return False
        payload = request.SerializeToString()
        if len(payload) > self._max_message_bytes:
            return False
        if not self._link.send(wire.encode_request(method, payload, timeout_s, oneway=True), timeout_s):
            return False
        with self._lock:
            self.calls[method] += 1
        return True

    def call_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.calls)

    def close(self) -> None:
        """Closes every connection (the session is over); a call still using one sees it closed."""
        self._link.close()
