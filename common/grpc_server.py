"""Building, binding and announcing a daemon's gRPC server (the sync server with a thread pool)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2

from pegaflow.common.addresses import format_host_port


def new_grpc_server(
    workers: int,
    thread_name_prefix: str,
    max_message_bytes: int,
    max_concurrent_rpcs: int | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> grpc.Server:
    """``max_concurrent_rpcs``: calls beyond it are refused (RESOURCE_EXHAUSTED) instead of queued.
    ``interceptors``: run before every handler (common/auth.py's token check)."""
    return grpc.server(
        started_thread_pool(workers, thread_name_prefix),
        interceptors=list(interceptors) or None,
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[
            # grpc enables SO_REUSEPORT by default: a second server on the same port would
            # silently share it instead of failing to start.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )


def started_thread_pool(workers: int, thread_name_prefix: str) -> futures.ThreadPoolExecutor:
    """A ThreadPoolExecutor with all of its ``workers`` threads running before the first call.

    Why: the executor starts a thread only when a task finds none idle and never ends one, so the
    server's thread count climbed one step at each new peak of concurrent calls, up to
    ``workers``, long into a run (the 30-minute soak's "threads keep rising", issue 12). Started
    at once, the count is a constant of the configuration, and a leak shows as a leak."""
    if workers < 1:
        raise ValueError(f"a thread pool needs at least one worker, not {workers}")
    pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix)
    all_running = threading.Barrier(workers + 1)
    # Each task holds its worker until every worker holds one, so each submit finds none idle
    # and starts the next thread.
    for _ in range(workers):
        pool.submit(all_running.wait, 30.0)
    all_running.wait(30.0)
    return pool


def listen(
    server: grpc.Server, addr: str, host: str, credentials: grpc.ServerCredentials | None = None
) -> str:
    """Binds ``addr`` (``host`` is its host, parsed by the caller); returns the address with the
    port actually bound (port 0 picks a free one). Raises OSError when it cannot bind.
    ``credentials``: TLS (common/auth.py's ``ServerSecurity.credentials``); None: plaintext."""
    try:
        if credentials is None:
            port = server.add_insecure_port(addr)
        else:
            port = server.add_secure_port(addr, credentials)
    except RuntimeError as exc:  # grpc raises rather than returning 0 on some failed binds
        raise OSError(f"cannot listen for gRPC on {addr}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {addr}")
    return format_host_port(host, port)


def mark_serving(health_servicer: health.HealthServicer, service_name: str) -> None:
    """Health checks answer SERVING for the server as a whole ("") and for its service."""
    for service in ("", service_name):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
