"""The connector's stats objects in vLLM's own metrics classes: accumulation across threads,
aggregation across TP ranks through vLLM's KVOutputAggregator and across roles as the
Scheduler does it, the msgpack trip to the API server, the log line of vLLM's
KVConnectorLogging and the /metrics series of vLLM's KVConnectorProm."""

from __future__ import annotations

import pickle
import threading

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from pegaflow.connector import PegaKVConnector
from pegaflow.connector.stats import COUNTERS, HISTOGRAMS, PegaKVConnectorStats, StatsRecorder

MIB = 1 << 20


def worker_interval(blocks: int, block_bytes: int, load_s: float, stall_s: float) -> PegaKVConnectorStats:
    r = StatsRecorder()
    r.add("load_blocks", blocks)
    r.add("load_bytes", blocks * block_bytes)
    r.observe("load_seconds", load_s)
    r.observe("load_stall_seconds", stall_s)
    stats = r.take()
    assert stats is not None
    return stats


def scheduler_interval(hit_tokens: int, asked: int, hit: int, lookup_s: float) -> PegaKVConnectorStats:
    r = StatsRecorder()
    r.add("lookups")
    r.add("lookup_blocks", asked)
    r.add("lookup_hit_blocks", hit)
    r.add("hit_tokens", hit_tokens)
    r.observe("lookup_seconds", lookup_s)
    stats = r.take()
    assert stats is not None
    return stats


def test_recorder_hands_over_each_interval_once_and_keeps_lifetime_totals():
    r = StatsRecorder()
    assert r.take() is None  # nothing happened: vLLM gets no object
    r.add("save_blocks", 3)
    r.add("save_blocks", 0)  # a zero is not an event
    r.observe("save_seconds", 0.004)
    first = r.take()
    assert first.counters == {"save_blocks": 3} and first.samples == {"save_seconds": [0.004]}
    assert r.take() is None
    r.add("save_blocks", 2)
    assert r.take().counters == {"save_blocks": 2}
    assert r.totals["save_blocks"] == 5
    with pytest.raises(KeyError):
        r.add("saved_blokcs")  # a typo fails at once instead of vanishing
    with pytest.raises(KeyError):
        r.observe("load_secs", 1.0)


def test_recorder_loses_no_count_under_concurrent_threads():
    r = StatsRecorder()
    taken: list[PegaKVConnectorStats] = []
    stop = threading.Event()

    def taker():  # vLLM's step thread takes intervals while the copy threads record
        while not stop.is_set():
            s = r.take()
            if s is not None:
                taken.append(s)

    def adder():
        for _ in range(20000):
            r.add("load_blocks")
            r.observe("load_seconds", 0.001)

    t = threading.Thread(target=taker)
    t.start()
    adders = [threading.Thread(target=adder) for _ in range(4)]
    for a in adders:
        a.start()
    for a in adders:
        a.join()
    stop.set()
    t.join()
    rest = r.take()
    if rest is not None:
        taken.append(rest)
    assert sum(s.counters.get("load_blocks", 0) for s in taken) == 80000
    assert sum(len(s.samples.get("load_seconds", [])) for s in taken) == 80000


def test_aggregate_sums_counters_and_concatenates_samples():
    a = worker_interval(78, MIB, 0.010, 0.002)
    b = worker_interval(78, MIB, 0.012, 0.000)
    out = a.aggregate(b)
    assert out is a  # vLLM keeps the returned object as its accumulator
    assert out.counters == {"load_blocks": 156, "load_bytes": 156 * MIB}
    assert out.samples["load_seconds"] == [0.010, 0.012]
    assert not out.is_empty()
    assert PegaKVConnectorStats().is_empty()
    assert PegaKVConnectorStats(data={"counters": {"lookups": 0}, "samples": {"save_seconds": []}}).is_empty()


def test_a_payload_from_another_version_keeps_the_known_keys():
    s = PegaKVConnectorStats(
        data={"counters": {"lookups": 2, "future_counter": 7}, "samples": {"load_seconds": [1], "x": [2.0]}}
    )
    assert s.counters == {"lookups": 2} and s.samples == {"load_seconds": [1.0]}
    assert PegaKVConnectorStats(data={}).is_empty()


def test_reduce_summarizes_the_interval_for_vllms_log_line():
    s = scheduler_interval(9984, 78, 78, 0.0005)
    s.aggregate(scheduler_interval(0, 78, 0, 0.0007))
    s.aggregate(worker_interval(78, MIB, 0.010, 0.004))
    r = s.reduce()
    assert r["lookups"] == 2 and r["hit_tokens"] == 9984
    assert r["block_hit_rate"] == 0.5
    assert r["lookup_avg_ms"] == 0.6 and r["lookup_p90_ms"] == 0.7
    assert r["loaded_MiB"] == 78.0
    assert r["load_GBps"] == round(78 * MIB / 0.010 / 1e9, 2)
    assert r["load_avg_ms"] == 10.0 and r["load_stall_avg_ms"] == 4.0
    assert "save_failures" not in r  # failures appear only when there were some
    f = StatsRecorder()
    f.add("lookup_failures")
    f.add("save_dropped_blocks", 5)
    assert f.take().reduce() == {"lookup_failures": 1, "save_dropped_blocks": 5}


