"""Which bytes of vLLM's KV tensors make a stored block, and the copies that move them.

vLLM hands the worker one tensor per attention layer whose first dimension is the block
id; on CPU each `tensor[block_id]` is one contiguous page whose interior order belongs
to the attention kernel (the vec kernels store K transposed). So pages are copied whole,
as opaque bytes, never interpreted. A stored block is every layer's page of one vLLM
block for one rank, laid out layer after layer in one contiguous pool location:

    pool[offset + layer * page_bytes : offset + (layer + 1) * page_bytes] == page of `layer`

Copies go one per run of blocks that are consecutive both in vLLM's cache and in the pool, per
layer, never per byte: a page-by-page copy of two strided byte views, outside the interpreter
lock, with streaming stores once common/native/page_copy.c is built (numpy's copyto, i.e. memcpy per page,
until then). Measured for a warm 10K-token load's pages (bench/page_copy_bench.py): torch's
``copy_`` of the same views ran ~30 % slower than numpy's, and numpy's memcpy slower than the
streaming copy: CPU the load takes from the forward beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pegaflow.common.native import page_copy


class LayoutMismatch(Exception):
    """vLLM's KV tensors are not the page layout the namespace promised."""


@dataclasses.dataclass(frozen=True)
class Run:
    """`count` blocks with consecutive vLLM block ids from `block_id` whose pool copies sit
    back to back from `offset` (block_bytes apart)."""

    block_id: int
    offset: int
    count: int


def plan_runs(block_ids: Sequence[int], offsets: Sequence[int], block_bytes: int) -> list[Run]:
    """Group (block id, pool offset) pairs into maximal runs, keeping their order."""
    if len(block_ids) != len(offsets):
        raise ValueError(f"{len(block_ids)} block ids but {len(offsets)} offsets")
    runs: list[Run] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if (
            i == len(block_ids)
            or block_ids[i] != block_ids[i - 1] + 1
            or offsets[i] != offsets[i - 1] + block_bytes
        ):
            if i > start:
                runs.append(Run(int(block_ids[start]), int(offsets[start]), i - start))
            start = i
    return runs


# One unit of a load's copies: (layer, [(pool, runs)], bytes): pages of one layer only.
CopyUnit = tuple[int, list[tuple[Any, list[Run]]], int]


