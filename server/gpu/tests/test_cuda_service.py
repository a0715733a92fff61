"""GpuDataPath over a real KVEngine and a separate worker process (GPU only; skipped cleanly elsewhere).

Covers the engine side of the GPU path: allocate -> copy -> seal, dedup, query(lease) -> copy -> release,
MLA ranks sharing one stored copy, worker-session death, and bad requests.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.server.gpu import cuda_runtime

if not cuda_runtime.available():
    pytest.skip("needs CuPy and a CUDA GPU", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("the worker stand-in needs torch with CUDA", allow_module_level=True)

from pegaflow.server.config import ServerConfig  # noqa: E402
from pegaflow.server.engine import AllocStatus, KVEngine, QueryPurpose  # noqa: E402
from pegaflow.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound  # noqa: E402
from pegaflow.server.gpu.registration import DeviceRegistration  # noqa: E402
from pegaflow.server.gpu.service import GpuDataPath, GpuOptions  # noqa: E402
from pegaflow.server.gpu.tests.gpu_worker_support import Worker  # noqa: E402
from pegaflow.server.store.namespace import KvLayout  # noqa: E402


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module", params=["auto", "direct", "staged"])
def stack(request):
    engine = KVEngine(ServerConfig(pool_size_bytes=256 << 20, http_addr=None))
    gpu = GpuDataPath(engine, GpuOptions(copy_mode=request.param, slot_bytes=1 << 20, slots=2))
    try:
        yield engine, gpu
    finally:
        gpu.close()
        engine.close()


def _deadline(s: float = 30.0) -> float:
    return time.monotonic() + s


def _instance(engine, session, reg: DeviceRegistration, mla=False, rank=0, tp=1):
    bb = reg.validate()
    layout = KvLayout(
        model_id="m", block_bytes=bb, dtype="bf16", layout="gpu", tp_size=tp, tp_rank=rank, mla=mla
    )
    return engine.register_instance(session, layout).instance_id


def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _hashes(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


@pytest.mark.parametrize("name", ["kv_first", "cross_layer"])
def test_save_seals_exact_bytes_dedups_and_loads_back(worker, stack, name):
    engine, gpu = stack
    session = engine.open_session("worker").session_id
    reg = worker.regs[name]
    inst = _instance(engine, session, reg)
    rid = gpu.register(session, inst, reg)
    bb = reg.validate()
    hashes = _hashes(name, 10)
    ids = [5, 9, 1, 33, 2, 60, 7, 8, 11, 40]

    out = gpu.save(session, rid, hashes, ids, _deadline())
    assert out.written == 10 and out.statuses == [AllocStatus.GRANTED] * 10
    hit = engine.query_prefix(session, inst, hashes)
    assert hit.num_hits == 10
    pool = engine.pool_view()
    got = b"".join(pool[o : o + bb].tobytes() for o in hit.offsets)
    assert got == worker.ask("blocks", name, ids)

    again = gpu.save(session, rid, hashes, ids, _deadline())
    assert again.written == 0 and again.statuses == [AllocStatus.EXISTS] * 10

    targets = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    assert worker.ask("zero", name, targets) == "ok"
    loaded = gpu.load(session, rid, hashes + [b"missing"], targets + [22], _deadline())
    assert loaded.num_hits == 10
    assert worker.ask("blocks", name, targets) == worker.ask("blocks", name, ids)
    _eventually(lambda: engine.stats().pinned_blocks == 0)  # the load's lease is released (off its path)
    gpu.unregister(session, rid)
    engine.close_session(session)


def test_a_save_into_slots_another_model_held_seals_exactly_the_gpu_bytes(worker):
    """The GPU copy overwrites every byte of each block it is granted (engine.allocate_blocks
    whole_write=True): slots another namespace's blocks last held are not zeroed first, and what
    is sealed is exactly the worker's bytes, none of the old ones."""
    engine = KVEngine(ServerConfig(pool_size_bytes=64 << 20, http_addr=None, free_reserve_bytes=0))
    gpu = GpuDataPath(engine, GpuOptions(copy_mode="auto", slot_bytes=1 << 20, slots=2))
    try:
        session = engine.open_session("worker").session_id
        reg = worker.regs["kv_first"]
        bb = reg.validate()
        other = engine.register_instance(
            session, KvLayout(model_id="other", block_bytes=bb, dtype="bf16", layout="gpu")
        ).instance_id
        pool = engine.pool_view()
        for i in range((64 << 20) // bb):  # the whole pool: the other model's blocks, all 0xAB
            res = engine.allocate_blocks(session, other, [f"old-{i}".encode()])
            for loc in res.locations:
                if loc is not None:
                    pool[loc.offset : loc.offset + loc.length] = 0xAB
            if res.save_id:
                engine.seal_blocks(session, res.save_id)
        inst = _instance(engine, session, reg)
        rid = gpu.register(session, inst, reg)
        hashes, ids = _hashes("over-old", 10), [3, 8, 13, 21, 34, 55, 1, 2, 5, 44]
        evicted = engine.stats().evictions
        out = gpu.save(session, rid, hashes, ids, _deadline())
        assert out.written == 10 and engine.stats().evictions > evicted
        hit = engine.query_prefix(session, inst, hashes)
        assert hit.num_hits == 10
        got = b"".join(pool[o : o + bb].tobytes() for o in hit.offsets)
        assert got == worker.ask("blocks", "kv_first", ids)
        gpu.unregister(session, rid)
        engine.close_session(session)
    finally:
        gpu.close()
        engine.close()


def test_mla_ranks_share_one_stored_copy(worker, stack):
    engine, gpu = stack
    reg = worker.regs["mla"]
    bb = reg.validate()
    sessions = [engine.open_session(f"rank{r}").session_id for r in range(2)]
    insts = [_instance(engine, s, reg, mla=True, rank=r, tp=2) for r, s in enumerate(sessions)]
    # Both "ranks" register the same tensors: the IPC mappings are shared by handle.
    rids = [gpu.register(s, i, reg) for s, i in zip(sessions, insts, strict=True)]
    hashes = _hashes("mla", 6)
    used_before = engine.stats().pool_used_bytes
    first = gpu.save(sessions[0], rids[0], hashes, [0, 1, 2, 3, 4, 5], _deadline())
    second = gpu.save(sessions[1], rids[1], hashes, [0, 1, 2, 3, 4, 5], _deadline())
    assert first.written == 6 and second.written == 0
    assert set(second.statuses) == {AllocStatus.EXISTS}
    assert engine.stats().pool_used_bytes - used_before == 6 * bb
    assert worker.ask("zero", "mla", [50, 51, 52, 53, 54, 55]) == "ok"
    assert gpu.load(sessions[1], rids[1], hashes, [50, 51, 52, 53, 54, 55], _deadline()).num_hits == 6
    assert worker.ask("blocks", "mla", [50, 51, 52, 53, 54, 55]) == worker.ask(
        "blocks", "mla", [0, 1, 2, 3, 4, 5]
    )
    for s in sessions:
        engine.close_session(s)
        gpu.on_session_end(s)
    assert gpu.registrations() == 0


def test_session_end_drops_registrations(worker, stack):
    engine, gpu = stack
    session = engine.open_session("short-lived").session_id
    reg = worker.regs["blocks_first"]
    rid = gpu.register(session, _instance(engine, session, reg), reg)
    before = gpu.registrations()
    engine.close_session(session)
    gpu.on_session_end(session)
    assert gpu.registrations() == before - 1
    with pytest.raises(NotFound):
        gpu.save(session, rid, [b"x"], [0], _deadline())


def test_bad_requests_are_refused_and_leave_nothing_behind(worker, stack):
    engine, gpu = stack
    session = engine.open_session("bad").session_id
    reg = worker.regs["cross_layer"]
    inst = _instance(engine, session, reg)
    rid = gpu.register(session, inst, reg)
    with pytest.raises(InvalidArgument, match="GPU block ids"):
        gpu.save(session, rid, [b"a", b"b"], [1], _deadline())
    with pytest.raises(InvalidArgument, match="outside"):
        gpu.save(session, rid, [b"a"], [10_000], _deadline())
    with pytest.raises(NotFound):
        gpu.save(session, "g-unknown", [b"a"], [1], _deadline())
    other = engine.open_session("other").session_id
    with pytest.raises(NotFound):  # a registration is only usable by its own session
        gpu.save(other, rid, [b"a"], [1], _deadline())
    small = KvLayout(model_id="m2", block_bytes=reg.validate() // 2)
    inst_small = engine.register_instance(session, small).instance_id
    rid_small = gpu.register(session, inst_small, reg)
    with pytest.raises(InvalidArgument, match="byte blocks"):
        gpu.save(session, rid_small, [b"size"], [1], _deadline())
    bad_uuid = DeviceRegistration("00" * 16, reg.tensors, reg.segments, reg.num_blocks)
    with pytest.raises(FailedPrecondition, match="not visible"):
        gpu.register(session, inst, bad_uuid)
    bad_layout = DeviceRegistration(reg.device_uuid, reg.tensors, reg.segments, reg.num_blocks + 1)
    with pytest.raises(InvalidArgument):
        gpu.register(session, inst, bad_layout)
    with pytest.raises(DeadlineExceeded):
        gpu.save(session, rid, _hashes("late", 4), [1, 2, 3, 4], time.monotonic() + 1e-4)
    _eventually(lambda: engine.stats().writing_blocks == 0 and engine.stats().pinned_blocks == 0)
    assert engine.query_prefix(session, inst, _hashes("late", 4)).num_hits == 0
    engine.close_session(session)
    engine.close_session(other)
    gpu.on_session_end(session)


def test_pool_is_registered_once_for_dma(stack):
    _, gpu = stack
    rt = cuda_runtime.runtime()
    attrs = rt.pointerGetAttributes(gpu._pinned.host_addr)
    assert attrs.type == 1  # cudaMemoryTypeHost: pinned (registered) host memory
    assert np.uint64(attrs.devicePointer) == np.uint64(gpu._pinned.device_addr)


def test_chunked_save_and_load_keep_prefix_semantics(worker, stack):
    """40 blocks span two chunks (32 + 8); a load stops at the first unknown hash, across chunks."""
    engine, gpu = stack
    session = engine.open_session("chunks").session_id
    reg = worker.regs["cross_layer"]
    inst = _instance(engine, session, reg)
    rid = gpu.register(session, inst, reg)
    hashes = _hashes("chunked", 40)
    ids = list(range(40))
    assert gpu.save(session, rid, hashes, ids, _deadline()).written == 40
    assert engine.query_prefix(session, inst, hashes).num_hits == 40
    want = worker.ask("blocks", "cross_layer", ids[:35])  # before the load: targets overlap the sources
    holed = hashes[:35] + [b"not-stored"] + hashes[36:]
    targets = list(range(20, 60))
    assert worker.ask("zero", "cross_layer", targets) == "ok"
    assert gpu.load(session, rid, holed, targets, _deadline()).num_hits == 35
    assert worker.ask("blocks", "cross_layer", targets[:35]) == want
    _eventually(lambda: engine.stats().pinned_blocks == 0)
    gpu.unregister(session, rid)
    engine.close_session(session)


def test_a_chunked_load_counts_one_request_and_a_load_purpose_none(worker, stack):
    """(server follow-up) The chunks' queries are accounted as one query of the whole request."""
    engine, gpu = stack
    session = engine.open_session("counting").session_id
    reg = worker.regs["kv_first"]
    inst = _instance(engine, session, reg)
    rid = gpu.register(session, inst, reg)
    hashes = _hashes("counted", 20)  # chunks of 8 + 12
    assert gpu.save(session, rid, hashes, list(range(20)), _deadline()).written == 20
    before = engine.stats()
    targets = list(range(30, 51))
    assert gpu.load(session, rid, hashes + [b"absent"], targets, _deadline()).num_hits == 20
    _eventually(lambda: engine.stats().lookup_queries == before.lookup_queries + 1)  # off the critical path
    after = engine.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (20, 1)
    load = gpu.load(session, rid, hashes, targets[:20], _deadline(), QueryPurpose.LOAD)
    assert load.num_hits == 20
    _eventually(lambda: engine.stats().load_queries == before.load_queries + 1)
    assert engine.stats().hits == after.hits and engine.stats().lookup_queries == after.lookup_queries
    gpu.unregister(session, rid)
    engine.close_session(session)


def test_a_chunked_save_leaves_its_chain_head_most_recent(worker, stack):
    """(server follow-up) Chunks are sealed head first; the chain is restated after the last one."""
    engine, gpu = stack
    session = engine.open_session("chain").session_id
    reg = worker.regs["kv_first"]
    inst = _instance(engine, session, reg)
    rid = gpu.register(session, inst, reg)
    hashes = _hashes("chain", 20)
    assert gpu.save(session, rid, hashes, list(range(20)), _deadline()).written == 20
    ns = engine._registry.instances[inst].namespace.index
    keys = [(ns, h) for h in hashes]
    wanted = set(keys)

    def order() -> list:  # the chain's keys, coldest first (LRU, the default policy)
        return [k for k in list(engine.policy._recency) if k in wanted]

    _eventually(lambda: order() == keys[::-1])
    gpu.unregister(session, rid)
    engine.close_session(session)
