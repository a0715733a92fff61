"""How a model id appears outside the server: as it is, or as a stable digest (``--metrics-hide-models``).

/metrics has no authentication (Prometheus scrapes it, dashboards show it to whoever reads them), and
GetStats answers every caller the gRPC port lets in, the local RPC socket's included. A model id can
say what a tenant runs (a fine-tune's name, a customer's path), so with the flag every model label of
/metrics (``pegaflow_namespace_resident_blocks``, the ``pegaflow_prefill_*`` savings families) and
every ``NamespaceStats.model_id`` of GetStats carries ``model-<16 hex>`` instead. Hidden always when
the flag is set, for every caller: a GetStats caller already passed the token check (there is no
"caller without the token" to tell apart), and one rule for both surfaces means a digest on a
dashboard matches the one in GetStats.

The digest is stable (the same on every node and after every restart, so series can be joined and
alerts keep their labels). Unkeyed it is SHA-256 of the id, which hides a name from a reader but lets
anyone who guesses a public model's name confirm the guess; with ``--metrics-model-key-file`` it is
HMAC-SHA-256 under that key (give every node the same file), which a guess cannot confirm.
The server's own logs still name models: they are the operator's.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

DIGEST_HEX_CHARS = 16  # 64 bits: no collision in practice among a server's few thousand namespaces
PREFIX = "model-"
_UNKEYED_DOMAIN = b"pegaflow model id\0"
MIN_KEY_BYTES = 16


class ModelNames:
    """``names(model_id) -> label``: the id itself, or its digest when hiding."""

    def __init__(self, hide: bool = False, key: bytes | None = None) -> None:
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a model-name key must be at least {MIN_KEY_BYTES} bytes")
        self.hidden = hide or key is not None
        self._key = key
        # Bounded: namespaces are (server config max_namespaces, 4096 by default).
        self._digest = functools.lru_cache(maxsize=8192)(self._compute)

    def __call__(self, model_id: str) -> str:
        if not self.hidden:
            return model_id
        return self._digest(model_id)

    def _compute(self, model_id: str) -> str:
        data = model_id.encode("utf-8", "surrogatepass")
        if self._key is not None:
            digest = hmac.new(self._key, data, hashlib.sha256).hexdigest()
        else:
            digest = hashlib.sha256(_UNKEYED_DOMAIN + data).hexdigest()
        return PREFIX + digest[:DIGEST_HEX_CHARS]

    @classmethod
    def from_key_file(cls, path: str) -> ModelNames:
        """Hiding, keyed by the file's bytes (surrounding whitespace stripped); ValueError if unusable."""
        try:
            with open(path, "rb") as f:
                key = f.read(1 << 16).strip()
        except OSError as exc:
            reason = exc.strerror or exc
            raise ValueError(f"--metrics-model-key-file {path}: cannot read it: {reason}") from None
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(
                f"--metrics-model-key-file {path}: the key must be at least {MIN_KEY_BYTES} bytes "
                "(make one with: openssl rand -hex 32)"
            )
        return cls(hide=True, key=key)


SHOWN = ModelNames()  # the default: ids as they are
