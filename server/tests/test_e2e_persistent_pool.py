"""A persistent pool end to end: a real server process on a tmpfs pool file is SIGKILLed, and the
next one re-adopts the sealed blocks (checksums verified) and serves them from DRAM at once; bytes
changed under it are a miss, never wrong bytes (issue 12, item 10)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest

from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.store.namespace import KvLayout as EngineLayout
from pegaflow.server.testing import ServerProcess, held_elsewhere, wait_for

pytestmark = pytest.mark.timeout(240)

BLOCK = 256 * 1024
LAYOUT = dict(
    model_id="persist-e2e", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=BLOCK, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
)  # fmt: skip


def pattern(tag: str, i: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng([sum(tag.encode()), i]).bytes(BLOCK), np.uint8)


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


@pytest.fixture
def pool_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs here")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="pegaflow-test-pool-") as d:
        yield d


def server(work, pool_dir) -> ServerProcess:
    return ServerProcess(
        work, pool_size="32mb", extra_args=["--pool-dir", pool_dir, "--persist-pool"]
    ).start()


def save(client, inst, tag, n) -> None:
    batch = client.allocate(inst, hashes(tag, n))
    write_blocks(client.pool_view(batch.epoch), batch.allocations, [pattern(tag, i) for i in range(n)])
    client.seal(batch.save_id)


def read_back(client, inst, tag, n) -> list[bool]:
    hit = client.query_prefix(inst, hashes(tag, n), lease=True)
    view = client.pool_view(hit.epoch)
    same = [
        bool(np.array_equal(view[loc.offset : loc.offset + BLOCK], pattern(tag, i)))
        for i, loc in enumerate(hit.locations)
    ]
    if hit.lease_id:
        client.release(hit.lease_id)
    return same


def test_a_killed_server_s_successor_serves_the_pool_s_blocks_again(tmp_path, pool_dir):
    srv = server(tmp_path / "a", pool_dir)
    try:
        with PegaClient(srv.addr, timeout_s=10) as c:
            inst = c.register_instance(KvLayout(**LAYOUT))
            save(c, inst, "kept", 16)
            save(c, inst, "scribbled", 4)
            wait_for(lambda: os.path.getsize(os.path.join(pool_dir, "pegaflow-pool.journal")) > 20 * 40, 20)
            scribble_at = c.query_prefix(inst, hashes("scribbled", 4)).locations[1].offset
        srv.kill()
    finally:
        srv.stop()
    with open(os.path.join(pool_dir, "pegaflow-pool.data"), "r+b") as f:  # bytes changed while it was down
        f.seek(scribble_at + 77)
        f.write(b"\xff\x00\xff")
    started = time.monotonic()
    again = server(tmp_path / "b", pool_dir)
    try:
        with PegaClient(again.addr, timeout_s=10) as c:
            stats = c.stats()
            assert stats.recovered_dram_blocks == 16 + 3
            inst = c.register_instance(KvLayout(**LAYOUT))
            same = read_back(c, inst, "kept", 16)
            first_hit_s = time.monotonic() - started
            assert same == [True] * 16  # served from DRAM at once, byte-identical
            assert read_back(c, inst, "scribbled", 4) == [True]  # the changed block ends the prefix
            assert first_hit_s < 30
    finally:
        again.stop()


def test_two_servers_never_share_one_persistent_pool(tmp_path, pool_dir):
    srv = server(tmp_path / "a", pool_dir)
    try:
        other = ServerProcess(
            tmp_path / "b", pool_size="32mb", extra_args=["--pool-dir", pool_dir, "--persist-pool"]
        )
        with pytest.raises(Exception) as info:
            other.start()
        assert "another pegaflow-server uses this pool" in str(info.value) + other.log_text()
    finally:
        srv.stop()


def test_a_reused_pool_file_whose_blocks_were_not_adopted_is_zeroed_before_a_grant(pool_dir):
    """F2 across a restart: slots that no adopted block holds still hold what the previous process wrote
    (here: its journal lost, so nothing is adopted); a writer that seals without writing must get zeros."""

    def engine() -> KVEngine:
        return KVEngine(
            ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, pool_dir=pool_dir, persist_pool=True)
        )

    first = engine()
    try:
        sid = first.open_session("t").session_id
        iid = first.register_instance(
            sid, EngineLayout(model_id="victim", block_bytes=BLOCK, dtype="bf16")
        ).instance_id
        res = first.allocate_blocks(sid, iid, hashes("secret", 8))
        view = first.pool_view()
        for loc in res.locations:
            view[loc.offset : loc.offset + loc.length] = 0xAB
        first.seal_blocks(sid, res.save_id)
        written = [loc.offset for loc in res.locations]
    finally:
        first.close()
    os.remove(os.path.join(pool_dir, "pegaflow-pool.journal"))  # nothing will be adopted
    second = engine()
    try:
        assert second.region.reused
        sid = second.open_session("t").session_id
        iid = second.register_instance(
            sid, EngineLayout(model_id="lazy", block_bytes=BLOCK, dtype="bf16")
        ).instance_id
        res = second.allocate_blocks(sid, iid, hashes("lazy", 8))
        view = second.pool_view()
        assert sorted(loc.offset for loc in res.locations) == sorted(written)  # the same slots again
        for loc in res.locations:
            assert not view[loc.offset : loc.offset + loc.length].any()
        second.seal_blocks(sid, res.save_id)
    finally:
        second.close()


def test_registering_an_instance_never_waits_past_its_deadline_for_the_layouts_file(pool_dir):
    """A new namespace's layouts are written before its blocks can be saved, unless another write
    (the reaper retrying a failing disk) holds the file past the call's deadline: then the reaper
    writes it at its next tick, and the call answers in time."""
    from pegaflow.server.store import persistence

    eng = KVEngine(
        ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, pool_dir=pool_dir, persist_pool=True)
    )
    try:
        sid = eng.open_session("t").session_id
        with held_elsewhere(eng._persist_lock, 3.0):  # another write of the file, to a slow disk
            started = time.monotonic()
            eng.register_instance(
                sid, EngineLayout(model_id="late", block_bytes=BLOCK, dtype="bf16"), deadline=started + 0.3
            )
            assert time.monotonic() - started < 1.5  # not the other write's 3 s
        eng.reap()  # (or the reaper thread's own tick already did)
        assert not eng._namespaces_unsaved
        (directory,) = eng._state_dirs
        assert any(
            layout.get("model_id") == "late" for layout in persistence.load_namespaces(directory).values()
        )
    finally:
        eng.close()


def test_saving_the_layouts_never_waits_past_its_deadline_for_the_engine_lock(pool_dir):
    """RegisterInstance writes the layouts off the engine lock, then takes it again to read them: a
    lock held past the call's deadline (a long engine call) leaves the write to the reaper's next
    tick instead of holding the call."""
    eng = KVEngine(
        ServerConfig(pool_size_bytes=16 * MIB, http_addr=None, pool_dir=pool_dir, persist_pool=True)
    )
    try:
        with held_elsewhere(eng._lock, 3.0):
            started = time.monotonic()
            eng._save_namespaces(deadline=started + 0.3)
            assert time.monotonic() - started < 1.5  # not the holder's 3 s
            assert eng._namespaces_unsaved  # the reaper writes them
        eng.reap()
        assert not eng._namespaces_unsaved
    finally:
        eng.close()
