"""A call that is sent now and answered later: what lets a save overlap its RPCs with its copies.

``PegaClient.allocate_async`` / ``seal_async`` send their request at once, over the local RPC
socket (its own connection for as long as the answer is out: client/frame_link.py) or as a gRPC
future, and return a ``PendingRpc``. ``result()`` waits for the answer within the call's deadline
and raises exactly what the synchronous call would; ``abandon()`` stops waiting (the request may
still run: whoever abandons it undoes it, as the save pipeline aborts an allocation it will not
use). Every PendingRpc must end in one of the two: an unread local answer holds a connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

from pegaflow.client import errors
from pegaflow.client.local_rpc import PendingCall

T = TypeVar("T")


class PendingRpc(Generic[T]):
    __slots__ = (
        "_client", "_conn", "_method", "_request", "_deadline", "_local", "_future", "_decode", "_undo",
        "_done",
    )  # fmt: skip

    def __init__(
        self,
        client: Any,
        conn: Any,
        method: str,
        request: Any,
        deadline: float,
        decode: Callable[[Any], T],
        undo: Callable[[], None] | None = None,
    ):
        self._client, self._conn, self._method = client, conn, method
        self._request, self._deadline, self._decode, self._undo = request, deadline, decode, undo
        self._local: PendingCall | None = None
        self._future = None
        self._done = False
        if conn.local is not None:
            self._local = conn.local.start(method, request, deadline)  # raises LocalRpcError
        if self._local is None:
            self._future = getattr(conn.stub, method).future(request, timeout=self._left())

    def _left(self) -> float:
        return max(self._deadline - time.monotonic(), 0.001)

    def result(self) -> T:
        """The decoded answer; raises the call's ``errors.PegaflowError``."""
        if self._done:
            raise RuntimeError(f"{self._method}: result() called twice")
        self._done = True
        try:
            if self._local is not None:
                response = self._local.result()
                if response is None:  # the server did not run it there: gRPC, same deadline
                    response = getattr(self._conn.stub, self._method)(self._request, timeout=self._left())
            else:
                response = self._future.result()
        except (grpc.RpcError, ValueError, grpc.FutureCancelledError) as err:
            exc = self._client._failed(self._conn, err, self._method)
            if self._undo is not None and isinstance(exc, errors.DeadlineExceeded):
                self._undo()  # it may still run: what it would grant is given back
            raise exc from None
        return self._decode(response)

    def abandon(self) -> None:
        if self._done:
            return
        self._done = True
        if self._local is not None:
            self._local.abandon()
        else:
            self._future.cancel()
        if self._undo is not None:
            self._undo()


def start(
    client: Any,
    conn: Any,
    method: str,
    request: Any,
    deadline: float,
    decode: Callable[[Any], T],
    undo: Callable[[], None] | None = None,
) -> PendingRpc[T]:
    """A PendingRpc, or the call's error if it could not even be sent. ``undo`` runs when the call
    is abandoned or misses its deadline (it may run all the same)."""
    try:
        return PendingRpc(client, conn, method, request, deadline, decode, undo)
    except (grpc.RpcError, ValueError) as err:
        raise client._failed(conn, err, method) from None


__all__ = ["PendingRpc", "start"]
