"""Remote access to a real pegaflow-metaserver process: with a token (and TLS) it refuses a node
without the token (UNAUTHENTICATED) and serves an authenticated publisher; the node that is refused
says so once; health stays open; a wildcard address without authentication is warned about once."""

from __future__ import annotations

import logging
import re
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.common.auth import ClientAuth
from pegaflow.common.testing.tls import TestCA, write_token_file
from pegaflow.metaserver.client import MetaClient, Unauthenticated
from pegaflow.metaserver.publisher import BlockPublisher, MetaServerTargets
from pegaflow.metaserver.testing import MetaServerProcess, wait_until

pytestmark = pytest.mark.timeout(120)

TOKEN = "meta-" + "5" * 32
NAMESPACE = "ns-" + "a" * 20
GRPC_WARNING = "pegaflow-metaserver gRPC listens on"
HTTP_WARNING = "pegaflow-metaserver /metrics and /health (HTTP) listens on"


def refusals(meta: MetaServerProcess) -> float:
    """pegaflow_meta_rpc_unauthenticated_total from the metaserver's /metrics."""
    with urllib.request.urlopen(f"http://{meta.ready['http_addr']}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(r"^pegaflow_meta_rpc_unauthenticated_total (\S+)$", text, re.M).group(1))


@pytest.fixture
def secured(tmp_path):
    """A metaserver that requires the token over TLS (its certificate names 127.0.0.1)."""
    ca = TestCA(tmp_path / "pki")
    cert = ca.issue("metaserver", ips=["127.0.0.1"])
    token_file = write_token_file(tmp_path / "token", TOKEN)
    args = ["--auth-token-file", token_file, "--tls-cert", cert.cert, "--tls-key", cert.key]
    with MetaServerProcess(tmp_path / "meta", extra_args=args) as meta:
        yield meta, ca, token_file


def test_a_node_without_the_token_is_refused(secured):
    meta, ca, _ = secured
    with MetaClient(meta.addr, auth=ClientAuth(tls_ca_file=ca.cert)) as anonymous:
        with pytest.raises(Unauthenticated, match="requires an auth token"):
            anonymous.register("node-x", "10.0.0.9:50055")
        with pytest.raises(Unauthenticated, match="requires an auth token"):
            anonymous.locate(NAMESPACE, [b"h"])
    wrong = ClientAuth(token="x" * 32, tls_ca_file=ca.cert)
    with MetaClient(meta.addr, auth=wrong) as impostor:
        with pytest.raises(Unauthenticated, match="does not accept"):
            impostor.get_leader()
    with grpc.secure_channel(meta.addr, grpc.ssl_channel_credentials(open(ca.cert, "rb").read())) as ch:
        answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    with MetaClient(meta.addr, timeout_s=2.0, auth=ClientAuth(token=TOKEN)) as plaintext:
        with pytest.raises(Exception):  # noqa: B017 - the TLS port refuses plaintext in the handshake
            plaintext.get_leader()


def test_an_authenticated_publisher_registers_and_publishes_and_a_refused_one_says_so_once(secured, caplog):
    meta, ca, token_file = secured
    hashes = [f"blk-{i}".encode() for i in range(32)]
    good = ClientAuth(token_file=token_file, tls_ca_file=ca.cert)
    publisher = BlockPublisher(
        MetaServerTargets.parse(meta.addr),
        "node-a",
        "10.0.0.1:50055",
        lambda: [(NAMESPACE, hashes)],
        auth=good,
    )
    refused = BlockPublisher(
        MetaServerTargets.parse(meta.addr),
        "node-b",
        "10.0.0.2:50055",
        lambda: [(NAMESPACE, hashes)],
        auth=ClientAuth(tls_ca_file=ca.cert),
        retry_backoff_s=(0.02, 0.05),
    )
    with caplog.at_level(logging.WARNING, logger="pegaflow.metaserver.publisher"):
        with publisher, refused, MetaClient(meta.addr, auth=good) as reader:
            wait_until(lambda: reader.stats().entries >= len(hashes), 20, "node-a's blocks in the index")
            hits = reader.locate(NAMESPACE, hashes)
            assert [(h.node_id, h.num_blocks) for h in hits] == [("node-a", len(hashes))]
            # node-b keeps asking (every 20-50 ms) and keeps being refused: one warning, no registration.
            wait_until(lambda: refusals(meta) >= 5, 20, "five refused calls of node-b")
            assert not refused.stats().connected and refused.stats().registrations == 0
            assert [n.node_id for n in reader.stats().nodes] == ["node-a"]
    assert caplog.text.count("refuses this node's credentials") == 1, caplog.text


def test_a_wildcard_address_without_authentication_is_warned_about_once(tmp_path):
    with MetaServerProcess(tmp_path / "meta", host="0.0.0.0") as meta:
        port = meta.addr.rsplit(":", 1)[1]
        with MetaClient(f"127.0.0.1:{port}") as client:  # no settings: served, as before
            assert client.get_leader().is_leader
        log = meta.log_tail(100_000)
    assert log.count(GRPC_WARNING) == 1, log
    assert log.count(HTTP_WARNING) == 1, log
    assert "IPv6" in next(line for line in log.splitlines() if GRPC_WARNING in line)
