"""PegaKVConnector inside vLLM's own Scheduler (the class vLLM builds from the kv-transfer
config, with the connector from its factory) with the worker half driven by the
scheduler's real step outputs, over a real pegaflow-server; the model forward is the
one part left out (blocks are filled with known bytes instead).

Proves against vLLM's code, not a model of it: saves are planned and finished requests
keep their blocks until the worker reports them saved; a second request loads the
first's blocks byte for byte; and a load that fails after the lookup promised it is
recomputed, not failed (the connector sets kv_load_failure_policy=recompute; with the
policy honoured as vLLM's default "fail", the same failure fails the request).
"""

from __future__ import annotations

import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from pegaflow.connector import PegaKVConnector
from pegaflow.connector.config import load_config
from pegaflow.connector.namespace import build_layouts, layout_for_rank
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.tests.support import wait_for
from pegaflow.connector.worker import WorkerConnector
from pegaflow.server.testing import ServerProcess
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec, ensure_tiny_model

pytestmark = pytest.mark.timeout(300)

BS, KV_HEADS, HEAD, LAYERS, NUM_BLOCKS = 128, 2, 64, 4, 64
PAGE = KV_HEADS * BS * 2 * HEAD * 2  # CPU attention page: [heads, tokens, K|V] bf16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PROMPT = [(i * 37) % 3900 + 3 for i in range(1000)]  # 7 full blocks + a tail
FULL = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # the default tiny model: qwen3, 4 layers, 2 KV heads of 64
    return ensure_tiny_model(tmp_path_factory.mktemp("models"), TinyModelSpec())


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path / "server", pool_size="64mb") as srv:
        yield srv


class Engine:
    """vLLM's Scheduler + this connector's worker half, stepped like EngineCore does."""

    def __init__(self, model_dir, addr: str, register: bool = True, **extra):
        kv = KVTransferConfig(
            kv_connector="PegaKVConnector",
            kv_role="kv_both",
            kv_connector_module_path="pegaflow.connector",
            kv_connector_extra_config={"server_addr": addr, **extra},
        )
        args = EngineArgs(
            model=str(model_dir),
            dtype="bfloat16",
            max_model_len=4096,
            enforce_eager=True,
            enable_prefix_caching=False,
            kv_transfer_config=kv,
        )
        self.vllm_config = vc = args.create_engine_config()
        assert vc.cache_config.block_size == BS
        specs = {
            name: FullAttentionSpec(
                block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
            )
            for name in LAYER_NAMES
        }
        resolve_kv_cache_layout(vc, [["LBHNC"]], specs.values())
        self.kv_cache_config = kcc = get_kv_cache_configs(vc, [specs], [NUM_BLOCKS * PAGE * LAYERS])[0]
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BS,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BS, hash_fn)
        # the worker's KV tensors: per-layer views of one buffer, as vLLM's CPU backend
        n = kcc.num_blocks
        backing = torch.zeros(LAYERS * n * PAGE, dtype=torch.int8)
        self.caches = {
            name: backing[i * n * PAGE : (i + 1) * n * PAGE]
            .view(torch.bfloat16)
            .view(n, KV_HEADS, BS, 2 * HEAD)
            for i, name in enumerate(LAYER_NAMES)
        }
        cfg = load_config(kv.kv_connector_extra_config)
        layout = layout_for_rank(build_layouts(vc, kcc, cfg.model_id, cfg.namespace_salt), 0)
        self.worker = WorkerConnector(
            cfg, layout, num_blocks=n, layer_names=LAYER_NAMES, instance_name="test"
        )
        self.worker.register_kv_caches(self.caches if register else {})
        # what EngineCore does once the workers registered their KV caches
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): self.worker.handshake()})
        self.outputs = []
        self.connector_stats = []  # SchedulerStats.kv_connector_stats payloads, per step

    @property
    def connector(self):
        return self.scheduler.connector

    def add(self, req_id: str, max_tokens: int = 1) -> Request:
        req = Request(
            req_id, list(PROMPT), SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher
        )
        self.scheduler.add_request(req)
        return req

    def step(self, compute=None):
        """schedule -> worker hooks (in vLLM's order) -> update_from_output."""
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        w.begin_step(meta)  # what PegaKVConnector.handle_preemptions calls
        w.start_load(meta)
        for name in LAYER_NAMES:
            w.wait_for_layer(name)
        if compute is not None:
            compute(so)  # stands in for the forward writing the scheduled blocks
        w.finish_step(meta)
        sending = w.finished_sending(meta.delayed_free_req_ids)
        invalid = w.take_load_errors()
        req_ids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[11] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                invalid_block_ids=invalid,
                kv_connector_stats=self.worker.metrics.take(),  # what the worker role returns
            ),
        )
        out = self.scheduler.update_from_output(so, mro)
        for engine_outputs in out.values():
            self.outputs.extend(engine_outputs.outputs)
            stats = engine_outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                self.connector_stats.append(stats.kv_connector_stats)
        return so, meta, invalid

    def finished(self, req_id: str):
        return [o for o in self.outputs if o.request_id == req_id and o.finish_reason is not None]

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self):
        self.worker.shutdown()
        self.connector.shutdown()


