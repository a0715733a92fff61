"""Remote access to the gRPC surfaces: a shared bearer token, TLS and mutual TLS, and the warning for
a listen address that other hosts can reach.

Everything here is grpcio's own machinery: ``grpc.ssl_server_credentials`` /
``grpc.ssl_channel_credentials`` for TLS (no home-made crypto), a ``grpc.ServerInterceptor`` that
checks the token before any request byte is parsed, a client interceptor that sends it. Nothing
configured means exactly what the daemons did before: plaintext gRPC, no check.

Primitives, by role:

Daemon side (pegaflow-server, pegaflow-metaserver; built once at start, before anything listens):
    ServerAuth(token_file, tls_cert_file, tls_key_file, tls_client_ca_file).open() -> ServerSecurity
        Reads and checks every file now; AuthConfigError (a ValueError naming the flag) refuses the
        start. ``.interceptors`` go to ``grpc.server(interceptors=...)``, ``.credentials`` (None:
        plaintext) to ``add_secure_port``. Calls without an accepted token are answered
        UNAUTHENTICATED before their request is deserialized; the health service
        (``/grpc.health.v1.Health/``) stays open, so probes need no secret (it tells only
        SERVING / NOT_SERVING). With a client CA the TLS handshake itself requires a certificate
        that CA signed (grpcio offers "require" or "do not ask", nothing between): a client
        without one is refused before any call, health probes included, and sees UNAVAILABLE.
    exposure_warning(surface, host, authenticated, wildcard_note) -> str | None
        The one warning a daemon logs for a listen address other hosts can reach while nothing
        authenticates its callers (None for loopback, or when something does).

Client side (the Python client, the connector, a node's peer links and metaserver publisher):
    ClientAuth(token, token_file, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name)
    ClientAuth.from_env()   PEGAFLOW_AUTH_TOKEN / PEGAFLOW_AUTH_TOKEN_FILE / PEGAFLOW_TLS_CA /
                            PEGAFLOW_TLS_CERT / PEGAFLOW_TLS_KEY / PEGAFLOW_TLS_SERVER_NAME
    auth.channel(target, options) -> grpc.Channel
        TLS when ``tls_ca_file`` is set (the client certificate too, for mutual TLS), the token on
        every call when one is set; reads the files at each call (a client builds a channel per
        (re)connect, so a renewed certificate is picked up by the next one). Plain
        ``grpc.insecure_channel`` when nothing is set. AuthConfigError for unreadable files.

Tokens (``TokenSource``): a file holds one or more tokens, one per line (blank lines and ``#``
comments ignored). A server accepts any of them, a client sends the first, so a token is rotated
without a restart: add the new one as a second line on the servers, move the clients' files to
it, then drop the old one. The file is re-read when it changes (checked at most once a second; a
read that fails or finds no token keeps the previous tokens and logs one warning). Tokens are
printable ASCII without spaces (what gRPC metadata can carry), at least ``MIN_TOKEN_CHARS`` long
(``openssl rand -hex 32`` makes a good one), compared in constant time (``hmac.compare_digest``).
A token is never taken from a command line (``ps`` shows every argument to every local user):
daemons read it from a file, clients from a file or the environment.

What this does not protect, on purpose (ARCHITECTURE.md, "Trust model"): the local Unix sockets
(fd broker, local RPC, GPU doorbell) are gated by their file permissions (0660, server
endpoints/unix_socket.py), not by the token; the peer data plane (TCP streams / RDMA) is not
encrypted, and its reads are gated by the transfer ids that an authenticated control-plane call
handed out.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import ssl
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "authorization"  # as HTTP: "authorization: Bearer <token>"
TOKEN_SCHEME = "Bearer "
# Methods served without a token: health probes (they learn SERVING / NOT_SERVING, nothing else).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
MAX_TOKEN_FILE_BYTES = 64 << 10
RELOAD_CHECK_S = 1.0

ENV_TOKEN = "PEGAFLOW_AUTH_TOKEN"
ENV_TOKEN_FILE = "PEGAFLOW_AUTH_TOKEN_FILE"
ENV_TLS_CA = "PEGAFLOW_TLS_CA"
ENV_TLS_CERT = "PEGAFLOW_TLS_CERT"
ENV_TLS_KEY = "PEGAFLOW_TLS_KEY"
ENV_TLS_SERVER_NAME = "PEGAFLOW_TLS_SERVER_NAME"


class AuthConfigError(ValueError):
    """A credential setting that cannot work (a file missing or malformed, a key without its
    certificate): the daemon refuses to start, the client to connect."""


# ------------------------------------------------------------------ tokens


def parse_tokens(text: str, where: str) -> tuple[str, ...]:
    """The tokens of a token file's text (one per line; blank lines and ``#`` comments skipped)."""
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        tokens.append(check_token(token, f"{where}, line {number}"))
    if not tokens:
        raise AuthConfigError(f"{where} holds no token (one per line; make one with: openssl rand -hex 32)")
    return tuple(tokens)


