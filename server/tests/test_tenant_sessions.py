"""Tenants through a real pegaflow-server (--tenant-file): the token a client opens its session
with names its tenant; tenants do not see each other's blocks (the same prompt saved by tenant a is
a miss for b and for a session of no tenant), one tenant's clients share; calls without an accepted
token are refused; GetStats and /metrics split the use per tenant."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from pegaflow.client import KvLayout, PegaClient, errors, read_blocks, write_blocks
from pegaflow.common.auth import ClientAuth
from pegaflow.common.testing.tls import write_token_file
from pegaflow.server.testing import ServerProcess

pytestmark = pytest.mark.timeout(120)

TOKEN_A, TOKEN_B, OPERATOR = "tenant-a-" + "1" * 24, "tenant-b-" + "2" * 24, "operator-" + "3" * 24
LAYOUT = KvLayout(
    model_id="shared-model", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=64 * 1024, num_layers=2, tp_size=1, tp_rank=0,
)  # fmt: skip
CHAIN = [f"prompt-{i}".encode() for i in range(4)]


def client(addr: str, token: str | None) -> PegaClient:
    c = PegaClient(addr, timeout_s=10, auth=ClientAuth(token=token))
    c.connect()
    return c


def hits(c: PegaClient) -> int:
    inst = c.register_instance(LAYOUT)
    return c.query_prefix(inst, CHAIN).num_hits


def test_a_token_binds_its_session_to_its_tenant(tmp_path):
    tenants = tmp_path / "tenants"
    tenants.write_text(f"team-a {TOKEN_A} leased=1mb\nteam-b {TOKEN_B}\n")
    tenants.chmod(0o600)
    args = ["--tenant-file", str(tenants), "--auth-token-file", write_token_file(tmp_path / "op", OPERATOR)]
    with ServerProcess(tmp_path / "srv", pool_size="64mb", extra_args=args) as srv:
        a = client(srv.addr, TOKEN_A)
        inst = a.register_instance(LAYOUT)
        rows = [np.full(LAYOUT.block_bytes, i + 7, dtype=np.uint8) for i in range(len(CHAIN))]
        batch = a.allocate(inst, CHAIN)
        write_blocks(a.pool_view(batch.epoch), batch.allocations, rows)
        assert a.seal(batch.save_id) == len(CHAIN)

        a2 = client(srv.addr, TOKEN_A)  # another engine of tenant a: shares a's blocks
        inst2 = a2.register_instance(LAYOUT)
        got = a2.query_prefix(inst2, CHAIN, lease=True)
        out = np.empty((got.num_hits, LAYOUT.block_bytes), dtype=np.uint8)
        read_blocks(a2.pool_view(got.epoch), got.locations, out)
        a2.release(got.lease_id, loaded_bytes=out.nbytes)
        assert got.num_hits == 4 and all(np.array_equal(out[i], rows[i]) for i in range(4))

        b, operator = client(srv.addr, TOKEN_B), client(srv.addr, OPERATOR)
        assert hits(b) == 0 and hits(operator) == 0  # the same prompt, another tenant: a miss

        with pytest.raises(errors.ServerError, match="requires an auth token"):
            client(srv.addr, None)
        with pytest.raises(errors.ServerError, match="does not accept"):
            client(srv.addr, "tenant-c-" + "4" * 24)

        stats = {t.name: t for t in operator.stats().tenants}
        assert (stats["team-a"].sessions, stats["team-a"].resident_blocks) == (2, 4)
        assert (stats["team-b"].sessions, stats["team-b"].resident_blocks) == (1, 0)
        assert stats[""].sessions == 1
        with urllib.request.urlopen(f"http://{srv.http_addr}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'pegaflow_tenant_sessions{tenant="team-a"} 2.0' in text
        assert 'pegaflow_tenant_resident_blocks{tenant="team-a"} 4.0' in text
        for c in (a, a2, b, operator):
            c.close()


def test_a_bad_tenant_file_refuses_the_start(tmp_path):
    tenants = tmp_path / "tenants"
    tenants.write_text("team-a short\n")
    tenants.chmod(0o600)
    from pegaflow.server.testing import ServerStartError

    with pytest.raises(ServerStartError) as info:
        with ServerProcess(tmp_path / "srv", pool_size="64mb", extra_args=["--tenant-file", str(tenants)]):
            pass
    assert "--tenant-file" in info.value.log and "line 1" in info.value.log
    assert "Traceback" not in info.value.log
