import csv
import json

import pytest

from pegaflow.bench.harness import models, results
from pegaflow.server.tiers.dram.allocator import SlabAllocator


def rec(index, prompt, cached, ttft, ok=True, start=0.0, e2e=1.0, instance=0):
    return {
        "index": index,
        "instance": instance,
        "kind": "session",
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_s": ttft if ok else None,
        "e2e_s": e2e,
        "start": start,
        "ok": ok,
        "error": None if ok else "StreamError: boom",
    }


def test_summary_hit_rates_and_latencies():
    records = [
        rec(0, 300, 0, 1.0, start=0.0, e2e=2.0),  # 2 full blocks of 128, none loaded
        rec(1, 300, 256, 0.2, start=1.0, e2e=1.0),  # both loaded
        rec(2, 520, 128, 0.4, start=2.0, e2e=2.0, instance=1),  # 1 of 4 loaded
        rec(3, 100, 0, None, ok=False, start=3.0, e2e=0.5),
    ]
    s = results.summarize_requests(records, block_tokens=128)
    assert (s.requests, s.succeeded, s.failed) == (4, 3, 1)
    assert s.errors == ("StreamError: boom",)
    assert s.duration_s == pytest.approx(4.0)
    assert s.throughput_rps == pytest.approx(3 / 4.0)
    assert s.ttft_mean_s == pytest.approx((1.0 + 0.2 + 0.4) / 3)
    assert s.full_prompt_blocks == 8 and s.loaded_blocks == 3
    assert s.block_hit_rate == pytest.approx(3 / 8)
    assert s.request_hit_rate == pytest.approx(2 / 3)
    assert s.token_hit_rate == pytest.approx(384 / 1120)
    by = results.summarize_by(records, "instance", 128)
    assert by["1"].requests == 1 and by["0"].requests == 3
    # the JSON form: field order as always written, and it reads back
    assert list(s.to_dict())[:4] == ["requests", "succeeded", "failed", "errors"]
    assert s.to_dict()["errors"] == ["StreamError: boom"]
    assert results.RequestSummary.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="not a request summary"):
        results.RequestSummary.from_dict({**s.to_dict(), "extra": 1})


def test_missing_usage_is_reported_not_hidden():
    s = results.summarize_requests([rec(0, 300, None, 0.1)], 128)
    assert s.responses_without_cached_tokens == 1


def test_write_json_and_csv(tmp_path):
    results.write_json(tmp_path / "a" / "r.json", {"x": [1, 2], "p": tmp_path})
    assert json.loads((tmp_path / "a" / "r.json").read_text())["x"] == [1, 2]
    results.write_csv(tmp_path / "r.csv", [{"a": 1}, {"a": 2, "b": 3}])
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert rows == [{"a": "1", "b": ""}, {"a": "2", "b": "3"}]


@pytest.mark.parametrize("pool_mib, block_kib", [(12, 1024), (24, 1024), (256, 1024), (100, 256), (64, 300)])
def test_pool_capacity_matches_what_the_server_allocator_really_hands_out(pool_mib, block_kib):
    pool, block = pool_mib << 20, block_kib << 10
    alloc = SlabAllocator(pool)
    granted = 0
    while alloc.allocate(block) is not None:
        granted += 1
    assert models.pool_capacity_blocks(pool, block) == granted


def test_smallest_pool_for_blocks_and_bench_model_geometry():
    assert models.block_bytes(models.BENCH_MODEL) == 1 << 20
    size = models.smallest_pool_for_blocks(68, 1 << 20)
    assert models.pool_capacity_blocks(size, 1 << 20) >= 68
    assert models.pool_capacity_blocks(size - (1 << 20), 1 << 20) < 68


def test_gpu_bench_stream_summary_gives_each_in_flight_counts_median_and_slowest_stream():
    from pegaflow.bench.gpu_bench import stream_summary

    streams = [
        {"inflight": n, "save_ratio": s, "load_ratio": ld}
        for n, s, ld in [(1, 0.88, 0.91), (2, 0.97, 0.98), (1, 0.86, 0.93), (2, 0.90, 0.99), (2, 0.98, 0.97)]
    ]
    assert stream_summary(streams) == [
        {
            "inflight": 1,
            "streams": 2,
            "save_median": 0.87,
            "save_worst": 0.86,
            "load_median": 0.92,
            "load_worst": 0.91,
        },
        {
            "inflight": 2,
            "streams": 3,
            "save_median": 0.97,
            "save_worst": 0.9,
            "load_median": 0.98,
            "load_worst": 0.97,
        },
    ]


def test_save_stream_compare_merges_runs_of_one_arm_and_summarizes_them_again(tmp_path):
    from pegaflow.bench.save_stream_cpu import compare

    def row(threads, cpu, ratio):
        return {
            "threads": threads,
            "batches_per_s": 1000 / cpu,
            "server_cpu_ms_per_batch": cpu,
            "client_cpu_ms_per_batch": cpu + 0.2,
            "windows": {"save_vs_memcpy": [ratio, ratio - 0.1]},
        }

    paths = []
    for i, (label, cpu) in enumerate([("before", 1.0), ("after", 0.8), ("before", 1.2), ("after", 0.9)]):
        report = {"label": label, "rows": [row(1, cpu, 0.8), row(2, cpu + 0.2, 0.5)], "summary": {}}
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(report))
    compare(paths, tmp_path / "out")
    merged = json.loads((tmp_path / "out" / "save_stream_cpu.json").read_text())
    assert list(merged) == ["before", "after"]
    assert len(merged["before"]["rows"]) == 4
    assert merged["before"]["reports"] == [str(paths[0]), str(paths[2])]
    one = merged["before"]["summary"]["1"]
    assert one["server_cpu_ms_per_batch"] == {"median": 1.1, "worst": 1.2}
    assert one["save_vs_memcpy"] == {"median": pytest.approx(0.75), "worst": pytest.approx(0.7)}
    assert merged["after"]["summary"]["2"]["server_cpu_ms_per_batch"]["worst"] == pytest.approx(1.1)
    assert (tmp_path / "out" / "save_stream_cpu.png").exists()
