"""Segment space bookkeeping (no I/O): striping, FIFO reuse, never past capacity, contract checks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.common.wire.block_record import record_bytes
from pegaflow.server.tiers.base import Extent
from pegaflow.server.tiers.ssd.segment_format import BLOCK, summary_reserve
from pegaflow.server.tiers.ssd.space import FREE, OPEN, SEALED, Space

MIB = 1 << 20


def _space(lanes=2, per_lane=2, seg=1 * MIB):
    return Space(lanes, per_lane, seg, itertools.count(1).__next__)


def _write_all(space, extents, tag=b"t"):
    for seg, off in space.begin_writes(extents):
        space.end_write(seg, off, True, 1, tag)


def test_consecutive_extents_alternate_lanes_and_fill_front_to_back():
    space = _space(lanes=2)
    ext = space.allocate(100_000, 6)
    segs = [space.locate(e.address)[0] for e in ext]
    assert [s.lane for s in segs] == [0, 1, 0, 1, 0, 1]
    offsets = [space.locate(e.address)[1] for e in ext[::2]]
    assert offsets == [BLOCK + i * record_bytes(100_000) for i in range(3)]
    opened, _ = space.take_events()
    assert sorted(s.gid for s in opened) == [0, 1]  # one header write per opened segment


def test_allocation_stops_at_capacity_and_resumes_fifo_after_frees():
    space = _space(lanes=1, per_lane=3)
    block = 200_000
    first = space.allocate(block, 1000)
    per_seg = len([e for e in first if space.locate(e.address)[0].gid == 0])
    assert len(first) == 3 * per_seg  # all three segments full, and no more
    assert space.allocate(block, 1) == []
    span_total = sum(record_bytes(e.length) for e in first)
    assert span_total == space.used_bytes <= 3 * MIB
    _write_all(space, first)
    space.free(first[: per_seg - 1])  # the oldest segment not yet empty
    assert space.allocate(block, 1) == []
    space.free(first[per_seg - 1 : per_seg])
    again = space.allocate(block, 2)
    assert [space.locate(e.address)[0].gid for e in again] == [0, 0]  # the oldest segment, reused
    seg0 = space.segments[0]
    assert seg0.state == OPEN and seg0.generation > seg0.prev_generation
    opened, _ = space.take_events()
    assert seg0 in opened  # its next generation's header was issued when it emptied


def test_a_sealed_segment_gets_one_summary_once_nothing_is_pending():
    space = _space(lanes=1, per_lane=2)
    ext = space.allocate(300_000, 4)
    space.take_events()
    seg0 = space.segments[0]
    in_seg0 = [e for e in ext if space.locate(e.address)[0] is seg0]
    assert seg0.state == SEALED and len(in_seg0) == 3
    _write_all(space, in_seg0[:2])
    assert space.take_events()[1] == []  # one still allocated, unwritten
    space.free(in_seg0[2:])
    assert space.take_events()[1] == [seg0]
    assert [e.offset for e in space.summary_entries(seg0)] == [BLOCK, BLOCK + record_bytes(300_000)]
    space.internal_begin(seg0)  # its summary write is in flight ...
    space.free(in_seg0[:2])
    assert seg0.state == FREE and space.free_queue[0][-1] is seg0  # ... reusable at once all the same
    space.internal_end(seg0)  # (the tier holds the next header write until this point)
    assert seg0.state == FREE


def test_records_and_summary_reserve_never_reach_the_footer():
    seg_bytes = 1 * MIB
    space = _space(lanes=1, per_lane=1, seg=seg_bytes)
    ext = space.allocate(1, 10_000)  # smallest records: the summary reserve binds
    last = max(space.locate(e.address)[1] for e in ext) + record_bytes(1)
    assert last + summary_reserve(len(ext)) + BLOCK <= seg_bytes


def test_contract_violations_raise_before_changing_anything():
    space = _space()
    ext = space.allocate(50_000, 2)
    with pytest.raises(ValueError):
        space.allocate(2 * MIB, 1)  # larger than a segment
    with pytest.raises(ValueError):
        space.free([ext[0], Extent(ext[1].address + BLOCK, 50_000)])
    assert len(space.segments[0].extents) == 1  # nothing was freed
    space.begin_writes([ext[0]])
    with pytest.raises(ValueError):
        space.free([ext[0]])  # being written
    with pytest.raises(ValueError):
        space.begin_writes([ext[1], ext[0]])
    with pytest.raises(ValueError):
        space.check_read(ext[1])  # never written


def test_a_disabled_lane_gets_no_more_extents():
    space = _space(lanes=2)
    space.allocate(10_000, 2)
    space.disable_lane(1)
    ext = space.allocate(10_000, 10)
    assert {space.locate(e.address)[0].lane for e in ext} == {0}


@settings(max_examples=60, deadline=None)
@given(
    lanes=st.integers(1, 3),
    ops=st.lists(
        st.tuples(st.sampled_from([4096, 70_000, 200_000, 333_333]), st.integers(1, 12)), max_size=40
    ),
)
def test_fifo_frees_never_overlap_never_exceed_capacity(lanes, ops):
    per_lane, seg_bytes = 3, 1 * MIB
    space = _space(lanes=lanes, per_lane=per_lane, seg=seg_bytes)
    live: list[Extent] = []
    for size, count in ops:
        got = space.allocate(size, count)
        if len(got) < count:  # full: the store frees its oldest and asks again
            while live and len(got) < count:
                victims, live = live[: count - len(got)], live[count - len(got) :]
                space.free(victims)
                got += space.allocate(size, count - len(got))
        _write_all(space, got)
        live += got
        intervals = sorted((e.address, e.address + record_bytes(e.length)) for e in live)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(intervals))
        for start, end in intervals:
            assert (start // seg_bytes) == ((end - 1) // seg_bytes)  # inside one segment
            assert BLOCK <= start % seg_bytes and (end - 1) % seg_bytes < seg_bytes - BLOCK
        assert space.used_bytes == sum(record_bytes(e.length) for e in live) <= lanes * per_lane * seg_bytes
