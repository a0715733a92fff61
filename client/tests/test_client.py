"""PegaClient / AsyncPegaClient against real servers: deadlines, reconnects, threads, epochs."""

from __future__ import annotations

import asyncio
import pathlib
import random
import threading
import time

import numpy as np
import pytest

from pegaflow.client import (
    AsyncPegaClient,
    KvLayout,
    PegaClient,
    QueryPurpose,
    errors,
    read_blocks,
    write_blocks,
)
from pegaflow.client.backoff import Backoff
from pegaflow.client.types import Allocation, AllocStatus, Location
from pegaflow.server.testing import ServerProcess, free_port, wait_for

BLOCK = 64 * 1024
LAYOUT = KvLayout(model_id="m", block_bytes=BLOCK, dtype="bfloat16", block_tokens=16, num_layers=2)

pytestmark = pytest.mark.timeout(180)


def roundtrip(c: PegaClient, inst, tag: str, n: int = 8) -> bool:
    hashes = [f"{tag}-{i}".encode() for i in range(n)]
    data = np.random.default_rng(abs(hash(tag)) % 2**32).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)
    batch = c.allocate(inst, hashes)
    write_blocks(c.pool_view(batch.epoch), batch.allocations, data)
    if batch.save_id:
        c.seal(batch.save_id)
    hit = c.query_prefix(inst, hashes, lease=True)
    out = np.empty_like(data)
    read_blocks(c.pool_view(hit.epoch), hit.locations, out)
    c.release(hit.lease_id, loaded_bytes=out.nbytes)
    return hit.num_hits == n and np.array_equal(out, data)


