"""Helpers for the connector's tests: vLLM-shaped CPU KV tensors, worker steps driven in
vLLM's hook order, layouts, hashes and polling."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata
from pegaflow.connector.namespace import KvLayoutSpec
from pegaflow.connector.worker import WorkerConnector

NUM_BLOCKS, HEADS, TOKENS, WIDTH, LAYERS = 32, 2, 32, 64, 4
PAGE_BYTES = HEADS * TOKENS * WIDTH * 2  # bf16
BLOCK_BYTES = PAGE_BYTES * LAYERS
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer views into one int8 backing buffer (layer-major), as vLLM's CPU backend."""
    per_layer = NUM_BLOCKS * PAGE_BYTES
    backing = torch.zeros(LAYERS * per_layer, dtype=torch.int8)
    caches = {
        name: backing[i * per_layer : (i + 1) * per_layer]
        .view(torch.bfloat16)
        .view(NUM_BLOCKS, HEADS, TOKENS, WIDTH)
        for i, name in enumerate(LAYER_NAMES)
    }
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in caches.values():
            t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    return caches


def block_bytes(caches: dict[str, torch.Tensor], block_id: int) -> bytes:
    return b"".join(caches[n][block_id].contiguous().view(torch.uint8).numpy().tobytes() for n in LAYER_NAMES)


def layout(model: str = "tiny-a", *, mla: bool = False, tp_size: int = 1, tp_rank: int = 0) -> KvLayoutSpec:
    return KvLayoutSpec(
        model_id=model,
        model_fingerprint=hashlib.sha256(model.encode()).hexdigest(),
        dtype="bfloat16",
        layout="cpu:attn:test:LBHNC:auto",
        block_tokens=TOKENS,
        block_bytes=BLOCK_BYTES,
        num_layers=LAYERS,
        tp_size=tp_size,
        tp_rank=tp_rank,
        mla=mla,
    )


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def config(addr: str, **overrides) -> ConnectorConfig:
    # generous step-path deadlines: other tests load this machine, and a local RPC that
    # misses a tight deadline would open the breaker and fail an unrelated check
    values = dict(
        server_addr=addr, lookup_timeout_s=1.0, load_timeout_s=2.0, rpc_timeout_s=5.0, retry_interval_s=0.2
    )
    values.update(overrides)
    return ConnectorConfig(**values)


def worker(
    cfg: ConnectorConfig, lay: KvLayoutSpec, caches: dict[str, torch.Tensor], name: str
) -> WorkerConnector:
    w = WorkerConnector(cfg, lay, num_blocks=NUM_BLOCKS, layer_names=list(LAYER_NAMES), instance_name=name)
    w.register_kv_caches(caches)
    return w


def step(w: WorkerConnector, meta: PegaConnectorMetadata) -> tuple[set[str], set[int]]:
    """One engine step in vLLM's hook order; returns (finished_sending, failed block ids)."""
    w.begin_step(meta)  # vLLM's handle_preemptions: settles preempted saves, starts host loads
    w.start_load(meta)
    for name in LAYER_NAMES:
        w.wait_for_layer(name)
    w.finish_step(meta)
    done = w.finished_sending(meta.delayed_free_req_ids)
    return done, w.take_load_errors()


def save_meta(req_id: str, block_ids: list[int], block_hashes: list[bytes]) -> PegaConnectorMetadata:
    return PegaConnectorMetadata(saves=[BlockTransfer(req_id, list(block_ids), list(block_hashes))])


def load_meta(req_id: str, block_ids: list[int], block_hashes: list[bytes]) -> PegaConnectorMetadata:
    return PegaConnectorMetadata(loads=[BlockTransfer(req_id, list(block_ids), list(block_hashes))])


def save_and_wait(w: WorkerConnector, req_id: str, block_ids: list[int], block_hashes: list[bytes]) -> None:
    """Save in one step, finish the request, step until the worker reports its saves done."""
    step(w, save_meta(req_id, block_ids, block_hashes))
    finished = PegaConnectorMetadata(delayed_free_req_ids=[req_id])
    done, _ = step(w, finished)
    deadline = time.monotonic() + 30
    while req_id not in done:
        assert time.monotonic() < deadline, "saves never finished"
        time.sleep(0.02)
        done, _ = step(w, PegaConnectorMetadata())


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {timeout_s} s")
        time.sleep(interval_s)


def ready_blocks(lookup):
    """A ServerPrefixLookup answering the number of ready leading blocks (None: no answer), as the
    tests of the server-backed lookup compare it."""

    def call(hashes):
        answer = lookup(hashes)
        return None if answer is None else answer.ready

    return call


class StandInLink:
    """ServerLink's surface as the worker and the lookup use it, over ``client`` (any object: the
    calls that reach it are the test's); records the failures reported and whether it was closed."""

    def __init__(self, client=None):
        self.client = client if client is not None else object()
        self.failures: list[str] = []
        self.closed = False

    def usable(self):
        return self.client, ("instance",)

    def report_failure(self, exc, what):
        self.failures.append(what)

    def close(self):
        self.closed = True