def fill_blocks_of(engine: Engine, req_id: str, value_of):
    """A stand-in forward: every layer's page of the request's blocks gets known bytes."""

    def compute(so):
        for new in so.scheduled_new_reqs:
            if new.req_id == req_id:
                for idx, block_id in enumerate(new.block_ids[0]):
                    for name in LAYER_NAMES:
                        engine.caches[name][block_id].fill_(value_of(idx))

    return compute


def test_a_worker_without_the_cache_makes_the_scheduler_claim_no_hits(model_dir, server):
    engine = Engine(model_dir, server.addr)
    try:
        attached(engine)
        store_prompt(engine)
    finally:
        engine.close()
    # an engine whose worker could not register its KV tensors (e.g. a layout it cannot copy)
    crippled = Engine(model_dir, server.addr, register=False)
    try:
        assert crippled.worker.handshake().layout is None
        crippled.add("r2")
        so, meta, invalid = crippled.step()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit claimed, nothing to fail
        assert meta.loads == [] and invalid == set()
    finally:
        crippled.close()


def attached(engine: Engine) -> None:
    wait_for(lambda: engine.worker.link.usable() is not None and engine.connector._link.usable() is not None)


def store_prompt(engine: Engine) -> list[int]:
    """R1 computes the prompt and finishes; returns its block ids once its saves are done."""
    free_before = engine.free_blocks()
    engine.add("r1")
    so, meta, _ = engine.step(fill_blocks_of(engine, "r1", lambda idx: float(idx + 1)))
    (save,) = meta.saves
    assert save.req_id == "r1" and len(save.block_ids) == FULL
    assert engine.finished("r1")[0].finish_reason == FinishReason.LENGTH
    # vLLM keeps the finished request's blocks until the worker reports its saves done
    assert engine.free_blocks() < free_before
    wait_for(lambda: engine.step() and engine.free_blocks() == free_before)
    return save.block_ids


def test_the_connector_makes_vllm_recompute_failed_loads(model_dir, server):
    engine = Engine(model_dir, server.addr)
    try:
        assert engine.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        assert engine.scheduler.recompute_kv_load_failures is True
    finally:
        engine.close()
    honoring = Engine(model_dir, server.addr, honor_kv_load_failure_policy=True)
    try:
        assert honoring.scheduler.recompute_kv_load_failures is False  # vLLM's default "fail"
    finally:
        honoring.close()


def test_saved_blocks_come_back_byte_for_byte_in_a_later_request(model_dir, server):
    engine = Engine(model_dir, server.addr)
    try:
        attached(engine)
        store_prompt(engine)
        for t in engine.caches.values():
            t.zero_()  # whatever R2 reads, it must have loaded
        engine.add("r2")
        so, meta, invalid = engine.step()
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == FULL * BS  # 896 tokens from pegaflow
        assert so.num_scheduled_tokens["r2"] == len(PROMPT) - FULL * BS
        assert so.has_sync_kv_loads
        (load,) = meta.loads
        assert load.block_ids == new.block_ids[0][:FULL]
        assert invalid == set()
        # R1's blocks went back to vLLM's free pool (and may be R2's now): the bytes came
        # from pegaflow
        for idx, block_id in enumerate(load.block_ids):
            for name in LAYER_NAMES:
                assert engine.caches[name][block_id].eq(float(idx + 1)).all()
        assert engine.finished("r2")[0].finish_reason == FinishReason.LENGTH
    finally:
        engine.close()


