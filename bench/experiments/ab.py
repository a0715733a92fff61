"""The A/B skeleton of the trace-replay experiments: arms run one after another (or side by side)
on the same trace, typed reports of what each measured, one arm compared with another, the
regression's verdict, the result files and `--redraw`.

An experiment declares what it compares and how its figure and derived numbers are made; it keeps
to itself only what differs (its setups, its budget rule, what one arm starts):

    EXPERIMENT = ab.ABExperiment(
        name="multi_instance",
        comparison=ab.ArmComparison("shared", ("isolated", "isolated-servers"), min_gap=0.2, ...),
        figure=plots.multi_instance_figure,
        derive=derive,                       # ABReport -> None: report.sections[...] = ...
    )
    report = ab.ABReport.start("multi_instance", setup.to_dict(), model_dir, trace, budget)
    EXPERIMENT.run_arms(report, ("shared", "isolated"), lambda arm: run_arm(arm, ...))
    return EXPERIMENT.finish(report, regression=args.regression, out=out, stem=stem)  # exit code

Reports serialise to the JSON the experiments always wrote (`ABReport.to_dict`), and a saved one
reads back (`ABReport.from_dict`) keeping its key order, so a redraw rewrites only the numbers
that changed. Figures are drawn from the JSON form, so a committed result can always be redrawn.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pegaflow.bench.experiments import common
from pegaflow.bench.experiments.common import say
from pegaflow.bench.harness import loadgen, results, traces
from pegaflow.bench.harness.results import Comparison, RequestSummary
from pegaflow.bench.harness.vllm_fleet import VllmConfig, VllmFleet, counters_delta


@dataclasses.dataclass
class ArmReport:
    """One arm: what it started (configs, ready times: the JSON keys before "summary"), its
    requests in numbers, what else it measured (the keys after), and its per-request records
    (written to the CSV, not to the JSON)."""

    arm: str
    started: dict[str, Any]
    summary: RequestSummary
    measured: dict[str, Any]
    records: list[dict] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {"arm": self.arm, **self.started, "summary": self.summary.to_dict(), **self.measured}

    @classmethod
    def from_dict(cls, data: Mapping) -> ArmReport:
        keys = list(data)
        cut = keys.index("summary")
        return cls(
            arm=data["arm"],
            started={k: data[k] for k in keys[1:cut] if k != "arm"},
            summary=RequestSummary.from_dict(data["summary"]),
            measured={k: data[k] for k in keys[cut + 1 :]},
        )


@dataclasses.dataclass(frozen=True)
class RegressionVerdict:
    """Whether a reduced run passed, with what it required (`criteria`) and every problem found."""

    criteria: dict[str, Any]
    passed: bool
    problems: tuple[str, ...]

    def to_dict(self) -> dict:
        return {**self.criteria, "passed": self.passed, "problems": list(self.problems)}

    @classmethod
    def from_dict(cls, data: Mapping) -> RegressionVerdict:
        criteria = {k: v for k, v in data.items() if k not in ("passed", "problems")}
        return cls(criteria, bool(data["passed"]), tuple(data["problems"]))


@dataclasses.dataclass
class ABReport:
    """A whole run: `context` (setup, machine, start time, model, trace, budget: what was run, on
    what), the arms, the comparison, the experiment's own sections (derived numbers, measurements of
    its own) and the regression verdict."""

    experiment: str
    context: dict[str, Any]
    arms: dict[str, ArmReport] = dataclasses.field(default_factory=dict)
    comparison: Comparison | None = None
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)
    regression: RegressionVerdict | None = None
    # The order of the keys after "arms" in a saved report (kept on redraw); new keys go last.
    tail_order: tuple[str, ...] = ()

    @classmethod
    def start(
        cls,
        experiment: str,
        setup: dict,
        model_dir: pathlib.Path | str,
        trace: traces.Trace | None,
        budget: dict | None,
        **before_trace: Any,
    ) -> ABReport:
        """A report of a run starting now: the machine as it is now (load, free memory)."""
        context: dict[str, Any] = {
            "setup": setup,
            "machine": results.machine_info(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model_dir": str(model_dir),
            **before_trace,
        }
        if trace is not None:
            context["trace"] = trace.summary()
        if budget is not None:
            context["budget"] = budget
        return cls(experiment, context)

    @property
    def setup(self) -> dict:
        return self.context["setup"]

    @property
    def budget(self) -> dict:
        return self.context["budget"]

    @property
    def trace(self) -> dict:
        return self.context["trace"]

    def summary(self, arm: str) -> RequestSummary:
        return self.arms[arm].summary

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"experiment": self.experiment, **self.context}
        out["arms"] = {name: arm.to_dict() for name, arm in self.arms.items()}
        tail: dict[str, Any] = {}
        if self.comparison is not None:
            tail["comparison"] = self.comparison.to_dict()
        tail.update(self.sections)
        if self.regression is not None:
            tail["regression"] = self.regression.to_dict()
        order = [k for k in self.tail_order if k in tail] + [k for k in tail if k not in self.tail_order]
        out.update((k, tail[k]) for k in order)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> ABReport:
        keys = list(data)
        cut = keys.index("arms")
        tail = keys[cut + 1 :]
        return cls(
            experiment=data["experiment"],
            context={k: data[k] for k in keys[1:cut] if k != "experiment"},
            arms={name: ArmReport.from_dict(arm) for name, arm in data["arms"].items()},
            comparison=Comparison.from_dict(data["comparison"]) if "comparison" in data else None,
            sections={k: data[k] for k in tail if k not in ("comparison", "regression")},
            regression=RegressionVerdict.from_dict(data["regression"]) if "regression" in data else None,
            tail_order=tuple(tail),
        )


def request_problems(arms: Mapping[str, ArmReport]) -> list[str]:
    """What makes any regression fail whatever it compares: a failed request, or a response without
    cached_tokens (its hit rate would be understated)."""
    problems = []
    for name, arm in arms.items():
        s = arm.summary
        if s.failed:
            problems.append(f"{name}: {s.failed} request(s) failed: {list(s.errors)}")
        if s.responses_without_cached_tokens:
            problems.append(f"{name}: {s.responses_without_cached_tokens} response(s) without cached_tokens")
    return problems


@dataclasses.dataclass(frozen=True)
class ArmComparison:
    """What an A/B experiment compares and what its regression requires: `treatment` against the
    first of `baselines` that ran, on every metric of `gaps`; the regression passes when no request
    failed and `metric` of the treatment beats the baseline's by at least `min_gap`.

    Wording of the verdict (it goes into the JSON): "<treatment_says> block hit rate X is not
    <min_gap> above <baseline_says> Y (LRU model: x vs y)", the model's numbers read from
    budget["lru_model"][k] for k in `model_arms`. `pass_names` name the two arms in the log line of a
    pass (None: the baseline's arm name). `baseline_label`: the comparison records the baseline it
    used under this key (None: not recorded)."""

    treatment: str
    baselines: tuple[str, ...]
    min_gap: float
    metric: str = "block_hit_rate"
    gaps: tuple[str, ...] = ("block_hit_rate",)
    baseline_label: str | None = None
    treatment_says: str = ""
    baseline_says: str = ""
    model_arms: tuple[str, str] | None = None
    pass_names: tuple[str, str | None] = ("", None)
    missing_arms: str = "the regression needs both arms"

    def baseline_in(self, arms: Mapping[str, Any]) -> str | None:
        return next((b for b in self.baselines if b in arms), None)

    def compare(self, report: ABReport) -> Comparison | None:
        baseline = self.baseline_in(report.arms)
        if self.treatment not in report.arms or baseline is None:
            return None
        labels = {self.baseline_label: baseline} if self.baseline_label else None
        return results.compare_summaries(
            report.summary(self.treatment), report.summary(baseline), gaps=self.gaps, labels=labels
        )

    def verdict(self, report: ABReport) -> tuple[bool, list[str]]:
        if report.comparison is None:
            return False, [self.missing_arms]
        baseline = self.baseline_in(report.arms)
        problems = request_problems(report.arms)
        gap = report.comparison.gap(self.metric)
        if gap is None or gap < self.min_gap:
            t = getattr(report.summary(self.treatment), self.metric)
            b = getattr(report.summary(baseline), self.metric)
            words = self.metric.replace("_", " ")
            text = f"{self.treatment_says} {words} {t} is not {self.min_gap} above {self.baseline_says} {b}"
            if self.model_arms is not None:
                model = report.budget["lru_model"]
                mt, mb = (model[k][self.metric] for k in self.model_arms)
                text += f" (LRU model: {mt:.3f} vs {mb:.3f})"
            problems.append(text)
        return not problems, problems

    def compared_rates(self, report: ABReport) -> str:
        """What a passing regression logs: the two rates it compared."""
        baseline = self.baseline_in(report.arms)
        t_name, b_name = self.pass_names[0] or self.treatment, self.pass_names[1] or baseline
        t = getattr(report.summary(self.treatment), self.metric)
        b = getattr(report.summary(baseline), self.metric)
        return f"{self.metric.replace('_', ' ')} {t_name} {t:.3f} vs {b_name} {b:.3f}"

    def judge(self, report: ABReport) -> bool:
        """Records the verdict in the report (so the JSON says why a run failed) and logs it."""
        ok, problems = self.verdict(report)
        passed = f"{self.compared_rates(report)} (gap >= {self.min_gap}), no failed request" if ok else ""
        return record_verdict(report, {f"min_{self.metric}_gap": self.min_gap}, problems, passed)


def record_verdict(report: ABReport, criteria: dict[str, Any], problems: Sequence[str], passed: str) -> bool:
    """Puts a regression's verdict into the report and the log: every problem as FAIL, or `passed`
    as PASS when there is none. True when it passed."""
    ok = not problems
    report.regression = RegressionVerdict(dict(criteria), ok, tuple(problems))
    for p in problems:
        say(f"FAIL: {p}")
    if ok:
        say(f"PASS: {passed}")
    return ok


@dataclasses.dataclass
class FleetReplay:
    """One arm's trace served by a fleet: when each instance was ready, the load generator's result,
    each instance's vLLM counters over the trace and its memory after it, and what the arm's own
    `before` / `after` callbacks measured around the trace."""

    ready_s: list[float]
    load: loadgen.LoadResult
    counters_delta: list[dict[str, float]]
    memory: list[dict]
    before: Any = None
    after: Any = None


def replay_on_fleet(
    arm: str,
    setup,
    configs: Sequence[VllmConfig],
    trace: traces.Trace,
    arm_dir: pathlib.Path,
    before: Callable[[VllmFleet], Any] | None = None,
    after: Callable[[VllmFleet], Any] | None = None,
) -> FleetReplay:
    """Fleet up, one warm-up request per instance, the trace through locust (paced as the setup
    says), the counters and memory scraped, the fleet down. `before` runs right before the trace and
    `after` right after it, with the fleet still up (an embedded pool's stats die with it)."""
    model_name = configs[0].served_model_name
    with VllmFleet(configs, arm_dir) as fleet:
        say(f"{arm}: starting {len(configs)} vLLM instance(s)")
        ready = fleet.start(setup.ready_timeout_s)
        say(f"{arm}: instances ready in {', '.join(f'{r:.1f}' for r in ready)} s")
        loadgen.run_warmup(fleet.endpoints, model_name)
        counters = fleet.counters()
        measured_before = before(fleet) if before else None
        load = common.replay_trace(arm, setup, trace, fleet.endpoints, model_name, arm_dir)
        measured_after = after(fleet) if after else None
        delta = [counters_delta(b, a) for b, a in zip(counters, fleet.counters(), strict=True)]
        memory = fleet.memory()
    return FleetReplay(ready, load, delta, memory, measured_before, measured_after)


def log_arm(arm: ArmReport, suffix: str = "") -> None:
    s = arm.summary

    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    say(
        f"{arm.arm}: {s.succeeded}/{s.requests} ok, {num(s.throughput_rps, '.3f')} req/s, "
        f"TTFT mean {num(s.ttft_mean_s, '.3f')} s P99 {num(s.ttft_p99_s, '.3f')} s, "
        f"block hit {num(s.block_hit_rate, '.3f')}, request hit {num(s.request_hit_rate, '.3f')}{suffix}"
    )


def _no_derived_numbers(report: ABReport) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class ABExperiment:
    """One A/B experiment's shared behaviour (see the module doc)."""

    name: str  # report["experiment"] and the result files' stem ("<name>[_regression].json")
    comparison: ArmComparison
    figure: Callable[[dict, pathlib.Path], None]
    derive: Callable[[ABReport], None] = _no_derived_numbers
    # The regression's verdict (records it with `record_verdict`); default: the comparison's gap.
    judge: Callable[[ABReport], bool] | None = None

    def run_arms(
        self,
        report: ABReport,
        arms: Sequence[str],
        run_arm: Callable[[str], ArmReport],
        side_by_side: bool = False,
        log_suffix: Callable[[ArmReport], str] | None = None,
    ) -> None:
        """Runs every arm (in this order, or all at once), fills report.arms and logs each arm."""
        if side_by_side:
            with concurrent.futures.ThreadPoolExecutor(len(arms)) as pool:
                futures = {arm: pool.submit(run_arm, arm) for arm in arms}
                for arm in arms:
                    report.arms[arm] = futures[arm].result()
            for arm in arms:
                log_arm(report.arms[arm], log_suffix(report.arms[arm]) if log_suffix else "")
            return
        for arm in arms:
            report.arms[arm] = run_arm(arm)
            log_arm(report.arms[arm], log_suffix(report.arms[arm]) if log_suffix else "")

    def analyse(self, report: ABReport) -> None:
        """The comparison and the experiment's derived numbers (also on --redraw)."""
        report.comparison = self.comparison.compare(report)
        self.derive(report)

    def finish(self, report: ABReport, regression: bool, out: pathlib.Path) -> int:
        """Analyses a finished run, judges it when it is the regression, writes its files; the
        process exit code (1: the regression failed)."""
        self.analyse(report)
        ok = not regression or (self.judge or self.comparison.judge)(report)
        write_outputs(report, out, f"{self.name}_regression" if regression else self.name, self.figure)
        return 0 if ok else 1

    def redraw(self, path: pathlib.Path) -> None:
        """Recomputes a saved report's derived numbers in place and redraws its figure next to it, so
        committed results follow changes to the analysis without a rerun."""
        report = ABReport.from_dict(json.loads(path.read_text()))
        self.analyse(report)
        data = report.to_dict()
        results.write_json(path, data)
        self.figure(data, path.with_suffix(".png"))
        say(f"rewrote {path} and {path.with_suffix('.png')}")


def write_outputs(
    report: ABReport, out: pathlib.Path, stem: str, figure: Callable[[dict, pathlib.Path], None]
) -> None:
    """<stem>_requests.csv (every arm's per-request records), <stem>.json, <stem>.png."""
    rows = [r for arm in report.arms.values() for r in arm.records]
    results.write_csv(out / f"{stem}_requests.csv", rows)
    data = report.to_dict()
    results.write_json(out / f"{stem}.json", data)
    figure(data, out / f"{stem}.png")
    say(f"wrote {out / (stem + '.json')}, {stem}_requests.csv, {stem}.png")
