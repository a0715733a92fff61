"""PegaKVConnector settings: `kv_connector_extra_config` keys plus PEGAFLOW_HOST/PEGAFLOW_PORT.

Every key is optional:

  server_addr            "host:port" of pegaflow-server's gRPC endpoint. Default: from
                         PEGAFLOW_HOST (default "http://127.0.0.1"; a scheme is stripped)
                         and PEGAFLOW_PORT (default 50055).
  lookup_timeout_ms      deadline of the scheduler's prefix lookup, which runs inside the
                         engine step (default 200).
  load_timeout_ms        the most one step waits for its loads (lease RPC + copies);
                         loads that have not landed by then are recomputed (default 500).
  max_lookup_wait_ms     the most a request waits, off the engine step, for blocks on their
                         way into the server (promoted from its SSD tier, pulled from another
                         node): vLLM is told "ask again" meanwhile, so the request waits and the
                         batch does not; past it the request takes what is ready (default 3000;
                         0: never wait).
  rpc_timeout_ms         deadline of calls off the step's path: connect, register, allocate,
                         seal, release, health probes (default 2000).
  retry_interval_s       longest wait between attempts to attach to, or re-probe, a server
                         that is down or slow (default 2.0; attempts back off from 0.1 s).
  max_pending_saves      save batches queued behind those in flight; more are dropped, so
                         a slow server cannot hold vLLM's blocks (default 16).
  model_id               model identity in the namespace (default: the served model's path
                         or name). Set it to share a cache between copies of one model at
                         different paths, or to separate weights replaced in place.
  namespace_salt         extra string mixed into the namespace (default "").
  mla_store              MLA models (DeepSeek-V2/V3 latent KV) under tensor parallelism:
                         "once" (default): the TP group stores each block once, written by
                         one rank per block and loaded by every rank (all ranks hold the
                         same latent); "per_rank": every rank stores its own copy in its
                         own namespace, like a non-MLA model (A/B comparisons; needs TP x
                         the pool). Ignored for non-MLA models, which are always per rank.
  embedded_pool_size     run the cache inside this engine instead of reaching a server:
                         TP rank 0's worker starts an in-process pegaflow server with a
                         pool of this size ("2gb", "1073741824b"), pre-faulted before vLLM
                         reports ready (see embedded.py). Excludes server_addr.
  embedded_addr          gRPC address of the embedded server (default "127.0.0.1:0": a
                         free port); set it to query the embedded engine's GetStats.
  embedded_http_addr     /metrics and /health of the embedded server (default: none).
  auth_token_file        a file whose first line is the token a server started with
                         --auth-token-file asks for (default: PEGAFLOW_AUTH_TOKEN_FILE, or
                         the token itself in PEGAFLOW_AUTH_TOKEN). Never the token itself in
                         this config: it is on vLLM's command line, which ps shows.
  tls_ca_file            speak TLS to the server, verifying it against this PEM CA (default:
                         PEGAFLOW_TLS_CA; unset: plaintext).
  tls_cert_file, tls_key_file
                         this engine's client certificate and key, for a server started with
                         --tls-client-ca (defaults: PEGAFLOW_TLS_CERT, PEGAFLOW_TLS_KEY).
  tls_server_name        the name to check in the server's certificate when it differs from
                         the host dialled (default: PEGAFLOW_TLS_SERVER_NAME).
  block_checksums        true: every saved block goes with the XXH3-64 of its bytes, and every
                         load checks the bytes it is about to copy against the checksum its
                         writer sent; a block that does not match is a miss from there on
                         (recomputed) and reported, the server drops it. Catches a pool that
                         was written behind the cache's back (another client's mapping, a bad
                         DIMM) before vLLM computes on it. Costs one hash per block each way,
                         about half a memcpy (XXH3 ~18 GB/s here); false (default): neither.
                         Host KV only (with CUDA KV the server copies).
  honor_kv_load_failure_policy
                         false (default): the connector sets vLLM's kv_load_failure_policy
                         to "recompute", so a failed load is recomputed, never a failed
                         request (vLLM's default "fail" is indistinguishable from an explicit
                         "fail"). true: keep whatever kv_load_failure_policy says.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from pegaflow.common.auth import AuthConfigError, ClientAuth
from pegaflow.connector.mla import parse_store_mode

DEFAULT_HOST = "http://127.0.0.1"
DEFAULT_PORT = 50055


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    server_addr: str  # "" in embedded mode: the address is published by rank 0
    lookup_timeout_s: float = 0.2
    load_timeout_s: float = 0.5
    max_lookup_wait_s: float = 3.0
    rpc_timeout_s: float = 2.0
    retry_interval_s: float = 2.0
    max_pending_saves: int = 16
    model_id: str | None = None
    namespace_salt: str = ""
    honor_kv_load_failure_policy: bool = False
    block_checksums: bool = False
    mla_store: str = "once"
    embedded_pool_size: int | None = None
    embedded_addr: str = "127.0.0.1:0"
    embedded_http_addr: str | None = None
    # The credentials of every process's client (common/auth.py): the keys above over the
    # PEGAFLOW_AUTH_* / PEGAFLOW_TLS_* environment; empty: plaintext and no token, as before.
    auth: ClientAuth = ClientAuth()

    @property
    def embedded(self) -> bool:
        return self.embedded_pool_size is not None

    @property
    def worst_step_stall_s(self) -> float:
        """The longest a slow or stopped server can delay one engine step: one lookup
        deadline in the scheduler plus one load deadline in each worker (saves never
        block a step). After the first miss the circuit breaker skips the server."""
        return self.lookup_timeout_s + self.load_timeout_s


_MS_KEYS = {
    "lookup_timeout_ms": "lookup_timeout_s",
    "load_timeout_ms": "load_timeout_s",
    "rpc_timeout_ms": "rpc_timeout_s",
    "max_lookup_wait_ms": "max_lookup_wait_s",
}
# key -> the ClientAuth field (common/auth.py) it sets
_AUTH_KEYS = {
    "auth_token_file": "token_file",
    "tls_ca_file": "tls_ca_file",
    "tls_cert_file": "tls_cert_file",
    "tls_key_file": "tls_key_file",
    "tls_server_name": "tls_server_name",
}
_KNOWN_KEYS = frozenset(
    {
        "server_addr",
        *_MS_KEYS,
        "retry_interval_s",
        "max_pending_saves",
        "model_id",
        "namespace_salt",
        "honor_kv_load_failure_policy",
        "block_checksums",
        "mla_store",
        "embedded_pool_size",
        "embedded_addr",
        "embedded_http_addr",
        *_AUTH_KEYS,
    }
)


def server_addr_from_env(env: Mapping[str, str] | None = None) -> str:
    """gRPC target from PEGAFLOW_HOST / PEGAFLOW_PORT: "http://10.0.0.5" + "50055" -> "10.0.0.5:50055"."""
    env = os.environ if env is None else env
    host = (env.get("PEGAFLOW_HOST") or DEFAULT_HOST).strip()
    port_text = (env.get("PEGAFLOW_PORT") or "").strip()
    if "://" in host:
        host = host.split("://", 1)[1]
    host = host.rstrip("/")
    if not host:
        raise ValueError("PEGAFLOW_HOST is empty after removing its scheme")
    if "/" in host:
        raise ValueError(f"PEGAFLOW_HOST must be a host (optionally with scheme), got {host!r}")
    if port_text:
        port = _parse_port(port_text, "PEGAFLOW_PORT")
        host = _strip_port(host)
    elif _has_port(host):
        return host
    else:
        port = DEFAULT_PORT
    return f"{host}:{port}"


def _has_port(host: str) -> bool:
    if host.startswith("["):  # [ipv6]:port
        return "]:" in host
    return host.count(":") == 1


def _strip_port(host: str) -> str:
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _parse_port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a port number, got {text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{what} must be in 1..65535, got {port}")
    return port


def _positive_float(key: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}") from None
    if not out > 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be > 0, got {value!r}")
    return out


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")


def _embedded(extra: Mapping[str, Any]) -> dict[str, Any]:
    from pegaflow.common.units import parse_host_port, parse_size

    out: dict[str, Any] = {}
    value = extra["embedded_pool_size"]
    try:
        out["embedded_pool_size"] = parse_size(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kv_connector_extra_config['embedded_pool_size']: {exc}") from None
    if out["embedded_pool_size"] <= 0:
        raise ValueError("kv_connector_extra_config['embedded_pool_size'] must be positive")
    for key in ("embedded_addr", "embedded_http_addr"):
        if key in extra:
            try:
                parse_host_port(str(extra[key]))
            except ValueError as exc:
                raise ValueError(f"kv_connector_extra_config[{key!r}]: {exc}") from None
            out[key] = str(extra[key])
    return out


def load_config(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
    """Validate kv_connector_extra_config; unknown keys are an error (a typo would otherwise
    silently fall back to a default)."""
    extra = dict(extra or {})
    if "auth_token" in extra:
        raise ValueError(
            "kv_connector_extra_config['auth_token']: a token does not belong in this config (it is on "
            "vLLM's command line, which ps shows to every local user): put it in a file named by "
            "'auth_token_file' or PEGAFLOW_AUTH_TOKEN_FILE, or in PEGAFLOW_AUTH_TOKEN"
        )
    unknown = sorted(set(extra) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"unknown PegaKVConnector kv_connector_extra_config key(s) {unknown}; "
            f"known: {sorted(_KNOWN_KEYS)}"
        )
    kwargs: dict[str, Any] = {}
    addr = extra.get("server_addr")
    if "embedded_pool_size" in extra:
        if addr is not None:
            raise ValueError("kv_connector_extra_config: set server_addr or embedded_pool_size, not both")
        kwargs.update(_embedded(extra))
        kwargs["server_addr"] = ""
    elif "embedded_addr" in extra or "embedded_http_addr" in extra:
        raise ValueError(
            "kv_connector_extra_config: embedded_addr / embedded_http_addr need embedded_pool_size"
        )
    elif addr is not None:
        if not isinstance(addr, str) or not _has_port(addr.split("://", 1)[-1]):
            raise ValueError(f"kv_connector_extra_config['server_addr'] must be 'host:port', got {addr!r}")
        kwargs["server_addr"] = addr.split("://", 1)[-1].rstrip("/")
    else:
        kwargs["server_addr"] = server_addr_from_env(env)
    for key, field in _MS_KEYS.items():
        if key == "max_lookup_wait_ms" and extra.get(key) == 0:
            kwargs[field] = 0.0  # never wait for blocks on their way
        elif key in extra:
            kwargs[field] = _positive_float(key, extra[key]) / 1000.0
    if "retry_interval_s" in extra:
        kwargs["retry_interval_s"] = _positive_float("retry_interval_s", extra["retry_interval_s"])
    if "max_pending_saves" in extra:
        value = extra["max_pending_saves"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"kv_connector_extra_config['max_pending_saves'] must be an int >= 1, got {value!r}"
            )
        kwargs["max_pending_saves"] = value
    for key in ("model_id", "namespace_salt"):
        if key in extra:
            value = extra[key]
            if not isinstance(value, str) or (key == "model_id" and not value):
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}] must be a non-empty string, got {value!r}"
                )
            kwargs[key] = value
    if "honor_kv_load_failure_policy" in extra:
        kwargs["honor_kv_load_failure_policy"] = _bool(
            "honor_kv_load_failure_policy", extra["honor_kv_load_failure_policy"]
        )
    if "block_checksums" in extra:
        kwargs["block_checksums"] = _bool("block_checksums", extra["block_checksums"])
    if "mla_store" in extra:
        kwargs["mla_store"] = parse_store_mode(extra["mla_store"])
    kwargs["auth"] = _auth(extra, env)
    return ConnectorConfig(**kwargs)


def _auth(extra: Mapping[str, Any], env: Mapping[str, str] | None) -> ClientAuth:
    """The credentials: the config's keys over the environment's PEGAFLOW_AUTH_* / PEGAFLOW_TLS_*."""
    given = {}
    for key, field in _AUTH_KEYS.items():
        if key in extra:
            value = extra[key]
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}] must be a non-empty string, got {value!r}"
                )
            given[field] = value
    try:
        return ClientAuth.from_env(env, **given)
    except AuthConfigError as exc:
        raise ValueError(f"kv_connector_extra_config / PEGAFLOW_AUTH_*, PEGAFLOW_TLS_*: {exc}") from None