def test_vllm_carries_the_connectors_stats_of_both_roles(model_dir, server):
    """What vLLM's Scheduler hands to its loggers (SchedulerStats.kv_connector_stats, every step)
    adds up to exactly what a cold and a warm request moved."""
    engine = Engine(model_dir, server.addr)
    try:
        attached(engine)
        store_prompt(engine)
        engine.add("r2")
        engine.step()
        assert engine.finished("r2")
        total = PegaKVConnectorStats()
        for payload in engine.connector_stats:
            total.aggregate(PegaKVConnector.build_kv_connector_stats(payload))
        block = PAGE * LAYERS
        assert total.counters == {
            "lookups": 2,  # r1 (nothing stored yet) and r2
            "lookup_blocks": 2 * FULL,
            "lookup_hit_blocks": FULL,
            "hit_tokens": FULL * BS,
            "save_blocks": FULL,  # r1's full blocks; r2 completes none
            "save_bytes": FULL * block,
            "load_blocks": FULL,
            "load_bytes": FULL * block,
        }
        assert len(total.samples["lookup_seconds"]) == 2
        assert len(total.samples["load_seconds"]) == len(total.samples["load_stall_seconds"]) == 1
        assert len(total.samples["save_seconds"]) == 1
        assert engine.scheduler.connector.get_kv_connector_stats() is None  # all handed over
    finally:
        engine.close()


def failed_load_after_lookup(model_dir, server, **extra):
    """R3's lookup finds the prompt, then the server dies before the worker loads it."""
    engine = Engine(model_dir, server.addr, **extra)
    attached(engine)
    store_prompt(engine)
    engine.add("r3", max_tokens=2)
    # schedule() runs the lookup; the server dies before the worker's lease
    so = engine.scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == FULL * BS
    server.kill()
    meta = so.kv_connector_metadata
    w = engine.worker
    w.start_load(meta)
    for name in LAYER_NAMES:
        w.wait_for_layer(name)
    w.finish_step(meta)
    invalid = w.take_load_errors()
    assert invalid == set(meta.loads[0].block_ids)
    failed = w.metrics.take()
    assert failed.counters["load_failed_blocks"] == FULL and failed.counters.get("load_blocks", 0) == 0
    mro = ModelRunnerOutput(
        req_ids=["r3"],
        req_id_to_index={"r3": 0},
        sampled_token_ids=[[11]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
    )
    out = engine.scheduler.update_from_output(so, mro)
    for engine_outputs in out.values():
        engine.outputs.extend(engine_outputs.outputs)
    return engine


def test_a_load_that_fails_after_the_lookup_is_recomputed(model_dir, server):
    engine = failed_load_after_lookup(model_dir, server)
    try:
        assert engine.finished("r3") == []  # not failed
        req = engine.scheduler.requests["r3"]
        assert req.num_computed_tokens == 0  # rolled back to the first failed block
        so, meta, invalid = engine.step()
        assert so.num_scheduled_tokens["r3"] == len(PROMPT)  # recomputed from the start
        assert meta.loads == [] and invalid == set()
        while not engine.finished("r3"):
            engine.step()
        assert engine.finished("r3")[0].finish_reason == FinishReason.LENGTH
    finally:
        engine.close()


def test_with_vllms_default_policy_the_same_failure_fails_the_request(model_dir, server):
    engine = failed_load_after_lookup(model_dir, server, honor_kv_load_failure_policy=True)
    try:
        (finished,) = engine.finished("r3")
        assert finished.finish_reason == FinishReason.ERROR
    finally:
        engine.close()
