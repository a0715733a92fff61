"""The frame every gRPC handler of the server and the metaserver runs in.

The caller's deadline (or the service's default when a call arrives without
one, e.g. a health probe) becomes an absolute ``time.monotonic`` deadline the
handler passes on; the service's own errors become their status codes;
anything unexpected is logged and answered INTERNAL, so no request can take a
daemon down; every call is counted with its status code and latency.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import grpc

# What a service maps its errors with: (code, message) for an error it knows, None for a bug.
StatusOf = Callable[[Exception, grpc.ServicerContext], "tuple[grpc.StatusCode, str] | None"]


def rpc_handler(status_of: StatusOf, arrived_late: Callable[[str], Exception]):
    """A decorator for servicer methods ``fn(self, request, context, deadline) -> response``.

    The servicer has ``_config.default_rpc_deadline_s`` and ``_metrics`` (an object with
    ``observe_rpc(method, code_name, seconds)``, or None). ``arrived_late(message)`` is the
    service's deadline error, raised (and mapped by ``status_of``) when the deadline passed
    before the call was read.
    """

    def decorate(fn):
        method = fn.__name__
        log = logging.getLogger(fn.__module__)

        @functools.wraps(fn)
        def wrapper(self, request, context: grpc.ServicerContext):
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                remaining = context.time_remaining()
                if remaining is None:
                    remaining = self._config.default_rpc_deadline_s
                if remaining <= 0:
                    raise arrived_late("deadline already passed on arrival")
                return fn(self, request, context, time.monotonic() + remaining)
            except Exception as exc:
                status = status_of(exc, context)
                if status is None:
                    code = grpc.StatusCode.INTERNAL
                    log.exception("rpc %s failed", method)
                    context.abort(code, f"internal error in {method}: {type(exc).__name__}")
                code, message = status
                context.abort(code, message)
            finally:
                if self._metrics is not None:
                    self._metrics.observe_rpc(method, code.name, time.perf_counter() - start)

        return wrapper

    return decorate
