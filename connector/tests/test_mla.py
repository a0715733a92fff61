"""MLA under tensor parallelism (connector/mla.py): which rank writes a block, the
`mla_store` option, the CPU RoPE check, and, over a real pegaflow-server, that no rank
of a TP group sees a block before its writer sealed it. (Two worker connectors sharing
one MLA namespace: test_worker_server.py; real vLLM at TP=2: test_e2e_mla.py.)"""

from __future__ import annotations

import hashlib

import pytest

from pegaflow.connector import mla
from pegaflow.connector.config import load_config
from pegaflow.connector.tests.support import layout
from pegaflow.server.testing import ServerProcess

pytestmark = pytest.mark.timeout(240)


def sha(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


# ----------------------------------------------------------------- writer choice


def test_writer_rank_is_a_stable_function_of_the_hash():
    hashes = [sha(i) for i in range(64)]
    first = [mla.writer_rank(h, 4) for h in hashes]
    assert first == [mla.writer_rank(h, 4) for h in hashes]
    # pinned values: every process, engine and restart must pick the same writer
    # (a change here splits a running group's saves across two rules)
    digest = hashlib.blake2b(hashes[0], digest_size=8).digest()
    assert first[0] == int.from_bytes(digest, "little") % 4
    for i in range(8):
        h = bytes([i]) * 32
        expected = int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "little") % 2
        assert mla.writer_rank(h, 2) == expected
    assert all(mla.writer_rank(h, 1) == 0 for h in hashes)


@pytest.mark.parametrize("tp_size", [2, 3, 8])
def test_writers_spread_evenly_over_the_ranks(tp_size):
    n = 8000
    counts = [0] * tp_size
    for i in range(n):
        counts[mla.writer_rank(sha(i), tp_size)] += 1
    # fixed inputs, so this is exact, not statistical; a digest that favoured a rank
    # (or "always rank 0") would miss the bounds by far
    for c in counts:
        assert abs(c - n / tp_size) < 0.1 * n / tp_size, counts


def test_writer_rank_rejects_a_bad_tp_size():
    with pytest.raises(ValueError):
        mla.writer_rank(sha(0), 0)


def test_own_blocks_partition_a_save_over_the_ranks():
    ids = list(range(100, 140))
    hashes = [sha(i) for i in range(40)]
    parts = [mla.own_blocks(True, r, 4, ids, hashes) for r in range(4)]
    got = sorted(b for part_ids, _ in parts for b in part_ids)
    assert got == ids  # every block exactly once
    for part_ids, part_hashes in parts:
        assert part_ids == sorted(part_ids)  # order kept
        assert all(ids[hashes.index(h)] == b for b, h in zip(part_ids, part_hashes, strict=True))
    # a per-rank namespace: every rank saves everything (its own shard or copy)
    assert mla.own_blocks(False, 3, 4, ids, hashes) == (ids, hashes)
    with pytest.raises(ValueError):
        mla.own_blocks(True, 0, 2, ids, hashes[:-1])


# -------------------------------------------------------------------- the option


def test_mla_store_option():
    assert load_config({}, env={}).mla_store == "once"
    assert load_config({"mla_store": "per_rank"}, env={}).mla_store == "per_rank"
    assert load_config({"mla_store": "once"}, env={}).mla_store == "once"
    for bad in ("twice", "", None, 1, "ONCE"):
        with pytest.raises(ValueError, match="mla_store"):
            load_config({"mla_store": bad}, env={})


def test_the_cpu_rope_workaround_is_detected():
    from types import SimpleNamespace

    def cfg(use_mla: bool, ops: list[str]):
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=use_mla), compilation_config=SimpleNamespace(custom_ops=ops)
        )

    assert mla.rope_workaround_missing(cfg(True, ["all"]))
    assert mla.rope_workaround_missing(cfg(True, []))
    assert mla.rope_workaround_missing(cfg(True, ["none", "+rotary_embedding"]))
    assert not mla.rope_workaround_missing(cfg(True, ["-rotary_embedding", "all"]))
    assert not mla.rope_workaround_missing(cfg(True, ["none"]))
    assert not mla.rope_workaround_missing(cfg(False, ["all"]))  # the bug is MLA's strided views
    assert "-rotary_embedding" in mla.ROPE_WORKAROUND_HINT


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path / "server", pool_size="64mb") as srv:
        yield srv


def test_a_block_is_invisible_to_every_rank_until_its_writer_seals_it(server):
    """The race of a shared namespace: rank 1 asks for a block rank 0 is still writing. It gets
    no hit (never partial bytes) and is told the block is in progress if it tries to store it
    too; once sealed, both ranks read the writer's bytes."""
    import numpy as np

    from pegaflow.client import AllocStatus, PegaClient, read_blocks, write_blocks

    clients = [PegaClient(server.addr, timeout_s=10.0, name=f"rank{r}") for r in range(2)]
    try:
        for c in clients:
            c.connect()
        insts = [
            c.register_instance(layout("mla", mla=True, tp_size=2, tp_rank=r).to_client())
            for r, c in enumerate(clients)
        ]
        hs = [sha(100 + i) for i in range(3)]
        rows = np.random.default_rng(0).integers(0, 256, size=(3, insts[0].block_bytes), dtype=np.uint8)
        batch = clients[0].allocate(insts[0], hs)
        assert [a.status for a in batch.allocations] == [AllocStatus.GRANTED] * 3
        write_blocks(clients[0].pool_view(batch.epoch), batch.allocations[:2], rows[:2])  # half written
        for c, inst in zip(clients, insts, strict=True):
            hit = c.query_prefix(inst, hs, lease=True)
            assert hit.num_hits == 0 and not hit.lease_id
        again = clients[1].allocate(insts[1], hs)
        assert [a.status for a in again.allocations] == [AllocStatus.IN_PROGRESS] * 3 and not again.save_id
        write_blocks(clients[0].pool_view(batch.epoch), batch.allocations, rows)
        clients[0].seal(batch.save_id)
        for c, inst in zip(clients, insts, strict=True):
            hit = c.query_prefix(inst, hs, lease=True)
            assert hit.num_hits == 3
            out = np.zeros_like(rows)
            read_blocks(c.pool_view(hit.epoch), hit.locations, out)
            assert np.array_equal(out, rows)
            c.release(hit.lease_id)
    finally:
        for c in clients:
            c.close()
