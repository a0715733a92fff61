"""The remote-read experiment's numbers and verdict from made-up measurements (no namespaces, no
vLLM): pull statistics and round ratios, the table on the seed's NICs, the per-prompt TTFT view, the
regression's failures, the figure, and the pools that make every pull move a whole prefix."""

from __future__ import annotations

import pytest

from pegaflow.bench.experiments import ab, remote_read
from pegaflow.bench.harness import node_agent, plots, pulls, results

MIB = 1 << 20
GIB = 1 << 30


def _pull(gbps: float, blocks: int = 4, verified: bool = True) -> dict:
    pulled = blocks * 4 * MIB
    return {
        "gbps": gbps,
        "pulled_bytes": pulled,
        "pulled_blocks": blocks,
        "seconds": pulled / gbps / 1e9,
        "search_s": 0.01,
        "verified": verified,
        "mismatched": 0 if verified else 1,
        "client_cpu_s": 0.001,
        "server_cpu_s": {"a": 0.4 * pulled / 1e9, "b": 0.3 * pulled / 1e9},
        "first": {"hits": 0, "pending": 0, "searching": True, "sources": []},
    }


def _raw(rounds: list[tuple[float, list[float]]], verified: bool = True) -> dict:
    def load(x):
        return {"load1": x, "load5": x, "load15": x, "cpus": 2, "at": 0.0}

    return {
        "streams": 4,
        "pools": {"a": 32 * MIB, "b": 16 * MIB},
        "blocks_per_pull": 4,
        "rounds": [
            {
                "round": i,
                "load": load(1.0 + i),
                "load_after": load(2.0 + i),
                "iperf3": {"gbps": base, "cpu_s_per_gb": {"receiver (b)": 0.2, "sender (a)": 0.3}},
                "pulls": [_pull(g, verified=verified) for g in rates],
            }
            for i, (base, rates) in enumerate(rounds)
        ],
        "server_stats": {},
    }


def test_pull_stats_compare_each_round_with_its_own_iperf3():
    stats = pulls.pull_stats(_raw([(2.0, [1.8, 1.6]), (1.0, [0.5, 0.7])]), target_ratio=0.8)
    assert stats["pull_gbps"]["mean"] == pytest.approx(1.15)
    assert stats["pull_gbps"]["peak"] == 1.8 and stats["pull_gbps"]["worst"] == 0.5
    assert stats["round_ratio"]["median"] == pytest.approx((0.85 + 0.6) / 2)
    assert stats["round_ratio"]["worst"] == pytest.approx(0.6)
    assert stats["target_met"] is False
    assert stats["cpu_s_per_gb"]["sender (A's server)"] == pytest.approx(0.4)
    assert stats["load1"] == {"median": 1.5, "worst": 3.0}
    assert stats["complete"] == stats["verified"] == 4


def test_the_table_on_the_seeds_nics_caps_at_the_line_rate_and_counts_cores():
    stats = pulls.pull_stats(_raw([(1.0, [0.8, 1.2])]), target_ratio=0.8)
    table = pulls.scaled_table(stats, "8 x 400 Gbit/s", 400.0, {"mean": 194, "p99": 250, "peak": 261.6})
    rows = table["rows"]
    assert rows["mean"]["scaled_gbps"] == pytest.approx(400.0) and not rows["mean"]["capped_at_line_rate"]
    assert rows["peak"]["capped_at_line_rate"] and rows["peak"]["scaled_gbps"] == 400.0
    assert rows["mean"]["seed_gbps"] == 194
    assert table["cores_needed_at_line_rate"]["sender (A's server)"] == pytest.approx(160.0)
    assert pulls.scaled_table(pulls.pull_stats(_raw([]), 0.8), "x", 1.0, {}) is None


def test_pools_hold_exactly_what_makes_every_pull_move_a_whole_prefix():
    assert pulls.exact_pools(GIB, 4 * MIB) == {"a": 2 * GIB, "b": GIB}
    assert pulls.exact_pools(64 * MIB, 4 * MIB) == {"a": 128 * MIB, "b": 64 * MIB}
    with pytest.raises(ValueError, match="does not hold exactly"):
        pulls.exact_pools(100 * MIB, 3 * MIB)


