"""The parts of the experiments that decide what runs (budgets, instance counts, verdicts),
without starting vLLM."""

import dataclasses

import pytest

from pegaflow.bench.experiments import ab, common, startup
from pegaflow.bench.experiments import multi_instance as mi
from pegaflow.bench.experiments.common import window_covering
from pegaflow.bench.harness import cachesim, models, results, traces

GIB = 1 << 30


@pytest.mark.parametrize("setup", [mi.REGRESSION, mi.FULL, dataclasses.replace(mi.FULL, num_instances=7)])
def test_budget_gives_both_layouts_the_same_total_and_the_shared_pool_the_working_set(setup):
    blocks = cachesim.trace_blocks(traces.generate(setup.trace), models.CPU_BLOCK_TOKENS)
    block_bytes = models.block_bytes(setup.model)
    plan = mi.plan_budget(setup, blocks, block_bytes)
    n = setup.num_instances
    assert plan["shared_pool_bytes"] == n * plan["isolated_pool_bytes"]
    assert plan["shared_capacity_blocks"] >= n * plan["isolated_capacity_blocks_each"] > 0
    assert plan["shared_capacity_blocks"] >= plan["target_blocks"]
    # the working set does not fit in one isolated pool...
    assert plan["isolated_capacity_blocks_each"] < plan["target_blocks"]
    # ...and the replay model says sharing the same budget wins clearly
    model = plan["lru_model"]
    assert model["shared"]["block_hit_rate"] > model["isolated"]["block_hit_rate"] + mi.REGRESSION_MIN_GAP
    assert model["shared"]["block_hit_rate"] <= plan["exact_ceiling"]


def test_an_explicit_budget_is_split_evenly():
    setup = dataclasses.replace(mi.REGRESSION, budget_bytes=32 << 20)
    blocks = cachesim.trace_blocks(traces.generate(setup.trace), models.CPU_BLOCK_TOKENS)
    plan = mi.plan_budget(setup, blocks, models.block_bytes(setup.model))
    assert plan["shared_pool_bytes"] == 32 << 20 and plan["isolated_pool_bytes"] == 16 << 20
    assert plan["target_blocks"] is None


def test_instances_that_fit_follow_free_memory_within_3_to_8():
    footprint = mi.instance_footprint(mi.FULL)
    assert mi.instances_that_fit(mi.FULL, available=2 * GIB) == 3
    assert mi.instances_that_fit(mi.FULL, available=mi.MEMORY_HEADROOM + 5 * footprint) == 5
    assert mi.instances_that_fit(mi.FULL, available=200 * GIB) == 8


def test_hll_window_is_the_shortest_that_covers_the_run():
    windows = {"15m": 900.0, "1h": 3600.0, "24h": 86400.0}
    assert window_covering(windows, 300) == "15m"
    assert window_covering(windows, 901) == "1h"
    assert window_covering(windows, 10**6) == "24h"
    assert window_covering({}, 10) is None


def _summary(rate, failed=0, **kw):
    base = dict(
        requests=10, succeeded=10 - failed, failed=failed, errors=("boom",) if failed else (),
        duration_s=10.0, throughput_rps=1.0, ttft_mean_s=1.0, ttft_p50_s=1.0, ttft_p90_s=1.0,
        ttft_p99_s=1.0, e2e_mean_s=1.0, e2e_p99_s=1.0, prompt_tokens=1000, cached_tokens=500,
        token_hit_rate=0.5, full_prompt_blocks=8, loaded_blocks=4, block_hit_rate=rate,
        request_hit_rate=rate, responses_without_cached_tokens=0,
    )  # fmt: skip
    return results.RequestSummary(**{**base, **kw})


def _report(shared_rate, isolated_rate, failed=0):
    report = ab.ABReport(
        "multi_instance",
        {"budget": {"lru_model": {"shared": {"block_hit_rate": 0.75}, "isolated": {"block_hit_rate": 0.43}}}},
    )
    for name, rate in (("shared", shared_rate), ("isolated", isolated_rate)):
        report.arms[name] = ab.ArmReport(name, {}, _summary(rate, failed), {})
    mi.EXPERIMENT.analyse(report)
    return report


