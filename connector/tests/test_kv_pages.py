"""Whole-page copies between vLLM-shaped KV tensors and a byte pool."""

import numpy as np
import pytest
import torch

from pegaflow.common.native import page_copy
from pegaflow.connector.kv_pages import KvPages, LayoutMismatch, Run, copy_units, plan_runs

NUM_BLOCKS, HEADS, TOKENS, WIDTH, LAYERS = 16, 2, 8, 16, 3


def cpu_attn_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Layers as views into one int8 backing buffer, layer-major, like vLLM's CPU backend."""
    page = HEADS * TOKENS * WIDTH * 2  # bf16
    backing = torch.zeros(LAYERS * NUM_BLOCKS * page, dtype=torch.int8)
    caches = {}
    for i in range(LAYERS):
        chunk = backing[i * NUM_BLOCKS * page : (i + 1) * NUM_BLOCKS * page]
        caches[f"model.layers.{i}.self_attn.attn"] = chunk.view(torch.bfloat16).view(
            NUM_BLOCKS, HEADS, TOKENS, WIDTH
        )
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in caches.values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(torch.bfloat16))
    return caches


def pages_of(caches):
    return KvPages(caches, NUM_BLOCKS, list(caches))


def test_plan_runs_merges_only_where_both_sides_are_consecutive():
    bb = 100
    runs = plan_runs([4, 5, 6, 9, 10, 2], [0, 100, 200, 300, 500, 600], bb)
    assert runs == [Run(4, 0, 3), Run(9, 300, 1), Run(10, 500, 1), Run(2, 600, 1)]
    assert plan_runs([], [], bb) == []
    with pytest.raises(ValueError):
        plan_runs([1, 2], [0], bb)


def test_geometry():
    p = pages_of(cpu_attn_caches(None))
    assert p.page_bytes == HEADS * TOKENS * WIDTH * 2
    assert p.num_layers == LAYERS
    assert p.block_bytes == LAYERS * p.page_bytes


def test_save_then_load_round_trips_whole_pages_at_scattered_offsets():
    src = pages_of(cpu_attn_caches(seed=1))
    bb = src.block_bytes
    pool_np = np.zeros(20 * bb, dtype=np.uint8)
    pool = torch.from_numpy(pool_np)
    blocks = [3, 4, 5, 11, 0]
    slots = [7, 8, 9, 2, 15]  # pool slots, in block units
    runs = plan_runs(blocks, [s * bb for s in slots], bb)
    assert len(runs) == 3
    assert src.save_blocks(pool, runs) == len(blocks) * bb
    for b, s in zip(blocks, slots, strict=True):
        assert pool_np[s * bb : (s + 1) * bb].tobytes() == src.block_bytes_of(b)
    untouched = set(range(20)) - set(slots)
    assert all(not pool_np[s * bb : (s + 1) * bb].any() for s in untouched)

    dst_caches = cpu_attn_caches(seed=None)
    dst = pages_of(dst_caches)
    targets = [1, 2, 3, 12, 13]  # other block ids on the loading side
    load_runs = plan_runs(targets, [s * bb for s in slots], bb)
    for layer in range(LAYERS):
        dst.load_layer(pool, load_runs, layer)
    for b_src, b_dst in zip(blocks, targets, strict=True):
        assert dst.block_bytes_of(b_dst) == src.block_bytes_of(b_src)
        for name in dst_caches:
            assert torch.equal(dst_caches[name][b_dst], cpu_attn_caches(seed=1)[name][b_src])
    others = set(range(NUM_BLOCKS)) - set(targets)
    assert all(not any(dst.block_bytes_of(b)) for b in others)


def test_copy_units_cover_every_page_once_in_layer_order_and_load_the_same_bytes():
    src = pages_of(cpu_attn_caches(seed=4))
    bb, page = src.block_bytes, src.page_bytes
    pool_a = torch.zeros(20 * bb, dtype=torch.uint8)
    pool_b = torch.zeros(20 * bb, dtype=torch.uint8)  # a second epoch's pool: units never mix pools
    runs_a = plan_runs([0, 1, 2, 3, 4, 5, 6], [s * bb for s in range(7)], bb)  # one long run
    runs_b = plan_runs([9, 12], [3 * bb, 8 * bb], bb)  # two single blocks
    src.save_blocks(pool_a, runs_a)
    src.save_blocks(pool_b, runs_b)
    units = copy_units([(pool_a, runs_a), (pool_b, runs_b)], LAYERS, page, unit_bytes=3 * page)
    assert [u[0] for u in units] == sorted(u[0] for u in units)  # layer order
    for layer in range(LAYERS):
        mine = [u for u in units if u[0] == layer]
        pages = [
            (id(pool), r.block_id + k)
            for _, pieces, _ in mine
            for pool, rs in pieces
            for r in rs
            for k in range(r.count)
        ]
        assert sorted(pages) == sorted(
            [(id(pool_a), b) for b in range(7)] + [(id(pool_b), 9), (id(pool_b), 12)]
        )
        assert all(nbytes <= 3 * page for _, _, nbytes in mine)
        assert sum(nbytes for _, _, nbytes in mine) == 9 * page
    dst_caches = cpu_attn_caches(seed=None)
    dst = pages_of(dst_caches)
    for layer, pieces, _ in reversed(units):  # any order, any thread: each unit stands alone
        for pool, rs in pieces:
            dst.load_layer(pool, rs, layer)
    for b in [0, 1, 2, 3, 4, 5, 6, 9, 12]:
        assert dst.block_bytes_of(b) == src.block_bytes_of(b)
    assert not any(dst.block_bytes_of(7)) and not any(dst.block_bytes_of(10))
    # a unit smaller than a page still moves whole pages, one per unit
    assert len(copy_units([(pool_a, runs_a)], LAYERS, page, unit_bytes=1)) == 7 * LAYERS