def test_tp_ranks_fold_through_vllms_output_aggregator_and_the_scheduler_part_joins():
    """Two TP ranks' step outputs through vLLM's KVOutputAggregator (as its executor does),
    then the scheduler connector's stats as Scheduler.update_from_output adds them: bytes of
    both ranks add up, the scheduler's lookups count once."""
    outputs = []
    for rank_stall in (0.001, 0.003):
        mro = ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[1]])
        mro.kv_connector_output = KVConnectorOutput(
            kv_connector_stats=worker_interval(78, 512 << 10, 0.008, rank_stall)
        )
        outputs.append(mro)
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs, output_rank=0)
    stats = merged.kv_connector_output.kv_connector_stats
    assert stats.counters == {"load_blocks": 156, "load_bytes": 156 * (512 << 10)}
    assert sorted(stats.samples["load_stall_seconds"]) == [0.001, 0.003]
    # Scheduler.update_from_output: worker stats .aggregate(scheduler connector stats), .to_dict()
    payload = stats.aggregate(scheduler_interval(9984, 78, 78, 0.0004)).to_dict()
    assert payload["counters"]["lookups"] == 1 and payload["counters"]["hit_tokens"] == 9984
    # EngineCore -> API server: SchedulerStats travel msgpack'd; the payload must survive it
    enc, dec = MsgpackEncoder(), MsgpackDecoder(SchedulerStats)
    back = dec.decode(enc.encode(SchedulerStats(kv_connector_stats=payload))).kv_connector_stats
    assert back == payload
    # worker -> EngineCore: ModelRunnerOutput is pickled
    assert pickle.loads(pickle.dumps(stats)).to_dict() == stats.to_dict()


@pytest.fixture
def vllm_config():
    kv = KVTransferConfig(
        kv_connector="PegaKVConnector", kv_role="kv_both", kv_connector_module_path="pegaflow.connector"
    )
    return VllmConfig(kv_transfer_config=kv)


def test_vllms_log_line_carries_the_interval(vllm_config):
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    assert logging.connector_cls is PegaKVConnector
    logging.observe(scheduler_interval(9984, 78, 78, 0.0005).to_dict())
    logging.observe(worker_interval(78, MIB, 0.010, 0.0).to_dict())
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert line.startswith("KV Transfer metrics: ")
    assert "lookups=1" in line and "hit_tokens=9984" in line and "loaded_MiB=78.0" in line
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # the interval was reset


def scrape() -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name.startswith("vllm:pegaflow_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vllms_prometheus_logger_exposes_the_series_per_engine(vllm_config):
    unregister_vllm_metrics()
    try:
        labels = ["model_name", "engine"]
        prom = KVConnectorProm(vllm_config, labels, {0: ["tiny", "0"], 1: ["tiny", "1"]})
        assert prom.prom_metrics is not None
        samples = scrape()
        engine0 = (("engine", "0"), ("model_name", "tiny"))
        engine1 = (("engine", "1"), ("model_name", "tiny"))
        # every series exists from the start, at zero, for each engine
        for series in COUNTERS:
            assert samples[(series.name + "_total", engine0)] == 0
            assert samples[(series.name + "_total", engine1)] == 0
        for series, _ in HISTOGRAMS:
            assert samples[(series.name + "_count", engine1)] == 0
        step = scheduler_interval(9984, 78, 78, 0.0005).aggregate(worker_interval(78, MIB, 0.010, 0.002))
        prom.observe(step.to_dict(), engine_idx=1)
        prom.observe(scheduler_interval(0, 78, 0, 0.0007).to_dict(), engine_idx=1)
        samples = scrape()
        assert samples[("vllm:pegaflow_lookups_total", engine1)] == 2
        assert samples[("vllm:pegaflow_hit_tokens_total", engine1)] == 9984
        assert samples[("vllm:pegaflow_lookup_hit_blocks_total", engine1)] == 78
        assert samples[("vllm:pegaflow_load_bytes_total", engine1)] == 78 * MIB
        assert samples[("vllm:pegaflow_lookup_seconds_count", engine1)] == 2
        assert samples[("vllm:pegaflow_lookup_seconds_sum", engine1)] == pytest.approx(0.0012)

        def bucket(le: str) -> float:
            return samples[("vllm:pegaflow_load_seconds_bucket", tuple(sorted((*engine1, ("le", le)))))]

        assert bucket("0.01") == 1 and bucket("0.005") == 0
        assert samples[("vllm:pegaflow_lookups_total", engine0)] == 0  # the other engine did nothing
    finally:
        unregister_vllm_metrics()
