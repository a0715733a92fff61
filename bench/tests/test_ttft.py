"""bench/ttft.py's bookkeeping, without vLLM: the hit proof of a pass from /metrics deltas, the
ratios taken inside each round, the verdict against the issue's targets, the client command."""

from __future__ import annotations

import pathlib

from pegaflow.bench import ttft

BS = 128


def pass_record(engine, kind, rnd, mean, p99, *, ext=0.0, local=0.0, lens=None, extra_tokens=1, foreign=0.0):
    lens = lens if lens is not None else [10000] * 8
    total = sum(lens) + extra_tokens * len(lens)
    return {
        "mode": "concurrent",
        "engine": engine,
        "kind": kind,
        "round": rnd,
        "mean_ttft_ms": mean,
        "p99_ttft_ms": p99,
        "completed": len(lens),
        "failed": 0,
        "client_input_lens": lens,
        "foreign_cores": foreign,
        "metrics_delta": {
            "prompt_tokens": total,
            "by_source:external_kv_transfer": ext,
            "by_source:local_cache_hit": local,
            "by_source:local_compute": total - ext - local,
        },
    }


def test_the_hit_proof_needs_every_loadable_token_from_the_right_source():
    # the server adds one special token: 10,001 tokens, of which 78 whole blocks are loadable
    loadable = 8 * ((10001 - 1) // BS * BS)
    warm = pass_record("pega", "warm", 1, 50, 60, ext=loadable)
    got = ttft.hit_proof(warm, "pega", "warm", BS)
    assert got["hit_ok"] and got["loadable_tokens"] == loadable == 8 * 9984
    short = pass_record("pega", "warm", 1, 50, 60, ext=loadable - BS)  # one block recomputed
    assert not ttft.hit_proof(short, "pega", "warm", BS)["hit_ok"]
    floor = pass_record("floor", "warm", 1, 40, 50, local=loadable)
    assert ttft.hit_proof(floor, "floor", "warm", BS)["hit_ok"]
    # the floor's hits must be vLLM's own: external ones do not count for it
    assert not ttft.hit_proof(pass_record("floor", "warm", 1, 40, 50, ext=loadable), "floor", "warm", BS)[
        "hit_ok"
    ]
    cold = pass_record("pega", "cold", 0, 9000, 20000)
    assert ttft.hit_proof(cold, "pega", "cold", BS)["hit_ok"]
    assert not ttft.hit_proof(pass_record("pega", "cold", 0, 50, 60, ext=BS), "pega", "cold", BS)["hit_ok"]


def test_ratios_are_taken_inside_each_round_and_judged_on_median_and_worst():
    passes = [
        pass_record("pega", "cold", 0, 9000, 12000),
        pass_record("floor", "cold", 0, 9100, 12100),
        pass_record("example", "cold", 0, 9200, 12200),
        # round 1: a slow round for everyone
        pass_record("pega", "warm", 1, 110, 140),
        pass_record("floor", "warm", 1, 100, 110),
        pass_record("example", "warm", 1, 200, 260),
        # round 2
        pass_record("pega", "warm", 2, 55, 66, foreign=0.9),
        pass_record("floor", "warm", 2, 50, 60),
        pass_record("example", "warm", 2, 60, 90),
    ]
    s = ttft.summarize(passes, ["pega", "floor", "example"], ["concurrent"], quiet_cores=0.25)["concurrent"]
    r = s["ratios"]
    assert r["pega_vs_floor_mean"]["per_round"] == [1.1, 1.1]
    assert r["pega_vs_floor_p99"]["worst"] == 140 / 110
    # bigger is better for ExampleConnector / pega: its worst round is the smallest ratio
    assert r["example_vs_pega_mean"]["worst"] == 60 / 55
    assert s["engines"]["pega"]["warm_mean_ms"]["median"] == (110 + 55) / 2
    assert s["engines"]["floor"]["cold"] == {"mean_ms": 9100, "p99_ms": 12100}
    assert s["quiet_rounds"] == [1]  # round 2 had other work on the machine
    verdict = ttft.judge({"concurrent": s})
    assert verdict["warm_mean_vs_floor"]["met_median"] and verdict["warm_mean_vs_floor"]["met_worst"]
    assert verdict["warm_p99_vs_floor"]["met_median"] and not verdict["warm_p99_vs_floor"]["met_worst"]
    assert verdict["example_vs_pega_warm_mean"]["met_median"] is False  # (200/110 + 60/55) / 2 < 1.5


def test_the_client_command_is_the_seeds_shape_with_vllms_own_client():
    class Srv:
        base_url = "http://127.0.0.1:1"
        model = "/models/tiny"

    cmd = ttft.client_command(Srv(), "concurrent", pathlib.Path("/r"), "x.json")
    line = " ".join(cmd)
    assert "bench serve" in line
    for arg in (
        "--dataset-name random",
        "--random-input-len 10000",
        "--random-output-len 1",
        "--num-prompts 8",
        "--request-rate 4.0",
        "--seed 42",
        "--ready-check-timeout-sec 0",
    ):
        assert arg in line
    seq = " ".join(ttft.client_command(Srv(), "sequential", pathlib.Path("/r"), "x.json"))
    assert "--request-rate inf --max-concurrency 1" in seq and "--seed 43" in seq
