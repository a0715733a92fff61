"""This server's remote-access settings made concrete (the mechanisms are common/auth.py's).

    access = RemoteAccess.load(config)        # at the start of start_server: reads every file;
                                              # AuthConfigError (a ValueError) refuses the start
    new_grpc_server(..., interceptors=access.server.interceptors)
    listen(grpc_server, config.addr, host, access.server.credentials)
    access.warn_exposure(config, grpc_address, http_address)   # once everything listens

What each setting protects:
  * ``--auth-token-file``: every call on ``--addr`` but health needs one of the file's tokens. That
    port carries the Engine service (local engines, remote clients) and the peer control plane
    PeerTransfer (other nodes), so one token set admits both. Peers are nodes of one cluster:
    they send the first token of ``--peer-auth-token-file``, by default of this node's own
    ``--auth-token-file`` (one cluster token, one file: the usual set-up).
  * ``--tls-cert`` / ``--tls-key``: TLS on ``--addr``; ``--tls-client-ca`` makes it mutual. The
    node's certificate is also its client certificate towards peers and the metaserver (one
    identity per node, both ways), presented whenever TLS to them is on.
  * ``--peer-tls-ca`` / ``--metaserver-tls-ca``: speak TLS to peers / the metaserver, verifying
    their certificates against that CA (certificates must name the host dialled: the address a
    node advertises, the metaserver's address); ``--metaserver-auth-token-file``: the token the
    metaserver asks for. There is no default from this node's own token: the metaserver is
    another service, possibly run by others, and need not learn this cluster's node token.
  * ``--tenant-file``: tenants with tokens of their own (server/clients/tenants.py); their
    tokens are accepted on ``--addr`` beside ``--auth-token-file``'s, and a session opened with
    one acts for that tenant.
  * ``--metrics-hide-models`` / ``--metrics-model-key-file``: server/metrics/model_names.py.

Why this set: one credential per thing a node talks to (its own callers, its peers, the
metaserver), each with the same two knobs (a token file, a CA), and the node's certificate as its
one TLS identity. Peer settings default to the node's own because every node of a cluster is
configured alike; the metaserver's do not, because it is not a node.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from pegaflow.common.auth import AuthConfigError, ClientAuth, ServerAuth, ServerSecurity, exposure_warning
from pegaflow.common.auth import is_loopback as _is_loopback
from pegaflow.server.clients.tenants import TenantTable
from pegaflow.server.metrics.model_names import ModelNames

if TYPE_CHECKING:
    from pegaflow.server.config import ServerConfig

log = logging.getLogger(__name__)


def _server_auth(config: ServerConfig) -> ServerAuth:
    return ServerAuth(
        token_file=config.auth_token_file,
        tls_cert_file=config.tls_cert_file,
        tls_key_file=config.tls_key_file,
        tls_client_ca_file=config.tls_client_ca_file,
    )


def peer_client_auth(config: ServerConfig) -> ClientAuth:
    """What this node presents to its peers' PeerTransfer."""
    tls = config.peer_tls_ca_file is not None
    return ClientAuth(
        token_file=config.peer_auth_token_file or config.auth_token_file,
        tls_ca_file=config.peer_tls_ca_file,
        tls_cert_file=config.tls_cert_file if tls else None,
        tls_key_file=config.tls_key_file if tls else None,
    )


def metaserver_client_auth(config: ServerConfig) -> ClientAuth:
    """What this node presents to the metaserver."""
    tls = config.metaserver_tls_ca_file is not None
    return ClientAuth(
        token_file=config.metaserver_auth_token_file,
        tls_ca_file=config.metaserver_tls_ca_file,
        tls_cert_file=config.tls_cert_file if tls else None,
        tls_key_file=config.tls_key_file if tls else None,
    )


def check_config(config: ServerConfig) -> None:
    """Flag combinations (ServerConfig.__post_init__): AuthConfigError (a ValueError). No file is read."""
    _server_auth(config).check()
    outgoing = (
        ("--peer-auth-token-file", config.peer_auth_token_file),
        ("--peer-tls-ca", config.peer_tls_ca_file),
        ("--metaserver-auth-token-file", config.metaserver_auth_token_file),
        ("--metaserver-tls-ca", config.metaserver_tls_ca_file),
    )
    for flag, value in outgoing:
        if value is not None and config.metaserver_addr is None:
            raise AuthConfigError(f"{flag} needs --metaserver-addr (without it this node calls nobody)")
    peer_client_auth(config).check()
    metaserver_client_auth(config).check()


@dataclasses.dataclass(frozen=True)
class RemoteAccess:
    server: ServerSecurity  # for --addr
    peers: ClientAuth  # for this node's peer links
    metaserver: ClientAuth  # for its metaserver publisher
    model_names: ModelNames
    tenants: TenantTable | None = None  # --tenant-file: who a session opened over gRPC acts for

    @classmethod
    def load(cls, config: ServerConfig, service_name: str = "pegaflow-server") -> RemoteAccess:
        """Reads every file the settings name (tokens, certificates, keys, the model key); raises
        AuthConfigError / ValueError naming the flag when one cannot be used. The outgoing
        credentials' files are read here too, so a typo refuses the start rather than every pull."""
        tenants = TenantTable.load(config.tenant_file) if config.tenant_file is not None else None
        server = _server_auth(config).open(service_name, extra_tokens=tenants)
        peers, metaserver = peer_client_auth(config), metaserver_client_auth(config)
        if config.metaserver_addr is not None:
            for auth in (peers, metaserver):
                auth.token_source()
                auth.channel_credentials()
        if config.metrics_model_key_file is not None:
            names = ModelNames.from_key_file(config.metrics_model_key_file)
        else:
            names = ModelNames(hide=config.metrics_hide_models)
        return cls(server, peers, metaserver, names, tenants)

    def warn_exposure(self, config: ServerConfig, grpc_address: str, http_address: str | None) -> list[str]:
        """Logs (and returns) one warning per listening surface that other hosts can reach with
        nothing authenticating its callers: gRPC on ``--addr`` without a token or mutual TLS,
        /metrics while it names models. Called once, at start."""
        from pegaflow.server.config import parse_host_port

        warnings = []
        host, _ = parse_host_port(config.addr)
        text = exposure_warning("pegaflow-server gRPC", grpc_address, host, self.server.authenticates, True)
        if text is not None:
            warnings.append(
                text + " Any caller can open sessions, read and write cached blocks and pull them as a "
                "peer. Set --auth-token-file and/or --tls-cert/--tls-key/--tls-client-ca, or listen on "
                "127.0.0.1."
            )
        elif self.server.token and not self.server.tls and not _is_loopback(host):
            log.info(
                "pegaflow-server gRPC on %s: token authentication without TLS, the token crosses the "
                "network in clear (--tls-cert/--tls-key encrypt it)",
                grpc_address,
            )
        if config.http_addr is not None and http_address is not None:
            http_host, _ = parse_host_port(config.http_addr)
            text = exposure_warning("pegaflow-server /metrics and /health (HTTP)", http_address, http_host,
                                    self.model_names.hidden, False)  # fmt: skip
            if text is not None:
                warnings.append(
                    text + " /metrics labels name every model this server caches; --metrics-hide-models "
                    "replaces them by digests (HTTP has no authentication: keep it behind a network policy)."
                )
        for text in warnings:
            log.warning("%s", text)
        return warnings

    def describe(self) -> str:
        parts = [f"grpc auth: {self.server.describe()}"]
        if self.tenants is not None:
            parts.append(f"{len(self.tenants)} tenant(s)")
        if self.model_names.hidden:
            parts.append("model names hidden")
        return ", ".join(parts)
