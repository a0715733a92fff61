"""The A/B skeleton's reports: the JSON a fresh run writes, a saved report read back unchanged, the
records moved to the CSV, redraw recomputing only the derived numbers."""

from __future__ import annotations

import csv
import json

from pegaflow.bench.experiments import ab
from pegaflow.bench.harness import results


def _records(arm: str, cached: int) -> list[dict]:
    return [
        {
            "index": i,
            "instance": i % 2,
            "kind": "session",
            "prompt_tokens": 300,
            "cached_tokens": cached,
            "ttft_s": 0.1 * (i + 1),
            "e2e_s": 0.5,
            "start": float(i),
            "ok": True,
            "error": None,
            "arm": arm,
        }
        for i in range(4)
    ]


def _derive(report: ab.ABReport) -> None:
    report.sections["loaded"] = {name: arm.summary.loaded_blocks for name, arm in report.arms.items()}


def _figure(data: dict, path) -> None:
    path.write_text(json.dumps(sorted(data["arms"])))


EXPERIMENT = ab.ABExperiment(
    "toy",
    ab.ArmComparison("b", ("a",), min_gap=0.2, treatment_says="b's", baseline_says="a's"),
    _figure,
    _derive,
)


def _report() -> ab.ABReport:
    report = ab.ABReport("toy", {"setup": {"x": 1}, "trace": {"requests": 4}, "budget": {}})

    def run_arm(name: str) -> ab.ArmReport:
        records = _records(name, 256 if name == "b" else 0)
        summary = results.summarize_requests(records, 128)
        return ab.ArmReport(name, {"ready_s": 1.0}, summary, {"wall_s": 2.0}, records)

    EXPERIMENT.run_arms(report, ("a", "b"), run_arm)
    return report


def test_a_fresh_report_writes_json_csv_and_figure_and_reads_back_unchanged(tmp_path):
    report = _report()
    assert EXPERIMENT.finish(report, regression=True, out=tmp_path) == 0
    data = json.loads((tmp_path / "toy_regression.json").read_text())
    assert list(data) == [
        "experiment",
        "setup",
        "trace",
        "budget",
        "arms",
        "comparison",
        "loaded",
        "regression",
    ]
    assert list(data["arms"]["a"]) == ["arm", "ready_s", "summary", "wall_s"]  # records went to the CSV
    assert data["comparison"]["block_hit_rate_gap"] == 1.0
    assert data["regression"] == {"min_block_hit_rate_gap": 0.2, "passed": True, "problems": []}
    rows = list(csv.DictReader((tmp_path / "toy_regression_requests.csv").open()))
    assert [r["arm"] for r in rows] == ["a"] * 4 + ["b"] * 4
    assert ab.ABReport.from_dict(data).to_dict() == data
    assert json.dumps(ab.ABReport.from_dict(data).to_dict()) == json.dumps(data)  # key order too


def test_a_failing_regression_says_why_in_the_json_and_exits_1(tmp_path):
    report = _report()
    report.arms["b"].summary = report.arms["a"].summary
    assert EXPERIMENT.finish(report, regression=True, out=tmp_path) == 1
    data = json.loads((tmp_path / "toy_regression.json").read_text())
    assert data["regression"]["problems"] == ["b's block hit rate 0.0 is not 0.2 above a's 0.0"]


def test_redraw_keeps_the_saved_key_order_and_recomputes_the_derived_numbers(tmp_path):
    report = _report()
    EXPERIMENT.finish(report, regression=True, out=tmp_path)
    path = tmp_path / "toy_regression.json"
    data = json.loads(path.read_text())
    # a report saved by an older analysis: its regression before a derived number, one number stale
    older = {
        k: data[k] for k in ("experiment", "setup", "trace", "budget", "arms", "comparison", "regression")
    }
    older["loaded"] = {"a": 99, "b": 99}
    path.write_text(json.dumps(older))
    EXPERIMENT.redraw(path)
    again = json.loads(path.read_text())
    assert list(again)[-2:] == ["regression", "loaded"]
    assert again["loaded"] == {"a": 0, "b": 8}
    assert (tmp_path / "toy_regression.png").read_text() == '["a", "b"]'