def test_connect_to_nothing_raises_server_unavailable():
    c = PegaClient(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    try:
        with pytest.raises(errors.ServerUnavailable):
            c.connect()
        inst = c.register_instance(LAYOUT)  # no server: handle comes back unregistered
        assert not inst.registered
        with pytest.raises(errors.ServerUnavailable):
            c.query_prefix(inst, [b"a"])
        with pytest.raises(errors.ServerUnavailable):
            c.stats()
    finally:
        c.close()


def test_instances_registered_while_the_server_is_down_get_registered_when_it_comes(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    c = PegaClient(addr, timeout_s=2.0)
    srv = ServerProcess(tmp_path, pool_size="32mb", addr=addr, http_addr=None)
    try:
        with pytest.raises(errors.ServerUnavailable):
            c.connect()
        inst = c.register_instance(LAYOUT, name="early")
        srv.start()
        wait_for(lambda: inst.registered)
        assert roundtrip(c, inst, "late")
        assert c.stats().live_instances == 1
    finally:
        c.close()
        srv.stop()


def test_one_client_many_threads(inproc_server):
    with PegaClient(inproc_server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        results: list[bool] = []
        failures: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                for r in range(5):
                    results.append(roundtrip(c, inst, f"t{k}-{r}", n=4))
            except BaseException as exc:  # surfaced below
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
        assert results == [True] * 40


def test_calls_end_at_their_deadline_when_the_server_is_stuck(inproc_server):
    # Queries to the engine (the read lane answers them without the engine: server/read_lane/tests).
    with PegaClient(inproc_server.address, timeout_s=5.0, read_lane=False) as c:
        inst = c.register_instance(LAYOUT)
        engine = inproc_server.engine
        with engine._lock:  # the server cannot serve anything that needs the engine
            with pytest.raises(errors.DeadlineExceeded):
                c.allocate(inst, [b"stuck"], timeout_s=0.3)
            with pytest.raises(errors.DeadlineExceeded):
                c.query_prefix(inst, [b"stuck"], lease=True, timeout_s=0.3)
        assert c.connected
        wait_for(lambda: c.stats().writing_blocks == 0 and c.stats().live_leases == 0)
        assert c.query_prefix(inst, [b"stuck"]).num_hits == 0


def test_close_ends_the_session_and_frees_its_state(inproc_server):
    watcher = PegaClient(inproc_server.address, timeout_s=5.0)
    watcher.connect()
    c = PegaClient(inproc_server.address, timeout_s=5.0)
    c.connect()
    inst = c.register_instance(LAYOUT)
    c.allocate(inst, [b"pending"])
    assert watcher.stats().live_sessions == 2 and watcher.stats().writing_blocks == 1
    c.close()
    stats = watcher.stats()
    assert stats.live_sessions == 1 and stats.writing_blocks == 0 and stats.live_instances == 0
    with pytest.raises(errors.PegaflowError):
        c.stats()
    watcher.close()


def test_the_session_is_replaced_when_the_server_forgets_it(inproc_server):
    with PegaClient(inproc_server.address, timeout_s=5.0) as c:
        inst = c.register_instance(LAYOUT)
        first, first_instance = c.session_id, inst.instance_id
        inproc_server.engine.close_session(
            first
        )  # as if it had expired: the server also drops its pool socket
        wait_for(lambda: c.connected and inst.registered and c.session_id != first)
        assert inst.instance_id != first_instance
        assert c.epoch == inproc_server.epoch  # same server, same pool
        assert roundtrip(c, inst, "after-session-loss")


def test_an_unknown_session_maps_to_session_lost(inproc_server):
    import grpc

    from pegaflow.client import rpc_codec
    from pegaflow.proto import pegaflow_pb2 as pb
    from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

    with grpc.insecure_channel(inproc_server.address) as channel:
        stub = pb_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(pb.HeartbeatRequest(session_id="s-gone"), timeout=5)
        with pytest.raises(grpc.RpcError) as lease_info:
            stub.ReleaseLease(pb.ReleaseLeaseRequest(session_id="s-gone", lease_id="l-x"), timeout=5)
    assert isinstance(rpc_codec.translate(info.value, "Heartbeat"), errors.SessionLost)
    assert rpc_codec.needs_reconnect(rpc_codec.translate(lease_info.value, "ReleaseLease"))


def test_async_client_roundtrip_and_reconnect(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    srv = ServerProcess(tmp_path, pool_size="32mb", addr=addr, http_addr=None).start()

    async def scenario():
        c = AsyncPegaClient(addr, timeout_s=5.0, name="aio")
        await c.connect()
        try:
            inst = await c.register_instance(LAYOUT)
            hashes = [b"a1", b"a2", b"a3"]
            data = np.arange(3 * BLOCK, dtype=np.uint64).astype(np.uint8).reshape(3, BLOCK)
            batch = await c.allocate(inst, hashes)
            write_blocks(c.pool_view(batch.epoch), batch.allocations, data)
            assert await c.seal(batch.save_id) == 3
            hit = await c.query_prefix(inst, hashes, lease=True)
            out = np.empty_like(data)
            read_blocks(c.pool_view(hit.epoch), hit.locations, out)
            assert [loc.offset for loc in await c.load_blocks(inst, hit.lease_id)] == [
                loc.offset for loc in hit.locations
            ]
            await c.release(hit.lease_id, loaded_bytes=out.nbytes)
            assert np.array_equal(out, data)
            assert (await c.stats()).resident_blocks == 3
            old_epoch = c.epoch
            srv.kill()
            with pytest.raises(errors.ServerUnavailable):
                await c.query_prefix(inst, hashes)
            srv.start()
            deadline = time.monotonic() + 60
            while not (c.connected and inst.registered and c.epoch == srv.epoch):
                assert time.monotonic() < deadline, "no reconnect"
                await asyncio.sleep(0.05)
            with pytest.raises(errors.StaleEpoch):
                c.pool_view(old_epoch)
            assert (await c.query_prefix(inst, hashes)).num_hits == 0
        finally:
            await c.close()

    try:
        asyncio.run(scenario())
    finally:
        srv.stop()


@pytest.mark.parametrize("copy_mode", ["numpy", "native"])
@pytest.mark.parametrize("B", [1024, 96 * 1024 + 8])  # below / above the streaming-store threshold
def test_block_copy_merges_adjacent_runs_and_skips_ungranted(copy_mode, B):
    from pegaflow.common.native import page_copy

    was = page_copy.is_native()
    assert page_copy.use(copy_mode == "native"), page_copy.EXTENSION.probe()
    try:
        pool = np.zeros(64 * B, dtype=np.uint8)
        rows = np.random.default_rng(3).integers(0, 256, size=(5, B), dtype=np.uint8)
        locs = [
            Allocation(AllocStatus.GRANTED, 0, B),
            Allocation(AllocStatus.GRANTED, B, B),  # adjacent: one copy with the first
            Allocation(AllocStatus.EXISTS),  # skipped
            Allocation(AllocStatus.GRANTED, 8 * B, B),
            Allocation(AllocStatus.GRANTED, 4 * B, B),  # not adjacent to the previous one
        ]
        assert write_blocks(pool, locs, rows) == 4 * B
        assert np.array_equal(pool[0 : 2 * B], rows[0:2].reshape(-1))
        assert np.array_equal(pool[8 * B : 9 * B], rows[3]) and np.array_equal(pool[4 * B : 5 * B], rows[4])
        assert not pool[2 * B : 4 * B].any() and not pool[5 * B : 8 * B].any() and not pool[9 * B :].any()
        out = np.zeros_like(rows)
        assert read_blocks(pool, locs, out) == 4 * B
        assert np.array_equal(out[[0, 1, 3, 4]], rows[[0, 1, 3, 4]]) and not out[2].any()
        listed = [np.empty(B, dtype=np.uint8) for _ in range(2)]
        read_blocks(pool, [Location(8 * B, B), Location(0, B)], listed)
        assert np.array_equal(listed[0], rows[3]) and np.array_equal(listed[1], rows[0])
        wide = rows[:2].view(np.uint16) if B % 2 == 0 else None  # rows of another dtype, same bytes
        if wide is not None:
            again = np.zeros_like(pool)
            write_blocks(again, locs[:2], wide)
            assert np.array_equal(again[: 2 * B], rows[:2].reshape(-1))
        with pytest.raises(ValueError):
            write_blocks(pool, [Location(64 * B - 10, B)], rows[:1])
        with pytest.raises(ValueError):
            write_blocks(pool, [Location(0, B // 2)], rows[:1])
    finally:
        page_copy.use(was)


def test_backoff_grows_jittered_and_caps():
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(0))
    delays = [b.next() for _ in range(10)]
    assert all(0.05 <= d <= 1.0 for d in delays)
    assert max(delays[:2]) <= 0.2 and min(delays[5:]) >= 0.5
    b.reset()
    assert b.next() <= 0.1


def test_async_calls_end_at_their_deadline_and_leak_nothing(inproc_server):
    async def scenario():
        # Queries to the engine (the read lane answers them without the engine: server/read_lane/tests).
        async with AsyncPegaClient(inproc_server.address, timeout_s=5.0, read_lane=False) as c:
            inst = await c.register_instance(LAYOUT)
            lock = inproc_server.engine._lock
            lock.acquire()  # the server cannot serve anything that needs the engine
            try:
                with pytest.raises(errors.DeadlineExceeded):
                    await c.allocate(inst, [b"late"], timeout_s=0.3)
                with pytest.raises(errors.DeadlineExceeded):
                    await c.query_prefix(inst, [b"late"], lease=True, timeout_s=0.3)
            finally:
                lock.release()
            assert c.connected
            deadline = time.monotonic() + 60
            while True:
                stats = await c.stats()
                if stats.writing_blocks == 0 and stats.live_leases == 0:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)

    asyncio.run(scenario())


def pool_mappings() -> int:
    """How many mappings of a pegaflow pool this process has (the in-process server's own is one)."""
    return sum("pegaflow-pool" in line for line in pathlib.Path("/proc/self/maps").read_text().splitlines())


def test_the_pool_is_mapped_on_first_use_not_at_connect(inproc_server):
    before = pool_mappings()
    with PegaClient(inproc_server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        c.query_prefix(inst, [b"lazy"])
        # Connected (the pool fd arrived, its connection is the session's liveness), nothing mapped:
        # a process that never copies, like vLLM's scheduler, never maps the pool.
        assert pool_mappings() == before
        assert roundtrip(c, inst, "lazy")
        assert pool_mappings() == before + 1
    assert pool_mappings() == before  # unmapped at close


def test_an_unmapped_client_still_ends_its_session_when_it_goes_away(inproc_server):
    with PegaClient(inproc_server.address, timeout_s=10.0) as watcher:
        c = PegaClient(inproc_server.address, timeout_s=10.0)
        c.connect()
        inst = c.register_instance(LAYOUT)
        c.allocate(inst, [b"unsealed"])
        assert watcher.stats().writing_blocks == 1
        before = inproc_server.engine.counters.sessions_disconnected
        c._conn.pool.release()  # what a process exit does to its pool connection
        wait_for(lambda: inproc_server.engine.counters.sessions_disconnected == before + 1)
        assert watcher.stats().writing_blocks == 0
        c.close()


def test_query_purpose_reaches_the_server(inproc_server):
    async def scenario():
        async with AsyncPegaClient(inproc_server.address, timeout_s=10.0) as c:
            inst = await c.register_instance(LAYOUT)
            await c.seal((await c.allocate(inst, [b"p1", b"p2"])).save_id)
            assert (await c.query_prefix(inst, [b"p1", b"p2", b"p3"])).num_hits == 2
            hit = await c.query_prefix(inst, [b"p1", b"p2"], lease=True, purpose=QueryPurpose.LOAD)
            await c.release(hit.lease_id)
            return await c.stats()

    stats = asyncio.run(scenario())
    assert (stats.hits, stats.misses, stats.lookup_queries, stats.load_queries) == (2, 1, 1, 1)
    with PegaClient(inproc_server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        c.query_prefix(inst, [b"p1", b"p2"], purpose=QueryPurpose.LOAD)
        with pytest.raises(ValueError):
            c.query_prefix(inst, [b"p1"], purpose=5)
        assert c.stats().load_queries == 2


def test_releases_sent_without_waiting_all_reach_the_server(inproc_server):
    """grpc cancels a call whose future is garbage-collected: a fire-and-forget release must keep it."""
    with PegaClient(inproc_server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        c.seal(c.allocate(inst, [b"ff"]).save_id)
        for _ in range(50):
            hit = c.query_prefix(inst, [b"ff"], lease=True)
            c.release(hit.lease_id, loaded_bytes=BLOCK, wait=False)
        wait_for(lambda: c.stats().live_leases == 0)
        assert c.stats().load_bytes == 50 * BLOCK  # every one arrived (none expired at its TTL)


def test_a_query_keeps_the_interpreter_lock_for_its_first_wait_unless_told_not_to(inproc_server, monkeypatch):
    """client/sync.py QUERY_HOLD_LOCK_S: every read-lane query waits held by default, the caller's
    hold_lock_s overrides it, and the module value is read at each call."""
    from pegaflow.client import sync
    from pegaflow.client.frame_link import FrameLink

    default = sync.QUERY_HOLD_LOCK_S
    assert default > 0
    seen: list[float] = []
    call = FrameLink.call

    def spy(self, frame, deadline, held_s=0.0):
        seen.append(held_s)
        return call(self, frame, deadline, held_s)

    monkeypatch.setattr(FrameLink, "call", spy)
    with PegaClient(inproc_server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        c.seal(c.allocate(inst, [b"h1", b"h2"]).save_id)
        assert c._conn.lane is not None
        assert c.query_prefix(inst, [b"h1", b"h2"]).num_hits == 2
        assert c.query_prefix(inst, [b"h1"], hold_lock_s=0.0).num_hits == 1
        monkeypatch.setattr(sync, "QUERY_HOLD_LOCK_S", 0.003)
        hit = c.query_prefix(inst, [b"h1", b"h2"], lease=True)
        c.release(hit.lease_id)
    assert seen[:3] == [default, 0.0, 0.003]
