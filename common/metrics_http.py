"""/metrics (Prometheus text format) and /health over HTTP, in background threads.

A small threaded WSGI server from the standard library: scrapes are rare and
cheap, and running them in their own threads keeps them off the gRPC workers.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from pegaflow.common.addresses import format_host_port

log = logging.getLogger(__name__)


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingWSGIServerV6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        log.debug("http: " + format, *args)


class MetricsHttpServer:
    """Serves ``registry`` on /metrics and ``health()`` (-> (ok, detail dict)) on /health.

    ``host`` and ``port`` come parsed (each daemon parses its own flags); port 0 picks a
    free one, and ``address`` says which.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Callable[[], tuple[bool, dict]],
        thread_name: str,
    ):
        metrics_app = make_wsgi_app(registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            if path == "/health":
                try:
                    ok, detail = health()
                except Exception as exc:  # a failing check is an unhealthy answer, not a crash
                    ok, detail = False, {"error": str(exc)}
                body = json.dumps({"status": "ok" if ok else "unhealthy", **detail}).encode()
                status = "200 OK" if ok else "503 Service Unavailable"
                start_response(
                    status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
                )
                return [body]
            body = b"not found: try /metrics or /health\n"
            start_response(
                "404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
            )
            return [body]

        server_class = _ThreadingWSGIServerV6 if ":" in host else _ThreadingWSGIServer
        self._server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
        bound_host, bound_port = self._server.server_address[:2]
        self.address = format_host_port(host or bound_host, bound_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name=thread_name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
