"""Which bytes go where when a block moves between a worker's KV tensors and the host pool.

Pure numpy, no CUDA: everything here is tested on CPU.

A stored block is the concatenation, in a fixed order, of *segments*. A segment
is one contiguous run of bytes per block inside one of the worker's KV tensors:
block ``b``'s bytes of segment ``s`` start at ``tensor_addr[s.tensor] + s.offset
+ b * s.stride`` and are ``s.nbytes`` long. Every vLLM GPU layout is a list of
segments:

* per-layer tensors with K and V separate, ``[2, num_blocks, ...]`` per layer:
  two segments per layer (K at offset 0, V at offset ``num_blocks * stride``);
* per-layer blocks-first, ``[num_blocks, 2, ...]``: one segment per layer;
* cross-layer blocks, ``[num_blocks, num_layers, 2, ...]``: one segment;
* MLA, ``[num_blocks, block_size, latent]`` per layer: one segment per layer.

The first three all store "layer-major, K before V" and so produce identical
stored bytes for the same model; a namespace is free to share them.

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

# Pieces are cut on this boundary so that 16-byte vector accesses stay aligned.
VECTOR_BYTES = 16
DEFAULT_MAX_PIECE_BYTES = 64 * 1024  # one thread block's share; 32-64 KiB measured equal on an H200


class LayoutError(ValueError):
    """A KV tensor layout the copy planner cannot describe or that does not fit its tensors."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous run of bytes per block inside one KV tensor."""

    tensor: int  # index into the registration's tensor list
    offset: int  # bytes from the tensor's start to block 0's bytes of this segment
    stride: int  # bytes between the same segment of consecutive blocks
    nbytes: int  # contiguous bytes per block


def segments_from_strides(
    tensor: int, shape: Sequence[int], strides: Sequence[int], itemsize: int, block_dim: int
) -> list[Segment]:
    """The segments of one strided tensor whose dimension ``block_dim`` indexes KV blocks.

    ``strides`` are in elements (as torch reports them). Dimensions with a larger
    stride than the block dimension (e.g. the K/V dimension of ``[2, blocks, ...]``)
    become separate segments, in index order; the remaining dimensions must cover
    one dense byte range per block (any physical order: the bytes are opaque).
    """
    shape = [int(s) for s in shape]
    strides = [int(s) for s in strides]
    if len(shape) != len(strides) or not shape:
        raise LayoutError(f"shape {shape} and strides {strides} do not describe a tensor")
    if not 0 <= block_dim < len(shape):
        raise LayoutError(f"block dimension {block_dim} is outside a {len(shape)}-d tensor")
    if itemsize <= 0:
        raise LayoutError(f"itemsize must be positive, got {itemsize}")
    if any(s <= 0 for s in shape):
        raise LayoutError(f"every dimension must be non-empty, got shape {shape}")
    if any(st < 0 for st in strides):
        raise LayoutError(f"negative strides are not supported: {strides}")
    block_stride = strides[block_dim]
    outer = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1 and strides[d] > block_stride]
    inner = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1 and strides[d] <= block_stride]
    # The inner dimensions, innermost first, must tile one dense range per block.
    expected = 1
    for d in sorted(inner, key=lambda d: strides[d]):
        if strides[d] != expected:
            raise LayoutError(
                f"tensor {tensor}: the bytes of one block are not contiguous "
                f"(shape {shape}, strides {strides})"
            )
        expected *= shape[d]
    piece_elems = expected
    if shape[block_dim] > 1 and block_stride < piece_elems:
        raise LayoutError(f"tensor {tensor}: blocks overlap (shape {shape}, strides {strides})")
    offsets = np.zeros(1, dtype=np.int64)
    for d in outer:
        offsets = (offsets[:, None] + np.arange(shape[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    return [
        Segment(
            tensor=tensor,
            offset=int(o) * itemsize,
            stride=block_stride * itemsize,
            nbytes=piece_elems * itemsize,
        )
        for o in offsets
    ]


class BlockLayout:
    """The segments of one worker registration, validated against its tensors' sizes.

    Holds the per-segment arrays the planner needs so a request costs no Python
    work per segment.
    """

    def __init__(self, segments: Sequence[Segment], tensor_sizes: Sequence[int], num_blocks: int):
        if not segments:
            raise LayoutError("a layout needs at least one segment")
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        self.segments = tuple(segments)
        self.tensor_sizes = tuple(int(s) for s in tensor_sizes)
        self.num_blocks = int(num_blocks)
        for i, seg in enumerate(self.segments):
            if not 0 <= seg.tensor < len(self.tensor_sizes):
                raise LayoutError(
                    f"segment {i} names tensor {seg.tensor}; there are {len(self.tensor_sizes)}"
                )
            if seg.nbytes <= 0 or seg.offset < 0 or seg.stride < 0:
                raise LayoutError(f"segment {i} has a negative offset/stride or no bytes: {seg}")
            if self.num_blocks > 1 and seg.stride < seg.nbytes:
                raise LayoutError(
                    f"segment {i}: stride {seg.stride} < {seg.nbytes} bytes, blocks would overlap"
                )
            end = seg.offset + (self.num_blocks - 1) * seg.stride + seg.nbytes
            if end > self.tensor_sizes[seg.tensor]:
                raise LayoutError(
                    f"segment {i} reaches byte {end} of tensor {seg.tensor}, "
                    f"which has {self.tensor_sizes[seg.tensor]} bytes"
                )
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