def check_token(token: str, where: str) -> str:
    """``token`` if gRPC metadata can carry it and it is long enough to be a secret."""
    if not all(0x21 <= ord(ch) <= 0x7E for ch in token):
        raise AuthConfigError(f"{where}: a token must be printable ASCII without spaces")
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise AuthConfigError(
            f"{where}: a token must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} characters, got {len(token)} "
            "(make one with: openssl rand -hex 32)"
        )
    return token


def _read_small(path: str, what: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise AuthConfigError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise AuthConfigError(f"{what} {path}: larger than {limit} bytes, so not what it should be")
    return data


_GONE = (0, 0, -1)  # the state of a token file that cannot be stat()ed


def _file_state(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


class TokenSource:
    """The tokens of a file (re-read when it changes) or of one fixed value (from the environment).

    ``tokens()`` (a server's accepted set) and ``current()`` (what a client sends: the first) are
    cheap: one ``stat`` at most every ``RELOAD_CHECK_S``, a tuple otherwise.
    """

    def __init__(
        self,
        path: str | None = None,
        value: str | None = None,
        what: str = "auth token file",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (path is None) == (value is None):
            raise ValueError("a TokenSource has a file or a value")
        self.path = path
        self.what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._state: tuple[int, int, int] | None = None
        self._failed_state: tuple[int, int, int] | None = None
        if value is not None:
            self._tokens: tuple[str, ...] = (check_token(value, what),)
            return
        try:
            self._state = _file_state(path)
        except OSError as exc:
            raise AuthConfigError(f"{what} {path}: {exc.strerror or exc}") from None
        text = _read_small(path, what, MAX_TOKEN_FILE_BYTES)
        try:
            self._tokens = parse_tokens(text.decode("ascii"), f"{what} {path}")
        except UnicodeDecodeError:
            raise AuthConfigError(f"{what} {path}: a token file is ASCII text") from None
        self._next_check = clock() + RELOAD_CHECK_S
        if os.stat(path).st_mode & stat.S_IROTH:
            log.warning(
                "%s %s is readable by every local user: anyone on this host can use it (chmod o-r)",
                what,
                path,
            )

    def tokens(self) -> tuple[str, ...]:
        if self.path is not None and self._clock() >= self._next_check:
            self._maybe_reload()
        return self._tokens

    def current(self) -> str:
        return self.tokens()[0]

    def _maybe_reload(self) -> None:
        with self._lock:
            now = self._clock()
            if now < self._next_check:
                return
            self._next_check = now + RELOAD_CHECK_S
            try:
                state = _file_state(self.path)
            except OSError as exc:
                self._reload_failed(_GONE, f"{exc.strerror or exc}")
                return
            if state == self._state or state == self._failed_state:
                return
            try:
                tokens = parse_tokens(
                    _read_small(self.path, self.what, MAX_TOKEN_FILE_BYTES).decode("ascii"),
                    f"{self.what} {self.path}",
                )
            except (AuthConfigError, UnicodeDecodeError) as exc:
                self._reload_failed(state, str(exc))
                return
            self._tokens, self._state, self._failed_state = tokens, state, None
            log.info("%s %s re-read: %d token(s)", self.what, self.path, len(tokens))

    def _reload_failed(self, state: tuple[int, int, int], reason: str) -> None:
        """One warning per bad version of the file (a file that stays broken is not logged again)."""
        if state != self._failed_state:
            log.warning(
                "%s %s changed but cannot be used (%s); keeping its previous tokens",
                self.what,
                self.path,
                reason,
            )
        self._failed_state = state


def bearer_tokens(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[bytes]:
    """The tokens a call's metadata carries as ``authorization: Bearer <token>``."""
    out = []
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            if isinstance(value, str):
                value = value.encode("ascii", "replace")
            if value[: len(TOKEN_SCHEME)].lower() == TOKEN_SCHEME.lower().encode():
                out.append(value[len(TOKEN_SCHEME) :].strip())
    return out


def token_accepted(metadata, tokens: Sequence[str]) -> bool:
    """Whether the call's metadata carries one of ``tokens``; every comparison runs in constant time."""
    ok = False
    for sent in bearer_tokens(metadata):
        for token in tokens:
            ok |= hmac.compare_digest(sent, token.encode())
    return ok


# ------------------------------------------------------------------ server side


def _refuse(message: str):
    def behaviour(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return behaviour


def _refusal_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED. No request
    deserializer: nothing an unauthenticated caller sent is ever parsed."""
    refuse = _refuse(message)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class TokenSet:
    """Several sources' tokens accepted alike (a server's auth token file and its tenant file):
    anything with a ``tokens()`` method."""

    def __init__(self, *sources) -> None:
        self._sources = sources

    def tokens(self) -> tuple[str, ...]:
        return tuple(token for source in self._sources for token in source.tokens())


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Lets a call through when its metadata carries an accepted token; UNAUTHENTICATED otherwise.
    Methods under ``open_prefixes`` (health) pass without one. ``refused`` counts refusals."""

    def __init__(self, tokens: TokenSource | TokenSet, service_name: str, open_prefixes=OPEN_METHOD_PREFIXES):
        self._tokens = tokens
        self._open = tuple(open_prefixes)
        self._missing = (
            f"{service_name} requires an auth token: send metadata 'authorization: Bearer <token>' "
            f"(the Python client: PEGAFLOW_AUTH_TOKEN_FILE or ClientAuth(token_file=...))"
        )
        self._wrong = f"{service_name} does not accept the auth token sent"
        self._refused_lock = threading.Lock()
        self.refused = 0  # calls answered UNAUTHENTICATED

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        metadata = handler_call_details.invocation_metadata
        if token_accepted(metadata, self._tokens.tokens()):
            return handler
        with self._refused_lock:
            self.refused += 1
        return _refusal_handler(handler, self._wrong if bearer_tokens(metadata) else self._missing)


def read_pem(path: str, what: str) -> bytes:
    data = _read_small(path, what, 1 << 20)
    if b"-----BEGIN " not in data:
        raise AuthConfigError(f"{what} {path}: not a PEM file")
    return data


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """What ``ServerAuth.open()`` built: hand ``interceptors`` and ``credentials`` to the gRPC server."""

    interceptors: tuple[grpc.ServerInterceptor, ...]
    credentials: grpc.ServerCredentials | None  # None: plaintext
    token: bool  # callers must send a token
    mutual_tls: bool  # callers must present a certificate the client CA signed

    @property
    def authenticates(self) -> bool:
        return self.token or self.mutual_tls

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def refused(self) -> int:
        """Calls answered UNAUTHENTICATED so far (TLS handshakes refused are not calls: not counted)."""
        return sum(getattr(i, "refused", 0) for i in self.interceptors)

    def describe(self) -> str:
        parts = (["token"] if self.token else []) + (
            ["mutual TLS"] if self.mutual_tls else ["TLS"] if self.tls else []
        )
        return " + ".join(parts) or "none"


@dataclasses.dataclass(frozen=True)
class ServerAuth:
    """A daemon's settings for the callers of its gRPC port (all None: no authentication)."""

    token_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # How the flags are spelled, for error messages ("--auth-token-file", ...).
    flag_names: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {
            "token_file": "--auth-token-file",
            "tls_cert_file": "--tls-cert",
            "tls_key_file": "--tls-key",
            "tls_client_ca_file": "--tls-client-ca",
        },
        compare=False,
        repr=False,
    )

    def check(self) -> None:
        """Flag combinations only (no file is read): AuthConfigError."""
        names = self.flag_names
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise AuthConfigError(f"{names['tls_cert_file']} and {names['tls_key_file']} go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise AuthConfigError(
                f"{names['tls_client_ca_file']} (mutual TLS) needs {names['tls_cert_file']} and "
                f"{names['tls_key_file']}: the server's own certificate"
            )

    def open(self, service_name: str, extra_tokens=None) -> ServerSecurity:
        """Reads every file now; AuthConfigError for any that cannot be used. ``extra_tokens``
        (anything with ``tokens()``, e.g. a tenant table) are accepted beside the token file's."""
        self.check()
        names = self.flag_names
        interceptors: tuple[grpc.ServerInterceptor, ...] = ()
        sources = []
        if self.token_file is not None:
            sources.append(TokenSource(self.token_file, what=names["token_file"]))
        if extra_tokens is not None:
            sources.append(extra_tokens)
        if sources:
            interceptors = (TokenAuthInterceptor(TokenSet(*sources), service_name),)
        credentials = None
        if self.tls_cert_file is not None:
            cert = read_pem(self.tls_cert_file, names["tls_cert_file"])
            key = read_pem(self.tls_key_file, names["tls_key_file"])
            ca = None
            if self.tls_client_ca_file is not None:
                ca = read_pem(self.tls_client_ca_file, names["tls_client_ca_file"])
            check_tls_files(
                self.tls_cert_file,
                self.tls_key_file,
                self.tls_client_ca_file,
                (names["tls_cert_file"], names["tls_key_file"], names["tls_client_ca_file"]),
            )
            credentials = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
            )
        return ServerSecurity(
            interceptors=interceptors,
            credentials=credentials,
            token=bool(sources),
            mutual_tls=self.tls_client_ca_file is not None,
        )


def check_tls_files(
    cert_file: str | None, key_file: str | None, ca_file: str | None, names: tuple[str, str, str]
) -> None:
    """Loads the files as OpenSSL will (stdlib ``ssl``): a key that does not match its certificate, or
    a file that is no certificate, is refused now. grpcio itself checks nothing when credentials are
    built: a bad pair would only fail every handshake, after a start that looked fine."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise AuthConfigError(
                f"{names[0]} {cert_file} / {names[1]} {key_file}: not a matching certificate and "
                f"unencrypted private key ({exc})"
            ) from None
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise AuthConfigError(f"{names[2]} {ca_file}: no CA certificate in it ({exc})") from None


class RefusalCollector:
    """A prometheus_client collector: ``<name>_total``, the calls ``security`` refused (a client with
    a stale token, or someone trying tokens)."""

    def __init__(self, security: ServerSecurity, name: str) -> None:
        self._security = security
        self._name = name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(
            self._name,
            "gRPC calls refused as UNAUTHENTICATED (no token, or one not accepted)",
            value=self._security.refused(),
        )


# ------------------------------------------------------------------ warnings


def is_loopback(host: str) -> bool:
    """Whether only this host can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def wildcard_note(host: str, grpc_bind: bool) -> str:
    """What a wildcard host actually binds, said in the warning."""
    host = host.strip("[]")
    if host in ("0.0.0.0", ""):
        if grpc_bind:
            return (
                " gRPC binds 0.0.0.0 as the IPv6 wildcard [::] (dual-stack), so it is reachable on "
                "every IPv4 and IPv6 address of this host."
            )
        return " 0.0.0.0 is every IPv4 address of this host."
    if host == "::":
        return (
            " :: is every IPv6 address and, dual-stack (net.ipv6.bindv6only=0, the default), every IPv4 one."
        )
    return ""


def exposure_warning(surface: str, addr: str, host: str, authenticated: bool, grpc_bind: bool) -> str | None:
    """The warning to log once at start for ``surface`` listening on ``addr`` (host ``host``), or None
    when only this host can reach it or its callers are authenticated."""
    if authenticated or is_loopback(host):
        return None
    return (
        f"{surface} listens on {addr}, which other hosts can reach, and nothing authenticates its "
        f"callers.{wildcard_note(host, grpc_bind)}"
    )


# ------------------------------------------------------------------ client side


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` (the source's current token) to every call."""

    def __init__(self, tokens: TokenSource) -> None:
        self._tokens = tokens

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != TOKEN_METADATA_KEY]
        metadata.append((TOKEN_METADATA_KEY, TOKEN_SCHEME + self._tokens.current()))
        return _CallDetails(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


@dataclasses.dataclass(frozen=True)
class ClientAuth:
    """The credentials a client presents (all None: plaintext, no token: as before).

    ``token`` is the token itself (from the environment; never put one on a command line),
    ``token_file`` a token file (its first token is sent). ``tls_ca_file``: verify the server's
    certificate against this CA and speak TLS; ``tls_cert_file`` + ``tls_key_file``: this client's
    certificate for a server that requires mutual TLS; ``tls_server_name``: the name to check in
    the server's certificate when it differs from the host dialled (an IP, a tunnel).
    """

    token: str | None = dataclasses.field(default=None, repr=False)
    token_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> ClientAuth:
        """From PEGAFLOW_AUTH_TOKEN(_FILE) and PEGAFLOW_TLS_*; ``overrides`` (not None) win over them."""
        env = os.environ if env is None else env
        values = {
            "token": env.get(ENV_TOKEN) or None,
            "token_file": env.get(ENV_TOKEN_FILE) or None,
            "tls_ca_file": env.get(ENV_TLS_CA) or None,
            "tls_cert_file": env.get(ENV_TLS_CERT) or None,
            "tls_key_file": env.get(ENV_TLS_KEY) or None,
            "tls_server_name": env.get(ENV_TLS_SERVER_NAME) or None,
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        if "token_file" in given:
            values["token"] = None  # an explicit file replaces a token from the environment
        if "token" in given:
            values["token_file"] = None
        values.update(given)
        auth = cls(**values)
        auth.check()
        return auth

    @property
    def configured(self) -> bool:
        return any(dataclasses.astuple(self))

    @property
    def tls(self) -> bool:
        return self.tls_ca_file is not None

    def check(self) -> None:
        """Combinations only (no file is read): AuthConfigError."""
        if self.token is not None and self.token_file is not None:
            raise AuthConfigError(f"give a token or a token file ({ENV_TOKEN} or {ENV_TOKEN_FILE}), not both")
        if self.token is not None:
            check_token(self.token, ENV_TOKEN)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise AuthConfigError(
                "a client certificate and its key go together (tls_cert_file, tls_key_file)"
            )
        if self.tls_cert_file is not None and self.tls_ca_file is None:
            raise AuthConfigError("a client certificate (mutual TLS) needs tls_ca_file: the server's CA")
        if self.tls_server_name is not None and self.tls_ca_file is None:
            raise AuthConfigError("tls_server_name needs tls_ca_file (it names the server's certificate)")

    def token_source(self) -> TokenSource | None:
        if self.token is not None:
            return TokenSource(value=self.token, what=ENV_TOKEN)
        if self.token_file is not None:
            return TokenSource(self.token_file, what="auth token file")
        return None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls_ca_file is None:
            return None
        ca = read_pem(self.tls_ca_file, "TLS CA file")
        cert = key = None
        if self.tls_cert_file is not None:
            cert = read_pem(self.tls_cert_file, "TLS client certificate")
            key = read_pem(self.tls_key_file, "TLS client key")
        check_tls_files(
            self.tls_cert_file,
            self.tls_key_file,
            self.tls_ca_file,
            ("TLS client certificate", "TLS client key", "TLS CA file"),
        )
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to ``target`` with these credentials; AuthConfigError for an unusable file."""
        self.check()
        tokens = self.token_source()
        credentials = self.channel_credentials()
        options = list(options)
        if credentials is None:
            channel = grpc.insecure_channel(target, options=options)
        else:
            if self.tls_server_name is not None:
                options.append(("grpc.ssl_target_name_override", self.tls_server_name))
            channel = grpc.secure_channel(target, credentials, options=options)
        if tokens is not None:
            channel = grpc.intercept_channel(channel, TokenClientInterceptor(tokens))
        return channel


def channel(target: str, options: Sequence[tuple[str, object]] = (), auth: ClientAuth | None = None):
    """``auth.channel(target, options)``, or a plain insecure channel without ``auth``."""
    if auth is None or not auth.configured:
        return grpc.insecure_channel(target, options=list(options))
    return auth.channel(target, options)
