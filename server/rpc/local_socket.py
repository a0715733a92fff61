"""The local RPC socket: the Engine service's unary RPCs for clients on this host, without gRPC.

The wire format, and why this path exists, are in ``pegaflow.common.local_rpc``. Each request
runs through the servicer's own method (the one gRPC calls) with ``LocalCallContext`` standing in
for grpc's context, so validation, engine calls, deadlines, error -> status mapping (with the
NOT_FOUND metadata) and per-call metrics are the gRPC path's, byte for byte.

One thread per connection (a client opens as many as it has calls in flight), blocking reads:
a request waits for no pool thread, and a stalled client holds only its own thread. Bad input
never takes the server down: a frame that is malformed or larger than the server's message limit
is answered (not executed) and its connection closed; anything unexpected while serving one
connection ends that connection only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from pegaflow.common import local_rpc as wire
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.pool.fd_broker import prepare_socket_path

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
SOCKET_MODE = 0o660  # the fd broker's: whoever may map the pool may call the service that manages it


class _Aborted(Exception):
    """Raised by LocalCallContext.abort, as grpc's context.abort raises: the handler ends there."""


class LocalCallContext:
    """What the servicer's handlers use of ``grpc.ServicerContext``, for a call read off a Unix socket.

    The deadline is counted from when the whole request was read, as gRPC counts the caller's
    timeout from when its call arrived. The call is inactive once the client closed its
    connection (it gave up at its deadline), as gRPC reports a cancelled call.
    """

    __slots__ = ("_sock", "_deadline", "code", "message", "trailing_metadata")

    def __init__(self, sock: socket.socket, deadline: float | None):
        self._sock = sock
        self._deadline = deadline
        self.code = grpc.StatusCode.OK
        self.message = ""
        self.trailing_metadata: tuple = ()

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def is_active(self) -> bool:
        if self._deadline is not None and time.monotonic() > self._deadline:
            return False
        try:
            # While a call is served its client waits for the answer: EOF here means it hung up.
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str):
        self.code, self.message = code, details
        raise _Aborted(details)


class LocalRpcServer:
    """Serves ``servicer``'s methods named in ``common.local_rpc.LOCAL_METHODS`` on the Unix socket ``path``.

    ``epoch`` is sent in every connection's greeting, so a client checks it reached the server its
    session belongs to. Binding raises OSError (path too long, directory not writable, another
    live server on it).
    """

    def __init__(
        self, path: str, servicer, epoch: str, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    ):
        self.path = path
        self._hello = wire.encode_hello(epoch)
        self._max_message_bytes = max_message_bytes
        self._max_frame = wire.max_frame_bytes(max_message_bytes)
        service = pb.DESCRIPTOR.services_by_name["Engine"]
        self._methods = {
            name: (getattr(servicer, name), getattr(pb, service.methods_by_name[name].input_type.name))
            for name in sorted(wire.LOCAL_METHODS)
        }
        prepare_socket_path(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            os.chmod(path, SOCKET_MODE)
            self._listener.listen(128)
        except BaseException:
            self._listener.close()
            raise
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="pegaflow-local-rpc", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def stop(self, grace_s: float = 2.0) -> None:
        """Stops accepting, hangs up every connection (a client mid-call sees EOF: UNAVAILABLE, as when
        gRPC stops) and waits up to ``grace_s`` for calls being served to finish."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=grace_s + 1)
        end = time.monotonic() + grace_s
        for thread in conns.values():
            thread.join(timeout=max(end - time.monotonic(), 0))
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # EMFILE and friends: back off rather than spin; the client falls back to gRPC meanwhile.
                log.warning("local rpc: accept failed: %s", exc)
                time.sleep(0.1)
                continue
            with self._lock:
                refuse = self._closed or len(self._conns) >= MAX_CONNECTIONS
                if not refuse:
                    thread = threading.Thread(
                        target=self._serve, args=(sock,), name="pegaflow-local-rpc-conn", daemon=True
                    )
                    self._conns[sock] = thread
            if refuse:
                # Closed before the greeting: the client knows nothing was run and uses gRPC.
                if not self._closed:
                    log.warning("local rpc: %d connections open, refusing one", MAX_CONNECTIONS)
                sock.close()
                continue
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.sendall(self._hello)
            while True:
                try:
                    body = wire.read_frame(sock, self._max_frame)
                except wire.FrameError as exc:  # oversized: its body is never read
                    self._refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                    return
                if body is None:
                    return
                try:
                    request = wire.decode_request(body)
                except wire.FrameError as exc:
                    self._refuse(sock, grpc.StatusCode.UNIMPLEMENTED, str(exc))
                    return
                answer = self._call(sock, request, time.monotonic())
                if answer is not None:
                    sock.sendall(answer)
        except OSError:
            pass  # the client went away (or stop() hung up on it)
        except Exception:
            log.exception("local rpc: connection failed unexpectedly; closing it")
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _refuse(self, sock: socket.socket, code: grpc.StatusCode, reason: str) -> None:
        log.warning("local rpc: closing a connection that sent a bad frame: %s", reason)
        try:
            sock.sendall(wire.encode_response(code, reason, not_executed=True))
        except OSError:
            pass

    # ------------------------------------------------------------------ calls

    def _call(self, sock: socket.socket, request: wire.Request, arrived: float) -> bytes | None:
        """The response frame (None for a oneway request): what gRPC would have answered."""
        entry = self._methods.get(request.method)
        if entry is None:
            message = f"method {request.method!r} is not served on the local RPC socket"
            if request.oneway:  # nobody reads an answer to it; the next call's answer must stay its own
                log.warning("local rpc: dropped a oneway request: %s", message)
                return None
            return wire.encode_response(grpc.StatusCode.UNIMPLEMENTED, message, not_executed=True)
        handler, request_type = entry
        try:
            message = request_type.FromString(request.payload)
        except DecodeError:
            # grpc's own answer to a request it cannot deserialize
            return self._answer(request, grpc.StatusCode.INTERNAL, "Exception deserializing request!")
        deadline = None if request.timeout_s is None else arrived + request.timeout_s
        context = LocalCallContext(sock, deadline)
        try:
            response = handler(message, context)
        except _Aborted:
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
