"""The GPU path on a real GPU: IPC from a separate worker process, both copy modes, cancellation.

Skipped (cleanly, at collection) where CuPy, torch with CUDA or a GPU is missing -- as in CI.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import time

import numpy as np
import pytest

from pegaflow.server.gpu import cuda_runtime

if not cuda_runtime.available():
    pytest.skip("needs CuPy and a CUDA GPU", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("the worker stand-in needs torch with CUDA", allow_module_level=True)

from pegaflow.server.gpu.copy_plan import BlockLayout, Segment  # noqa: E402
from pegaflow.server.gpu.device_copier import CopyCancelled, DeviceCopier  # noqa: E402
from pegaflow.server.gpu.ipc import IpcMappings, PinnedHostRegion  # noqa: E402
from pegaflow.server.gpu.registration import layout_of  # noqa: E402
from pegaflow.server.gpu.tests.gpu_worker_support import Worker  # noqa: E402

POOL_BYTES = 64 << 20


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def pool():
    mm = mmap.mmap(-1, POOL_BYTES, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    view = np.frombuffer(mm, dtype=np.uint8)
    region = PinnedHostRegion(view.ctypes.data, POOL_BYTES)
    try:
        yield region, view
    finally:
        region.close()
        del view
        try:
            mm.close()
        except BufferError:  # pytest still holds the fixture's numpy view; the GC unmaps it
            pass


@pytest.fixture(scope="module")
def copier(pool):
    region, _ = pool
    c = DeviceCopier(0, region.device_addr, POOL_BYTES, slot_bytes=1 << 20, slots=2)
    try:
        yield c
    finally:
        c.close()


class Opened:
    """A registration opened in this process as the server would: IPC mappings + the copier's item table."""

    def __init__(self, reg, ipc: IpcMappings, copier: DeviceCopier, key: str):
        self.reg = reg
        self.layout = layout_of(reg)
        self.ordinal = ipc.device_ordinal(reg.device_uuid)
        self.addrs = [ipc.open(self.ordinal, t.ipc_handle) + t.offset for t in reg.tensors]
        self.key = key
        self._ipc = ipc
        self._copier = copier
        copier.add_layout(key, self.layout, self.addrs)

    def close(self):
        assert self._copier.retire(self.key, timeout_s=60)
        for t in self.reg.tensors:
            self._ipc.close(t.ipc_handle)


