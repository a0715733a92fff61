"""--kv-transfer-config values for PegaKVConnector in the two pool modes the experiments compare.

- shared: the connector reaches a pegaflow-server that owns the pool (`server_addr`, or
  PEGAFLOW_HOST / PEGAFLOW_PORT in the engine's environment: `server_from_env`);
- embedded: the vLLM worker owns a pool of its own, in-process, with the same engine and policy
  (the connector's single-instance mode).

Keys are the connector's (connector/config.py documents them); `timeouts` passes its
lookup_timeout_ms / load_timeout_ms through unchanged, the same in both modes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pegaflow.connector.embedded import published_address, published_metrics_address

CONNECTOR = "PegaKVConnector"
CONNECTOR_MODULE = "pegaflow.connector"


def _kv_transfer_config(extra: Mapping) -> dict:
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_connector_extra_config": dict(extra),
    }


def shared_pool(server_addr: str, timeouts: Mapping[str, int] | None = None) -> dict:
    return _kv_transfer_config({"server_addr": server_addr, **(timeouts or {})})


def server_from_env(timeouts: Mapping[str, int] | None = None) -> dict:
    """The connector reaches the pegaflow-server that PEGAFLOW_HOST / PEGAFLOW_PORT name (the seed's
    way: set them in the engine's environment, `server_env`)."""
    return _kv_transfer_config(dict(timeouts or {}))


def server_env(addr: str) -> dict[str, str]:
    """PEGAFLOW_HOST / PEGAFLOW_PORT for a server at "host:port"."""
    host, port = addr.rsplit(":", 1)
    return {"PEGAFLOW_HOST": f"http://{host}", "PEGAFLOW_PORT": port}


def embedded_pool(
    pool_bytes: int,
    timeouts: Mapping[str, int] | None = None,
    stats_addr: str | None = None,
    metrics_addr: str | None = None,
    engine_id: str | None = None,
) -> dict:
    """The worker runs the cache engine in-process with a pool of pool_bytes; `stats_addr`
    ("127.0.0.1:<port>") makes its gRPC service listen there so GetStats can be read, and
    `metrics_addr` serves its Prometheus /metrics (pool pre-fault time included). `engine_id`:
    vLLM's engine id, which names the file the embedded server publishes its address in
    (connector/embedded.py): with `stats_addr` port 0, read the port it got there, rather than
    pick one beforehand that another process may take first."""
    if pool_bytes <= 0:
        raise ValueError(f"pool_bytes must be > 0, got {pool_bytes}")
    extra = {"embedded_pool_size": f"{pool_bytes}b", **(timeouts or {})}
    if stats_addr is not None:
        extra["embedded_addr"] = stats_addr
    if metrics_addr is not None:
        extra["embedded_http_addr"] = metrics_addr
    config = _kv_transfer_config(extra)
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def embedded_address(engine_id: str, vllm: Any, metrics: bool = False) -> str:
    """The gRPC (``metrics``: /metrics) address the embedded server of ``vllm`` (a started
    tools/vllm_cpu VllmServer, run with `embedded_pool(..., engine_id=engine_id)`) published in its
    TMPDIR, the work dir's tmp/. Its ports are 0, read here, never picked beforehand: another
    process could take such a port before the worker binds it. RuntimeError naming the instance's
    vllm.log when there is none: that instance serves without the cache (its embedded server did not
    start), and timing or comparing it as an embedded one would be wrong."""
    read = published_metrics_address if metrics else published_address
    addr = read(engine_id, vllm.workdir / "tmp")
    if addr is None:
        raise RuntimeError(
            f"the embedded server of {vllm.workdir} published no {'metrics ' if metrics else ''}address: "
            f"that vLLM runs without the cache; see {vllm.log_path}"
        )
    return addr
