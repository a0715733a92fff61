"""What the scheduler-side connector tells the workers each engine step.

Built once per step by `SchedulerConnector.build_meta`, pickled to every worker with the
scheduler output. Block ids are vLLM's (the request's KV cache group 0); hashes are
vLLM's chained block hashes, one per full block, which key the blocks in pegaflow.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from pegaflow.connector.namespace import KvLayoutSpec


@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to move between vLLM's KV cache and the pool, in prompt order.

    Saves may carry the request's chain before these blocks (`head_*`: loaded, found in vLLM's
    prefix cache, or saved in an earlier step). They are sent with the save, head first, so the
    server keeps the chain's head ahead of its tail for eviction; stored ones cost no copy.
    """

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    head_block_ids: list[int] = dataclasses.field(default_factory=list)
    head_hashes: list[bytes] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_hashes) or len(self.head_block_ids) != len(self.head_hashes):
            raise ValueError(
                f"request {self.req_id}: {len(self.block_ids)} block ids but {len(self.block_hashes)} hashes"
                f" (head: {len(self.head_block_ids)} ids, {len(self.head_hashes)} hashes)"
            )


@dataclasses.dataclass
class PegaConnectorMetadata(KVConnectorMetadata):
    # external hits to land in vLLM's blocks before the layers of this step read them
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    # loads the scheduler promised but cannot plan, by request: the worker reports these
    # blocks as failed so vLLM recomputes them
    failed_loads: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # full blocks computed by this step (after its forward) to store
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)
    # requests preempted while this step was scheduled: their blocks may be reused by
    # this very step, so saves still reading them must finish or be dropped first
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)
    # finished requests whose blocks the scheduler keeps until the workers report their
    # saves done (finished_sending); exactly these ids may be reported
    delayed_free_req_ids: list[str] = dataclasses.field(default_factory=list)
    # this step's scheduled tokens: prompt (prefill) and decode (the workers time the forward and
    # fit the engine's own prefill cost from these: prefill_rate.py)
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.failed_loads
            or self.saves
            or self.preempted_req_ids
            or self.delayed_free_req_ids
        )


@dataclasses.dataclass
class PegaHandshake(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler once its KV tensors are registered (vLLM's
    handshake channel, worker -> EngineCore): the namespace layout it actually stores
    under, so the scheduler looks up exactly what the workers save and load. None when
    this worker runs without the cache (then the scheduler claims no hits)."""

    tp_rank: int
    layout: KvLayoutSpec | None
    reason: str = ""
