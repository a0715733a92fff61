"""common/auth.py against a real in-process gRPC server: the token check (UNAUTHENTICATED before any
request byte is parsed, health open, rotation by re-reading the file), TLS and mutual TLS with a CA
made here, the credential files refused up front, and the exposure warning's rules."""

from __future__ import annotations

import logging
import os
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pegaflow.common import auth
from pegaflow.common.auth import AuthConfigError, ClientAuth, ServerAuth, TokenSource
from pegaflow.common.grpc_server import listen, mark_serving
from pegaflow.common.testing.tls import TestCA, write_token_file

TOKEN = "t0ken-" + "a" * 26
OTHER = "t0ken-" + "b" * 26
ECHO = "/test.Echo/Echo"


class _Recording:
    """The echo service; counts how often its request deserializer ran (a refusal must not)."""

    def __init__(self):
        self.parsed = 0

    def deserialize(self, data: bytes) -> bytes:
        self.parsed += 1
        return data


@pytest.fixture
def serve():
    """serve(ServerAuth) -> (address, recording); stops every server at the end."""
    servers = []

    def start(server_auth: ServerAuth, host: str = "127.0.0.1"):
        security = server_auth.open("test-service")
        recording = _Recording()
        server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=list(security.interceptors) or None)
        handler = grpc.unary_unary_rpc_method_handler(
            lambda request, context: b"echo:" + request, request_deserializer=recording.deserialize
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),)
        )
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        address = listen(server, f"{host}:0", host, security.credentials)
        server.start()
        mark_serving(hs, "test.Echo")
        servers.append(server)
        return address, recording

    yield start
    for server in servers:
        server.stop(0)


def echo(address: str, client_auth: ClientAuth | None = None, timeout: float = 5.0) -> bytes:
    with auth.channel(address, auth=client_auth) as ch:
        return ch.unary_unary(ECHO)(b"hi", timeout=timeout)


def health_of(address: str, client_auth: ClientAuth | None = None) -> int:
    with auth.channel(address, auth=client_auth) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def refused(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# ------------------------------------------------------------------ tokens


def test_a_token_file_holds_tokens_one_per_line(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# cluster token, rotated 2026-12\n\n{TOKEN}\n  {OTHER}  \n")
    assert TokenSource(str(path)).tokens() == (TOKEN, OTHER)
    assert TokenSource(str(path)).current() == TOKEN


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "holds no token"),
        ("# only a comment\n", "holds no token"),
        ("short\n", "16.."),
        ("with space inside the token\n", "printable ASCII without spaces"),
    ],
)
def test_a_bad_token_file_is_refused_with_a_clear_message(tmp_path, text, why):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(AuthConfigError, match=why):
        TokenSource(str(path))


def test_a_missing_token_file_is_refused(tmp_path):
    with pytest.raises(AuthConfigError, match="No such file"):
        TokenSource(str(tmp_path / "absent"))


def test_a_world_readable_token_file_is_warned_about(tmp_path, caplog):
    path = write_token_file(tmp_path / "tokens", TOKEN)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="pegaflow.common.auth"):
        TokenSource(path)
    assert "readable by every local user" in caplog.text


def test_the_token_file_is_re_read_when_it_changes_and_a_bad_rewrite_keeps_the_old_tokens(tmp_path, caplog):
    now = [0.0]
    path = write_token_file(tmp_path / "tokens", TOKEN)
    source = TokenSource(path, clock=lambda: now[0])
    write_token_file(path, TOKEN, OTHER)  # rotation, step 1: both accepted
    assert source.tokens() == (TOKEN,)  # not checked again within a second
    now[0] += auth.RELOAD_CHECK_S
    assert source.tokens() == (TOKEN, OTHER)
    with open(path, "w") as f:
        f.write("oops\n")  # a half-written or broken file
    with caplog.at_level(logging.WARNING, logger="pegaflow.common.auth"):
        for _ in range(3):
            now[0] += auth.RELOAD_CHECK_S
            assert source.tokens() == (TOKEN, OTHER)
    assert caplog.text.count("cannot be used") == 1  # one warning for the broken version, not one a second
    os.unlink(path)
    now[0] += auth.RELOAD_CHECK_S
    assert source.tokens() == (TOKEN, OTHER)
    write_token_file(path, OTHER)  # step 3: the old token dropped
    now[0] += auth.RELOAD_CHECK_S
    assert source.tokens() == (OTHER,) and source.current() == OTHER


