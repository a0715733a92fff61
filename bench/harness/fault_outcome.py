"""What one injected fault did to the traffic around it, from the per-request records of the run.

A scenario records four wall-clock times (`FaultTimes`): its traffic started, the fault was
injected, the fault was over (the server answers again, the process was resumed, the hog let go),
and the traffic ended. Requests are put in the phase their start time falls in:

  before   start < injected
  during   injected <= start < recovered
  after    recovered <= start

and, separately, `in_flight_at_fault` are the requests already running when the fault hit (the
ones a kill catches mid-load or mid-save).

Time to first hit after recovery: from `recovered` to the first token of the earliest-answered
request that started at or after `recovered` and loaded at least one block from the pool. Such a
request's lookup reached the recovered server, so this is how long the engines took to use it
again (the connector re-attaching, a save landing, a later request finding it), measured from
outside, with the engines never restarted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from pegaflow.bench.harness import results
from pegaflow.bench.harness.reference import TokenCheck

PHASES = ("before", "during", "after")


@dataclasses.dataclass(frozen=True)
class FaultTimes:
    load_start: float
    injected: float
    recovered: float
    load_end: float

    def __post_init__(self) -> None:
        if not self.load_start <= self.injected <= self.recovered <= self.load_end:
            raise ValueError(f"fault times out of order: {self}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def phase(record: Mapping, times: FaultTimes) -> str:
    start = record["start"]
    if start < times.injected:
        return "before"
    if start < times.recovered:
        return "during"
    return "after"


def split_phases(records: Iterable[Mapping], times: FaultTimes) -> dict[str, list[Mapping]]:
    out: dict[str, list[Mapping]] = {p: [] for p in PHASES}
    for r in records:
        out[phase(r, times)].append(r)
    return out


def _end(record: Mapping) -> float:
    return record["start"] + (record["e2e_s"] or 0.0)


def in_flight_at(records: Iterable[Mapping], t: float) -> list[Mapping]:
    """Requests sent before `t` that had not completed by then."""
    return [r for r in records if r["start"] < t < _end(r)]


def overlapping(records: Iterable[Mapping], t0: float, t1: float) -> list[Mapping]:
    """Requests whose [start, end] overlaps [t0, t1]."""
    return [r for r in records if r["start"] <= t1 and _end(r) >= t0]


def first_hit_after(records: Iterable[Mapping], t: float, block_tokens: int) -> float | None:
    """Seconds from `t` to the first token of the earliest-answered request that started at or
    after `t` and loaded >= 1 block; None if there is none."""
    firsts = [
        r["start"] + r["ttft_s"] - t
        for r in records
        if r["ok"] and r["start"] >= t and (r.get("cached_tokens") or 0) >= block_tokens
    ]
    return min(firsts) if firsts else None


def _phase_numbers(records: Sequence[Mapping], block_tokens: int) -> dict:
    s = results.summarize_requests(records, block_tokens)
    return {
        "requests": s.requests,
        "failed": s.failed,
        "block_hit_rate": s.block_hit_rate,
        "request_hit_rate": s.request_hit_rate,
        "ttft_p50_s": s.ttft_p50_s,
        "ttft_p99_s": s.ttft_p99_s,
        "e2e_max_s": max((r["e2e_s"] for r in records if r["e2e_s"] is not None), default=None),
    }


def fault_outcome(
    records: Sequence[Mapping], check: TokenCheck, times: FaultTimes, block_tokens: int
) -> dict:
    """The traffic's numbers for one scenario (see the module doc)."""
    phases = split_phases(records, times)
    failed = [r for r in records if not r["ok"]]
    hit = first_hit_after(records, times.recovered, block_tokens)
    caught = in_flight_at(records, times.injected)
    around = overlapping(records, times.injected, times.recovered)
    return {
        "times": times.to_dict(),
        "fault_s": times.recovered - times.injected,
        "requests": len(records),
        "failed": len(failed),
        "errors": sorted({r["error"] for r in failed if r.get("error")})[:5],
        "wrong_requests": check.wrong_requests,
        "wrong_tokens": check.wrong_tokens,
        "unchecked": check.unchecked,
        "wrong_examples": list(check.examples),
        "hit_path_answers": check.hit_path_answers,
        "phases": {p: _phase_numbers(rs, block_tokens) for p, rs in phases.items()},
        "in_flight_at_fault": len(caught),
        "in_flight_at_fault_max_e2e_s": max((r["e2e_s"] for r in caught), default=None),
        "max_e2e_around_fault_s": max((r["e2e_s"] for r in around if r["e2e_s"] is not None), default=None),
        "hits_resumed": hit is not None,
        "time_to_first_hit_s": hit,
    }


def judge(
    outcome: Mapping,
    *,
    require_hits_resume: bool = True,
    max_e2e_around_fault_s: float | None = None,
    extra_problems: Sequence[str] = (),
) -> dict:
    """{"passed", "problems"}: no failed request, no wrong or unchecked answer, hits after recovery
    (when required), requests around the fault within a bound (when given), plus the scenario's own
    problems."""
    problems = list(extra_problems)
    if outcome["failed"]:
        problems.append(f"{outcome['failed']} request(s) failed: {outcome['errors']}")
    if outcome["wrong_requests"]:
        problems.append(f"{outcome['wrong_requests']} answer(s) differ from the reference")
    if outcome["unchecked"]:
        problems.append(f"{outcome['unchecked']} answer(s) without a reference to check")
    if require_hits_resume and not outcome["hits_resumed"]:
        problems.append("no request loaded a block after recovery")
    worst = outcome["max_e2e_around_fault_s"]
    if max_e2e_around_fault_s is not None and worst is not None and worst > max_e2e_around_fault_s:
        problems.append(
            f"a request around the fault took {worst:.2f} s (bound {max_e2e_around_fault_s:.2f} s)"
        )
    if outcome["requests"] == 0:
        problems.append("no traffic ran")
    return {"passed": not problems, "problems": problems}