def copy_units(
    plans: Sequence[tuple[Any, Sequence[Run]]], num_layers: int, page_bytes: int, unit_bytes: int
) -> list[CopyUnit]:
    """A load's copies (per pool, its runs) cut into units of at most `unit_bytes` (at least
    one page), in layer order, so several threads can share them and each layer is complete
    once its units are. A run longer than a unit is split; short runs are grouped."""
    per_unit = max(1, unit_bytes // page_bytes)  # pages per unit
    block_bytes = page_bytes * num_layers  # a stored block: every layer's page, back to back
    pieces: list[tuple[Any, Run]] = []
    for pool, runs in plans:
        for run in runs:
            for k in range(0, run.count, per_unit):
                count = min(per_unit, run.count - k)
                pieces.append((pool, Run(run.block_id + k, run.offset + k * block_bytes, count)))
    units: list[CopyUnit] = []
    for layer in range(num_layers):
        group: list[tuple[Any, list[Run]]] = []
        pages = 0
        for pool, run in pieces:
            if pages and pages + run.count > per_unit:
                units.append((layer, group, pages * page_bytes))
                group, pages = [], 0
            if group and group[-1][0] is pool:
                group[-1][1].append(run)
            else:
                group.append((pool, [run]))
            pages += run.count
        if pages:
            units.append((layer, group, pages * page_bytes))
    return units


class KvPages:
    """vLLM's registered KV tensors seen as `num_layers` arrays of `[num_blocks, page_bytes]` bytes."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, layer_names: Sequence[str]):
        if num_blocks <= 0:
            raise LayoutMismatch(f"num_blocks must be positive, got {num_blocks}")
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise LayoutMismatch(f"KV tensors missing for layers {missing}")
        self.layer_names = list(layer_names)
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.num_blocks = num_blocks
        pages: list[np.ndarray] = []
        page_bytes = None
        for name in self.layer_names:
            t = kv_caches[name]
            if t.device.type != "cpu":
                raise LayoutMismatch(
                    f"{name}: KV tensor on {t.device}, the CPU page copier needs host memory"
                )
            if not t.is_contiguous():
                raise LayoutMismatch(f"{name}: KV tensor is not contiguous (stride {tuple(t.stride())})")
            nbytes = t.numel() * t.element_size()
            if t.dim() == 0 or t.shape[0] % num_blocks or nbytes % num_blocks:
                raise LayoutMismatch(
                    f"{name}: shape {tuple(t.shape)} does not split into {num_blocks} blocks on dim 0"
                )
            this_page = nbytes // num_blocks
            if page_bytes is None:
                page_bytes = this_page
            elif this_page != page_bytes:
                raise LayoutMismatch(f"{name}: page of {this_page} B, other layers {page_bytes} B")
            # a byte view of the same memory: [block, page bytes]
            pages.append(t.view(-1).view(torch.uint8).view(num_blocks, this_page).numpy())
        if page_bytes is None:
            raise LayoutMismatch("no KV tensors registered")
        self.pages = pages
        self.page_bytes = page_bytes
        self.num_layers = len(pages)
        self.block_bytes = page_bytes * self.num_layers
        page_copy.start()  # numpy's copies until the native one is built and proven

    def _pool_pages(self, pool: np.ndarray, run: Run, layer: int) -> np.ndarray:
        """The `[count, page_bytes]` strided view of one layer's pages of a run in the pool."""
        end = run.offset + run.count * self.block_bytes
        if run.offset < 0 or end > pool.size:
            raise ValueError(f"pool location [{run.offset}, {end}) outside the pool of {pool.size} B")
        # Inside [offset, end): the last page ends (count - 1) * block_bytes + (layer + 1) * page_bytes
        # after offset, and (layer + 1) * page_bytes <= block_bytes.
        return np.lib.stride_tricks.as_strided(
            pool[run.offset + layer * self.page_bytes :],
            (run.count, self.page_bytes),
            (self.block_bytes, 1),
        )

    def _check_blocks(self, run: Run) -> None:
        if run.block_id < 0 or run.block_id + run.count > self.num_blocks:
            raise ValueError(
                f"blocks [{run.block_id}, {run.block_id + run.count}) outside 0..{self.num_blocks}"
            )

    def load_layer(self, pool: np.ndarray | torch.Tensor, runs: Sequence[Run], layer: int) -> int:
        """Copy one layer's pages of `runs` from the pool (a flat byte array) into vLLM's cache;
        returns bytes copied."""
        pool = _bytes(pool)
        dst_layer = self.pages[layer]
        copied = 0
        for run in runs:
            self._check_blocks(run)
            dst = dst_layer[run.block_id : run.block_id + run.count]
            page_copy.copy(dst, self._pool_pages(pool, run, layer))
            copied += run.count * self.page_bytes
        return copied

    def save_blocks(self, pool: np.ndarray | torch.Tensor, runs: Sequence[Run]) -> int:
        """Copy every layer's pages of `runs` from vLLM's cache into the pool (a flat byte array);
        returns bytes copied."""
        pool = _bytes(pool)
        copied = 0
        for run in runs:
            self._check_blocks(run)
            lo, hi = run.block_id, run.block_id + run.count
            for layer, src_layer in enumerate(self.pages):
                page_copy.copy(self._pool_pages(pool, run, layer), src_layer[lo:hi])
                copied += run.count * self.page_bytes
        return copied

    def block_bytes_of(self, block_id: int) -> bytes:
        """One block as it is stored (all layers' pages in order): for checks and tests."""
        return b"".join(p[block_id].tobytes() for p in self.pages)


def _bytes(pool: np.ndarray | torch.Tensor) -> np.ndarray:
    """The pool as a flat uint8 numpy array (a CPU byte tensor is viewed, not copied)."""
    if isinstance(pool, torch.Tensor):
        pool = pool.numpy()
    if pool.dtype != np.uint8 or pool.ndim != 1:
        raise ValueError(f"the pool must be a flat byte array, got {pool.dtype} of shape {pool.shape}")
    return pool
