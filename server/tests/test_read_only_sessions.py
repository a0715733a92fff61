"""A reader's session (vLLM's kv_consumer) maps the pool read-only: it can load every block it may
read, and cannot write a byte of the pool or save (review finding F2, issue 12 item 2)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from pegaflow.client import KvLayout, PegaClient, errors, read_blocks, write_blocks
from pegaflow.server.testing import ServerProcess

LAYOUT = dict(
    model_id="reader", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=64 * 1024, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("ro"), pool_size="32mb").start()
    yield srv
    srv.stop()


def test_a_reader_loads_what_a_writer_saved_but_cannot_write_or_save(server):
    hashes = [f"ro-{i}".encode() for i in range(4)]
    rows = [np.full(64 * 1024, i + 1, dtype=np.uint8) for i in range(4)]
    with PegaClient(server.addr, timeout_s=10) as writer:
        inst = writer.register_instance(KvLayout(**LAYOUT))
        batch = writer.allocate(inst, hashes)
        write_blocks(writer.pool_view(batch.epoch), batch.allocations, rows)
        writer.seal(batch.save_id)
    with PegaClient(server.addr, timeout_s=10, read_only=True) as reader:
        # the fd it was passed (not mapped yet: the client maps on first use) cannot be mapped writable
        fd = reader._conn.pool._fd
        assert fd >= 0
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        inst = reader.register_instance(KvLayout(**LAYOUT))
        hit = reader.query_prefix(inst, hashes, lease=True)
        view = reader.pool_view(hit.epoch)
        out = np.empty((4, 64 * 1024), dtype=np.uint8)
        read_blocks(view, hit.locations, out)
        assert all(np.array_equal(out[i], rows[i]) for i in range(4))
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[hit.locations[0].offset] = 0  # the mapping itself is read-only
        with pytest.raises(errors.PegaflowError):
            reader.allocate(inst, [b"never"])
        reader.release(hit.lease_id)