@pytest.mark.parametrize("name", ["kv_first", "blocks_first", "cross_layer", "mla"])
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_save_and_load_through_ipc_are_byte_exact(worker, pool, copier, name, mode):
    region, view = pool
    ipc = IpcMappings()
    opened = Opened(worker.regs[name], ipc, copier, f"{name}-{mode}")
    layout = opened.layout
    try:
        rng = np.random.default_rng(5)
        ids = rng.choice(layout.num_blocks, size=12, replace=False).tolist()
        slots = rng.choice(POOL_BYTES // layout.block_bytes, size=len(ids), replace=False)
        offs = (slots * layout.block_bytes).tolist()
        view[:] = 0xAB

        result = copier.submit(opened.key, True, ids, offs, mode=mode).result(timeout=60)
        assert result.nbytes == len(ids) * layout.block_bytes and result.mode == mode
        want = worker.ask("blocks", name, ids)
        got = b"".join(view[o : o + layout.block_bytes].tobytes() for o in offs)
        assert got == want

        # Load into other blocks after zeroing them; they must then hold the stored bytes.
        targets = [b for b in range(layout.num_blocks) if b not in ids][: len(ids)]
        assert worker.ask("zero", name, targets) == "ok"
        copier.submit(opened.key, False, targets, offs, mode=mode).result(timeout=60)
        assert worker.ask("blocks", name, targets) == want
    finally:
        opened.close()
    assert len(ipc) == 0


def test_auto_mode_stages_long_pool_runs_and_copies_short_ones_directly(worker, pool):
    region, view = pool
    ipc = IpcMappings()
    c = DeviceCopier(
        0, region.device_addr, POOL_BYTES, slot_bytes=1 << 20, slots=2, staged_min_run_bytes=256 << 10
    )
    try:
        opened = Opened(worker.regs["cross_layer"], ipc, c, "auto")
        bb = opened.layout.block_bytes
        ids = list(range(12))
        adjacent = [i * bb for i in range(12)]
        spread = [2 * i * bb for i in range(12)]
        assert c.submit("auto", True, ids, adjacent).result(timeout=60).mode == "staged"
        assert c.submit("auto", True, ids, spread).result(timeout=60).mode == "direct"
        want = worker.ask("blocks", "cross_layer", ids)
        assert b"".join(view[o : o + bb].tobytes() for o in spread) == want
        opened.close()
    finally:
        c.close()


def test_bad_requests_are_refused_before_any_copy(worker, copier):
    ipc = IpcMappings()
    opened = Opened(worker.regs["mla"], ipc, copier, "bad")
    try:
        with pytest.raises(ValueError, match="registered blocks"):
            copier.submit("bad", True, [opened.layout.num_blocks], [0])
        with pytest.raises(ValueError, match="byte region"):
            copier.submit("bad", True, [0], [POOL_BYTES - 16])
        with pytest.raises(ValueError, match="mode"):
            copier.submit("bad", True, [0], [0], mode="fast")
        with pytest.raises(CopyCancelled):
            copier.submit("never-registered", True, [0], [0])
        assert copier.pending("bad") == 0
    finally:
        opened.close()


def test_unaligned_pieces_fall_back_to_byte_copies(pool, copier):
    cupy = cuda_runtime.cupy_module()
    region, view = pool
    src = cupy.arange(4096, dtype=cupy.uint8)
    layout = BlockLayout([Segment(0, 3, 1001, 1001)], [4096], 2)  # block 1 starts at byte 1004
    copier.add_layout("odd", layout, [src.data.ptr])
    try:
        dst_off = 1000003
        view[dst_off - 1 : dst_off + 1002] = 0
        copier.submit("odd", True, [1], [dst_off], mode="direct").result(timeout=60)
        assert view[dst_off : dst_off + 1001].tolist() == [(1004 + i) % 256 for i in range(1001)]
        assert view[dst_off - 1] == 0 and view[dst_off + 1001] == 0
    finally:
        assert copier.retire("odd", timeout_s=60)


def test_retire_waits_for_copies_in_flight_and_refuses_new_ones(pool, copier):
    cupy = cuda_runtime.cupy_module()
    src = cupy.zeros(8 << 20, dtype=cupy.uint8)
    # One 8 MiB block copied 32 times per copy (256 MiB): 50 of them are launched far ahead of the GPU.
    copier.add_layout("victim", BlockLayout([Segment(0, 0, 0, 8 << 20)], [8 << 20], 1), [src.data.ptr])
    futs = [copier.submit("victim", True, [0] * 32, [0] * 32, mode="direct") for _ in range(50)]
    assert copier.retire("victim", timeout_s=60)
    assert copier.pending("victim") == 0
    assert all(f.result(timeout=60).nbytes == 256 << 20 for f in futs)
    with pytest.raises(CopyCancelled):
        copier.submit("victim", True, [0], [0])
    with pytest.raises(CopyCancelled):
        copier.start("victim", True, [0], [0])


def test_a_copy_abandoned_at_its_deadline_is_cleaned_up_only_after_the_gpu_is_done(pool, copier):
    cupy = cuda_runtime.cupy_module()
    src = cupy.zeros(8 << 20, dtype=cupy.uint8)
    copier.add_layout("late", BlockLayout([Segment(0, 0, 0, 8 << 20)], [8 << 20], 1), [src.data.ptr])
    try:
        copies = [copier.start("late", True, [0] * 64, [0] * 64, mode="direct") for _ in range(8)]  # 4 GiB
        last = copies[-1]
        assert not last.wait(time.monotonic() + 0.001)  # the deadline passes first: it still runs
        cleaned = concurrent.futures.Future()
        last.abandon(lambda error: cleaned.set_result((error, last.done)))
        for c in copies[:-1]:
            assert c.wait(time.monotonic() + 60)
            assert c.finish().mode == "direct"
        error, was_done = cleaned.result(timeout=60)
        assert error is None and was_done
        with pytest.raises(CopyCancelled, match="deadline"):
            copier.start("late", True, [0], [0], start_by=time.monotonic() - 1)
        assert copier.start("late", True, [], []) is None  # nothing to copy
    finally:
        assert copier.retire("late", timeout_s=60)
    assert copier.pending("late") == 0


def test_the_driver_calls_pass_their_self_test_here(copier):
    """On a working GPU the GIL-holding driver calls are the ones used (else the fallback was logged)."""
    assert copier.driver_calls


def test_worker_killed_with_copies_in_flight_leaves_the_server_working(pool, copier):
    region, view = pool
    w = Worker()
    ipc = IpcMappings()
    try:
        opened = Opened(w.regs["cross_layer"], ipc, copier, "dying")
        bb = opened.layout.block_bytes
        futs = [copier.submit("dying", True, list(range(8)), [i * bb for i in range(8)]) for _ in range(20)]
        w.kill()
        opened.close()  # retire (refuse new copies, wait for those in flight), then unmap
        for f in futs:
            f.result(timeout=60)  # launched before the death: they ran through the open mappings
        assert len(ipc) == 0
    finally:
        w.close()
    cupy = cuda_runtime.cupy_module()
    src = cupy.full(1 << 16, 7, dtype=cupy.uint8)
    copier.add_layout("after", BlockLayout([Segment(0, 0, 1 << 16, 1 << 16)], [1 << 16], 1), [src.data.ptr])
    try:
        copier.submit("after", True, [0], [0]).result(timeout=60)
        assert (view[: 1 << 16] == 7).all()
    finally:
        assert copier.retire("after", timeout_s=60)


def test_uuid_of_torch_device_is_known_to_the_server():
    from pegaflow.client.device import torch_device_uuid

    assert torch_device_uuid(0) in cuda_runtime.device_uuids()


def test_submit_returns_at_once_and_copies_complete_on_the_reaper(pool, copier):
    cupy = cuda_runtime.cupy_module()
    src = cupy.zeros(32 << 20, dtype=cupy.uint8)
    copier.add_layout("bg", BlockLayout([Segment(0, 0, 0, 32 << 20)], [32 << 20], 1), [src.data.ptr])
    try:
        futs = [copier.submit("bg", True, [0] * 16, [0] * 16) for _ in range(8)]  # 512 MiB each
        assert not all(f.done() for f in futs)
        done, _ = concurrent.futures.wait(futs, timeout=60)
        assert len(done) == 8 and all(f.exception() is None for f in futs)
    finally:
        assert copier.retire("bg", timeout_s=60)


def test_a_full_upload_ring_waits_by_the_start_deadline(pool, copier):
    """More launches queued than a lane has upload buffers (32): a start waits (polling) for the
    oldest buffer's upload by its start_by; one whose start_by passes first is CopyCancelled having
    enqueued nothing, and the lane goes on: every copy before and after it completes."""
    cupy = cuda_runtime.cupy_module()
    src = cupy.zeros(32 << 20, dtype=cupy.uint8)
    copier.add_layout("ring", BlockLayout([Segment(0, 0, 0, 32 << 20)], [32 << 20], 1), [src.data.ptr])
    ids = [0] * 64  # 2 GiB a copy, ~40 ms of GPU time: the GPU falls behind and starts 33-40 wait
    try:
        far = time.monotonic() + 120
        copies = [copier.start("ring", True, ids, ids, "direct", far) for _ in range(40)]
        # The next buffer's last upload runs once the copy the GPU has just begun ends (~40 ms).
        with pytest.raises(CopyCancelled, match="uploads"):
            copier.start("ring", True, ids, ids, "direct", time.monotonic() + 0.001)
        copies.append(copier.start("ring", True, ids, ids, "direct", far))
        for c in copies:
            assert c.wait(time.monotonic() + 60)
            assert c.finish().nbytes == 2 << 30
    finally:
        assert copier.retire("ring", timeout_s=60)
    assert copier.pending("ring") == 0