def test_regression_verdict():
    assert mi.COMPARISON.verdict(_report(0.75, 0.41)) == (True, [])
    ok, problems = mi.COMPARISON.verdict(_report(0.55, 0.41))
    assert not ok and problems == [
        "shared block hit rate 0.55 is not 0.2 above the isolated pools' 0.41 (LRU model: 0.750 vs 0.430)"
    ]
    ok, problems = mi.COMPARISON.verdict(_report(0.75, 0.41, failed=1))
    assert not ok and "failed" in problems[0]
    ok, problems = mi.COMPARISON.verdict(ab.ABReport("multi_instance", {}))
    assert not ok and problems == ["the regression needs the shared arm and an isolated arm"]


def test_the_comparison_names_the_isolated_layout_it_used():
    report = _report(0.75, 0.41)
    assert report.comparison.labels == {"isolated_arm": "isolated"}
    del report.arms["isolated"]
    report.arms["isolated-servers"] = ab.ArmReport("isolated-servers", {}, _summary(0.3), {})
    mi.EXPERIMENT.analyse(report)
    assert report.to_dict()["comparison"]["isolated_arm"] == "isolated-servers"
    assert mi.COMPARISON.compared_rates(report) == "block hit rate shared 0.750 vs isolated-servers 0.300"


def test_compare_reports_relative_changes():
    shared = _summary(0.8, throughput_rps=3.0, ttft_mean_s=0.5, ttft_p99_s=2.0, request_hit_rate=0.8)
    isolated = _summary(0.2, throughput_rps=2.0, ttft_mean_s=1.0, ttft_p99_s=4.0, request_hit_rate=0.2)
    c = results.compare_summaries(shared, isolated, gaps=("block_hit_rate",))
    assert c.throughput_gain == pytest.approx(0.5)
    assert c.ttft_mean_change == pytest.approx(-0.5)
    assert c.ttft_p99_change == pytest.approx(-0.5)
    assert c.request_hit_rate_ratio == pytest.approx(4.0)
    assert c.gap("block_hit_rate") == pytest.approx(0.6)
    assert list(c.to_dict())[-1] == "block_hit_rate_gap"
    assert results.Comparison.from_dict(c.to_dict()) == c


def test_startup_refuses_a_pool_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(startup, "mem_available_bytes", lambda: 10 * GIB)
    with pytest.raises(SystemExit, match="largest size that fits now is ~7 GiB"):
        startup.check_memory(startup.Setup(sizes_bytes=(16 * GIB,)))
    assert startup.check_memory(startup.Setup(sizes_bytes=(4 * GIB,)))["needed_bytes"] == 7 * GIB


def test_startup_stats_use_the_median():
    s = startup.stats_of([30.0, 10.0, 20.0, 100.0])
    assert (s["median"], s["min"], s["max"], s["runs"]) == (25.0, 10.0, 100.0, 4)


def test_the_regression_verdict_is_recorded_in_the_report():
    report = _report(0.55, 0.41)
    assert not mi.COMPARISON.judge(report)
    recorded = report.to_dict()["regression"]
    assert recorded["passed"] is False
    assert recorded["min_block_hit_rate_gap"] == mi.REGRESSION_MIN_GAP
    assert "not 0.2 above" in recorded["problems"][0]
    report = _report(0.75, 0.41)
    assert mi.COMPARISON.judge(report)
    assert report.to_dict()["regression"] == {"min_block_hit_rate_gap": 0.2, "passed": True, "problems": []}


def test_trace_flags_override_only_what_was_given():
    ap = common.experiment_parser(None)
    common.add_trace_overrides(ap, budget_help="B")
    setup = common.apply_trace_overrides(mi.FULL, ap.parse_args(["--requests", "50", "--budget-mib", "96"]))
    assert setup.trace.num_requests == 50 and setup.budget_bytes == 96 << 20
    assert setup.users == mi.FULL.users and setup.trace.seed == mi.FULL.trace.seed
    assert common.apply_trace_overrides(mi.FULL, ap.parse_args([])) == mi.FULL