def test_layer_by_layer_load_touches_only_that_layer():
    src = pages_of(cpu_attn_caches(seed=2))
    bb = src.block_bytes
    pool = torch.zeros(4 * bb, dtype=torch.uint8)
    src.save_blocks(pool, [Run(5, 0, 2)])
    dst_caches = cpu_attn_caches(seed=None)
    dst = pages_of(dst_caches)
    dst.load_layer(pool, [Run(7, 0, 2)], 1)
    names = list(dst_caches)
    assert torch.equal(dst_caches[names[1]][7:9], cpu_attn_caches(seed=2)[names[1]][5:7])
    assert not dst_caches[names[0]].any() and not dst_caches[names[2]].any()


def test_locations_outside_the_pool_or_cache_are_refused():
    p = pages_of(cpu_attn_caches(seed=3))
    bb = p.block_bytes
    pool = torch.zeros(2 * bb, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside the pool"):
        p.save_blocks(pool, [Run(0, bb, 2)])
    with pytest.raises(ValueError, match="outside"):
        p.load_layer(pool, [Run(NUM_BLOCKS - 1, 0, 2)], 0)
    assert not pool.any()


def test_layouts_the_copier_cannot_handle_are_refused():
    caches = cpu_attn_caches(seed=None)
    name = next(iter(caches))
    bad = dict(caches)
    bad[name] = caches[name].transpose(1, 2)
    with pytest.raises(LayoutMismatch, match="contiguous"):
        KvPages(bad, NUM_BLOCKS, list(bad))
    bad[name] = torch.zeros(NUM_BLOCKS, HEADS, TOKENS, WIDTH // 2, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatch, match="page of"):
        KvPages(bad, NUM_BLOCKS, list(bad))
    with pytest.raises(LayoutMismatch, match="split"):
        KvPages(caches, NUM_BLOCKS + 1, list(caches))
    with pytest.raises(LayoutMismatch, match="missing"):
        KvPages(caches, NUM_BLOCKS, [*caches, "model.layers.9.self_attn.attn"])


def test_mla_shaped_pages():
    # CPU MLA: [num_blocks, 1, 16, 576] bf16 per layer
    caches = {f"l{i}": torch.randn(6, 1, 16, 576).to(torch.bfloat16) for i in range(2)}
    p = KvPages(caches, 6, list(caches))
    assert p.page_bytes == 16 * 576 * 2
    pool = torch.zeros(3 * p.block_bytes, dtype=torch.uint8)
    p.save_blocks(pool, [Run(4, p.block_bytes, 2)])
    assert pool[p.block_bytes : 2 * p.block_bytes].numpy().tobytes() == p.block_bytes_of(4)


def test_a_numpy_pool_as_the_worker_passes_it_and_pools_that_are_not_flat_bytes_are_refused():
    src = pages_of(cpu_attn_caches(seed=5))
    bb = src.block_bytes
    pool = np.zeros(4 * bb, dtype=np.uint8)  # what client.pool_view() hands the worker
    assert src.save_blocks(pool, [Run(2, bb, 2)]) == 2 * bb
    assert pool[bb : 2 * bb].tobytes() == src.block_bytes_of(2)
    assert pool[2 * bb : 3 * bb].tobytes() == src.block_bytes_of(3)
    assert not pool[:bb].any() and not pool[3 * bb :].any()
    dst = pages_of(cpu_attn_caches(seed=None))
    for layer in range(LAYERS):
        assert dst.load_layer(pool, [Run(9, bb, 2)], layer) == 2 * src.page_bytes
    assert dst.block_bytes_of(9) == src.block_bytes_of(2)
    assert dst.block_bytes_of(10) == src.block_bytes_of(3)
    for bad in (pool.view(np.uint16), pool.reshape(4, bb)):
        with pytest.raises(ValueError, match="flat byte array"):
            src.save_blocks(bad, [Run(0, 0, 1)])
        with pytest.raises(ValueError, match="flat byte array"):
            dst.load_layer(bad, [Run(0, 0, 1)], 0)


def test_kv_pages_load_and_save_the_same_bytes_native_or_not():
    layers, blocks, page = 2, 6, 80 * 1024
    caches = {f"l{i}": torch.randint(0, 100, (blocks, page // 2), dtype=torch.int16) for i in range(layers)}
    kv = KvPages(caches, blocks, list(caches))
    pools = []
    for native in (False, True):
        assert page_copy.use(native), page_copy.EXTENSION.probe()
        pool = np.zeros(blocks * layers * page + 7, dtype=np.uint8)
        kv.save_blocks(pool, [Run(1, 7, 3), Run(4, 7 + 3 * layers * page, 2)])
        pools.append(pool)
    assert np.array_equal(pools[0], pools[1])
    wanted = [kv.block_bytes_of(b) for b in range(1, 6)]
    for native in (False, True):
        assert page_copy.use(native), page_copy.EXTENSION.probe()
        for t in caches.values():
            t.zero_()
        for layer in range(layers):
            kv.load_layer(pools[0], [Run(1, 7, 5)], layer)
        assert [kv.block_bytes_of(b) for b in range(1, 6)] == wanted
    page_copy.use(True)
