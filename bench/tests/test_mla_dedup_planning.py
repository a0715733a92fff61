"""The MLA dedup experiment's planning, without vLLM: block geometry, the budget rule (the working
set fits in B once but not per rank), the TP=8 arithmetic, the engine flags and the figure."""

from __future__ import annotations

import json

import numpy as np

from pegaflow.bench.experiments import ab, mla_dedup
from pegaflow.bench.harness import cachesim, plots, results, traces


def test_block_is_the_real_deepseek_v3_block():
    # 61 layers x 16 tokens x (512 latent + 64 rope) x bf16
    assert mla_dedup.mla_block_bytes() == 1_124_352


def _budget(setup):
    trace = traces.generate(setup.trace)
    blocks = cachesim.trace_blocks(trace, mla_dedup.BLOCK_TOKENS)
    return trace, mla_dedup.plan_budget(setup, blocks, mla_dedup.mla_block_bytes(setup.model))


def test_the_budget_holds_the_working_set_once_but_not_per_rank():
    for setup in (mla_dedup.FULL, mla_dedup.REGRESSION):
        _, budget = _budget(setup)
        assert budget["capacity_blocks"] >= budget["working_set_blocks"] == budget["target_blocks"]
        assert budget["logical_capacity_blocks"]["per_rank"] < budget["working_set_blocks"]
        model = budget["lru_model"]
        assert model["once"]["block_hit_rate"] >= 0.95 * budget["unbounded_lru"]["block_hit_rate"]
        assert (
            model["once"]["block_hit_rate"] - model["per_rank"]["block_hit_rate"]
            > 2 * mla_dedup.REGRESSION_MIN_GAP
        )
        # more ranks, more copies, fewer hits; store-once does not depend on the TP size
        assert budget["lru_model_tp8"]["per_rank"]["block_hit_rate"] < model["per_rank"]["block_hit_rate"]
        assert budget["lru_model_tp8"]["once"] == model["once"]
        assert budget["exact_ceiling"] >= model["once"]["block_hit_rate"]
        assert budget["request_ceiling"] >= model["once"]["request_hit_rate"]


def test_request_ceiling_counts_requests_whose_first_block_was_seen():
    def rb(i, keys):
        return cachesim.RequestBlocks(i, 0, 16 * len(keys) + 1, tuple(keys), len(keys))

    blocks = [rb(0, [b"a", b"b"]), rb(1, [b"a", b"c"]), rb(2, [b"d"]), rb(3, [b"b"])]
    # request 1 starts with a seen block; 3's first block b was seen (as request 0's second)
    assert mla_dedup.request_ceiling(blocks) == 0.5


def test_engine_flags():
    cfg = mla_dedup.vllm_config(mla_dedup.FULL, "/models/m", "per_rank", "127.0.0.1:1")
    args = list(cfg.extra_args)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--attention-backend") + 1] == "CPU_MLA"
    custom = json.loads(args[args.index("--compilation-config") + 1])["custom_ops"]
    assert "-rotary_embedding" in custom
    extra = cfg.kv_transfer_config["kv_connector_extra_config"]
    assert extra["mla_store"] == "per_rank" and extra["server_addr"] == "127.0.0.1:1"
    assert cfg.placement.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def _summary(throughput, ttft, block_hit, request_hit, prompt_tokens=1000, cached=500, n=10):
    return results.RequestSummary(
        requests=n, succeeded=n, failed=0, errors=(), duration_s=n / throughput,
        throughput_rps=throughput, ttft_mean_s=ttft, ttft_p50_s=ttft, ttft_p90_s=ttft,
        ttft_p99_s=2 * ttft, e2e_mean_s=ttft, e2e_p99_s=ttft, prompt_tokens=prompt_tokens,
        cached_tokens=cached, token_hit_rate=cached / prompt_tokens, full_prompt_blocks=100,
        loaded_blocks=int(100 * block_hit), block_hit_rate=block_hit, request_hit_rate=request_hit,
        responses_without_cached_tokens=0,
    )  # fmt: skip


def test_tp8_arithmetic_and_verdict_and_figure(tmp_path):
    _, budget = _budget(mla_dedup.REGRESSION)
    context = {
        "setup": mla_dedup.REGRESSION.to_dict(),
        "trace": {"prompt_tokens_mean": 600.0},
        "budget": budget,
    }
    report = ab.ABReport("mla_dedup", context)
    report.arms["once"] = ab.ArmReport(
        "once", {}, _summary(0.5, 1.0, 0.75, 0.87, 6000, 4500), {"hll_ceiling": 0.8}
    )
    report.arms["per_rank"] = ab.ArmReport(
        "per_rank", {}, _summary(0.3, 2.0, 0.40, 0.54, 6000, 2400), {"hll_ceiling": 0.8}
    )
    mla_dedup.EXPERIMENT.analyse(report)
    assert np.isclose(report.comparison.throughput_gain, 0.5 / 0.3 - 1)
    assert np.isclose(report.comparison.gap("block_hit_rate"), 0.35)
    assert np.isclose(report.comparison.gap("request_hit_rate"), 0.33)
    tp8 = report.sections["tp8"]
    # fewer per-rank hits at TP=8, so a larger estimated gain than at TP=2
    assert tp8["throughput_gain_estimate"] > report.comparison.throughput_gain
    # the fitted cost model reproduces the two measured arms
    a, b = tp8["cost_model"]["seconds_per_request"], tp8["cost_model"]["seconds_per_computed_token"]
    assert np.isclose(1 / (a + b * 150), 0.5) and np.isclose(1 / (a + b * 360), 0.3)
    ws = budget["working_set_blocks"] * budget["block_bytes"]
    assert tp8["pool_bytes_needed_for_working_set"] == {
        "once": ws,
        "per_rank_tp2": 2 * ws,
        "per_rank_tp8": 8 * ws,
    }
    ok, problems = mla_dedup.COMPARISON.verdict(report)
    assert ok, problems
    assert mla_dedup.COMPARISON.compared_rates(report) == "block hit rate once 0.750 vs per rank 0.400"
    report.arms["per_rank"].summary = _summary(0.3, 2.0, 0.70, 0.54, 6000, 2400)
    mla_dedup.EXPERIMENT.analyse(report)
    ok, problems = mla_dedup.COMPARISON.verdict(report)
    assert not ok and problems[0].startswith(
        "store-once block hit rate 0.75 is not 0.15 above per-rank's 0.7"
    )
    data = report.to_dict()
    assert list(data) == ["experiment", "setup", "trace", "budget", "arms", "comparison", "tp8", "hll"]
    plots.mla_dedup_figure(data, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
