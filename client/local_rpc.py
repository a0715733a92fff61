"""The client end of the local RPC socket (its wire format, and why it exists: ``common/local_rpc.py``).

``LocalRpcClient`` belongs to one session (``Connection``): the socket its OpenSession named, and
the pool epoch the server must greet with. A call takes an idle connection (the one used last:
a single-threaded caller's calls, oneway ones included, run in order on one connection) or opens
one, and puts it back once its answer is in: as many connections as calls run at once, whichever
threads make them (a thread per task costs no connection set-up).

What the caller sees matches the gRPC call it replaces: an answer, or a ``LocalRpcError`` (a
``grpc.RpcError`` with the same code, details and trailing metadata, so the client maps it with
the same code), or None: "not sent, use gRPC". None is only returned when the server surely did
not run the request (no connection, a refused greeting, a failed send, a request it answered as
not executed), so a fallback never runs a call twice. After such a failure the socket rests for
``RETRY_AFTER_S`` (every call meanwhile goes to gRPC) and is tried again. A call never outlasts
its deadline: every socket operation is bounded by the time left.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from pegaflow.common import local_rpc as wire
from pegaflow.proto import pegaflow_pb2 as pb

log = logging.getLogger("pegaflow.client")

RETRY_AFTER_S = 1.0
# How long a caller polls for its answer before sleeping in the kernel. On the 2-vCPU VM we
# measured, waking a sleeping thread adds ~50-70 us to a round trip (~110 us instead of ~60 us;
# bench/server_bench.py-like loop: 300 -> 240 us a call); most answers come within this budget.
# The poll yields the CPU to any other runnable thread each turn, so it takes only idle time.
SPIN_S = 0.001

_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"]
_RESPONSE_TYPES = {
    name: getattr(pb, _SERVICE.methods_by_name[name].output_type.name) for name in wire.LOCAL_METHODS
}


class LocalRpcError(grpc.RpcError):
    """A call answered with an error status over the local socket (or failed there after it was sent)."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata=()):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._metadata = code, details, tuple(metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._metadata


class _NotSent(Exception):
    """The request did not reach the server (it ran nothing): the call may go over gRPC instead."""


class _Link:
    """One connection, used by one call at a time."""

    __slots__ = ("sock", "poller")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def await_readable(self, spin_s: float) -> None:
        """Returns once the answer has arrived or ``spin_s`` has passed (the caller then blocks)."""
        start = time.perf_counter()
        while not self.poller.poll(0) and time.perf_counter() - start < spin_s:
            os.sched_yield()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it (a close from elsewhere)
        except OSError:
            pass
        self.sock.close()


