"""Tenants (server/clients/tenants.py): the tenant file is read strictly; a tenant's sessions get
namespaces of their own (no hit, EXISTS or probe across tenants, every engine of one tenant still
shares), and the tenant-wide limits hold over all its sessions together while other tenants keep
working. In-process engine; the gRPC binding of a token to its tenant is in
server/tests/test_tenants_e2e.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pegaflow.common.auth import AuthConfigError
from pegaflow.common.wire.types import AllocStatus
from pegaflow.server.clients.tenants import Tenant, TenantTable
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.errors import FailedPrecondition, PoolCapacityError, ResourceExhausted
from pegaflow.server.store.namespace import KvLayout

BLOCK = 64 * 1024
TOKEN_A = "a" * 32
TOKEN_B = "b" * 32


def layout() -> KvLayout:
    return KvLayout(
        model_id="m", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
        block_bytes=BLOCK, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
    )  # fmt: skip


def hashes(n: int, tag: str = "h") -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


# ------------------------------------------------------------------ the file


def test_the_tenant_file_is_parsed_with_limits():
    table = TenantTable.from_text(
        f"# comment\nteam-a {TOKEN_A} leased=1mb unsealed=512kb pool=2mb # trailing\n\nteam_b.2 {TOKEN_B}\n"
        f"own {'c' * 32} region=8mb\n",
        "t",
    )
    a, b = table.by_name["team-a"], table.by_name["team_b.2"]
    assert (a.leased_bytes, a.unsealed_bytes, a.pool_bytes) == (1 << 20, 512 << 10, 2 << 20)
    assert (b.leased_bytes, b.unsealed_bytes, b.pool_bytes) == (None, None, None)
    assert table.pool_caps() == {"team-a": 2 << 20}
    assert table.regions() == {"own": 8 << 20} and table.by_name["own"].pool_bytes is None
    assert set(table.tokens()) == {TOKEN_A, TOKEN_B, "c" * 32}
    assert TOKEN_A not in repr(a)  # a secret is never printed


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "names no tenant"),
        (f"bad/name {TOKEN_A}", "tenant name"),
        ("team short", "16"),
        (f"team {TOKEN_A} memory=1gb", "not a limit"),
        (f"team {TOKEN_A} pool=1gb pool=2gb", "not a limit"),
        (f"team {TOKEN_A} leased=1gb leased=2gb", "not a limit"),
        (f"team {TOKEN_A} leased=lots", "leased"),
        (f"team {TOKEN_A}\nteam {TOKEN_B}", "named twice"),
        (f"one {TOKEN_A}\ntwo {TOKEN_A}", "share a token"),
        (f"team {TOKEN_A} pool=1gb region=1gb", "one of them"),
        (f"team {TOKEN_A} region=0b", "greater than zero"),
    ],
)
def test_a_bad_tenant_file_refuses_the_start_with_the_line(text, why):
    with pytest.raises(AuthConfigError, match=why):
        TenantTable.from_text(text, "f")


def test_a_tenant_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "tenants"
    path.write_text(f"team {TOKEN_A}\n")
    os.chmod(path, 0o644)
    with pytest.raises(AuthConfigError, match="readable by every local user"):
        TenantTable.load(str(path))
    os.chmod(path, 0o600)
    assert len(TenantTable.load(str(path))) == 1


def test_a_token_names_its_tenant_and_nothing_else_does():
    table = TenantTable.from_text(f"a {TOKEN_A}\nb {TOKEN_B}", "t")
    assert table.identify([("authorization", f"Bearer {TOKEN_B}")]).name == "b"
    assert table.identify([("authorization", f"Bearer {TOKEN_A}x")]) is None
    assert table.identify([("authorization", TOKEN_A)]) is None  # not as a bearer token
    assert table.identify(None) is None


# ------------------------------------------------------------------ the engine


@pytest.fixture
def engine():
    cfg = ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, slab_bytes=4 * MIB, reaper_interval_s=3600)
    eng = KVEngine(cfg)
    yield eng
    eng.close()


def open_for(eng: KVEngine, tenant: Tenant | None) -> tuple[str, str]:
    sid = eng.open_session("t", tenant=tenant).session_id
    return sid, eng.register_instance(sid, layout()).instance_id


def save(eng: KVEngine, sid: str, iid: str, hs: list[bytes]) -> list[AllocStatus]:
    res = eng.allocate_blocks(sid, iid, hs)
    if res.save_id:
        eng.seal_blocks(sid, res.save_id)
    return res.statuses


def test_tenants_never_share_a_block_and_one_tenants_engines_do(engine):
    a, b = Tenant("a", TOKEN_A), Tenant("b", TOKEN_B)
    sa, ia = open_for(engine, a)
    sa2, ia2 = open_for(engine, a)  # a second engine of tenant a
    sb, ib = open_for(engine, b)
    sn, i_none = open_for(engine, None)
    chain = hashes(4)
    assert save(engine, sa, ia, chain) == [AllocStatus.GRANTED] * 4
    assert engine.query_prefix(sa2, ia2, chain).num_hits == 4  # shared within the tenant
    assert engine.query_prefix(sb, ib, chain).num_hits == 0  # b cannot see a's prompts
    assert engine.query_prefix(sn, i_none, chain).num_hits == 0
    # b's save of the same hashes is its own (GRANTED, not EXISTS: no probing a's blocks).
    assert save(engine, sb, ib, chain) == [AllocStatus.GRANTED] * 4
    stats = engine.stats()
    tenants = {t.name: t for t in stats.tenants}
    assert tenants["a"].sessions == 2 and tenants["a"].resident_blocks == 4
    assert tenants["b"].sessions == 1 and tenants["b"].resident_blocks == 4
    assert tenants[""].sessions == 1 and tenants[""].resident_blocks == 0
    assert {ns.tenant for ns in stats.namespaces} == {"a", "b", ""}
    assert len({ns.namespace_id for ns in stats.namespaces}) == 3


def test_without_tenants_the_namespace_ids_are_unchanged_and_no_tenant_stats(engine):
    from pegaflow.server.store.namespace import namespace_id

    sid, _ = open_for(engine, None)
    stats = engine.stats()
    assert [ns.namespace_id for ns in stats.namespaces] == [namespace_id(layout())]
    assert stats.tenants == []
    assert namespace_id(layout(), "a") != namespace_id(layout())


def test_the_leased_limit_holds_over_all_a_tenants_sessions(engine):
    a = Tenant("a", TOKEN_A, leased_bytes=6 * BLOCK)
    sa, ia = open_for(engine, a)
    sa2, ia2 = open_for(engine, a)
    sb, ib = open_for(engine, Tenant("b", TOKEN_B))
    chain = hashes(8)
    save(engine, sa, ia, chain)
    save(engine, sb, ib, chain)
    first = engine.query_prefix(sa, ia, chain[:4], lease=True)
    assert first.num_hits == 4
    second = engine.query_prefix(sa2, ia2, chain, lease=True)
    assert second.num_hits == 2  # cut to the tenant's room: 6 - 4 blocks
    with pytest.raises(ResourceExhausted, match="tenant a already pins"):
        engine.query_prefix(sa2, ia2, chain, lease=True)
    assert engine.query_prefix(sb, ib, chain, lease=True).num_hits == 8  # b is not a's limit
    engine.release_lease(sa, first.lease_id)
    assert engine.query_prefix(sa2, ia2, chain[:4], lease=True).num_hits == 4  # room again
    refusals = {t.name: t.quota_refusals for t in engine.stats().tenants}
    assert refusals["a"] == 2 and refusals["b"] == 0


def test_the_unsealed_limit_holds_over_all_a_tenants_sessions(engine):
    a = Tenant("a", TOKEN_A, unsealed_bytes=5 * BLOCK)
    sa, ia = open_for(engine, a)
    sa2, ia2 = open_for(engine, a)
    sb, ib = open_for(engine, Tenant("b", TOKEN_B))
    open_save = engine.allocate_blocks(sa, ia, hashes(4, "x"))
    assert open_save.statuses == [AllocStatus.GRANTED] * 4
    other = engine.allocate_blocks(sa2, ia2, hashes(4, "y"))
    assert other.statuses == [AllocStatus.GRANTED] + [AllocStatus.REJECTED] * 3
    assert engine.allocate_blocks(sb, ib, hashes(4, "y")).statuses == [AllocStatus.GRANTED] * 4
    assert {t.name: t.unsealed_bytes for t in engine.stats().tenants} == {"a": 5 * BLOCK, "b": 4 * BLOCK}
    engine.seal_blocks(sa, open_save.save_id)
    again = engine.allocate_blocks(sa2, ia2, hashes(4, "z"))
    assert again.statuses == [AllocStatus.GRANTED] * 4  # the seal gave the room back


# ------------------------------------------------------------ the DRAM cap (pool=SIZE)

POOL_BLOCKS = 256  # the fixture's 16 MiB pool in 64 KiB blocks
CAP_BLOCKS = 32


def small_engine(**tenants) -> KVEngine:
    """A 16 MiB pool of 4 MiB slabs, no reaper; ``tenants``: KVEngine's tenant_caps / tenant_regions."""
    cfg = ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, slab_bytes=4 * MIB, reaper_interval_s=3600)
    return KVEngine(cfg, **tenants)


