"""VllmServer's start-up on an auto-picked port: a port taken between picking it and binding it
(vLLM binds only after loading the model) makes the launcher start again on a new one."""

from __future__ import annotations

import socket
import sys

import pytest

from pegaflow.tools.vllm_cpu import launcher

pytestmark = pytest.mark.timeout(120)

# Stands in for `vllm serve` in what the launcher relies on: bind --port (failing as uvicorn does
# when it is taken) and answer /v1/models.
STAND_IN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": []}')
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Models)
except OSError as exc:
    print(f"OSError: [Errno {exc.errno}] Address already in use", flush=True)
    sys.exit(1)
server.serve_forever()
"""


def test_a_start_whose_auto_picked_port_was_taken_is_retried_on_a_new_port(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy])  # the first pick is the port someone else holds
    real_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: next(picks, None) or real_free_port())
    server = launcher.VllmServer("unused-model", tmp_path)
    server.cmd = [sys.executable, "-c", STAND_IN, "--port", str(server.port)]
    assert server.port == busy
    try:
        server.start().wait_ready(timeout_s=60)
        assert server.port != busy and server.base_url.endswith(f":{server.port}")
        assert "Address already in use" in server.log_tail()  # the first start did fail
    finally:
        server.stop()
        taken.close()


def test_a_port_the_caller_chose_is_not_replaced(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    server = launcher.VllmServer("unused-model", tmp_path, port=busy)
    server.cmd = [sys.executable, "-c", STAND_IN, "--port", str(busy)]
    try:
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start().wait_ready(timeout_s=60)
    finally:
        server.stop()
        taken.close()
