"""The promotion-under-load experiment's analysis: which busy-phase requests count, and the ratios."""

import math

from pegaflow.bench.experiments.promotion_under_load import covered, summarize


def test_a_request_counts_as_covered_only_if_transfers_span_its_whole_ttft():
    spans = [(0.0, 1.0, 512), (1.01, 2.0, 512), (3.0, 4.0, 512)]
    assert covered({"t_send": 0.5, "t_first": 1.5}, spans)  # back-to-back transfers are one span
    assert not covered({"t_send": 1.9, "t_first": 2.5}, spans)  # ends in the gap before the third
    assert not covered({"t_send": 2.2, "t_first": 2.3}, spans)  # entirely in a gap
    assert covered({"t_send": 2.2, "t_first": 2.3}, spans, max_gap_s=1.5)


def _req(ttft, full_hit=True, covered=True):
    return {"ttft_s": ttft, "full_hit": full_hit, "covered": covered}


def test_ratios_are_taken_per_round_and_only_dram_hits_count():
    rounds = [
        {"quiet": [_req(0.02), _req(0.02)], "promoting": [_req(0.03), _req(0.5, full_hit=False)]},
        {"quiet": [_req(0.02)], "promoting": [_req(0.021), _req(0.9, covered=False)]},
    ]
    s = summarize(rounds)
    assert math.isclose(rounds[0]["promoting_ratio_mean"], 1.5)
    assert math.isclose(rounds[1]["promoting_ratio_mean"], 1.05)
    assert math.isclose(s["promoting"]["ratio_mean"]["worst"], 1.5)
    assert math.isclose(s["promoting"]["ratio_mean"]["median"], 1.275)
    assert s["not_full_hits"] == 1 and s["promoting"]["requests_covered"] == 0.75
    assert not s["target_met"]
    rounds[0]["promoting"][0]["ttft_s"] = 0.021
    assert summarize(rounds)["target_met"]
