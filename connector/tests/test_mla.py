"""MLA under tensor parallelism (connector/mla.py): which rank writes a block, the
`mla_store` option, and the ranks' agreement on failed loads, down to two worker
connectors over a real pegaflow-server and a real gloo all-reduce between processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest

from pegaflow.connector import mla
from pegaflow.connector.config import load_config
from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata
from pegaflow.connector.tests.support import (
    LAYER_NAMES,
    NUM_BLOCKS,
    block_bytes,
    config,
    kv_caches,
    layout,
    save_and_wait,
    step,
    wait_for,
)
from pegaflow.connector.worker import WorkerConnector
from pegaflow.server.testing import ServerProcess, free_port

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


# ------------------------------------------------------------ failed-load agreement


def test_agreement_is_needed_only_when_a_loaded_request_also_saves_under_tp():
    assert not mla.needs_agreement(1, ["a"], ["a"])
    assert not mla.needs_agreement(2, [], ["a"])
    assert not mla.needs_agreement(2, ["a"], ["b"])
    assert mla.needs_agreement(2, ["a", "b"], ["c", "b"])


_GLOO_CHILD = """
import json, sys
import torch.distributed as dist
from pegaflow.connector import mla
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
local = {0: {"b"}, 1: {"c", "x"}}[rank]
agreed = mla.agree_on_failed_loads(["a", "b", "c"], local, mla.all_reduce_max_over(dist.group.WORLD))
print(json.dumps(sorted(agreed)))
dist.destroy_process_group()
"""


def test_ranks_agree_on_the_union_of_failed_loads_over_a_real_gloo_group(tmp_path):
    store = tmp_path / "gloo-store"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_CHILD, str(rank), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    agreed = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # b failed on rank 0, c on rank 1: both ranks skip both; x was not a load of this step
    assert agreed[0] == ["b", "c"]
    assert agreed[1] == ["b", "c", "x"]


class ThreadAllReduceMax:
    """All-reduce(MAX) between threads of one process: the TP group of two worker
    connectors driven side by side in a test."""

    def __init__(self, world: int):
        self._barrier = threading.Barrier(world, timeout=60)
        self._slots: list[list[int] | None] = [None] * world

    def for_rank(self, rank: int) -> mla.AllReduceMax:
        def all_reduce_max(flags: list[int]) -> list[int]:
            self._slots[rank] = list(flags)
            self._barrier.wait()
            out = [max(col) for col in zip(*self._slots, strict=True)]
            self._barrier.wait()
            return out

        return all_reduce_max


def tp_worker(cfg, rank: int, caches, reducer: ThreadAllReduceMax) -> WorkerConnector:
    w = WorkerConnector(
        cfg,
        layout("mla", mla=True, tp_size=2, tp_rank=rank),
        num_blocks=NUM_BLOCKS,
        layer_names=list(LAYER_NAMES),
        instance_name=f"mla{rank}",
        tp_rank=rank,
        tp_size=2,
        all_reduce_max=reducer.for_rank(rank),
    )
    w.register_kv_caches(caches)
    return w


def owned_by(rank: int, count: int, tag: str) -> list[bytes]:
    out, i = [], 0
    while len(out) < count:
        h = hashlib.sha256(f"{tag}/{i}".encode()).digest()
        if mla.writer_rank(h, 2) == rank:
            out.append(h)
        i += 1
    return out


def step_together(workers: list[WorkerConnector], meta: PegaConnectorMetadata) -> list[set[int]]:
    """One engine step on every rank at once (the agreement is a collective)."""
    failed: list[set[int] | None] = [None] * len(workers)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            failed[i] = step(workers[i], meta)[1]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return failed  # type: ignore[return-value]


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path / "server", pool_size="64mb") as srv:
        yield srv


def test_a_load_failed_on_one_rank_stops_every_rank_from_saving_that_request(server):
    """Rank 1 cannot reach the server, so its load of request r fails while rank 0's
    succeeds. The step's forward mixed both ranks' results, so the block r completed in it
    is wrong everywhere: rank 0 (its writer) must not save it. A healthy step still saves."""
    reducer = ThreadAllReduceMax(2)
    caches0, caches1 = kv_caches(seed=1), kv_caches(seed=2)
    rank0 = tp_worker(config(server.addr), 0, caches0, reducer)
    rank1 = tp_worker(config(f"127.0.0.1:{free_port()}"), 1, caches1, reducer)
    # a third connector of the same shared namespace plays "another engine" that stored the prefix
    seeder_caches = kv_caches(seed=3)
    seeder = tp_worker(config(server.addr), 0, seeder_caches, ThreadAllReduceMax(1))
    prefix, new = owned_by(0, 2, "prefix"), owned_by(0, 2, "new")
    try:
        wait_for(lambda: rank0.link.usable() is not None and seeder.link.usable() is not None)
        save_and_wait(seeder, "seed", [1, 2], prefix)
        meta = PegaConnectorMetadata(
            loads=[BlockTransfer("r", [10, 11], prefix)], saves=[BlockTransfer("r", [12], new[:1])]
        )
        failed0, failed1 = step_together([rank0, rank1], meta)
        assert failed0 == set() and failed1 == {10, 11}
        for s, d in zip([1, 2], [10, 11], strict=True):  # rank 0 did load
            assert block_bytes(caches0, d) == block_bytes(seeder_caches, s)
        assert rank0.stats["save_blocks_skipped_failed_load"] == 1
        assert rank0.stats["saved_blocks"] == 0
        # control: with both ranks healthy the same kind of step saves its new block
        rank1.shutdown()
        rank1 = tp_worker(config(server.addr), 1, caches1, reducer)
        wait_for(lambda: rank1.link.usable() is not None)
        meta = PegaConnectorMetadata(
            loads=[BlockTransfer("q", [20, 21], prefix)], saves=[BlockTransfer("q", [22], new[1:])]
        )
        assert step_together([rank0, rank1], meta) == [set(), set()]
        wait_for(lambda: rank0.stats["saved_blocks"] == 1)
    finally:
        for w in (rank0, rank1, seeder):
            w.shutdown()


def test_the_failed_load_agreement_never_runs_on_a_single_rank(server):
    """TP=1 (and steps without a loaded request that saves) must not touch a collective:
    a worker without a TP group would hang or crash in one."""

    def forbidden(flags):
        raise AssertionError("no collective expected")

    w = WorkerConnector(
        config(server.addr),
        layout("solo"),
        num_blocks=NUM_BLOCKS,
        layer_names=list(LAYER_NAMES),
        instance_name="solo",
        all_reduce_max=forbidden,
    )
    w.register_kv_caches(kv_caches(seed=4))
    try:
        wait_for(lambda: w.link.usable() is not None)
        hs = [sha(i) for i in range(3)]
        meta = PegaConnectorMetadata(
            loads=[BlockTransfer("r", [1, 2], hs[:2])], saves=[BlockTransfer("r", [3], hs[2:])]
        )
        step(w, meta)
    finally:
        w.shutdown()


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
