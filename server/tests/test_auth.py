"""Remote access to real pegaflow-server processes (review finding F10): a token-protected server
refuses clients without the token (UNAUTHENTICATED) and serves those with it; TLS with a CA made
here, mutual TLS refusing a client without a certificate; the one start-up warning for an address
other hosts can reach; model names hidden from /metrics and GetStats; and (in network namespaces)
a node pulling from a peer that requires the token and mutual TLS, through a metaserver that
requires a token of its own."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.client import KvLayout, PegaClient, errors, read_blocks, write_blocks
from pegaflow.common.auth import ClientAuth
from pegaflow.common.testing.netns import NetnsLab, require_netns
from pegaflow.common.testing.tls import TestCA, write_token_file
from pegaflow.metaserver.testing import MetaServerProcess
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.server.metrics.model_names import ModelNames
from pegaflow.server.testing import ServerProcess, ServerStartError, wait_for

pytestmark = pytest.mark.timeout(180)

TOKEN = "cluster-" + "7" * 32
SECRET_MODEL = "acme-corp/secret-finetune-v3"
LAYOUT = KvLayout(
    model_id=SECRET_MODEL, model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=64 * 1024, num_layers=2, tp_size=1, tp_rank=0,
)  # fmt: skip
GRPC_WARNING = "pegaflow-server gRPC listens on"
HTTP_WARNING = "pegaflow-server /metrics and /health (HTTP) listens on"


def loopback(addr: str) -> str:
    """A wildcard-bound address (0.0.0.0:PORT) as a client on this host dials it."""
    return "127.0.0.1:" + addr.rsplit(":", 1)[1]


def save_and_read(client: PegaClient, hashes: list[bytes]) -> bool:
    inst = client.register_instance(LAYOUT)
    rows = [np.full(LAYOUT.block_bytes, i + 1, dtype=np.uint8) for i in range(len(hashes))]
    batch = client.allocate(inst, hashes)
    write_blocks(client.pool_view(batch.epoch), batch.allocations, rows)
    assert client.seal(batch.save_id) == len(hashes)
    hit = client.query_prefix(inst, hashes, lease=True)
    got = np.empty((hit.num_hits, LAYOUT.block_bytes), dtype=np.uint8)
    read_blocks(client.pool_view(hit.epoch), hit.locations, got)
    client.release(hit.lease_id, loaded_bytes=got.nbytes)
    return hit.num_hits == len(hashes) and all(np.array_equal(got[i], rows[i]) for i in range(len(rows)))


def metrics_text(http_addr: str) -> str:
    with urllib.request.urlopen(f"http://{loopback(http_addr)}/metrics", timeout=10) as r:
        return r.read().decode()


def test_a_token_protected_server_refuses_clients_without_it_and_hides_model_names(tmp_path):
    token_file = write_token_file(tmp_path / "token", TOKEN)
    args = ["--auth-token-file", token_file, "--metrics-hide-models"]
    with ServerProcess(tmp_path / "srv", pool_size="64mb", addr="0.0.0.0:0", http_addr="0.0.0.0:0",
                       extra_args=args) as srv:  # fmt: skip
        addr = loopback(srv.addr)
        # No token: OpenSession is refused, with a message that says what to send.
        anonymous = PegaClient(addr, timeout_s=5, auth=ClientAuth())
        with pytest.raises(errors.ServerError, match="requires an auth token"):
            anonymous.connect()
        anonymous.close()
        with grpc.insecure_channel(addr) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.EngineStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health probes stay open.
            answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        # The token from the environment, as a deployment sets it.
        os.environ["PEGAFLOW_AUTH_TOKEN_FILE"] = token_file
        try:
            client = PegaClient(addr, timeout_s=5)
        finally:
            del os.environ["PEGAFLOW_AUTH_TOKEN_FILE"]
        client.connect()
        try:
            hashes = [f"blk-{i}".encode() for i in range(8)]
            assert save_and_read(client, hashes)
            client.query_prefix(client.register_instance(LAYOUT), hashes)  # a lookup: savings are counted
            stats = client.stats()
        finally:
            client.close()
        digest = ModelNames(hide=True)(SECRET_MODEL)
        assert [ns.model_id for ns in stats.namespaces] == [digest]

        def labelled() -> bool:
            return f'model="{digest}"' in metrics_text(srv.http_addr)

        wait_for(labelled, 10, what="the digest in /metrics")
        text = metrics_text(srv.http_addr)
        assert "secret-finetune" not in text and "acme" not in text
        assert re.search(rf'pegaflow_namespace_resident_blocks\{{[^}}]*model="{digest}"', text)
        assert re.search(rf'pegaflow_prefill_tokens_served_total\{{[^}}]*model="{digest}"', text)
        refused = re.search(r"^pegaflow_rpc_unauthenticated_total (\S+)$", text, re.M)
        assert refused and float(refused.group(1)) >= 2  # the anonymous OpenSession and GetStats
        log = srv.log_text()
    assert GRPC_WARNING not in log and HTTP_WARNING not in log  # authenticated, names hidden


def test_an_unauthenticated_wildcard_address_is_warned_about_exactly_once(tmp_path):
    with ServerProcess(tmp_path / "srv", pool_size="64mb", addr="0.0.0.0:0", http_addr="0.0.0.0:0") as srv:
        # No settings: today's behaviour, a plaintext client without credentials is served.
        client = PegaClient(loopback(srv.addr), timeout_s=5, auth=ClientAuth())
        client.connect()
        client.close()
        log = srv.log_text()
    assert log.count(GRPC_WARNING) == 1, log
    assert log.count(HTTP_WARNING) == 1, log
    line = next(x for x in log.splitlines() if GRPC_WARNING in x)
    assert "WARNING" in line and "IPv6" in line and "--auth-token-file" in line
    assert "--metrics-hide-models" in next(x for x in log.splitlines() if HTTP_WARNING in x)


def test_mutual_tls_refuses_a_client_without_a_certificate_and_serves_one_with_it(tmp_path):
    ca = TestCA(tmp_path / "pki")
    server, client_cert = ca.issue("server", ips=["127.0.0.1"]), ca.issue("engine")
    args = ["--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", ca.cert]
    with ServerProcess(tmp_path / "srv", pool_size="64mb", extra_args=args) as srv:
        no_cert = PegaClient(srv.addr, timeout_s=3, auth=ClientAuth(tls_ca_file=ca.cert))
        with pytest.raises(errors.ServerUnavailable):
            no_cert.connect()
        no_cert.close()
        plaintext = PegaClient(srv.addr, timeout_s=3, auth=ClientAuth())
        with pytest.raises(errors.ServerUnavailable):
            plaintext.connect()
        plaintext.close()
        auth = ClientAuth(tls_ca_file=ca.cert, tls_cert_file=client_cert.cert, tls_key_file=client_cert.key)
        client = PegaClient(srv.addr, timeout_s=5, auth=auth)
        client.connect()
        try:
            assert save_and_read(client, [b"tls-0", b"tls-1"])
        finally:
            client.close()
        assert GRPC_WARNING not in srv.log_text()  # loopback: nothing to warn about


def test_a_key_that_does_not_match_its_certificate_refuses_the_start(tmp_path):
    ca = TestCA(tmp_path / "pki")
    server, other = ca.issue("server", ips=["127.0.0.1"]), ca.issue("other")
    srv = ServerProcess(tmp_path / "srv", pool_size="64mb", extra_args=["--tls-cert", server.cert,
                        "--tls-key", other.key])  # fmt: skip
    with pytest.raises(ServerStartError) as info:
        srv.start()
    assert info.value.returncode == 2
    assert "not a matching certificate" in info.value.log


def test_model_digests_are_stable_and_keyed_ones_cannot_be_confirmed_by_guessing(tmp_path):
    shown, hidden = ModelNames(), ModelNames(hide=True)
    assert shown(SECRET_MODEL) == SECRET_MODEL
    digest = hidden(SECRET_MODEL)
    assert re.fullmatch(r"model-[0-9a-f]{16}", digest) and digest == ModelNames(hide=True)(SECRET_MODEL)
    assert hidden("another-model") != digest
    key = tmp_path / "model-key"
    key.write_text("k" * 32 + "\n")
    keyed = ModelNames.from_key_file(str(key))
    assert keyed.hidden and keyed(SECRET_MODEL) != digest  # the unkeyed digest of a guess does not match
    assert keyed(SECRET_MODEL) == ModelNames.from_key_file(str(key))(SECRET_MODEL)  # same key, same label
    key.write_text("short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ModelNames.from_key_file(str(key))


def test_help_documents_every_remote_access_flag_of_both_daemons():
    from pegaflow.metaserver.main import build_parser as metaserver_parser
    from pegaflow.server.main import build_parser as server_parser

    server_help, meta_help = server_parser().format_help(), metaserver_parser().format_help()
    for flag in ("--auth-token-file", "--tls-cert", "--tls-key", "--tls-client-ca"):
        assert flag in server_help and flag in meta_help
    for flag in ("--peer-auth-token-file", "--peer-tls-ca", "--metaserver-auth-token-file",
                 "--metaserver-tls-ca", "--metrics-hide-models", "--metrics-model-key-file"):  # fmt: skip
        assert flag in server_help


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "/c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "/ca.pem"], "needs --tls-cert"),
        (["--peer-tls-ca", "/ca.pem"], "--peer-tls-ca needs --metaserver-addr"),
        (["--metaserver-auth-token-file", "/t"], "needs --metaserver-addr"),
    ],
)
def test_credential_flags_that_cannot_work_are_usage_errors(args, message, capsys):
    from pegaflow.server.main import main

    with pytest.raises(SystemExit) as info:
        main(["--pool-size", "64mb", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------ peers


WORKER = pathlib.Path(__file__).with_name("client_worker.py")
PEER_LAYOUT = dict(
    model_id="auth-peers", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=256 * 1024, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
)  # fmt: skip


def test_a_node_pulls_from_a_peer_that_requires_the_token_and_mutual_tls(tmp_path):
    require_netns()
    node_token = write_token_file(tmp_path / "node-token", TOKEN)
    meta_token = write_token_file(tmp_path / "meta-token", "meta-" + "9" * 32)
    with NetnsLab() as lab:
        a, b, m = lab.add_node("a"), lab.add_node("b"), lab.add_node("m")
        lab.switch([a, b, m])
        ca = TestCA(tmp_path / "pki")
        certs = {n.name: ca.issue(f"node-{n.name}", ips=[n.addr]) for n in (a, b, m)}
        meta = MetaServerProcess(tmp_path / "meta", host=m.addr, launcher=m.command([]),
                                 extra_args=["--auth-token-file", meta_token]).start()  # fmt: skip
        servers = {}
        try:
            for n in (a, b):
                cert = certs[n.name]
                args = ["--metaserver-addr", meta.addr, "--metaserver-auth-token-file", meta_token,
                        "--auth-token-file", node_token, "--peer-fetch-deadline", "3",
                        "--tls-cert", cert.cert, "--tls-key", cert.key, "--tls-client-ca", ca.cert,
                        "--peer-tls-ca", ca.cert]  # fmt: skip
                servers[n.name] = ServerProcess(
                    tmp_path / n.name, pool_size="64mb", addr=f"{n.addr}:50055", http_addr=f"{n.addr}:0",
                    launcher=n.command([]), extra_args=args,
                ).start()  # fmt: skip
            # The engines on each node present the token and the node's certificate.
            env = {**os.environ, "PEGAFLOW_AUTH_TOKEN_FILE": node_token, "PEGAFLOW_TLS_CA": ca.cert}

            def worker(node, action: str, hashes: list[str]) -> dict:
                cert = certs[node.name]
                spec = dict(addr=servers[node.name].addr, action=action, hashes=hashes, tag="auth",
                            layout=PEER_LAYOUT)  # fmt: skip
                node_env = {**env, "PEGAFLOW_TLS_CERT": cert.cert, "PEGAFLOW_TLS_KEY": cert.key}
                out = node.run([sys.executable, str(WORKER), json.dumps(spec)], timeout=120, env=node_env)
                return json.loads(out.stdout.strip().splitlines()[-1])

            hashes = [f"auth-{i:03d}".encode().hex() for i in range(16)]
            assert worker(a, "save", hashes)["sealed"] == 16

            def published() -> bool:
                probe = (
                    "from pegaflow.common.auth import ClientAuth; from pegaflow.metaserver.client import "
                    f"MetaClient; c = MetaClient({meta.addr!r}, auth=ClientAuth(token_file={meta_token!r})); "
                    "print(c.stats().entries)"
                )
                out = m.run([sys.executable, "-c", probe], check=False)
                return out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout) >= 16

            wait_for(published, 30, interval_s=0.2, what="node a's blocks in the token-protected metaserver")
            got = worker(b, "load-wait", hashes)
            assert got["hits"] == 16 and got["match"], got
            assert got["first"]["hits"] == 0  # b held none of them: every block came from a
            # The peer control plane itself: a caller with a good certificate but no token is refused.
            intruder = (
                "import time; from pegaflow.common.auth import ClientAuth; "
                "from pegaflow.server.peers.base import PeerAddress, PeerRefused; "
                "from pegaflow.server.peers.control import ControlClient; "
                "from pegaflow.server.peers.metrics import TransportCounters; "
                f"auth = ClientAuth(tls_ca_file={ca.cert!r}, tls_cert_file={certs['m'].cert!r}, "
                f"tls_key_file={certs['m'].key!r}); "
                f"c = ControlClient(PeerAddress({servers['a'].addr!r}), TransportCounters('tcp'), auth)\n"
                "try:\n    c.handshake('tcp', 'intruder', time.monotonic() + 5); print('ACCEPTED')\n"
                "except PeerRefused as e:\n    print(e.code)"
            )
            out = m.run([sys.executable, "-c", intruder], check=False)
            assert out.stdout.strip() == "UNAUTHENTICATED", out.stderr[-2000:]
        finally:
            for srv in servers.values():
                srv.stop()
            meta.kill()
        assert "refuses this node's credentials" not in servers["b"].log_text()