@pytest.fixture
def capped():
    eng = small_engine(tenant_caps={"a": CAP_BLOCKS * BLOCK})
    yield eng
    eng.close()


def tenant_row(eng: KVEngine, name: str):
    return {t.name: t for t in eng.stats().tenants}[name]


def test_a_capped_tenant_churns_its_own_share_and_never_pushes_others_out(capped):
    a = Tenant("a", TOKEN_A, pool_bytes=CAP_BLOCKS * BLOCK)
    sa, ia = open_for(capped, a)
    sb, ib = open_for(capped, Tenant("b", TOKEN_B))
    victim_chain = hashes(POOL_BLOCKS - CAP_BLOCKS - 8, "b")  # b fills what the cap leaves, nearly
    for start in range(0, len(victim_chain), 64):  # in saves below a session's unsealed quota
        part = victim_chain[: start + 64]
        assert AllocStatus.REJECTED not in save(capped, sb, ib, part)
    # a saves four times its cap, 16 blocks at a time: each save past the cap evicts a's own
    # oldest blocks, never b's, although b's are the least recently used of the pool.
    for n in range(8):
        assert save(capped, sa, ia, hashes(16, f"a{n}")) == [AllocStatus.GRANTED] * 16
        assert tenant_row(capped, "a").dram_bytes <= CAP_BLOCKS * BLOCK
    assert capped.query_prefix(sb, ib, victim_chain).num_hits == len(victim_chain)
    assert capped.query_prefix(sa, ia, hashes(16, "a7")).num_hits == 16  # its newest are kept
    assert capped.query_prefix(sa, ia, hashes(16, "a0")).num_hits == 0  # its oldest went
    row = tenant_row(capped, "a")
    assert (row.dram_bytes, row.dram_cap_bytes) == (CAP_BLOCKS * BLOCK, CAP_BLOCKS * BLOCK)
    assert row.cap_evictions == 6 * 16 and row.cap_refused_blocks == 0
    assert tenant_row(capped, "b").dram_cap_bytes == 0  # b is uncapped


