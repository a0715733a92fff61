"""Per-fault accounting of the fault matrix (bench/harness/fault_outcome.py)."""

import pytest

from pegaflow.bench.harness.fault_outcome import (
    FaultTimes,
    fault_outcome,
    first_hit_after,
    in_flight_at,
    judge,
    split_phases,
)
from pegaflow.bench.harness.reference import TokenCheck

BT = 128


def rec(start, e2e=1.0, ttft=0.5, cached=0, ok=True, prompt=1024):
    return {"start": start, "e2e_s": e2e, "ttft_s": ttft if ok else None, "cached_tokens": cached, "ok": ok,
            "error": None if ok else "boom", "prompt_tokens": prompt}  # fmt: skip


TIMES = FaultTimes(load_start=0.0, injected=10.0, recovered=13.0, load_end=30.0)
CLEAN = TokenCheck(checked=10, wrong_requests=0, wrong_tokens=0, unchecked=0)


def test_times_must_be_in_order():
    with pytest.raises(ValueError):
        FaultTimes(0, 5, 4, 10)


def test_phases_follow_the_start_time():
    recs = [rec(1), rec(9.9, e2e=3), rec(10), rec(12.9), rec(13), rec(20)]
    phases = split_phases(recs, TIMES)
    assert [len(phases[p]) for p in ("before", "during", "after")] == [2, 2, 2]
    assert in_flight_at(recs, 10.0) == [recs[1]]


def test_first_hit_after_recovery_is_the_earliest_first_token_of_a_later_request():
    recs = [
        rec(5, cached=512),
        rec(14, ttft=3.0, cached=256),
        rec(15, ttft=0.5, cached=128),
        rec(16, cached=0),
    ]
    assert first_hit_after(recs, 13.0, BT) == pytest.approx(2.5)  # 15 + 0.5 - 13, before 14 + 3
    assert first_hit_after([rec(14, cached=100)], 13.0, BT) is None  # less than one block


def test_outcome_counts_failures_phases_and_the_slowest_request_around_the_fault():
    recs = [rec(1, cached=512), rec(9, e2e=4.5), rec(11, ok=False, e2e=2.0), rec(14, cached=256), rec(20)]
    check = TokenCheck(checked=4, wrong_requests=1, wrong_tokens=3, unchecked=0, examples=({"index": 1},))
    out = fault_outcome(recs, check, TIMES, BT)
    assert out["failed"] == 1 and out["errors"] == ["boom"]
    assert out["wrong_requests"] == 1 and out["wrong_tokens"] == 3
    assert out["in_flight_at_fault"] == 1 and out["max_e2e_around_fault_s"] == 4.5
    assert out["hits_resumed"] and out["time_to_first_hit_s"] == pytest.approx(1.5)
    assert out["phases"]["before"]["block_hit_rate"] == pytest.approx(4 / 16)
    assert out["fault_s"] == 3.0


def test_judge_passes_a_clean_run_and_names_each_problem():
    good = fault_outcome([rec(1), rec(14, cached=512)], CLEAN, TIMES, BT)
    assert judge(good) == {"passed": True, "problems": []}
    bad = fault_outcome([rec(1, e2e=9.0), rec(11, ok=False)], TokenCheck(2, 1, 1, 1), TIMES, BT)
    v = judge(bad, max_e2e_around_fault_s=5.0, extra_problems=["scenario's own"])
    assert not v["passed"]
    text = " | ".join(v["problems"])
    for fragment in ("scenario's own", "failed", "differ", "without a reference", "after recovery", "bound"):
        assert fragment in text
    assert judge(bad, require_hits_resume=False, max_e2e_around_fault_s=None)["problems"] != []
