"""pegaflow.connector: vLLM's KV connector over pegaflow-server.

    --kv-transfer-config '{"kv_connector":"PegaKVConnector","kv_role":"kv_both",
                           "kv_connector_module_path":"pegaflow.connector"}'

vLLM imports this module in its API server, EngineCore and worker processes and then
asks it for `PegaKVConnector`; the class (and vLLM's connector base under it) loads on
that first access, and gRPC and the client only when a connector role starts. So the
submodules (config, namespace, kv_pages, ...) import without vLLM. See README.md here.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pegaflow.connector.connector import PegaKVConnector

__all__ = ["PegaKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "PegaKVConnector":
        from pegaflow.connector.connector import PegaKVConnector

        return PegaKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
