"""Which bytes go where when a block moves between a worker's KV tensors and the host pool.

Pure numpy, no CUDA: everything here is tested on CPU.

A stored block is the concatenation, in a fixed order, of *segments* (contiguous runs of bytes
per block inside the worker's KV tensors; ``Segment`` and ``segments_from_strides``, shared with
the worker side, are in ``pegaflow.common.wire.device_registration``, which says how every vLLM
GPU layout becomes a segment list).

Per registration the layout is cut once into an *item table* (each segment
split into pieces of at most ``max_piece_bytes``, tensor addresses folded in)
that lives in device memory; a request then ships only its block ids and host
offsets and the copy kernel computes every address itself. What stays on the
CPU per request is a handful of numpy operations over the request's blocks
(never over its chunks): bounds checks, and for the staged mode the grouping
of blocks into staging slots and of adjacent pool blocks into copy-engine
runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# The registration's value types are shared with the worker side (one definition, common/wire).
from pegaflow.common.wire.device_registration import (
    LayoutError,
    Segment,
    check_segments,
    segments_from_strides,
)

__all__ = ["BlockLayout", "LayoutError", "Segment", "item_table", "segments_from_strides"]

# Pieces are cut on this boundary so that 16-byte vector accesses stay aligned.
VECTOR_BYTES = 16
DEFAULT_MAX_PIECE_BYTES = 64 * 1024  # one thread block's share; 32-64 KiB measured equal on an H200


class BlockLayout:
    """The segments of one worker registration, validated against its tensors' sizes.

    Holds the per-segment arrays the planner needs so a request costs no Python
    work per segment.
    """

    def __init__(self, segments: Sequence[Segment], tensor_sizes: Sequence[int], num_blocks: int):
        check_segments(segments, tensor_sizes, num_blocks)
        self.segments = tuple(segments)
        self.tensor_sizes = tuple(int(s) for s in tensor_sizes)
        self.num_blocks = int(num_blocks)
        self.seg_tensor = np.array([s.tensor for s in self.segments], dtype=np.int64)
        self.seg_offset = np.array([s.offset for s in self.segments], dtype=np.uint64)
        self.seg_stride = np.array([s.stride for s in self.segments], dtype=np.uint64)
        self.seg_nbytes = np.array([s.nbytes for s in self.segments], dtype=np.uint64)
        # Where each segment starts inside the stored block.
        self.seg_block_offset = np.concatenate(([0], np.cumsum(self.seg_nbytes)[:-1])).astype(np.uint64)
        self.block_bytes = int(self.seg_nbytes.sum())
        self.vector_aligned = all(
            s.offset % VECTOR_BYTES == 0 and s.stride % VECTOR_BYTES == 0 and s.nbytes % VECTOR_BYTES == 0
            for s in self.segments
        )

    def __repr__(self) -> str:
        return (
            f"BlockLayout({len(self.segments)} segments, {self.num_blocks} blocks, "
            f"{self.block_bytes} bytes per block)"
        )


@dataclasses.dataclass
class CopyPlan:
    """Pieces of one launch, on the CPU: ``nbytes[i]`` bytes between ``device[i]`` and ``host[i]``."""

    device: np.ndarray  # uint64 addresses on the GPU side
    host: np.ndarray  # uint64 addresses on the host side (or a staging buffer)
    nbytes: np.ndarray  # uint64

    @property
    def pieces(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def _as_u64(values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"{what} must not be negative")
    return arr.astype(np.uint64, copy=False)


@dataclasses.dataclass(frozen=True)
class ItemTable:
    """A layout cut into per-block work items, with the tensors' addresses folded in.

    Item ``j`` of block ``b`` moves ``nbytes[j]`` bytes between device address
    ``device_base[j] + b * stride[j]`` and host address ``host_base +
    host_offset[b] + block_offset[j]``. Built once per registration and kept
    in device memory, so a request only ships its block ids and host offsets
    and the kernel computes every address itself.
    """

    device_base: np.ndarray  # uint64
    stride: np.ndarray  # uint64
    block_offset: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64

    @property
    def items(self) -> int:
        return int(self.nbytes.size)

    def packed(self) -> np.ndarray:
        """(4, items) uint64, the kernel's layout."""
        return np.ascontiguousarray(np.stack([self.device_base, self.stride, self.block_offset, self.nbytes]))


