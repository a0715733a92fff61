"""MLA under tensor parallelism: one stored copy per TP group, and who writes it.

An MLA model (DeepSeek-V2/V3 style) caches one compressed latent per token (kv_lora_rank
+ the RoPE'd key part) that every attention head reads, so tensor parallelism does not
shard it: each TP rank computes and holds the same bytes. (At TP=2 the all-reduce that
feeds the latent is exact, a + b == b + a; at TP >= 3 vLLM-CPU's shared-memory all-reduce
sums in a rank-rotated order, so two ranks may differ in the last bf16 bit of a few
values: storing once then makes every rank use one rank's rounding, which is as valid a
computation as either.) The bytes do depend on the TP size (the all-reduce changes the
rounding from layer 1 on), so the namespace keeps `tp_size` and drops only the rank.

How the group shares one copy (`mla_store = "once"`, the default):

- **Writer.** Exactly one rank saves each block: `writer_rank(hash, tp_size)`, a stable
  digest of vLLM's block hash modulo the TP size. Every rank sees the same step metadata
  and the same hashes, so the ranks agree on the writer without talking, and the save
  work (allocate, copy, seal) is spread evenly instead of landing on rank 0.
- **Readers.** Every rank queries the one namespace and copies the same sealed location.
  The server only ever returns sealed blocks (AllocateBlocks hides a block until its
  SealBlocks), so no rank reads a block its writer has not finished: a block still being
  written, or evicted between the scheduler's lookup and a rank's lease, is simply not a
  hit, and that rank reports the block as a load error.
- **When ranks disagree.** vLLM unions the load errors of all workers and rolls the
  request back to its first failed block on every rank (policy "recompute"), so the
  scheduler's view stays one view. The step that found the error already ran the
  request's forward, and a tensor-parallel forward mixes every rank's partial results
  (the all-reduce after attention): one rank's missing block spoils what *all* ranks
  computed for that request in that step. So the scheduler never plans a request's saves
  in the step that loads it, only in a later step (scheduler._plan_saves, `defer`), after
  vLLM reported that step's errors: no rank stores a block computed over missing KV. That
  holds while vLLM processes a step's output before it schedules the next, which vLLM-CPU
  always does (it turns async scheduling off); with async scheduling (vLLM's GPU default,
  two batches in flight) the next step is scheduled first, so a deferral of one step is
  not enough there.

A non-MLA model (per-head KV shards) is never shared across ranks: its layouts carry the
rank. `mla_store = "per_rank"` stores an MLA model like that too (each rank its own copy
in its own namespace), for A/B comparisons of the pool budget.

No vLLM import at module level: the pure parts are unit-tested without an engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

STORE_ONCE = "once"
STORE_PER_RANK = "per_rank"
STORE_MODES = (STORE_ONCE, STORE_PER_RANK)


def parse_store_mode(value: Any) -> str:
    """kv_connector_extra_config["mla_store"] -> "once" | "per_rank" (ValueError otherwise)."""
    if not isinstance(value, str) or value not in STORE_MODES:
        raise ValueError(
            f"kv_connector_extra_config['mla_store'] must be one of {list(STORE_MODES)}, got {value!r}"
        )
    return value


def writer_rank(block_hash: bytes, tp_size: int) -> int:
    """The TP rank that stores this block. An unkeyed digest, so every process of every
    engine (any Python hash seed) picks the same rank, and hashes of any algorithm
    (sha256, xxhash, ...) spread evenly."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    if tp_size == 1:
        return 0
    digest = hashlib.blake2b(block_hash, digest_size=8).digest()
    return int.from_bytes(digest, "little") % tp_size


def own_blocks(
    shared: bool, tp_rank: int, tp_size: int, block_ids: Sequence[int], hashes: Sequence[bytes]
) -> tuple[list[int], list[bytes]]:
    """The (block ids, hashes) of a save that this rank writes, in their order."""
    if len(block_ids) != len(hashes):
        raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
    if not shared:
        return list(block_ids), list(hashes)
    keep = [i for i, h in enumerate(hashes) if writer_rank(h, tp_size) == tp_rank]
    return [block_ids[i] for i in keep], [hashes[i] for i in keep]


ROPE_WORKAROUND_HINT = (
    "vllm-cpu's rotary-embedding kernel mis-rotates MLA's strided k_pe (token i lands at the "
    "wrong position and the bytes depend on the batch), which no logprob shows but every cached "
    "block carries; start vLLM with "
    '--compilation-config \'{"custom_ops":["-rotary_embedding"]}\' to use the native rotation'
)


def rope_workaround_missing(vllm_config: Any) -> bool:
    """True for an MLA model on CPU whose rotary embedding runs vllm-cpu's custom kernel (custom
    ops "all" or "+rotary_embedding", no "-rotary_embedding")."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return False
    if not getattr(vllm_config.model_config, "use_mla", False):
        return False
    ops = list(getattr(vllm_config.compilation_config, "custom_ops", None) or [])
    if "-rotary_embedding" in ops:
        return False
    return "+rotary_embedding" in ops or "none" not in ops
