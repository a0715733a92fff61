"""SlabAllocator: many block sizes at once, slab hand-back and slab moves, no overlap ever."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.server.config import MIB
from pegaflow.server.tiers.dram.allocator import SLOT_ALIGN, SlabAllocator, default_slab_bytes


def test_default_slab_size_scales_with_pool_and_is_clamped():
    assert default_slab_bytes(64 * MIB) == 4 * MIB
    assert default_slab_bytes(512 * MIB) == 16 * MIB
    assert default_slab_bytes(30 << 30) == 64 * MIB
    assert default_slab_bytes(1 << 40) == 64 * MIB


def test_fresh_slab_hands_out_contiguous_ascending_slots():
    alloc = SlabAllocator(32 * MIB, slab_bytes=4 * MIB)
    offsets = [alloc.allocate(256 * 1024) for _ in range(16)]
    assert offsets == [i * 256 * 1024 for i in range(16)]  # one slab, 16 slots, in order


def test_a_batch_over_freed_slabs_gets_them_in_address_order_as_one_run():
    alloc = SlabAllocator(32 * MIB, slab_bytes=4 * MIB)  # 8 slabs of 2 blocks of 2 MiB
    offsets = alloc.allocate_many(2 * MIB, 16)
    assert offsets == [i * 2 * MIB for i in range(16)]
    for slab in (5, 1, 6, 2):  # emptied in scattered order
        alloc.free(slab * 4 * MIB)
        alloc.free(slab * 4 * MIB + 2 * MIB)
    again = alloc.allocate_many(2 * MIB, 4)
    assert again == [4 * MIB, 6 * MIB, 8 * MIB, 10 * MIB]  # slabs 1 and 2: adjacent, one run


def test_sizes_get_separate_slabs_and_empty_slabs_return_to_the_pool():
    alloc = SlabAllocator(32 * MIB, slab_bytes=4 * MIB)
    a = alloc.allocate(256 * 1024)
    b = alloc.allocate(1 * MIB)
    assert a // (4 * MIB) != b // (4 * MIB)
    assert alloc.free_slabs == 6
    alloc.free(a)
    assert alloc.free_slabs == 7  # the 256 KiB slab emptied and went back
    c = alloc.allocate(2 * MIB)  # any size can take it now
    assert c is not None and alloc.free_slabs == 6
    assert alloc.used_bytes == 3 * MIB


def test_cuts_count_every_slab_assigned_to_a_size_reused_or_not():
    alloc = SlabAllocator(16 * MIB, slab_bytes=4 * MIB)  # 4 slabs of 2 blocks of 2 MiB
    assert alloc.cuts(2 * MIB) == 0
    first = alloc.allocate_many(2 * MIB, 2)
    assert alloc.cuts(2 * MIB) == 1
    alloc.allocate_many(2 * MIB, 1)
    assert alloc.cuts(2 * MIB) == 2
    for offset in first:  # the first slab empties, goes back to the pool, and is cut again
        alloc.free(offset)
    alloc.allocate_many(2 * MIB, 3)  # the second slab's free slot, then the first slab cut anew
    assert alloc.cuts(2 * MIB) == 3 and alloc.cuts(MIB) == 0


def test_full_pool_returns_none_and_reclaimable_slab_picks_the_emptiest_other_size():
    alloc = SlabAllocator(16 * MIB, slab_bytes=4 * MIB)  # 4 slabs
    big = [alloc.allocate(1 * MIB) for _ in range(12)]  # 3 slabs of 1 MiB blocks
    small = [alloc.allocate(512 * 1024) for _ in range(8)]  # 1 slab of 512 KiB blocks
    assert alloc.allocate(1 * MIB) is None and alloc.allocate(512 * 1024) is None
    for off in big[4:7]:  # leave the second 1 MiB slab with a single block
        alloc.free(off)
    slab = alloc.reclaimable_slab(512 * 1024)
    assert slab == 1
    assert alloc.used_offsets(slab) == [big[7]]
    alloc.hold(big[7])  # pinned: that slab must not be offered any more
    assert alloc.reclaimable_slab(512 * 1024) in (0, 2)
    alloc.unhold(big[7])
    assert alloc.reclaimable_slab(1 * MIB) == 3  # for 1 MiB blocks, only the 512 KiB slab is another size
    assert len(small) == 8


def test_rejects_blocks_larger_than_a_slab_and_foreign_offsets():
    alloc = SlabAllocator(16 * MIB, slab_bytes=4 * MIB)
    with pytest.raises(ValueError):
        alloc.allocate(4 * MIB + 1)
    off = alloc.allocate(3000)
    with pytest.raises(ValueError):
        alloc.free(off + 1)
    with pytest.raises(ValueError):
        alloc.free(8 * MIB)  # a free slab


def test_stats_account_for_slot_tails_and_stranded_bytes():
    alloc = SlabAllocator(16 * MIB, slab_bytes=4 * MIB)
    block = 3 * MIB  # one per 4 MiB slab: 1 MiB tail each
    offs = [alloc.allocate(block) for _ in range(2)]
    stats = alloc.stats()
    assert stats.used_bytes == 2 * block
    assert stats.stranded_bytes == 2 * MIB
    (cls,) = stats.classes
    assert cls.slabs == 2 and cls.used_blocks == 2 and cls.slot_tail_bytes == 2 * MIB
    for off in offs:
        alloc.free(off)
    assert alloc.stats().stranded_bytes == 0 and alloc.free_slabs == 4


SIZES = [4096, 100_000, 256 * 1024, 1 * MIB, 3 * MIB]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, len(SIZES) - 1), st.integers(0, 10_000)), max_size=300)
)
def test_random_alloc_free_never_overlaps_and_accounts_exactly(ops):
    alloc = SlabAllocator(24 * MIB, slab_bytes=4 * MIB)
    live: dict[int, int] = {}
    for is_alloc, size_idx, pick in ops:
        if is_alloc or not live:
            size = SIZES[size_idx]
            off = alloc.allocate(size)
            if off is None:
                continue
            assert off % SLOT_ALIGN == 0
            assert off // alloc.slab_bytes == (off + size - 1) // alloc.slab_bytes  # never straddles slabs
            live[off] = size
        else:
            off = sorted(live)[pick % len(live)]
            alloc.free(off)
            del live[off]
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        assert alloc.used_bytes == sum(live.values())
    for off in list(live):
        alloc.free(off)
    assert alloc.free_slabs == alloc.total_slabs and alloc.used_bytes == 0


def test_restore_readopts_slots_and_the_allocator_carries_on_around_them():
    a = SlabAllocator(8 * 4 * MIB, 4 * MIB, slot_align=4096)
    first = a.allocate_many(256 * 1024, 20)
    big = a.allocate_many(2 * MIB, 3)
    keep = [(o, 256 * 1024) for o in first[::2]] + [(big[1], 2 * MIB)]
    b = SlabAllocator(8 * 4 * MIB, 4 * MIB, slot_align=4096)
    assert b.restore(keep + [(first[0], 256 * 1024), (first[1] + 8, 256 * 1024)]) == [
        (first[0], 256 * 1024),  # twice
        (first[1] + 8, 256 * 1024),  # not a slot boundary
    ]
    assert b.used_bytes == 10 * 256 * 1024 + 2 * MIB
    fresh = b.allocate_many(256 * 1024, 40)
    assert not set(fresh) & {o for o, _ in keep}  # never hands out a restored slot
    for offset, _ in keep:
        b.free(offset)
    for offset in fresh:
        b.free(offset)
    assert b.used_bytes == 0 and b.free_slabs == b.total_slabs


# ------------------------------------------------------- parts (tenant regions, tiers/dram/region.py)


def test_a_parts_blocks_get_only_its_slabs_and_its_slabs_only_its_blocks():
    # 8 slabs of 4 MiB: the pool 0-4, part 1 slabs 5-6, part 2 slab 7.
    alloc = SlabAllocator(32 * MIB, slab_bytes=4 * MIB, part_slabs=[2, 1])
    assert alloc.parts == 3 and [alloc.part_of(i * 4 * MIB) for i in range(8)] == [0] * 5 + [1, 1, 2]
    got = alloc.allocate_many(1 * MIB, 100, part=1)
    assert len(got) == 8 and all(20 * MIB <= o < 28 * MIB for o in got)  # full at its 2 slabs
    assert alloc.available(1 * MIB, part=1) == 0 and alloc.allocate(1 * MIB, part=1) is None
    assert alloc.available(1 * MIB, part=2) == 4 and alloc.available(1 * MIB) == 20  # others untouched
    pool = alloc.allocate_many(1 * MIB, 100)
    assert len(pool) == 20 and all(o < 20 * MIB for o in pool)  # the pool never spills into a part
    alloc.free(got[0])
    assert alloc.allocate(1 * MIB) is None  # a part's freed slot is not the pool's
    assert alloc.allocate(1 * MIB, part=1) == got[0]


def test_an_emptied_slab_goes_back_to_its_part_and_reclaim_stays_in_the_part():
    alloc = SlabAllocator(16 * MIB, slab_bytes=4 * MIB, part_slabs=[1])  # pool: slabs 0-2, part 1: slab 3
    small = alloc.allocate_many(1 * MIB, 4, part=1)
    assert alloc.reclaimable_slab(2 * MIB, part=1) == 3
    assert alloc.reclaimable_slab(2 * MIB) is None  # the pool has nothing of another size to give
    alloc.allocate_many(1 * MIB, 4)
    assert alloc.reclaimable_slab(2 * MIB) == 0 and alloc.reclaimable_slab(1 * MIB, part=1) is None
    for offset in small:
        alloc.free(offset)
    assert alloc.allocate_many(2 * MIB, 4, part=1) == [12 * MIB, 14 * MIB]  # the slab, now any size
    stats = alloc.stats()  # one row per block size, every part counted
    assert {c.block_bytes: c.used_blocks for c in stats.classes} == {1 * MIB: 4, 2 * MIB: 2}


@pytest.mark.parametrize("parts", [[4], [3, 1], [0], [2, -1]])
def test_parts_that_leave_no_pool_or_are_empty_are_refused(parts):
    with pytest.raises(ValueError, match="cannot hold parts"):
        SlabAllocator(16 * MIB, slab_bytes=4 * MIB, part_slabs=parts)


def _allocator_state(alloc: SlabAllocator) -> tuple:
    stats = alloc.stats()
    return (
        alloc.used_bytes,
        alloc.free_slabs,
        stats,
        [alloc.allocate_many(size, 3) for size in (256 * 1024, 1 * MIB)],  # what comes next, in order
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60))
def test_free_many_leaves_the_allocator_as_frees_one_by_one_do(picks):
    one, many = SlabAllocator(16 * MIB, slab_bytes=2 * MIB), SlabAllocator(16 * MIB, slab_bytes=2 * MIB)
    taken = one.allocate_many(256 * 1024, 64)
    assert many.allocate_many(256 * 1024, 64) == taken
    one.allocate_many(1 * MIB, 4), many.allocate_many(1 * MIB, 4)  # another size beside them
    chosen = list(dict.fromkeys(taken[p % len(taken)] for p in picks))  # distinct, in pick order
    for offset in chosen:
        one.free(offset)
    many.free_many(chosen, 256 * 1024)
    assert _allocator_state(many) == _allocator_state(one)


def test_free_many_refuses_a_slot_it_did_not_hand_out_or_of_another_size():
    alloc = SlabAllocator(16 * MIB, slab_bytes=2 * MIB)
    offsets = alloc.allocate_many(256 * 1024, 4)
    big = alloc.allocate(1 * MIB)
    with pytest.raises(ValueError):
        alloc.free_many([offsets[0] + 4096], 256 * 1024)  # inside a slot
    with pytest.raises(ValueError):
        alloc.free_many([big], 256 * 1024)  # a slot of another size
    with pytest.raises(ValueError):
        alloc.free_many([15 * MIB], 256 * 1024)  # a slab never cut
    assert alloc.used_bytes == 4 * 256 * 1024 + 1 * MIB  # nothing freed by the refusals