class LocalRpcClient:
    def __init__(
        self,
        path: str,
        epoch: str,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        spin_s: float = SPIN_S,
    ):
        self.path = path
        self.epoch = epoch
        self.spin_s = spin_s
        self._max_message_bytes = max_message_bytes
        self._max_frame = wire.max_frame_bytes(max_message_bytes)
        self._lock = threading.Lock()
        self._links: set[_Link] = set()  # every open connection (closed by close())
        self._idle: list[_Link] = []  # not in a call; list.append / pop are atomic
        self._down_until = 0.0
        self._disabled = ""  # why this socket is never to be used (not our server); "" = usable
        self._closed = False
        self._warned = False
        # Requests the server ran from this socket (answered, or sent oneway), by method.
        self.calls: collections.Counter[str] = collections.Counter()

    @property
    def usable(self) -> bool:
        return not self._closed and not self._disabled and time.monotonic() >= self._down_until

    # ------------------------------------------------------------------ calls

    def call(self, method: str, request, deadline: float):
        """The response message; None if the request was not sent (use gRPC); raises LocalRpcError."""
        if method not in wire.LOCAL_METHODS or not self.usable:
            return None
        payload = request.SerializeToString()
        if len(payload) > self._max_message_bytes:
            return None  # gRPC refuses it with the status callers already know
        try:
            link = self._link(deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                self._put_back(link)
                raise TimeoutError
            link.sock.settimeout(left)
            try:
                link.sock.sendall(wire.encode_request(method, payload, left))
            except TimeoutError:
                self._drop(link)  # part of a frame may be out: the stream is unusable
                raise
            except OSError as exc:
                self._drop(link)
                raise _NotSent(f"send failed: {exc}") from exc
            try:
                link.await_readable(min(self.spin_s, left))
                body = wire.read_frame(link.sock, self._max_frame, deadline)
                if body is None:
                    raise ConnectionError("the server closed the connection")
                answer = wire.decode_response(body)
            except TimeoutError:
                self._drop(link)
                raise
            except (OSError, wire.FrameError) as exc:
                # Sent, so it may have run: report what gRPC reports when a connection dies mid-call.
                self._drop(link)
                raise LocalRpcError(
                    grpc.StatusCode.UNAVAILABLE, f"local RPC socket failed mid-call: {exc}"
                ) from exc
        except TimeoutError:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except _NotSent as exc:
            self._rest(str(exc))
            return None
        self._put_back(link)  # the stream is in step again: the next call may take it
        if answer.not_executed:
            self._rest(f"the server did not run {method}: {answer.message}")
            return None
        with self._lock:
            self.calls[method] += 1
        if answer.code != grpc.StatusCode.OK:
            raise LocalRpcError(answer.code, answer.message, answer.metadata)
        try:
            return _RESPONSE_TYPES[method].FromString(answer.payload)
        except DecodeError:
            raise LocalRpcError(grpc.StatusCode.INTERNAL, "Exception deserializing response!") from None

    def send(self, method: str, request, timeout_s: float) -> bool:
        """Sends without awaiting an answer (the server runs it, answers nothing); False if not sent (use
        gRPC). Only on an idle open connection: opening one means awaiting the server's greeting,
        and a fire-and-forget call must not wait on a stalled server."""
        if method not in wire.LOCAL_METHODS or not self.usable:
            return False
        payload = request.SerializeToString()
        if len(payload) > self._max_message_bytes:
            return False
        try:
            link = self._idle.pop()
        except IndexError:
            return False
        frame = wire.encode_request(method, payload, timeout_s, oneway=True)
        try:
            sent = link.sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            self._put_back(link)
            return False  # the server is not reading (stalled): gRPC's future does not block us
        except OSError as exc:
            self._drop(link)
            self._rest(f"send failed: {exc}")
            return False
        if sent < len(frame):  # rare (a nearly full buffer): the frame's rest must follow, within the timeout
            try:
                link.sock.settimeout(timeout_s)
                link.sock.sendall(frame[sent:])
            except OSError:
                self._drop(link)  # a partial frame is never run: the server sees it cut off
                return False
        self._put_back(link)
        with self._lock:
            self.calls[method] += 1
        return True

    def call_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.calls)

    def close(self) -> None:
        """Closes every connection (the session is over); a call still using one sees it closed."""
        with self._lock:
            self._closed = True
            links = list(self._links)
            self._links.clear()
            self._idle.clear()
        for link in links:
            link.close()

    # ------------------------------------------------------------------ connections

    def _link(self, deadline: float) -> _Link:
        """An idle connection (the last one put back), or a new one."""
        try:
            return self._idle.pop()
        except IndexError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            try:
                sock.connect(self.path)
                # The server greets before it reads anything: no greeting, nothing run.
                version, epoch = wire.read_hello(sock, deadline)
            except TimeoutError:
                raise
            except (OSError, wire.FrameError) as exc:
                raise _NotSent(f"cannot connect: {exc}") from exc
            if version != wire.VERSION or epoch != self.epoch:
                self._disabled = (
                    f"the socket's server speaks version {version} with pool epoch {epoch!r};"
                    f" this session is version {wire.VERSION}, epoch {self.epoch!r}"
                )
                log.warning("pegaflow: not using local RPC socket %s: %s", self.path, self._disabled)
                raise _NotSent(self._disabled)
        except BaseException:
            sock.close()
            raise
        link = _Link(sock)
        with self._lock:
            if self._closed:
                link.close()
                raise _NotSent("the session is closed")
            self._links.add(link)
        return link

    def _put_back(self, link: _Link) -> None:
        self._idle.append(link)
        if self._closed:  # close() may have emptied the idle list before this append
            link.close()

    def _drop(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
        link.close()

    def _rest(self, why: str) -> None:
        self._down_until = time.monotonic() + RETRY_AFTER_S
        # The first time at warning level, then quietly: a remote client would repeat it every second.
        if not self._warned:
            self._warned = True
            log.warning("pegaflow: local RPC socket %s unusable (%s); using gRPC meanwhile", self.path, why)
        else:
            log.debug("pegaflow: local RPC socket %s unusable (%s)", self.path, why)
