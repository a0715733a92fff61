"""client/save_pipeline.py and the calls it is made of (PegaClient.allocate_async / seal_async,
FrameLink.start / finish), against a real server over its local RPC socket and over gRPC."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.client import KvLayout, PegaClient, errors, read_blocks, write_blocks
from pegaflow.client.save_pipeline import save_batches
from pegaflow.server.testing import wait_for

BLOCK = 64 * 1024
LAYOUT = KvLayout(model_id="m", block_bytes=BLOCK, dtype="bfloat16", block_tokens=16, num_layers=2)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(inproc_server):
    return inproc_server


def chain(tag: str, chunks: int, per_chunk: int) -> list[list[bytes]]:
    return [[f"{tag}-{i}-{j}".encode() for j in range(per_chunk)] for i in range(chunks)]


def data_for(chunks: list[list[bytes]]) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, size=(len(c), BLOCK), dtype=np.uint8) for c in chunks]


def idle(c: PegaClient) -> bool:
    s = c.stats()
    return s.writing_blocks == 0 and s.open_saves == 0


@pytest.mark.parametrize("local_rpc", [True, False], ids=["local-socket", "grpc"])
def test_a_pipelined_save_stores_every_batch_and_overlaps_the_next_allocation(server, local_rpc):
    with PegaClient(server.address, timeout_s=10.0, local_rpc=local_rpc) as c:
        inst = c.register_instance(LAYOUT)
        chunks = chain("p", 4, 8)
        data = data_for(chunks)
        writing_seen = []

        def write(i, batch):
            if i + 1 < len(chunks):
                # The next batch's allocation is granted while this one is still being written.
                wait_for(lambda: c.stats().writing_blocks >= 16, timeout_s=10, what="the allocation ahead")
            writing_seen.append(c.stats().writing_blocks)
            write_blocks(c.pool_view(batch.epoch), batch.allocations, data[i])
            return ()

        batches, sealed = save_batches(c, inst, chunks, write)
        assert sealed == 32 and len(batches) == 4
        assert all(a.granted for b in batches for a in b.allocations)
        hashes = [h for chunk in chunks for h in chunk]
        hit = c.query_prefix(inst, hashes, lease=True)
        assert hit.num_hits == 32
        out = np.empty((32, BLOCK), dtype=np.uint8)
        read_blocks(c.pool_view(hit.epoch), hit.locations, out)
        c.release(hit.lease_id)
        assert np.array_equal(out, np.concatenate(data))
        assert idle(c)
        if local_rpc:
            counts = c._conn.local.call_counts()
            assert counts["AllocateBlocks"] == 4 and counts["SealBlocks"] == 4


def test_blocks_already_stored_are_not_written_again(server):
    with PegaClient(server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        chunks = chain("d", 2, 4)
        data = data_for(chunks)

        def write(i, batch):
            write_blocks(c.pool_view(batch.epoch), batch.allocations, data[i])
            return ()

        assert save_batches(c, inst, chunks, write)[1] == 8
        written = []
        batches, sealed = save_batches(c, inst, chunks, lambda i, b: written.append(i) or ())
        assert written == [] and sealed == 0 and not any(a.granted for b in batches for a in b.allocations)


def test_a_failed_copy_leaves_nothing_open_and_keeps_what_was_sealed(server):
    with PegaClient(server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        chunks = chain("f", 3, 8)
        data = data_for(chunks)

        def write(i, batch):
            if i == 1:
                raise OSError("copy failed")
            write_blocks(c.pool_view(batch.epoch), batch.allocations, data[i])
            return ()

        with pytest.raises(OSError, match="copy failed"):
            save_batches(c, inst, chunks, write)
        # Batch 0's seal was sent before batch 1 failed; batch 1 and the allocation ahead (batch 2)
        # are aborted, so nothing stays allocated.
        wait_for(lambda: idle(c), timeout_s=10)
        hashes = [h for chunk in chunks for h in chunk]
        assert c.query_prefix(inst, hashes).num_hits == 8
        assert c.stats().resident_blocks == 8


def test_a_pipelined_save_ends_at_its_deadline_and_leaks_nothing(server):
    with PegaClient(server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        with server.engine._lock:  # the server cannot allocate
            with pytest.raises(errors.DeadlineExceeded):
                save_batches(c, inst, chain("t", 2, 4), lambda i, b: (), timeout_s=0.3)
        assert c.connected
        wait_for(lambda: idle(c), timeout_s=30)


def test_calls_started_together_are_answered_in_any_order(server):
    with PegaClient(server.address, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        first = c.allocate_async(inst, [b"a0", b"a1"])
        second = c.allocate_async(inst, [b"b0"])
        b2, b1 = second.result(), first.result()
        assert [len(b1.allocations), len(b2.allocations)] == [2, 1]
        assert b1.save_id != b2.save_id
        with pytest.raises(RuntimeError):
            first.result()
        assert c.seal_async(b2.save_id).result() == 1
        c.abort(b1.save_id)
        assert idle(c)
        # Each call out at once had a connection of its own; both went back to the idle pool.
        assert len(c._conn.local._link._idle) >= 2


def test_a_server_that_goes_away_mid_save_ends_it_with_server_unavailable(server):
    with PegaClient(server.address, timeout_s=5.0) as c:
        inst = c.register_instance(LAYOUT)

        def write(i, batch):
            if i == 1:
                server.stop()  # gone while the stream is half written
            return ()

        t0 = time.monotonic()
        with pytest.raises(errors.ServerUnavailable):
            save_batches(c, inst, chain("gone", 4, 4), write)
        assert time.monotonic() - t0 < 5.0  # raised, not left to the deadline