def test_tokens_are_matched_whole_and_only_as_bearer_tokens():
    assert auth.token_accepted([("authorization", f"Bearer {TOKEN}")], [TOKEN])
    assert auth.token_accepted([("authorization", f"bearer {TOKEN}")], [OTHER, TOKEN])
    assert not auth.token_accepted([("authorization", f"Bearer {TOKEN[:-1]}")], [TOKEN])
    assert not auth.token_accepted([("authorization", f"Bearer {TOKEN}x")], [TOKEN])
    assert not auth.token_accepted([("authorization", TOKEN)], [TOKEN])  # no scheme
    assert not auth.token_accepted([("x-token", f"Bearer {TOKEN}")], [TOKEN])
    assert not auth.token_accepted(None, [TOKEN])


# ------------------------------------------------------------------ the server's token check


def test_a_call_without_the_token_is_unauthenticated_and_its_request_is_never_parsed(tmp_path, serve):
    address, recording = serve(ServerAuth(token_file=write_token_file(tmp_path / "t", TOKEN, OTHER)))
    err = refused(lambda: echo(address))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "requires an auth token" in err.details() and "authorization: Bearer" in err.details()
    wrong = write_token_file(tmp_path / "wrong", "x" * 32)
    err = refused(lambda: echo(address, ClientAuth(token_file=wrong)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "does not accept the auth token" in err.details()
    assert recording.parsed == 0
    assert echo(address, ClientAuth(token=TOKEN)) == b"echo:hi"
    assert echo(address, ClientAuth(token=OTHER)) == b"echo:hi"  # every token of the file is accepted
    assert recording.parsed == 2


def test_health_checks_need_no_token(tmp_path, serve):
    address, _ = serve(ServerAuth(token_file=write_token_file(tmp_path / "t", TOKEN)))
    assert health_of(address) == health_pb2.HealthCheckResponse.SERVING


def test_the_client_sends_the_token_on_future_calls_too(tmp_path, serve):
    address, _ = serve(ServerAuth(token_file=write_token_file(tmp_path / "t", TOKEN)))
    with ClientAuth(token=TOKEN).channel(address) as ch:
        assert ch.unary_unary(ECHO).future(b"f", timeout=5).result() == b"echo:f"


def test_no_settings_is_plaintext_and_open(serve):
    address, _ = serve(ServerAuth())
    assert echo(address) == b"echo:hi"
    assert not ServerAuth().open("x").authenticates


# ------------------------------------------------------------------ TLS


@pytest.fixture
def pki(tmp_path):
    ca, rogue_ca = TestCA(tmp_path / "ca"), TestCA(tmp_path / "rogue")
    return {
        "ca": ca,
        "server": ca.issue("server", ips=["127.0.0.1"], dns=["localhost"]),
        "client": ca.issue("client"),
        "rogue_ca": rogue_ca,
        "rogue": rogue_ca.issue("client", ips=["127.0.0.1"]),
    }


def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(pki, serve):
    server = pki["server"]
    address, _ = serve(ServerAuth(tls_cert_file=server.cert, tls_key_file=server.key))
    assert echo(address, ClientAuth(tls_ca_file=pki["ca"].cert)) == b"echo:hi"
    assert refused(lambda: echo(address, timeout=2)).code() == grpc.StatusCode.UNAVAILABLE
    # A server certificate another CA signed is not trusted.
    rogue_ca = pki["rogue_ca"].cert
    assert (
        refused(lambda: echo(address, ClientAuth(tls_ca_file=rogue_ca), 2)).code()
        == grpc.StatusCode.UNAVAILABLE
    )
    # The name checked is the host dialled, or tls_server_name.
    assert (
        echo(address.replace("127.0.0.1", "localhost"), ClientAuth(tls_ca_file=pki["ca"].cert)) == b"echo:hi"
    )
    bad_name = ClientAuth(tls_ca_file=pki["ca"].cert, tls_server_name="elsewhere.example")
    assert refused(lambda: echo(address, bad_name, 2)).code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(pki, serve):
    server, client, rogue = pki["server"], pki["client"], pki["rogue"]
    ca = pki["ca"].cert
    address, recording = serve(
        ServerAuth(tls_cert_file=server.cert, tls_key_file=server.key, tls_client_ca_file=ca)
    )
    assert refused(lambda: echo(address, ClientAuth(tls_ca_file=ca), 2)).code() == grpc.StatusCode.UNAVAILABLE
    with_rogue = ClientAuth(tls_ca_file=ca, tls_cert_file=rogue.cert, tls_key_file=rogue.key)
    assert refused(lambda: echo(address, with_rogue, 2)).code() == grpc.StatusCode.UNAVAILABLE
    assert recording.parsed == 0
    good = ClientAuth(tls_ca_file=ca, tls_cert_file=client.cert, tls_key_file=client.key)
    assert echo(address, good) == b"echo:hi"


def test_mutual_tls_and_a_token_are_both_required_when_both_are_set(tmp_path, pki, serve):
    server, client, ca = pki["server"], pki["client"], pki["ca"].cert
    address, _ = serve(
        ServerAuth(write_token_file(tmp_path / "t", TOKEN), server.cert, server.key, tls_client_ca_file=ca)
    )
    cert_only = ClientAuth(tls_ca_file=ca, tls_cert_file=client.cert, tls_key_file=client.key)
    assert refused(lambda: echo(address, cert_only)).code() == grpc.StatusCode.UNAUTHENTICATED
    both = ClientAuth(token=TOKEN, tls_ca_file=ca, tls_cert_file=client.cert, tls_key_file=client.key)
    assert echo(address, both) == b"echo:hi"


def test_unusable_tls_files_are_refused_before_anything_listens(tmp_path, pki):
    server, client = pki["server"], pki["client"]
    with pytest.raises(AuthConfigError, match="not a matching certificate"):
        ServerAuth(tls_cert_file=server.cert, tls_key_file=client.key).open("x")
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("junk")
    with pytest.raises(AuthConfigError, match="not a PEM file"):
        ServerAuth(tls_cert_file=str(not_pem), tls_key_file=server.key).open("x")
    with pytest.raises(AuthConfigError, match="cannot read"):
        ServerAuth(tls_cert_file=server.cert, tls_key_file=str(tmp_path / "absent")).open("x")
    with pytest.raises(AuthConfigError, match="go together"):
        ServerAuth(tls_cert_file=server.cert).check()
    with pytest.raises(AuthConfigError, match="needs --tls-cert"):
        ServerAuth(tls_client_ca_file=pki["ca"].cert).check()
    with pytest.raises(AuthConfigError, match="not a matching certificate"):
        ClientAuth(tls_ca_file=pki["ca"].cert, tls_cert_file=client.cert, tls_key_file=server.key).channel(
            "x:1"
        )


# ------------------------------------------------------------------ client settings


def test_client_auth_from_the_environment(tmp_path):
    assert not ClientAuth.from_env({}).configured
    env = {"PEGAFLOW_AUTH_TOKEN": TOKEN, "PEGAFLOW_TLS_CA": "/ca.pem"}
    got = ClientAuth.from_env(env)
    assert got.token == TOKEN and got.tls_ca_file == "/ca.pem" and got.tls
    assert TOKEN not in repr(got)  # never in a log line
    # An explicit setting wins over the environment; a file replaces an environment token.
    over = ClientAuth.from_env(env, token_file="/t", tls_ca_file=None)
    assert over.token is None and over.token_file == "/t" and over.tls_ca_file == "/ca.pem"
    with pytest.raises(AuthConfigError, match="not both"):
        ClientAuth.from_env({"PEGAFLOW_AUTH_TOKEN": TOKEN, "PEGAFLOW_AUTH_TOKEN_FILE": "/t"})
    with pytest.raises(AuthConfigError, match="16.."):
        ClientAuth.from_env({"PEGAFLOW_AUTH_TOKEN": "short"})
    with pytest.raises(AuthConfigError, match="needs tls_ca_file"):
        ClientAuth.from_env({"PEGAFLOW_TLS_CERT": "/c", "PEGAFLOW_TLS_KEY": "/k"})


# ------------------------------------------------------------------ exposure


def test_the_exposure_warning_names_wildcards_and_stays_quiet_on_loopback_or_with_auth():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert auth.exposure_warning("svc", f"{host}:1", host, False, True) is None
    assert auth.exposure_warning("svc", "0.0.0.0:1", "0.0.0.0", True, True) is None
    text = auth.exposure_warning("svc", "0.0.0.0:1", "0.0.0.0", False, True)
    assert "other hosts can reach" in text and "IPv6" in text and "[::]" in text
    assert "dual-stack" in auth.exposure_warning("svc", "[::]:1", "::", False, True)
    assert "IPv4" in auth.exposure_warning("http", "0.0.0.0:1", "0.0.0.0", False, False)
    assert auth.exposure_warning("svc", "10.0.0.5:1", "10.0.0.5", False, True) is not None
    assert (
        auth.exposure_warning("svc", "node-a:1", "node-a", False, True) is not None
    )  # a name may be anything


def test_grpc_really_listens_on_ipv6_for_0_0_0_0(serve):
    """What the warning says: gRPC binds 0.0.0.0 dual-stack, so [::1] reaches it too."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    address, _ = serve(ServerAuth(), host="0.0.0.0")
    port = address.rsplit(":", 1)[1]
    assert echo(f"[::1]:{port}") == b"echo:hi"