def test_what_does_not_fit_under_the_cap_is_refused_as_a_quota(capped):
    a = Tenant("a", TOKEN_A, pool_bytes=CAP_BLOCKS * BLOCK)
    sa, ia = open_for(capped, a)
    statuses = save(capped, sa, ia, hashes(CAP_BLOCKS + 8, "x"))
    assert statuses == [AllocStatus.GRANTED] * CAP_BLOCKS + [AllocStatus.REJECTED] * 8
    # Its whole share pinned by a lease: nothing of its own can go, so new blocks are refused
    # while the pool has room, and the granted-but-unsealed blocks of an open save count too.
    lease = capped.query_prefix(sa, ia, hashes(CAP_BLOCKS, "x"), lease=True)
    assert lease.num_hits == CAP_BLOCKS
    assert save(capped, sa, ia, hashes(4, "y")) == [AllocStatus.REJECTED] * 4
    capped.release_lease(sa, lease.lease_id)
    open_save = capped.allocate_blocks(sa, ia, hashes(8, "z"))
    assert open_save.statuses == [AllocStatus.GRANTED] * 8  # 8 of a's old blocks evicted for them
    assert save(capped, sa, ia, hashes(CAP_BLOCKS, "w")).count(AllocStatus.GRANTED) == CAP_BLOCKS - 8
    row = tenant_row(capped, "a")
    assert row.cap_refused_blocks == 8 + 4 + 8 and row.quota_refusals == 3