def item_table(
    layout: BlockLayout,
    tensor_addrs: Sequence[int] | np.ndarray,
    max_piece_bytes: int = DEFAULT_MAX_PIECE_BYTES,
) -> ItemTable:
    """Cuts every segment into pieces of at most ``max_piece_bytes`` (16-byte multiples)."""
    if max_piece_bytes <= 0 or max_piece_bytes % VECTOR_BYTES:
        raise ValueError(
            f"max_piece_bytes must be a positive multiple of {VECTOR_BYTES}, got {max_piece_bytes}"
        )
    addrs = _as_u64(tensor_addrs, "tensor_addrs")
    if addrs.size != len(layout.tensor_sizes):
        raise ValueError(
            f"{addrs.size} tensor addresses for a layout over {len(layout.tensor_sizes)} tensors"
        )
    base = addrs[layout.seg_tensor] + layout.seg_offset
    cap = np.uint64(max_piece_bytes)
    counts = ((layout.seg_nbytes + cap - np.uint64(1)) // cap).astype(np.int64)
    owner = np.repeat(np.arange(base.size), counts)
    first = np.cumsum(counts) - counts
    skip = (np.arange(int(counts.sum()), dtype=np.int64) - first[owner]).astype(np.uint64) * cap
    return ItemTable(
        device_base=base[owner] + skip,
        stride=layout.seg_stride[owner].copy(),
        block_offset=layout.seg_block_offset[owner] + skip,
        nbytes=np.minimum(layout.seg_nbytes[owner] - skip, cap),
    )


def expand_items(
    table: ItemTable,
    host_base: int,
    block_ids: Sequence[int] | np.ndarray,
    host_offsets: Sequence[int] | np.ndarray,
) -> CopyPlan:
    """The pieces the kernel moves for these blocks: the kernel's address arithmetic, in numpy.

    Used to test the item table on CPU; the server never calls it per request.
    """
    ids = _as_u64(block_ids, "block_ids")
    offs = _as_u64(host_offsets, "host_offsets")
    device = table.device_base[None, :] + ids[:, None] * table.stride[None, :]
    host = np.uint64(host_base) + offs[:, None] + table.block_offset[None, :]
    nbytes = np.broadcast_to(table.nbytes, device.shape)
    return CopyPlan(device.reshape(-1), host.reshape(-1), np.ascontiguousarray(nbytes).reshape(-1))


def check_request(
    layout: BlockLayout, host_size: int, block_ids, host_offsets
) -> tuple[np.ndarray, np.ndarray]:
    """Block ids and host offsets as uint64 arrays, refused unless every byte stays inside its memory."""
    ids = _as_u64(block_ids, "block_ids")
    offs = _as_u64(host_offsets, "host_offsets")
    if ids.size != offs.size:
        raise ValueError(f"{ids.size} block ids but {offs.size} host offsets")
    if ids.size:
        if int(ids.max()) >= layout.num_blocks:
            raise ValueError(
                f"block id {int(ids.max())} is outside the {layout.num_blocks} registered blocks"
            )
        if int(offs.max()) + layout.block_bytes > host_size:
            raise ValueError(
                f"host range [{int(offs.max())}, +{layout.block_bytes}) "
                f"is outside the {host_size}-byte region"
            )
    return ids, offs


@dataclasses.dataclass
class StagedPlan:
    """A request cut into groups that each fill one staging slot, in pool order.

    Group ``g`` is blocks ``order[starts[g]:starts[g+1]]`` (indices into the
    request); its ``k``-th block sits at ``k * block_bytes`` in the slot. Its
    copy-engine runs are ``run_host[r], run_slot_offset[r], run_bytes[r]`` for
    ``r`` in ``run_starts[g]:run_starts[g+1]`` (pool offsets, not addresses).
    """

    order: np.ndarray  # int64 permutation of the request's blocks
    starts: np.ndarray  # int64, groups + 1 entries
    slot_offset: np.ndarray  # uint64, per block in `order`: where it sits in its group's slot
    run_host: np.ndarray  # uint64 pool offsets
    run_slot_offset: np.ndarray  # uint64
    run_bytes: np.ndarray  # uint64
    run_starts: np.ndarray  # int64, groups + 1 entries

    @property
    def groups(self) -> int:
        return int(self.starts.size - 1)

    @property
    def mean_run_bytes(self) -> float:
        return float(self.run_bytes.mean()) if self.run_bytes.size else 0.0


def plan_staged(host_offsets: np.ndarray, block_bytes: int, slot_bytes: int) -> StagedPlan:
    """Groups of whole blocks per staging slot, in pool order so that adjacent pool blocks form one run."""
    if block_bytes <= 0 or block_bytes > slot_bytes:
        raise ValueError(f"a {block_bytes}-byte block does not fit a {slot_bytes}-byte staging slot")
    offs = _as_u64(host_offsets, "host_offsets")
    n = offs.size
    per_group = slot_bytes // block_bytes
    order = np.argsort(offs, kind="stable")
    sorted_offs = offs[order]
    starts = np.append(np.arange(0, n, per_group, dtype=np.int64), n)
    bb = np.uint64(block_bytes)
    position = np.arange(n, dtype=np.int64)
    slot_offset = (position % per_group).astype(np.uint64) * bb
    # A run breaks where the pool is not contiguous or where a new group (slot) begins.
    breaks = np.ones(n, dtype=bool)
    if n > 1:
        breaks[1:] = (sorted_offs[1:] != sorted_offs[:-1] + bb) | (position[1:] % per_group == 0)
    run_first = np.flatnonzero(breaks)
    run_len = np.diff(np.append(run_first, n))
    run_group_starts = np.searchsorted(run_first, starts[:-1])
    return StagedPlan(
        order=order,
        starts=starts,
        slot_offset=slot_offset,
        run_host=sorted_offs[run_first],
        run_slot_offset=slot_offset[run_first],
        run_bytes=run_len.astype(np.uint64) * bb,
        run_starts=np.append(run_group_starts, run_first.size).astype(np.int64),
    )


# A request's chunks (``pipeline_chunks``): the first is small so that the GPU starts soon; each
# next one at most CHUNK_GROWTH times larger; the last ones shrink again so that what is left after
# the last byte arrives (sealing that chunk, or releasing its lease) is small work. Every chunk costs
# the request thread a fixed ~0.5 ms (its engine call 0.15-0.3 ms, planning and launch 0.3-0.5 ms;
# measured on an H100 host, 2026-12-06, with the timing log on; ~0.3 ms without it by a GIL profile:
# server/gpu/README.md), i.e. 15-27 MB of link time, whatever its size: a chunk must move at least
# that much or the link waits for the next one. From 8 MiB to 32 MiB on 2026-12-06 (the first three
# chunks had been 3, 6, 12 blocks of 2.25 MiB, each moved in 0.13-0.5 ms: less than the next one's
# setup); measured gain: MLA +1-5 points, the 2.25 MiB layouts unchanged.
FIRST_CHUNK_BYTES = 32 << 20
LAST_CHUNK_BYTES = 16 << 20
LARGEST_CHUNK_BYTES = 256 << 20
CHUNK_GROWTH = 2


def pipeline_chunks(
    n: int,
    block_bytes: int,
    first_bytes: int = FIRST_CHUNK_BYTES,
    last_bytes: int = LAST_CHUNK_BYTES,
    largest_bytes: int = LARGEST_CHUNK_BYTES,
    growth: int = CHUNK_GROWTH,
) -> list[tuple[int, int]]:
    """``(lo, hi)`` bounds cutting ``n`` blocks into chunks that ramp up from ``first_bytes`` and back
    down to ``last_bytes`` (whole blocks, at least one each), each at most ``largest_bytes``."""
    if n < 0 or block_bytes <= 0 or growth < 1:
        raise ValueError("n must be >= 0, block_bytes > 0 and growth >= 1")
    largest = max(1, largest_bytes // block_bytes)
    front_size = min(max(1, first_bytes // block_bytes), largest)
    back_size = min(max(1, last_bytes // block_bytes), largest)
    front: list[int] = []
    back: list[int] = []
    left = n
    while left > 0:
        # The rest goes into one middle chunk once it is no larger than half again the next front one.
        if left <= front_size + front_size // 2:
            front.append(left)
            break
        front.append(front_size)
        left -= front_size
        front_size = min(front_size * growth, largest)
        if left <= back_size:
            back.append(left)
            break
        back.append(back_size)
        left -= back_size
        back_size = min(back_size * growth, largest)
    bounds = [0]
    for size in front + back[::-1]:
        bounds.append(bounds[-1] + size)
    return list(zip(bounds, bounds[1:], strict=False))
