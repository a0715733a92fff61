"""The SSD-tier experiment's planning, without vLLM: the DRAM budget holds a small share of the
working set while the SSD holds all of it, each arm's server flags, and the figure."""

from __future__ import annotations

import dataclasses

import pytest

from pegaflow.bench.experiments import ssd_tier
from pegaflow.bench.harness import cachesim, models, plots, traces


def _budget(setup):
    trace = traces.generate(setup.trace)
    blocks = cachesim.trace_blocks(trace, models.CPU_BLOCK_TOKENS)
    return ssd_tier.plan_budget(setup, blocks, models.block_bytes(setup.model))


def test_dram_holds_a_share_of_the_working_set_and_the_ssd_all_of_it():
    budget = _budget(ssd_tier.FULL)
    assert budget["dram_capacity_blocks"] < 0.2 * budget["trace_distinct_blocks"]
    assert budget["ssd_capacity_bytes"] >= budget["trace_working_set_bytes"]
    model = budget["lru_model"]
    # what the experiment is about: DRAM alone misses a large part of what a tier behind it keeps
    assert model["ssd-on-seal"]["block_hit_rate"] - model["dram"]["block_hit_rate"] > 0.2
    assert budget["exact_ceiling"] >= model["ssd-on-seal"]["block_hit_rate"]


def test_an_ssd_too_small_for_the_working_set_is_refused():
    with pytest.raises(ValueError, match="working set"):
        _budget(dataclasses.replace(ssd_tier.FULL, ssd_capacity_bytes=1 << 20))


def test_each_arm_starts_its_server_with_its_own_flags(tmp_path):
    setup = ssd_tier.FULL
    assert ssd_tier._server_args("dram", setup, tmp_path) == []
    assert ssd_tier._server_args("dram-tinylfu", setup, tmp_path) == ["--enable-lfu-admission"]
    for arm, policy in (("ssd-on-reuse", "on-reuse"), ("ssd-on-seal", "on-seal")):
        args = ssd_tier._server_args(arm, setup, tmp_path)
        assert args[args.index("--ssd-write-policy") + 1] == policy
        assert args[args.index("--ssd-cache-path") + 1] == str(tmp_path / "ssd-cache")
        assert args[args.index("--ssd-cache-capacity") + 1] == f"{setup.ssd_capacity_bytes}b"
    with pytest.raises(ValueError):
        ssd_tier._server_args("ssd", setup, tmp_path)


def test_the_figure_draws_from_a_report(tmp_path):
    budget = _budget(ssd_tier.FULL)
    summary = {
        "throughput_rps": 1.0,
        "ttft_mean_s": 0.2,
        "ttft_p99_s": 0.5,
        "block_hit_rate": 0.3,
        "request_hit_rate": 0.4,
    }
    report = {
        "budget": budget,
        "arms": {arm: {"summary": summary} for arm in ssd_tier.ARMS},
        "comparison": {"throughput_gain": 0.1, "ttft_mean_change": -0.2},
    }
    plots.ssd_tier_figure(report, tmp_path / "ssd_tier.png")
    assert (tmp_path / "ssd_tier.png").stat().st_size > 10_000
