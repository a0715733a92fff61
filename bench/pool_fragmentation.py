"""Fragmentation of the pool's slab allocator under mixed block sizes, through the real KVEngine.

    .venv/bin/python bench/pool_fragmentation.py      # writes bench/results/pool_fragmentation.json

Bookkeeping only (no bytes are copied): blocks are allocated, sealed, looked up
and evicted by the engine with its default LRU policy over a real 2 GiB memfd
pool (64 MiB slabs). Realistic sizes: 256 KiB, 1.07 MiB (DeepSeek-V3 MLA,
61 layers x 16 tokens x 576 x bf16) and 2.25 MiB (Qwen3-8B, 36 layers, K+V,
16 tokens x 8 heads x 128 x bf16). Reported, sampled once the pool is full:

- utilization: bytes held by blocks / pool capacity;
- stranded: bytes of slabs assigned to one size that hold no block (free slots,
  slot tails) - the price of serving many sizes from one pool;
- each size's share of the pool, and slabs moved between sizes.

Scenarios: one size alone; three sizes interleaved at random with Zipf reuse;
and a phase shift (only the small size writes, then only the large) to show that
a size that arrives late still gets the pool (no starvation).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import numpy as np

from pegaflow.server.config import GIB, KIB, ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.store.namespace import KvLayout

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
POOL = 2 * GIB
SIZES = {"256KiB": 256 * KIB, "mla_1.07MiB": 61 * 16 * 576 * 2, "qwen3_2.25MiB": 36 * 2 * 16 * 8 * 128 * 2}
BATCH = 32


class Run:
    def __init__(self) -> None:
        self.engine = KVEngine(ServerConfig(pool_size_bytes=POOL, http_addr=None))
        self.sid = self.engine.open_session("fragmentation", expires=False).session_id
        self.inst = {
            name: self.engine.register_instance(
                self.sid, KvLayout(model_id=name, block_bytes=size)
            ).instance_id
            for name, size in SIZES.items()
        }
        self.samples: list[dict] = []

    def save(self, name: str, keys: list[int]) -> None:
        hashes = [f"{name}-{k}".encode() for k in keys]
        res = self.engine.allocate_blocks(self.sid, self.inst[name], hashes)
        if res.save_id:
            self.engine.seal_blocks(self.sid, res.save_id)

    def lookup(self, name: str, keys: list[int]) -> None:
        self.engine.query_prefix(self.sid, self.inst[name], [f"{name}-{k}".encode() for k in keys])

    def sample(self) -> dict:
        stats = self.engine.stats()
        share = {}
        for ns in stats.namespaces:
            share[ns.model_id] = ns.resident_blocks * ns.block_bytes / stats.pool_capacity_bytes
        row = {
            "utilization": stats.pool_used_bytes / stats.pool_capacity_bytes,
            "stranded_fraction": stats.stranded_bytes / stats.pool_capacity_bytes,
            "free_slabs": stats.free_slabs,
            "slab_moves": stats.slab_moves,
            "evictions": stats.evictions,
            "share": share,
        }
        self.samples.append(row)
        return row

    def close(self) -> None:
        self.engine.close()


def summary(samples: list[dict]) -> dict:
    util = [s["utilization"] for s in samples]
    stranded = [s["stranded_fraction"] for s in samples]
    return {
        "samples": len(samples),
        "utilization_median": statistics.median(util),
        "utilization_min": min(util),
        "stranded_fraction_median": statistics.median(stranded),
        "stranded_fraction_max": max(stranded),
        "slab_moves": samples[-1]["slab_moves"],
        "evictions": samples[-1]["evictions"],
        "final_share": samples[-1]["share"],
    }


def scenario_single() -> dict:
    run = Run()
    try:
        rng = np.random.default_rng(1)
        for step in range(1200):
            run.save("qwen3_2.25MiB", list(range(step * BATCH, (step + 1) * BATCH)))
            run.lookup("qwen3_2.25MiB", sorted(rng.integers(0, (step + 1) * BATCH, 16).tolist()))
            if step >= 100 and step % 10 == 0:
                run.sample()
        return {
            "sizes": ["qwen3_2.25MiB"],
            **summary(run.samples),
            "slab_bytes": run.engine.allocator.slab_bytes,
        }
    finally:
        run.close()


def scenario_mixed() -> dict:
    """Three sizes, random interleaving; reuse follows a Zipf law over each size's keys."""
    run = Run()
    try:
        rng = np.random.default_rng(2)
        names = list(SIZES)
        next_key = dict.fromkeys(names, 0)
        for step in range(3000):
            name = names[rng.integers(0, len(names))]
            if rng.random() < 0.5 and next_key[name] > BATCH:
                # Re-save of popular keys (dedup: EXISTS when still resident, a fresh copy when evicted).
                keys = (next_key[name] - rng.zipf(1.3, BATCH)).clip(0).tolist()
            else:
                keys = list(range(next_key[name], next_key[name] + BATCH))
                next_key[name] += BATCH
            run.save(name, keys)
            if step >= 300 and step % 10 == 0:
                run.sample()
        return {"sizes": names, **summary(run.samples)}
    finally:
        run.close()


def scenario_phase_shift() -> dict:
    """Only 256 KiB blocks for a while (they take the whole pool), then only 2.25 MiB blocks."""
    run = Run()
    try:
        for step in range(600):
            run.save("256KiB", list(range(step * BATCH, (step + 1) * BATCH)))
        before = run.sample()
        timeline = []
        for step in range(400):
            run.save("qwen3_2.25MiB", list(range(step * BATCH, (step + 1) * BATCH)))
            if step % 20 == 0:
                row = run.sample()
                timeline.append({"step": step, "share_large": row["share"].get("qwen3_2.25MiB", 0.0)})
        after = run.sample()
        return {
            "share_before": before["share"],
            "share_after": after["share"],
            "utilization_after": after["utilization"],
            "stranded_fraction_after": after["stranded_fraction"],
            "slab_moves": after["slab_moves"],
            "timeline": timeline,
        }
    finally:
        run.close()


def main() -> int:
    results = {
        "command": "bench/pool_fragmentation.py",
        "pool_bytes": POOL,
        "block_sizes": SIZES,
        "single_size": scenario_single(),
        "mixed_sizes": scenario_mixed(),
        "phase_shift": scenario_phase_shift(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "pool_fragmentation.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    for name in ("single_size", "mixed_sizes"):
        r = results[name]
        print(
            f"{name}: utilization median {r['utilization_median']:.1%} (min {r['utilization_min']:.1%}), "
            f"stranded median {r['stranded_fraction_median']:.1%} (max {r['stranded_fraction_max']:.1%}), "
            f"slab moves {r['slab_moves']}, evictions {r['evictions']}"
        )
    p = results["phase_shift"]
    print(
        f"phase_shift: large-block share {p['share_after'].get('qwen3_2.25MiB', 0):.1%} after the shift, "
        f"utilization {p['utilization_after']:.1%}, slab moves {p['slab_moves']}"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
