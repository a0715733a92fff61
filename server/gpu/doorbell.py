"""The server end of the doorbell, the GPU workers' low-latency local path for SaveFromDevice /
LoadToDevice (a Unix socket with a tiny binary frame).

The frame format and the worker's end live with the client, in ``pegaflow.client.doorbell``
(the client never imports server code); the module docstring there says why the doorbell
exists. Requests are served with exactly the RPCs' semantics: the same GpuDataPath calls,
checks, error kinds and deadlines.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from pegaflow.client.doorbell import (
    CODE_DEADLINE_EXCEEDED,
    CODE_FAILED_PRECONDITION,
    CODE_INTERNAL,
    CODE_INVALID_ARGUMENT,
    CODE_NOT_FOUND,
    CODE_OK,
    CODE_RESOURCE_EXHAUSTED,
    CODE_UNAVAILABLE,
    MAX_BLOCKS,
    MAX_HASH_BYTES,
    OP_SAVE,
    FrameError,
    decode_request,
    encode_response,
    recv_frame,
    send_frame,
)
from pegaflow.server.engine import QueryPurpose
from pegaflow.server.errors import EngineError, InvalidArgument

log = logging.getLogger(__name__)

# An engine error's status (EngineError.status, named as in gRPC) as the doorbell's code; the
# client maps the codes back onto its own exceptions. A status missing here is answered INTERNAL.
WIRE_CODES: dict[str, int] = {
    "INVALID_ARGUMENT": CODE_INVALID_ARGUMENT,
    "NOT_FOUND": CODE_NOT_FOUND,
    "FAILED_PRECONDITION": CODE_FAILED_PRECONDITION,
    "DEADLINE_EXCEEDED": CODE_DEADLINE_EXCEEDED,
    "UNAVAILABLE": CODE_UNAVAILABLE,
    "RESOURCE_EXHAUSTED": CODE_RESOURCE_EXHAUSTED,
}


class DoorbellServer:
    """Serves GpuDataPath.save / .load on a Unix socket, one thread per connection.

    ``max_blocks`` and ``max_hash_bytes`` are the server's RPC limits, applied here too.
    """

    def __init__(self, path: str, gpu, max_blocks: int, max_hash_bytes: int):
        self.path = path
        self._gpu = gpu
        self._max_blocks = min(max_blocks, MAX_BLOCKS)
        self._max_hash_bytes = min(max_hash_bytes, MAX_HASH_BYTES)
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="pegaflow-gpu-doorbell", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="pegaflow-gpu-doorbell-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(conn)
                if frame is None:
                    return
                send_frame(conn, self._handle(frame))
        except FrameError as exc:
            log.warning("gpu doorbell: dropping a connection that sent a bad frame: %s", exc)
        except OSError:
            pass  # the worker went away
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, frame: bytes) -> bytes:
        start = time.monotonic()
        try:
            op, session_id, reg_id, hashes, block_ids, timeout_s, purpose = decode_request(frame)
        except FrameError:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad frame
            raise FrameError(str(exc)) from exc
        try:
            if not session_id or not reg_id:
                raise InvalidArgument("session_id and registration_id must not be empty")
            if not 0 < len(hashes) <= self._max_blocks:
                raise InvalidArgument(f"1..{self._max_blocks} blocks per request, got {len(hashes)}")
            if any(len(h) > self._max_hash_bytes for h in hashes):
                raise InvalidArgument(f"every block hash must be 1..{self._max_hash_bytes} bytes")
            deadline = start + timeout_s
            if op == OP_SAVE:
                out = self._gpu.save(session_id, reg_id, hashes, block_ids, deadline)
                return encode_response(CODE_OK, out.written, "", [int(s) for s in out.statuses])
            out = self._gpu.load(session_id, reg_id, hashes, block_ids, deadline, QueryPurpose(purpose))
            return encode_response(CODE_OK, out.num_hits)
        except EngineError as exc:
            code = WIRE_CODES.get(exc.status, CODE_INTERNAL)
            return encode_response(code, message=str(exc))
        except Exception as exc:
            log.exception("gpu doorbell: request failed")
            return encode_response(CODE_INTERNAL, message=f"internal error: {type(exc).__name__}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
