"""The connector's worker and scheduler halves against a real pegaflow-server process:
bytes saved by one engine load back byte-identical into another, namespaces isolate,
and a down, dying, restarted or stopped server costs cache hits, never correctness
and never more than the documented stall."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata
from pegaflow.connector.mla import writer_rank
from pegaflow.connector.scheduler import ServerPrefixLookup
from pegaflow.connector.server_link import ServerLink
from pegaflow.connector.tests.support import (
    BLOCK_BYTES,
    LAYER_NAMES,
    block_bytes,
    config,
    hashes,
    kv_caches,
    layout,
    load_meta,
    ready_blocks,
    save_and_wait,
    step,
    wait_for,
    worker,
)
from pegaflow.server.testing import ServerProcess, free_port, sigstop

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path / "server", pool_size="64mb") as srv:
        yield srv


def lookup_for(cfg, lay):
    link = ServerLink(
        cfg.server_addr,
        [lay],
        client_name="test-sched",
        instance_name="test-sched",
        rpc_timeout_s=cfg.rpc_timeout_s,
        retry_interval_s=cfg.retry_interval_s,
    )
    link.start()
    return link, ready_blocks(ServerPrefixLookup(link, cfg.lookup_timeout_s))


def attached(*workers_or_links):
    def ready():
        return all((x.link if hasattr(x, "link") else x).usable() is not None for x in workers_or_links)

    wait_for(ready)


def test_saved_blocks_load_back_byte_identical_into_other_blocks(server):
    cfg = config(server.addr)
    src_caches, dst_caches = kv_caches(seed=1), kv_caches(seed=None)
    a = worker(cfg, layout(), src_caches, "a")
    b = worker(cfg, layout(), dst_caches, "b")
    link, lookup = lookup_for(cfg, layout())
    try:
        attached(a, b, link)
        hs = hashes("prompt-1", 6)
        save_and_wait(a, "r1", [3, 4, 5, 9, 10, 11], hs)
        assert a.stats["saved_blocks"] == 6
        assert lookup(hs) == 6
        assert lookup(hs[:2] + hashes("other", 1) + hs[3:]) == 2  # leading hits only
        targets = [20, 21, 22, 1, 2, 30]
        done, failed = step(b, load_meta("r2", targets, hs))
        assert failed == set()
        for s, d in zip([3, 4, 5, 9, 10, 11], targets, strict=True):
            assert block_bytes(dst_caches, d) == block_bytes(src_caches, s)
        untouched = set(range(32)) - set(targets)
        assert all(not any(block_bytes(dst_caches, i)) for i in untouched)
        # saving the same blocks again writes nothing (deduplicated by the server)
        save_and_wait(a, "r3", [3, 4], hs[:2])
        assert a.stats["saved_blocks"] == 6
        assert a.stats["save_blocks_deduplicated"] == 2
    finally:
        a.shutdown(), b.shutdown(), link.close()


def test_a_partial_hit_reports_exactly_the_missing_blocks(server):
    cfg = config(server.addr)
    src_caches, dst_caches = kv_caches(seed=2), kv_caches(seed=None)
    a = worker(cfg, layout(), src_caches, "a")
    b = worker(cfg, layout(), dst_caches, "b")
    try:
        attached(a, b)
        hs = hashes("prompt-2", 5)
        save_and_wait(a, "r1", [0, 1, 2], hs[:3])
        _, failed = step(b, load_meta("r2", [10, 11, 12, 13, 14], hs))
        assert failed == {13, 14}
        for s, d in zip([0, 1, 2], [10, 11, 12], strict=True):
            assert block_bytes(dst_caches, d) == block_bytes(src_caches, s)
        # a request whose load failed saves nothing from that step: its new blocks were
        # computed over missing KV
        meta = PegaConnectorMetadata(
            loads=[BlockTransfer("r3", [15, 16], hashes("never-stored", 2))],
            saves=[BlockTransfer("r3", [17], hashes("computed-over-garbage", 1))],
        )
        _, failed = step(b, meta)
        assert failed == {15, 16}
        assert b.stats["save_blocks_skipped_failed_load"] == 1
    finally:
        a.shutdown(), b.shutdown()


def test_namespaces_isolate_models_and_mla_ranks_share_one_copy(server):
    cfg = config(server.addr)
    caches = kv_caches(seed=3)
    hs = hashes("shared-prompt", 4)
    model_a = worker(cfg, layout("model-a"), caches, "a")
    link_b, lookup_b = lookup_for(cfg, layout("model-b"))
    link_a1, lookup_a_rank1 = lookup_for(cfg, layout("model-a", tp_size=2, tp_rank=1))
    mla0_caches, mla1_caches = kv_caches(seed=4), kv_caches(seed=5)
    mla0 = worker(cfg, layout("mla", mla=True, tp_size=2, tp_rank=0), mla0_caches, "mla0")
    mla1 = worker(cfg, layout("mla", mla=True, tp_size=2, tp_rank=1), mla1_caches, "mla1")
    link_mla, lookup_mla = lookup_for(cfg, layout("mla", mla=True, tp_size=2, tp_rank=0))
    try:
        attached(model_a, mla0, mla1, link_b, link_a1, link_mla)
        save_and_wait(model_a, "r1", [0, 1, 2, 3], hs)
        assert lookup_b(hs) == 0  # another model never sees these blocks
        assert lookup_a_rank1(hs) == 0  # nor does another TP layout of the same model
        # MLA: one copy per TP group, each block written by one rank, spread over the ranks
        mla_hashes = hashes("mla-prompt", 8)
        owners = [writer_rank(h, 2) for h in mla_hashes]
        assert 0 < owners.count(1) < len(owners)  # fixed hashes: both ranks own some
        src = list(range(5, 13))
        save_and_wait(mla1, "m1", src, mla_hashes)  # rank 1 stores only its own blocks...
        assert mla1.stats["saved_blocks"] == owners.count(1)
        assert mla1.stats["save_blocks_other_rank"] == owners.count(0)
        assert lookup_mla(mla_hashes) == owners.index(0)  # ...and a prefix stops at a gap
        save_and_wait(mla0, "m1", src, mla_hashes)
        assert mla0.stats["saved_blocks"] == owners.count(0)
        assert lookup_mla(mla_hashes) == len(mla_hashes)
        # every rank loads the same stored copy: each block's bytes are its writer's
        dst = list(range(20, 28))
        for w, w_caches in ((mla0, mla0_caches), (mla1, mla1_caches)):
            _, failed = step(w, load_meta("m2", dst, mla_hashes))
            assert failed == set()
            for s, d, owner in zip(src, dst, owners, strict=True):
                writer_caches = mla0_caches if owner == 0 else mla1_caches
                assert block_bytes(w_caches, d) == block_bytes(writer_caches, s)
    finally:
        for x in (model_a, mla0, mla1):
            x.shutdown()
        for x in (link_b, link_a1, link_mla):
            x.close()


def test_server_down_at_start_then_up_later(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    cfg = config(addr)
    caches = kv_caches(seed=6)
    a = worker(cfg, layout(), caches, "a")
    link, lookup = lookup_for(cfg, layout())
    srv = ServerProcess(tmp_path / "server", pool_size="64mb", addr=addr)
    try:
        # no server: no hits, loads fail fast into recompute, saves are skipped, requests finish
        assert lookup(hashes("p", 2)) is None
        t0 = time.monotonic()
        _, failed = step(a, load_meta("r0", [1, 2], hashes("p", 2)))
        assert failed == {1, 2}
        save_and_wait(a, "r1", [1, 2], hashes("p", 2))
        assert time.monotonic() - t0 < 10
        assert a.stats["saved_blocks"] == 0
        srv.start()
        attached(a, link)  # both attach on their own
        save_and_wait(a, "r2", [1, 2], hashes("p", 2))
        assert lookup(hashes("p", 2)) == 2
    finally:
        a.shutdown(), link.close(), srv.stop()


def test_server_killed_then_restarted_recovers_without_restarting_the_engine(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    cfg = config(addr)
    src, dst = kv_caches(seed=7), kv_caches(seed=None)
    a = worker(cfg, layout(), src, "a")
    b = worker(cfg, layout(), dst, "b")
    link, lookup = lookup_for(cfg, layout())
    srv = ServerProcess(tmp_path / "server", pool_size="64mb", addr=addr)
    try:
        srv.start()
        attached(a, b, link)
        hs = hashes("before-kill", 3)
        save_and_wait(a, "r1", [0, 1, 2], hs)
        assert lookup(hs) == 3
        srv.kill()
        # the cache is gone: lookups miss, loads are reported failed (recomputed), saves skip
        wait_for(lambda: lookup(hs) is None)
        _, failed = step(b, load_meta("r2", [5, 6, 7], hs))
        assert failed == {5, 6, 7}
        save_and_wait(a, "r3", [3], hashes("while-down", 1))
        srv.start()  # a new pool, a new epoch: the old blocks are gone
        attached(a, b, link)
        assert lookup(hs) == 0
        save_and_wait(a, "r4", [0, 1, 2], hs)
        assert lookup(hs) == 3
        _, failed = step(b, load_meta("r5", [5, 6, 7], hs))
        assert failed == set()
        assert [block_bytes(dst, d) for d in (5, 6, 7)] == [block_bytes(src, s) for s in (0, 1, 2)]
    finally:
        a.shutdown(), b.shutdown(), link.close(), srv.stop()


def test_a_stopped_server_stalls_one_step_at_most_the_documented_bound(server):
    # the documented defaults on the step's path; rpc_timeout far above the bound: if a call
    # on the step's path used it instead of the lookup/load deadlines, the step would take
    # 30 s and fail the check below
    cfg = config(server.addr, lookup_timeout_s=0.2, load_timeout_s=0.5, rpc_timeout_s=30.0)
    caches = kv_caches(seed=8)
    a = worker(cfg, layout(), caches, "a")
    link, lookup = lookup_for(cfg, layout())
    try:
        attached(a, link)
        hs = hashes("stall", 4)
        save_and_wait(a, "r1", [0, 1, 2, 3], hs)
        sigstop(server.proc.pid)
        try:
            # one engine step: the scheduler's lookup, then the worker's load
            t0 = time.monotonic()
            stored = lookup(hs)
            _, failed = step(a, load_meta("r2", [10, 11, 12, 13], hs))
            stall = time.monotonic() - t0
            assert stored is None  # the lookup gave up at its deadline: no hits claimed
            assert failed == {10, 11, 12, 13} or failed == set()  # a load either lands or is recomputed
            assert stall < cfg.worst_step_stall_s + 2.0, f"step stalled {stall:.2f} s"
            # the breaker is open now: the next steps do not wait for the server at all
            t1 = time.monotonic()
            for _ in range(20):
                assert lookup(hs) is None
                step(a, load_meta("r3", [20, 21], hs[:2]))
            assert time.monotonic() - t1 < 2.0 + cfg.load_timeout_s
            # saves never block a step
            t2 = time.monotonic()
            step(a, PegaConnectorMetadata(saves=[BlockTransfer("r4", [5], hashes("x", 1))]))
            assert time.monotonic() - t2 < 2.0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        attached(a, link)  # the probe closes the breaker once the server answers
        wait_for(lambda: lookup(hs) == 4)
    finally:
        a.shutdown(), link.close()


def test_preemption_cancels_a_save_that_has_not_copied_yet(server):
    cfg = config(server.addr, rpc_timeout_s=30.0)
    caches = kv_caches(seed=9)
    a = worker(cfg, layout(), caches, "a")
    link, lookup = lookup_for(cfg, layout())
    try:
        attached(a, link)
        hs = hashes("preempted", 2)
        sigstop(server.proc.pid)
        stopped = True
        try:
            step(a, PegaConnectorMetadata(saves=[BlockTransfer("r1", [4, 5], hs)]))
            # the save thread now waits in allocate; the request is preempted and its
            # blocks handed to another request this step
            t0 = time.monotonic()
            a.handle_preemptions(["r1"])
            assert time.monotonic() - t0 < 2.0
            caches[LAYER_NAMES[0]][4].fill_(7)  # the new owner overwrites the block
            os.kill(server.proc.pid, signal.SIGCONT)
            stopped = False
            wait_for(lambda: "r1" in a.finished_sending(["r1"]))
        finally:
            if stopped:
                os.kill(server.proc.pid, signal.SIGCONT)
        attached(a, link)
        assert lookup(hs) == 0  # nothing from the reused blocks was stored
        assert a.stats["save_jobs_preempted"] == 1
    finally:
        a.shutdown(), link.close()


def test_each_layer_has_landed_when_its_wait_returns(server):
    cfg = config(server.addr)
    src, dst = kv_caches(seed=10), kv_caches(seed=None)
    a = worker(cfg, layout(), src, "a")
    b = worker(cfg, layout(), dst, "b")
    try:
        attached(a, b)
        hs = hashes("layers", 8)
        save_and_wait(a, "r1", list(range(8)), hs)
        meta = load_meta("r2", list(range(16, 24)), hs)
        b.start_load(meta)
        for name in LAYER_NAMES:
            b.wait_for_layer(name)
            assert all(dst[name][16 + k].equal(src[name][k]) for k in range(8))
        b.finish_step(meta)
        assert b.take_load_errors() == set()
        assert b.stats["loaded_blocks"] == 8
    finally:
        a.shutdown(), b.shutdown()


def test_the_step_thread_copies_every_layer_when_the_load_thread_is_busy(server):
    """Under concurrent arrivals the load thread's core is shared with the API server and
    EngineCore: the step thread must not idle waiting for it, it copies what it needs itself."""
    cfg = config(server.addr)
    src, dst = kv_caches(seed=11), kv_caches(seed=None)
    a = worker(cfg, layout(), src, "a")
    b = worker(cfg, layout(), dst, "b")
    gate = threading.Event()
    try:
        attached(a, b)
        hs = hashes("busy-load-thread", 6)
        save_and_wait(a, "r1", list(range(6)), hs)
        b._load_thread.submit(gate.wait, 60)  # the load thread is held elsewhere for this step
        t0 = time.monotonic()
        _, failed = step(b, load_meta("r2", list(range(20, 26)), hs))
        assert failed == set()
        # not at the deadline: the step thread did the copies (the load thread never ran)
        assert time.monotonic() - t0 < cfg.load_timeout_s
        for k in range(6):
            assert block_bytes(dst, 20 + k) == block_bytes(src, k)
        got = b.metrics.take()
        assert got.counters["load_blocks"] == 6 and "load_failed_blocks" not in got.counters
        assert got.counters["load_bytes"] == 6 * BLOCK_BYTES
        gate.set()
        # and with the load thread free, the same load lands the same bytes
        for t in dst.values():
            t.zero_()
        _, failed = step(b, load_meta("r3", list(range(26, 32)), hs))
        assert failed == set()
        for k in range(6):
            assert block_bytes(dst, 26 + k) == block_bytes(src, k)
    finally:
        gate.set()
        a.shutdown(), b.shutdown()


def test_the_worker_lease_counts_no_request_and_its_save_restates_the_loaded_head(server):
    """(from the server follow-up engineer) The scheduler's lookup is the block request; the
    worker's leasing query is a LOAD (counts no hit), and the save of the continuation carries
    the loaded head along (EXISTS at the server: nothing copied)."""
    from pegaflow.client import PegaClient

    cfg = config(server.addr)
    a = worker(cfg, layout(), kv_caches(seed=3), "a")
    link, lookup = lookup_for(cfg, layout())
    stats = PegaClient(server.addr, timeout_s=10.0, name="stats", map_pool=False)
    try:
        stats.connect()
        attached(a, link)
        head, tail = hashes("shared-head", 4), hashes("continuation", 2)
        save_and_wait(a, "r1", [0, 1, 2, 3], head)
        before = stats.stats()
        assert lookup(head + tail) == 4  # the scheduler's request
        _, failed = step(a, load_meta("r2", [10, 11, 12, 13], head))  # the worker's load
        assert failed == set()
        after = stats.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (4, 2)
        assert after.load_queries - before.load_queries == 1 and after.load_missed_blocks == 0
        save = BlockTransfer("r2", [14, 15], tail, head_block_ids=[10, 11, 12, 13], head_hashes=head)
        step(a, PegaConnectorMetadata(saves=[save]))
        done, _ = step(a, PegaConnectorMetadata(delayed_free_req_ids=["r2"]))
        wait_for(lambda: "r2" in done or "r2" in step(a, PegaConnectorMetadata())[0])
        assert a.stats["saved_blocks"] == 4 + 2 and a.stats["save_blocks_deduplicated"] == 4
        assert lookup(head + tail) == 6
    finally:
        a.shutdown(), link.close(), stats.close()


def test_with_block_checksums_a_block_scribbled_in_the_pool_is_recomputed_and_dropped(server):
    """Issue 12 F2: another client overwrote a sealed block through its whole-pool mapping. A
    worker that does not check loads the wrong bytes; one with block_checksums stops the prefix
    there (the block and the rest are load errors: vLLM recomputes them), and the server, told
    with the release, checks the block itself and drops it."""
    from pegaflow.client import PegaClient

    src_caches = kv_caches(seed=3)
    writer = worker(config(server.addr, block_checksums=True), layout(), src_caches, "w")
    trusting = worker(config(server.addr), layout(), kv_caches(seed=None), "t")
    checking_caches = kv_caches(seed=None)
    checking = worker(config(server.addr, block_checksums=True), layout(), checking_caches, "c")
    link, lookup = lookup_for(config(server.addr), layout())
    scribbler = PegaClient(server.addr, timeout_s=10)
    try:
        attached(writer, trusting, checking, link)
        hs = hashes("prompt-sum", 6)
        save_and_wait(writer, "r1", [0, 1, 2, 3, 4, 5], hs)
        client, (inst,) = writer.link.usable()
        hit = client.query_prefix(inst, hs)
        assert hit.num_hits == 6 and all(loc.checksum for loc in hit.locations)  # the writer's hashes
        scribbler.connect()
        victim = hit.locations[3]
        scribbler.pool_view(hit.epoch)[victim.offset : victim.offset + 64] ^= 0xFF

        _, failed = step(trusting, load_meta("r2", [10, 11, 12, 13, 14, 15], hs))
        assert failed == set()  # without checks the wrong bytes went into vLLM's KV
        _, failed = step(checking, load_meta("r3", [20, 21, 22, 23, 24, 25], hs))
        assert failed == {23, 24, 25}
        for s, d in zip([0, 1, 2], [20, 21, 22], strict=True):
            assert block_bytes(checking_caches, d) == block_bytes(src_caches, s)
        assert checking.stats["load_blocks_corrupt"] == 1
        wait_for(lambda: lookup(hs) == 3)  # the server hashed it again and dropped it
        assert scribbler.stats().corrupt_blocks == 1
    finally:
        scribbler.close()
        writer.shutdown(), trusting.shutdown(), checking.shutdown(), link.close()
