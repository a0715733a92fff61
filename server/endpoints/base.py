"""The seam of the server's local Unix-socket endpoints: a ``FrameCodec`` turns request frames into answers.

``UnixFrameServer`` (unix_socket.py) owns everything about the socket, once for every codec: the
listener (path checks, permissions, never stealing a live socket), the greeting with the pool
epoch, the connection cap, idle timeouts, incremental frame reads under a per-connection and a
total memory cap, the worker threads, the GOODBYE that tells a client its request was not run,
EMFILE back-off. A codec owns only the bytes of its requests and answers and how a request is
run. Two codecs: ``local_rpc.LocalRpcCodec`` (protobuf messages through the gRPC servicer's own
methods) and ``doorbell.DoorbellCodec`` (the GPU data path's fixed binary frame). The wire formats
are in ``pegaflow.common.wire``; the client end of the same plumbing is
``pegaflow.client.frame_link``.

Primitives, by role:

identity (read once, when the server is built)::

    name: str             thread names and log lines ("local-rpc", "doorbell")
    hello_magic: bytes    the 4 bytes the greeting starts with: a client knows which protocol it reached
    version: int          the greeting's version: a client of another version does not use the socket
    max_frame_bytes: int  the longest request body accepted: a longer one is refused unread

serving (called on a worker thread; one call at a time per connection, many connections at once)::

    handle(body, context) -> bytes | None
        ``body``: one whole request frame's body; ``context``: the call's ``CallContext`` (the
        server's clock at arrival, the connection) from which the codec makes the call's own
        deadline. Returns the whole answer frame (length prefix included), or None when the
        request wants no answer (oneway). May block, at most until the request's deadline (it
        runs engine calls). Bad *content* (unknown ids, invalid arguments, undecodable messages)
        is answered with its status code, never raised. Raises ``FrameError`` only when the body
        is not a request of this protocol at all: the server then sends ``refusal`` and closes
        the connection, which affects no other connection.

    refusal(code, message) -> bytes
        A whole answer frame saying "not executed, because <code>: <message>". Cheap, never fails.
        Sent for frames the server will not run: oversized, over the memory cap, not this protocol.
"""

from __future__ import annotations

import abc

import grpc


class FrameCodec(abc.ABC):
    name: str
    hello_magic: bytes
    version: int
    max_frame_bytes: int

    @abc.abstractmethod
    def handle(self, body: bytes, context) -> bytes | None: ...

    @abc.abstractmethod
    def refusal(self, code: grpc.StatusCode, message: str) -> bytes: ...

    def answered(self, context) -> None:
        """Called once a call's answer is on the socket (a timing log's last mark); nothing here."""
        return None