def test_saved_blocks_are_distinct_and_a_function_of_their_hash():
    hashes = node_agent.prefix_hashes("p", 3)
    assert len(set(hashes)) == 3 and node_agent.prefix_hashes("p", 3) == hashes
    pattern = node_agent._pattern()
    import numpy as np

    blocks = [np.empty(1 * MIB, dtype=np.uint8) for _ in hashes]
    for b, h in zip(blocks, hashes, strict=True):
        node_agent.fill_block(b, pattern, h)
    again = np.empty(1 * MIB, dtype=np.uint8)
    node_agent.fill_block(again, pattern, hashes[1])
    assert np.array_equal(again, blocks[1]) and not np.array_equal(blocks[0], blocks[1])


def _record(arm: str, index: int, ttft: float, cached: int, tokens: list[int]) -> dict:
    return {
        "index": index, "instance": 0 if arm == "recompute" else 1, "kind": "one_off", "prompt_tokens": 1024,
        "cached_tokens": cached, "ttft_s": ttft, "e2e_s": ttft + 0.1, "start": float(index), "ok": True,
        "error": None, "arm": arm, "completion_token_ids": tokens,
        "top_logprobs": [{f"token_id:{t}": -1.0} for t in tokens],
    }  # fmt: skip


def _ttft_report(remote_cached: int, remote_tokens: list[int], fetched: int = 14) -> ab.ABReport:
    setup = remote_read.REGRESSION
    report = ab.ABReport("remote_read", {"setup": setup.to_dict()})
    ttfts = {"recompute": 0.5, "remote": 0.09, "local": 0.06}
    for arm in remote_read.ARMS:
        records = []
        for i in range(2):
            cached = {"recompute": 0, "remote": remote_cached, "local": 896}[arm]
            tokens = remote_tokens if arm == "remote" else [1, 2, 3, 4]
            records.append(_record(arm, i, ttfts[arm], cached, tokens))
        measured = {
            "server_fetch_delta": {"fetched_blocks": fetched if arm == "remote" else 0, "fetch_failures": 0}
        }
        summary = results.summarize_requests(records, 128)
        report.arms[arm] = ab.ArmReport(arm, {"node": "b"}, summary, measured, records)
    report.sections["pulls"] = {"by_streams": {"4": _raw([(1.0, [0.9, 0.9])])}}
    report.sections["ttft"] = {"connector_waits": True, "connector_waits_reason": "it waits"}
    remote_read.EXPERIMENT.analyse(report)
    return report


def test_a_remote_hit_within_target_and_identical_tokens_pass_the_regression(tmp_path):
    report = _ttft_report(896, [1, 2, 3, 4])
    per = report.sections["ttft_per_prompt"]
    assert per["remote_hit_used"] and per["tokens_identical"] and per["logprobs_identical"]
    assert per["remote_over_local"]["median"] == pytest.approx(1.5)
    assert per["target_met"]
    assert remote_read.judge(report)
    plots.remote_read_figure(report.to_dict(), tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_a_recompute_on_b_or_other_tokens_fail_the_regression_and_say_why():
    report = _ttft_report(0, [1, 2, 3, 4])
    per = report.sections["ttft_per_prompt"]
    assert not per["remote_hit_used"] and "pull landed for the next request" in per["why_no_remote_hit"]
    assert not remote_read.judge(report)
    assert "did not load the prompt from A" in report.regression.problems[0]
    report = _ttft_report(896, [1, 2, 3, 5])
    assert not remote_read.judge(report)
    assert any("tokens generated on B differ" in p for p in report.regression.problems)


def test_an_unverified_pull_fails_the_regression():
    report = _ttft_report(896, [1, 2, 3, 4])
    report.sections["pulls"] = {"by_streams": {"4": _raw([(1.0, [0.9])], verified=False)}}
    remote_read.EXPERIMENT.analyse(report)
    assert not remote_read.judge(report)
    assert "differ from what A saved" in report.regression.problems[0]


def test_a_skipped_vllm_part_is_recorded_with_its_reason():
    report = _ttft_report(896, [1, 2, 3, 4])
    report.arms.clear()
    report.sections["ttft"] = {"skipped": "the connector does not wait"}
    del report.sections["ttft_per_prompt"]
    assert remote_read.judge(report)
    assert report.regression.criteria["vllm"] == "skipped: the connector does not wait"


def test_the_connector_check_reads_the_scheduler_source():
    waits, reason = remote_read.connector_waits()
    assert isinstance(waits, bool) and reason
