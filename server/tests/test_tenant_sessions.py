"""Tenants through a real pegaflow-server (--tenant-file): the token a client opens its session
with names its tenant; tenants do not see each other's blocks (the same prompt saved by tenant a is
a miss for b and for a session of no tenant), one tenant's clients share; calls without an accepted
token are refused; GetStats and /metrics split the use per tenant."""

from __future__ import annotations

import contextlib
import mmap
import os
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


def save_rows(c: PegaClient, inst, chain: list[bytes], value: int) -> int:
    batch = c.allocate(inst, chain)
    granted = [a for a in batch.allocations if a.granted]
    rows = [np.full(LAYOUT.block_bytes, value, np.uint8)] * len(granted)
    write_blocks(c.pool_view(batch.epoch), granted, rows)
    if batch.save_id:
        c.seal(batch.save_id)
    return len(granted)


@contextlib.contextmanager
def two_tenants(tmp_path, a_options: str):
    """A 16 MiB server with team-a (``a_options``) and team-b, and a client of each."""
    tenants = tmp_path / "tenants"
    tenants.write_text(f"team-a {TOKEN_A} {a_options}\nteam-b {TOKEN_B}\n")
    tenants.chmod(0o600)
    with ServerProcess(tmp_path / "srv", pool_size="16mb", extra_args=["--tenant-file", str(tenants)]) as srv:
        a, b = client(srv.addr, TOKEN_A), client(srv.addr, TOKEN_B)
        try:
            yield srv, a, b
        finally:
            a.close()
            b.close()


def test_a_tenant_at_its_dram_cap_evicts_its_own_blocks_not_the_others(tmp_path):
    """A 16 MiB pool (256 blocks), team-a capped at 1 MiB (16 blocks): team-a saves 8x its cap in
    saves of 8 blocks while team-b's 200 blocks, the least recently used of the pool, stay whole."""
    with two_tenants(tmp_path, "pool=1mb") as (srv, a, b):
        ia, ib = a.register_instance(LAYOUT), b.register_instance(LAYOUT)
        b_chain = [f"b-{i}".encode() for i in range(200)]
        for start in range(0, 200, 50):
            save_rows(b, ib, b_chain[: start + 50], 2)
        for n in range(16):
            assert save_rows(a, ia, [f"a{n}-{i}".encode() for i in range(8)], 3) == 8
        assert b.query_prefix(ib, b_chain).num_hits == 200
        got = b.query_prefix(ib, b_chain[:100], lease=True)  # a lease pins at most half the pool
        out = np.empty((got.num_hits, LAYOUT.block_bytes), dtype=np.uint8)
        read_blocks(b.pool_view(got.epoch), got.locations, out)
        b.release(got.lease_id, loaded_bytes=out.nbytes)
        assert got.num_hits == 100 and bool((out == 2).all())
        assert a.query_prefix(ia, [f"a15-{i}".encode() for i in range(8)]).num_hits == 8
        row = {t.name: t for t in a.stats().tenants}["team-a"]
        assert (row.dram_bytes, row.dram_cap_bytes) == (1 << 20, 1 << 20)
        assert row.cap_evictions == 128 - 16
        with urllib.request.urlopen(f"http://{srv.http_addr}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'pegaflow_tenant_dram_cap_bytes{tenant="team-a"} 1.048576e+06' in text
        assert f'pegaflow_tenant_cap_evictions_total{{tenant="team-a"}} {128 - 16:.1f}' in text


def test_a_region_tenant_maps_only_its_region_and_its_scribbles_reach_no_one_else(tmp_path):
    """team-a has 4 MiB of its own (64 blocks) beside a 16 MiB pool: its client is handed that memfd
    alone, so overwriting everything it maps damages nothing of team-b's, and team-a churns its
    own region while team-b keeps the whole pool."""
    with two_tenants(tmp_path, "region=4mb") as (srv, a, b):
        ia, ib = a.register_instance(LAYOUT), b.register_instance(LAYOUT)
        assert a.pool_view().nbytes == 4 << 20 and b.pool_view().nbytes == 16 << 20
        b_chain = [f"b-{i}".encode() for i in range(256)]
        for start in range(0, 256, 64):  # the whole pool: nothing of it is team-a's
            assert save_rows(b, ib, b_chain[: start + 64], 2) == 64
        for n in range(8):  # 4x its region, 32 blocks a save: each past the region evicts its own
            assert save_rows(a, ia, [f"a{n}-{i}".encode() for i in range(32)], 10 + n) == 32
        newest = a.query_prefix(ia, [f"a7-{i}".encode() for i in range(32)], lease=True)
        out = np.empty((newest.num_hits, LAYOUT.block_bytes), dtype=np.uint8)
        read_blocks(a.pool_view(newest.epoch), newest.locations, out)
        a.release(newest.lease_id, loaded_bytes=out.nbytes)
        assert newest.num_hits == 32 and bool((out == 17).all())
        # A reader of team-a (kv_consumer) is handed its region read-only, and reads the same bytes.
        with PegaClient(srv.addr, timeout_s=10, auth=ClientAuth(token=TOKEN_A), read_only=True) as reader:
            fd = reader._conn.pool._fd
            assert os.fstat(fd).st_size == 4 << 20
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            inst = reader.register_instance(LAYOUT)
            got = reader.query_prefix(inst, [f"a7-{i}".encode() for i in range(32)], lease=True)
            read_blocks(reader.pool_view(got.epoch), got.locations, out)
            reader.release(got.lease_id)
            assert got.num_hits == 32 and bool((out == 17).all())
        assert a.query_prefix(ia, [f"a0-{i}".encode() for i in range(32)]).num_hits == 0
        a.pool_view()[:] = 0xFF  # the worst team-a can do with everything it can reach
        assert b.query_prefix(ib, b_chain).num_hits == 256
        for start in range(0, 256, 64):
            got = b.query_prefix(ib, b_chain[start : start + 64], lease=True)
            out = np.empty((got.num_hits, LAYOUT.block_bytes), dtype=np.uint8)
            read_blocks(b.pool_view(got.epoch), got.locations, out)
            b.release(got.lease_id, loaded_bytes=out.nbytes)
            assert got.num_hits == 64 and bool((out == 2).all())
        rows = {t.name: t for t in a.stats().tenants}
        assert rows["team-a"].own_region and not rows["team-b"].own_region
        # team-a's saves into its full region evicted: from then on the region keeps a free-slot
        # reserve of 1/32 of itself (store/free_reserve.py), 2 of its 64 slots; team-b's pool, which
        # only filled up, keeps every block.
        assert (rows["team-a"].dram_bytes, rows["team-a"].resident_blocks) == (62 * LAYOUT.block_bytes, 62)
        assert rows["team-b"].resident_blocks == 256
