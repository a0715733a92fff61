"""Embedded mode: the engine owns its KV pool, like an in-process cache would.

With `embedded_pool_size` set, TP rank 0's worker runs a whole pegaflow server (the
same engine, pool, policy and gRPC service as `pegaflow-server`, see
server/runtime.py) inside the vLLM worker process, started while vLLM registers its KV
caches, so its pool is allocated and pre-faulted before vLLM reports ready; it stops
with the worker. The other ranks and the scheduler find it through a small file named
after the engine id under the temp dir, and use it exactly like an external server.

This is the baseline the shared server is measured against (startup time, one pool per
instance); in production the cache lives in `pegaflow-server`, outside vLLM.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile

log = logging.getLogger("vllm.pegaflow.connector.embedded")


def address_file(engine_id: str, temp_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where rank 0 publishes the embedded server's gRPC address (processes of one vLLM
    engine share its engine id and temp dir). ``temp_dir``: that engine's temp dir, for a reader
    outside it (a benchmark reading the address of a server bound to port 0); default this one's."""
    return pathlib.Path(temp_dir or tempfile.gettempdir()) / f"pegaflow-embedded-{engine_id}.addr"


def metrics_address_file(engine_id: str, temp_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where rank 0 publishes the embedded server's /metrics address, when it serves one (a
    benchmark reading the pool's pre-fault time from a port it did not pick). Written before the
    gRPC address: once that one is there, so is this one."""
    return address_file(engine_id, temp_dir).with_suffix(".metrics")


def published_address(engine_id: str, temp_dir: str | os.PathLike | None = None) -> str | None:
    """The embedded server's address once rank 0 has started it, else None (``temp_dir``: as for
    ``address_file``)."""
    return _read(address_file(engine_id, temp_dir))


def published_metrics_address(engine_id: str, temp_dir: str | os.PathLike | None = None) -> str | None:
    """The embedded server's /metrics address once rank 0 has started it with one, else None."""
    return _read(metrics_address_file(engine_id, temp_dir))


def _read(path: pathlib.Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def _publish(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # readers never see a half-written address


class EmbeddedServer:
    """A pegaflow server running in this process for this engine only."""

    def __init__(self, engine_id: str, pool_size_bytes: int, addr: str, http_addr: str | None):
        from pegaflow.server.config import ServerConfig
        from pegaflow.server.runtime import start_server

        self.engine_id = engine_id
        self._file = address_file(engine_id)
        # allocates and pre-faults the pool before returning
        self.server = start_server(
            ServerConfig(pool_size_bytes=pool_size_bytes, addr=addr, http_addr=http_addr)
        )
        self._metrics_file = metrics_address_file(engine_id)
        if self.server.http_address:
            _publish(self._metrics_file, self.server.http_address)
        _publish(self._file, self.server.address)
        log.info(
            "pegaflow: embedded server for engine %s at %s (pool %.1f GiB%s)",
            engine_id,
            self.server.address,
            pool_size_bytes / 2**30,
            f", metrics on {self.server.http_address}" if self.server.http_address else "",
        )

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        for path in (self._file, self._metrics_file):
            try:
                path.unlink()
            except OSError:
                pass
        self.server.stop()