# ------------------------------------------------------ memory of its own (region=SIZE)

REGION_BLOCKS = 64  # a 4 MiB region in 64 KiB blocks


@pytest.fixture
def regioned():
    eng = small_engine(tenant_regions={"r": REGION_BLOCKS * BLOCK})
    yield eng
    eng.close()


def test_a_region_tenants_blocks_live_only_in_its_region_and_it_evicts_only_its_own(regioned):
    r = Tenant("r", TOKEN_A, region_bytes=REGION_BLOCKS * BLOCK)
    sr, ir = open_for(regioned, r)
    sb, ib = open_for(regioned, Tenant("b", TOKEN_B))
    part = regioned.region.part("r")
    assert (part.base, part.size_bytes) == (16 * MIB, 4 * MIB)
    # Its session is handed its region (the broker passes that memfd): its size, its name.
    assert regioned.open_session("t", tenant=r).pool_size_bytes == 4 * MIB
    header = regioned.attach_session(sr)
    assert (header["size_bytes"], header["part"]) == (4 * MIB, "r")
    assert (regioned.attach_session(sb)["size_bytes"], regioned.attach_session(sb)["part"]) == (16 * MIB, "")
    # b fills the whole shared pool: r's region is not the pool, so b gets all 256 blocks of it.
    pool_chain = hashes(POOL_BLOCKS, "b")
    for i in range(0, POOL_BLOCKS, 64):
        assert save(regioned, sb, ib, pool_chain[i : i + 64]) == [AllocStatus.GRANTED] * 64
    # r saves four times its region: every save past it evicts r's own oldest, never b's.
    for n in range(8):
        res = regioned.allocate_blocks(sr, ir, hashes(32, f"r{n}"))
        assert res.statuses == [AllocStatus.GRANTED] * 32
        # Offsets are its region's own (what its mapping of the region's memfd addresses) ...
        assert all(0 <= o < part.size_bytes for o in res.offsets)
        buf = np.frombuffer(regioned.region.buffer, dtype=np.uint8)
        for i, o in enumerate(res.offsets):  # ... and the server's bytes are at base + offset
            buf[part.base + o : part.base + o + BLOCK] = n * 32 + i & 0xFF
        regioned.seal_blocks(sr, res.save_id)
    assert regioned.query_prefix(sb, ib, pool_chain).num_hits == POOL_BLOCKS
    newest = regioned.query_prefix(sr, ir, hashes(32, "r7"))
    assert newest.num_hits == 32 and regioned.query_prefix(sr, ir, hashes(32, "r0")).num_hits == 0
    for i, o in enumerate(newest.offsets):
        assert (buf[part.base + o : part.base + o + BLOCK] == (7 * 32 + i & 0xFF)).all()
    row, b_row = tenant_row(regioned, "r"), tenant_row(regioned, "b")
    assert row.own_region and not b_row.own_region
    assert (row.dram_bytes, row.dram_cap_bytes) == (4 * MIB, 4 * MIB)
    assert row.resident_blocks == REGION_BLOCKS and b_row.resident_blocks == POOL_BLOCKS


def test_a_session_without_the_tenant_works_in_the_pool_and_the_server_in_the_whole_region(regioned):
    s, i = open_for(regioned, None)
    res = regioned.allocate_blocks(s, i, hashes(8))
    assert all(o < 16 * MIB for o in res.offsets)
    assert regioned.attach_session(s)["part"] == ""
    # A tenant named region= in a file the engine was not started with has no memory to be given.
    stray = Tenant("stray", TOKEN_B, region_bytes=MIB)
    with pytest.raises(FailedPrecondition, match="no region"):
        regioned.open_session("t", tenant=stray)
    assert len(regioned._registry.sessions) == 1  # refused before anything was opened


def test_regions_need_the_default_pool_backing(tmp_path):
    cfg = ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, pool_dir=str(tmp_path))
    with pytest.raises(PoolCapacityError, match="--pool-dir"):
        KVEngine(cfg, tenant_regions={"r": MIB})
