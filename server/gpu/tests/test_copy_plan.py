"""Copy planning on CPU: a simulated address space stands in for GPU and host memory.

Every test builds KV tensors in one of vLLM's layouts as numpy views over one
byte array, runs a plan by copying each piece, and compares against the bytes
picked out by ordinary numpy indexing of those views.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.server.gpu.copy_plan import (
    FIRST_CHUNK_BYTES,
    LARGEST_CHUNK_BYTES,
    LAST_CHUNK_BYTES,
    BlockLayout,
    LayoutError,
    Segment,
    check_request,
    expand_items,
    item_table,
    pipeline_chunks,
    plan_staged,
    segments_from_strides,
)


class AddressSpace:
    """One flat byte array; 'addresses' are offsets into it (0 is never handed out)."""

    def __init__(self, size: int):
        self.mem = np.zeros(size, dtype=np.uint8)
        self.top = 4096

    def alloc(self, nbytes: int, align: int = 256) -> int:
        addr = -(-self.top // align) * align
        self.top = addr + nbytes
        assert self.top <= self.mem.size, "address space too small for the test"
        return addr

    def view(self, addr: int, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.mem[addr : addr + n].view(dtype).reshape(shape)

    def run(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
            self.mem[d : d + n] = self.mem[s : s + n]

    def run_plan(self, plan, to_host: bool) -> None:
        src, dst = (plan.device, plan.host) if to_host else (plan.host, plan.device)
        self.run(src, dst, plan.nbytes)


def _rand_fill(arr: np.ndarray, rng: np.random.Generator) -> None:
    flat = arr.reshape(-1).view(np.uint8)
    flat[:] = rng.integers(0, 256, size=flat.size, dtype=np.uint8)


def _make_layout(space, kind, layers, nblocks, bs, heads, dim, rng, dtype=np.uint16):
    """KV tensors in a vLLM layout; returns (layout, tensor addrs, function block -> expected bytes)."""
    itemsize = np.dtype(dtype).itemsize
    if kind == "kv_first":  # [2, NB, BS, H, D] per layer (FlashAttention)
        shape = (2, nblocks, bs, heads, dim)
        block_dim = 1
    elif kind == "blocks_first":  # [NB, 2, BS, H, D] per layer (FlashInfer)
        shape = (nblocks, 2, bs, heads, dim)
        block_dim = 0
    elif kind == "cross_layer":  # one [NB, L, 2, BS, H, D]
        shape = (nblocks, layers, 2, bs, heads, dim)
        block_dim = 0
    elif kind == "mla":  # [NB, BS, latent] per layer
        shape = (nblocks, bs, heads * dim)
        block_dim = 0
    else:
        raise AssertionError(kind)
    count = 1 if kind == "cross_layer" else layers
    tensors, addrs, segments, sizes = [], [], [], []
    for t in range(count):
        addr = space.alloc(int(np.prod(shape)) * itemsize)
        arr = space.view(addr, shape, dtype)
        _rand_fill(arr, rng)
        strides = [s // itemsize for s in arr.strides]
        segments += segments_from_strides(t, arr.shape, strides, itemsize, block_dim)
        tensors.append(arr)
        addrs.append(addr)
        sizes.append(arr.nbytes)

    def expected(b: int) -> bytes:
        if kind == "kv_first":
            return b"".join(t[k, b].tobytes() for t in tensors for k in range(2))
        if kind == "cross_layer":
            return tensors[0][b].tobytes()
        return b"".join(t[b].tobytes() for t in tensors)

    return BlockLayout(segments, sizes, nblocks), addrs, tensors, expected


@pytest.mark.parametrize("kind", ["kv_first", "blocks_first", "cross_layer", "mla"])
@pytest.mark.parametrize("max_piece", [16, 48, 64 * 1024])
def test_save_then_load_moves_exactly_the_named_blocks(kind, max_piece):
    rng = np.random.default_rng(7)
    space = AddressSpace(8 << 20)
    layers, nblocks = 3, 11
    layout, addrs, tensors, expected = _make_layout(space, kind, layers, nblocks, 4, 2, 8, rng)
    pool_size = layout.block_bytes * 16
    pool = space.alloc(pool_size)
    ids = [9, 0, 4, 5, 10]
    offs = [layout.block_bytes * i for i in (3, 7, 0, 1, 12)]
    table = item_table(layout, addrs, max_piece)
    plan = expand_items(table, pool, *check_request(layout, pool_size, ids, offs))
    assert plan.total_bytes == len(ids) * layout.block_bytes
    assert int(plan.nbytes.max()) <= max_piece
    space.run_plan(plan, to_host=True)
    for b, off in zip(ids, offs, strict=True):
        assert space.mem[pool + off : pool + off + layout.block_bytes].tobytes() == expected(b)

    # Load the stored blocks back into other GPU blocks; nothing else may change.
    before = [t.copy() for t in tensors]
    dst_ids = [1, 2, 3, 6, 8]
    plan = expand_items(table, pool, *check_request(layout, pool_size, dst_ids, offs))
    space.run_plan(plan, to_host=False)
    for src_b, dst_b in zip(ids, dst_ids, strict=True):
        assert expected(dst_b) == b"".join(_block_bytes_from(before, kind, src_b))
    untouched = sorted(set(range(nblocks)) - set(dst_ids))
    for t_now, t_before in zip(tensors, before, strict=True):
        axis = 1 if kind == "kv_first" else 0
        np.testing.assert_array_equal(
            np.take(t_now, untouched, axis=axis), np.take(t_before, untouched, axis=axis)
        )


def _block_bytes_from(tensors, kind, b):
    if kind == "kv_first":
        return [t[k, b].tobytes() for t in tensors for k in range(2)]
    return [t[b].tobytes() for t in tensors]


def test_three_mha_layouts_store_identical_bytes():
    """Per-layer KV-first, blocks-first and cross-layer hold the same logical KV -> same stored block."""
    rng = np.random.default_rng(3)
    layers, nblocks, bs, heads, dim = 4, 6, 4, 2, 8
    logical = rng.integers(0, 1 << 16, size=(layers, 2, nblocks, bs, heads, dim), dtype=np.uint16)
    space = AddressSpace(4 << 20)
    stored = {}
    for kind in ("kv_first", "blocks_first", "cross_layer"):
        layout, addrs, tensors, _ = _make_layout(space, kind, layers, nblocks, bs, heads, dim, rng)
        for layer in range(layers):
            if kind == "kv_first":
                tensors[layer][:] = logical[layer]
            elif kind == "blocks_first":
                tensors[layer][:] = logical[layer].transpose(1, 0, 2, 3, 4)
            else:
                tensors[0][:, layer] = logical[layer].transpose(1, 0, 2, 3, 4)
        pool = space.alloc(layout.block_bytes)
        plan = expand_items(item_table(layout, addrs), pool, [4], [0])
        space.run_plan(plan, to_host=True)
        stored[kind] = space.mem[pool : pool + layout.block_bytes].tobytes()
    assert stored["kv_first"] == stored["blocks_first"] == stored["cross_layer"]


def test_segments_follow_physical_order_of_a_permuted_view():
    """vLLM may permute a contiguous allocation (e.g. HND): the block's bytes are still one range."""
    physical = np.zeros((5, 2, 3, 4, 8), dtype=np.uint16)  # [NB, 2, H, BS, D] in memory
    logical = physical.transpose(0, 1, 3, 2, 4)  # seen as [NB, 2, BS, H, D]
    segs = segments_from_strides(0, logical.shape, [s // 2 for s in logical.strides], 2, 0)
    assert segs == [Segment(tensor=0, offset=0, stride=2 * 3 * 4 * 8 * 2, nbytes=2 * 3 * 4 * 8 * 2)]


def test_kv_first_gives_two_segments_per_layer():
    t = np.zeros((2, 10, 16, 8, 128), dtype=np.uint16)
    segs = segments_from_strides(3, t.shape, [s // 2 for s in t.strides], 2, 1)
    chunk = 16 * 8 * 128 * 2
    assert segs == [Segment(3, 0, chunk, chunk), Segment(3, 10 * chunk, chunk, chunk)]


def test_non_contiguous_block_bytes_are_refused():
    base = np.zeros((10, 16, 8, 256), dtype=np.uint16)
    sliced = base[:, :, :, :128]  # every row has a hole after it
    with pytest.raises(LayoutError, match="not contiguous"):
        segments_from_strides(0, sliced.shape, [s // 2 for s in sliced.strides], 2, 0)


@pytest.mark.parametrize(
    "segments,sizes,blocks,match",
    [
        ([Segment(0, 0, 64, 64)], [64 * 9], 10, "reaches byte"),
        ([Segment(1, 0, 64, 64)], [6400], 10, "names tensor 1"),
        ([Segment(0, 0, 32, 64)], [6400], 10, "overlap"),
        ([], [6400], 10, "at least one segment"),
        ([Segment(0, 0, 64, 64)], [6400], 0, "num_blocks"),
    ],
)
def test_bad_layouts_are_refused(segments, sizes, blocks, match):
    with pytest.raises(LayoutError, match=match):
        BlockLayout(segments, sizes, blocks)


def test_requests_outside_registered_memory_are_refused():
    layout = BlockLayout([Segment(0, 0, 64, 64)], [640], 10)
    with pytest.raises(ValueError, match="outside the 10 registered blocks"):
        check_request(layout, 1024, [10], [0])
    with pytest.raises(ValueError, match="outside the 1024-byte region"):
        check_request(layout, 1024, [1], [1024 - 32])
    with pytest.raises(ValueError, match="must not be negative"):
        check_request(layout, 1024, [-1], [0])
    with pytest.raises(ValueError, match="2 block ids but 1 host offsets"):
        check_request(layout, 1024, [1, 2], [0])
    with pytest.raises(ValueError, match="must be integers"):
        check_request(layout, 1024, [1.5], [0])
    ids, offs = check_request(layout, 1024, [], [])
    assert ids.size == 0 and offs.size == 0
    with pytest.raises(ValueError, match="tensor addresses"):
        item_table(layout, [4096, 8192])
    with pytest.raises(ValueError, match="multiple of 16"):
        item_table(layout, [4096], max_piece_bytes=40)


def test_item_table_cuts_segments_into_aligned_pieces():
    layout = BlockLayout([Segment(0, 0, 1000, 160), Segment(0, 160, 1000, 48)], [10_000], 10)
    table = item_table(layout, [1 << 20], max_piece_bytes=64)
    assert table.nbytes.tolist() == [64, 64, 32, 48]
    assert table.block_offset.tolist() == [0, 64, 128, 160]
    assert table.device_base.tolist() == [(1 << 20) + o for o in (0, 64, 128, 160)]
    assert table.stride.tolist() == [1000] * 4
    assert table.packed().shape == (4, 4)


def test_kernel_arithmetic_matches_the_segments():
    layout = BlockLayout([Segment(0, 0, 64, 64)], [640], 10)
    plan = expand_items(item_table(layout, [4096]), 65536, [2], [128])
    assert (plan.device.tolist(), plan.host.tolist(), plan.nbytes.tolist()) == (
        [4096 + 128],
        [65536 + 128],
        [64],
    )


@given(
    kind=st.sampled_from(["kv_first", "blocks_first", "cross_layer", "mla"]),
    layers=st.integers(1, 4),
    nblocks=st.integers(1, 9),
    bs=st.integers(1, 4),
    heads=st.integers(1, 3),
    dim=st.sampled_from([8, 16]),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_any_layout_round_trips(kind, layers, nblocks, bs, heads, dim, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    space = AddressSpace(4 << 20)
    layout, addrs, _tensors, expected = _make_layout(space, kind, layers, nblocks, bs, heads, dim, rng)
    ids = data.draw(st.lists(st.integers(0, nblocks - 1), min_size=1, max_size=nblocks, unique=True))
    slots = data.draw(st.permutations(range(len(ids) + 3)))[: len(ids)]
    pool_size = layout.block_bytes * (len(ids) + 3)
    pool = space.alloc(pool_size)
    offs = [s * layout.block_bytes for s in slots]
    cap = data.draw(st.sampled_from([16, 64, 4096]))
    plan = expand_items(item_table(layout, addrs, cap), pool, *check_request(layout, pool_size, ids, offs))
    space.run_plan(plan, to_host=True)
    for b, off in zip(ids, offs, strict=True):
        assert space.mem[pool + off : pool + off + layout.block_bytes].tobytes() == expected(b)


@pytest.mark.parametrize("kind", ["kv_first", "cross_layer", "mla"])
def test_staged_plan_moves_the_same_bytes_as_the_direct_copy(kind):
    """Gather each group into its slot (kernel), then the runs to the pool (copy engine)."""
    rng = np.random.default_rng(11)
    space = AddressSpace(16 << 20)
    layout, addrs, _tensors, expected = _make_layout(space, kind, 3, 20, 4, 2, 8, rng)
    table = item_table(layout, addrs, 64)
    pool_size = layout.block_bytes * 32
    pool = space.alloc(pool_size)
    slot_bytes = layout.block_bytes * 3 + 100  # 3 whole blocks per slot
    slots = [space.alloc(slot_bytes) for _ in range(2)]
    ids = np.array([3, 17, 0, 8, 9, 12, 19, 1])
    # Pool slots partly adjacent (4,5,6 and 20,21) so runs merge; request order differs from pool order.
    offs = np.array([20, 4, 6, 5, 21, 9, 30, 11]) * layout.block_bytes
    plan = plan_staged(offs, layout.block_bytes, slot_bytes)
    assert plan.groups == 3
    # Pool order: 4,5,6 | 9,11,20 | 21,30 -> runs [3 blocks], [1,1,1], [1,1]
    assert np.diff(plan.run_starts).tolist() == [1, 3, 2]
    assert plan.run_bytes.tolist() == [3 * layout.block_bytes] + [layout.block_bytes] * 5
    for g in range(plan.groups):
        members = plan.order[plan.starts[g] : plan.starts[g + 1]]
        slot = slots[g % 2]
        gather = expand_items(
            table, slot, ids[members], plan.slot_offset[plan.starts[g] : plan.starts[g + 1]]
        )
        space.run_plan(gather, to_host=True)
        r = slice(plan.run_starts[g], plan.run_starts[g + 1])
        space.run(
            plan.run_slot_offset[r] + np.uint64(slot), plan.run_host[r] + np.uint64(pool), plan.run_bytes[r]
        )
    for b, off in zip(ids.tolist(), offs.tolist(), strict=True):
        assert space.mem[pool + off : pool + off + layout.block_bytes].tobytes() == expected(b)


@given(
    slots=st.lists(st.integers(0, 200), min_size=1, max_size=60, unique=True),
    per_group=st.integers(1, 7),
)
@settings(max_examples=200, deadline=None)
def test_staged_runs_cover_each_block_once_and_never_cross_a_slot(slots, per_group):
    bb = 48
    offs = np.array(slots, dtype=np.uint64) * np.uint64(bb)
    plan = plan_staged(offs, bb, bb * per_group + 7)
    assert sorted(plan.order.tolist()) == list(range(len(slots)))
    assert np.all(np.diff(offs[plan.order].astype(np.int64)) > 0)  # pool order
    assert plan.starts[-1] == len(slots) and np.all(np.diff(plan.starts) <= per_group)
    covered = []
    for g in range(plan.groups):
        r = slice(plan.run_starts[g], plan.run_starts[g + 1])
        for h, o, n in zip(
            plan.run_host[r].tolist(),
            plan.run_slot_offset[r].tolist(),
            plan.run_bytes[r].tolist(),
            strict=True,
        ):
            assert o + n <= per_group * bb  # inside the slot
            covered += [(h + k, o + k) for k in range(0, n, bb)]
    want = [(int(offs[plan.order[i]]), int(plan.slot_offset[i])) for i in range(len(slots))]
    assert sorted(covered) == sorted(want)
    # Runs are maximal: two consecutive runs of a group are never adjacent in the pool.
    for g in range(plan.groups):
        r = slice(plan.run_starts[g], plan.run_starts[g + 1])
        ends = plan.run_host[r][:-1] + plan.run_bytes[r][:-1]
        assert not np.any(ends == plan.run_host[r][1:])


def test_staged_plan_refuses_blocks_larger_than_a_slot():
    with pytest.raises(ValueError, match="does not fit"):
        plan_staged(np.array([0], dtype=np.uint64), 1024, 512)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 5000),
    block_bytes=st.sampled_from([16 << 10, 1124352, 2359296, 64 << 20]),
    growth=st.integers(1, 4),
)
def test_pipeline_chunks_cover_the_request_ramp_up_and_end_small(n, block_bytes, growth):
    bounds = pipeline_chunks(n, block_bytes, growth=growth)
    sizes = [hi - lo for lo, hi in bounds]
    assert sum(sizes) == n and all(s >= 1 for s in sizes)
    assert [lo for lo, _ in bounds] == [0, *(hi for _, hi in bounds[:-1])][: len(bounds)]  # in order
    first = max(1, FIRST_CHUNK_BYTES // block_bytes)
    last = max(1, LAST_CHUNK_BYTES // block_bytes)
    largest = max(1, LARGEST_CHUNK_BYTES // block_bytes)
    if sizes:
        assert sizes[0] <= max(first + first // 2, 1)
        assert max(sizes) <= max(largest + largest // 2, first + first // 2)
    if len(sizes) > 1:
        assert sizes[-1] <= max(last, first + first // 2)
        # Ramp-up: each chunk of the first half at most `growth` (x1.5 for the merged rest) the one before.
        for a, b in zip(sizes, sizes[1 : len(sizes) // 2], strict=False):
            assert b <= max(growth * a + (growth * a) // 2, 1)


def test_pipeline_chunks_of_the_benchmark_request():
    """256 blocks of 2.25 MiB (Qwen3-8B): a 14-block (32 MiB) start, doubling, then halving down to 7;
    with the 8 MiB start of before 2026-12-06: 3, 6, 12, ..."""
    sizes = [hi - lo for lo, hi in pipeline_chunks(256, 2359296)]
    assert sizes == [14, 28, 56, 109, 28, 14, 7]
    sizes = [hi - lo for lo, hi in pipeline_chunks(256, 2359296, 8 << 20)]
    assert sizes[:5] == [3, 6, 12, 24, 48] and sizes[-4:] == [56, 28, 14, 7] and sum(sizes) == 256
    assert pipeline_chunks(0, 4096) == []
    with pytest.raises(ValueError):
        pipeline_chunks(4, 0)


def test_gpu_options_start_requests_with_32_mib_and_refuse_empty_chunks():
    """GpuOptions carries how a request is cut (bench variants ramp8/16/32 set it); 0 is refused."""
    from pegaflow.server.gpu.service import GpuOptions

    assert GpuOptions().first_chunk_bytes == FIRST_CHUNK_BYTES == 32 << 20
    for bad in (dict(first_chunk_bytes=0), dict(last_chunk_bytes=-1)):
        with pytest.raises(ValueError):
            GpuOptions(**bad)
