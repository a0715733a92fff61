"""Copying KV blocks between caller arrays and the mapped pool, in as few copies as possible.

Adjacent pool locations whose source rows are adjacent too are merged into one
copy (a fresh slab hands out consecutive slots, so a batch is usually a few
long runs). A run of whole rows goes through common/native/page_copy.py: one
call, the interpreter lock released, streaming stores for blocks of 64 KiB and
more. A save writes pool slots nobody reads next, and a load's destination is
usually cold too: stores that skip reading each destination line first ran
~1.7x numpy's copyto (glibc memcpy) for 16 MiB batches of 256 KiB blocks on
the 2-vCPU AMD VM (bench/server_bench.py has the full rows). Until the native
copy is built and proven (or with PEGAFLOW_NATIVE_COPY=0) it is numpy's, which
also releases the lock for large copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pegaflow.common.native import page_copy
from pegaflow.common.wire.checksum import checksum


def _runs(locations: Sequence) -> list[tuple[int, int, int, int]]:
    """(first index, count, pool offset, block length) of maximal runs of adjacent, equal-length locations."""
    runs: list[tuple[int, int, int, int]] = []
    previous = -2  # index of the last location placed in a run
    for i, loc in enumerate(locations):
        if loc is None or not loc.length:  # None, or an Allocation that was not GRANTED
            continue
        offset, length = loc.offset, loc.length
        if previous == i - 1:
            first, count, base, run_len = runs[-1]
            if length == run_len and offset == base + count * run_len:
                runs[-1] = (first, count + 1, base, run_len)
                previous = i
                continue
        runs.append((i, 1, offset, length))
        previous = i
    return runs


def _check(view: np.ndarray, locations: Sequence, blocks) -> None:
    if view.dtype != np.uint8 or view.ndim != 1:
        raise ValueError("view must be the 1-D uint8 pool view")
    if len(blocks) != len(locations):
        raise ValueError(f"{len(blocks)} blocks for {len(locations)} locations")
    for loc in locations:
        if loc is not None and (loc.offset < 0 or loc.offset + loc.length > view.size):
            raise ValueError(f"location ({loc.offset}, {loc.length}) lies outside the pool")


def _row(blocks, i: int, length: int) -> np.ndarray:
    row = np.asarray(blocks[i]).reshape(-1).view(np.uint8)
    if row.size != length:
        raise ValueError(f"block {i} has {row.size} bytes, its location holds {length}")
    return row


def write_blocks(view: np.ndarray, locations: Sequence, blocks) -> int:
    """Copies ``blocks[i]`` to ``locations[i]``. Returns bytes copied.

    ``locations`` may be a SaveBatch's ``allocations`` as is: entries that are
    None or not GRANTED (length 0) are skipped, with their rows.

    ``blocks`` is a C-contiguous 2-D array (one row per block; runs are merged)
    or a sequence of per-block arrays (bytes-like of the right length).
    """
    _check(view, locations, blocks)
    rows2d = isinstance(blocks, np.ndarray) and blocks.ndim == 2 and blocks.flags.c_contiguous
    copied = 0
    for first, count, offset, length in _runs(locations):
        if rows2d and blocks.shape[1] * blocks.itemsize == length:
            src = blocks[first : first + count].view(np.uint8)
            page_copy.copy(view[offset : offset + count * length].reshape(count, length), src)
        else:
            for k in range(count):
                start = offset + k * length
                np.copyto(view[start : start + length], _row(blocks, first + k, length))
        copied += count * length
    return copied


def read_blocks(view: np.ndarray, locations: Sequence, out) -> int:
    """Copies ``locations[i]`` into ``out[i]`` (skipping None / zero-length entries). Returns bytes copied.

    ``out`` is a writable C-contiguous 2-D array or a sequence of writable per-block arrays.
    """
    _check(view, locations, out)
    rows2d = isinstance(out, np.ndarray) and out.ndim == 2 and out.flags.c_contiguous
    copied = 0
    for first, count, offset, length in _runs(locations):
        if rows2d and out.shape[1] * out.itemsize == length:
            dst = out[first : first + count].view(np.uint8)
            page_copy.copy(dst, view[offset : offset + count * length].reshape(count, length))
        else:
            for k in range(count):
                start = offset + k * length
                np.copyto(_row(out, first + k, length), view[start : start + length])
        copied += count * length
    return copied


def block_checksums(view: np.ndarray, locations: Sequence) -> list[int]:
    """XXH3-64 of each located block's bytes in the pool, skipping None / zero-length entries: what
    ``seal(save_id, checksums=...)`` takes for a SaveBatch's ``allocations`` once they are written.
    The hash releases the GIL (~18 GB/s on one core here, about twice a memcpy)."""
    _check(view, locations, locations)
    return [checksum(view[loc.offset : loc.offset + loc.length]) for loc in locations if loc and loc.length]


def verify_blocks(view: np.ndarray, locations: Sequence) -> int:
    """How many leading ``locations`` hold the bytes their checksum names (a location whose checksum
    is 0, not known, counts as holding them). The first that does not ends the prefix: report its
    hash in ``release(corrupt_hashes=...)`` and treat it and the rest as misses."""
    _check(view, locations, locations)
    for i, loc in enumerate(locations):
        if loc.checksum and checksum(view[loc.offset : loc.offset + loc.length]) != loc.checksum:
            return i
    return len(locations)
