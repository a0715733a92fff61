"""PegaKVConnector's numbers inside vLLM's own metrics: the connector stats object vLLM
carries from the connector roles to its loggers, and the Prometheus series it feeds.

How vLLM 0.32 moves them (read in vllm/v1/worker/kv_connector_model_runner_mixin.py,
distributed/kv_transfer/kv_connector/utils.py, v1/core/sched/scheduler.py,
v1/metrics/loggers.py):

  worker (each TP rank)  get_kv_connector_stats() after every step -> ModelRunnerOutput
  executor               KVOutputAggregator: rank 0's object .aggregate(rank 1's) ...
  EngineCore             Scheduler.update_from_output: .aggregate(the scheduler connector's
                         get_kv_connector_stats()), then .to_dict() into SchedulerStats
                         (msgpack'd to the API server: plain dicts, lists and numbers only)
  API server             PrometheusStatLogger -> KVConnectorProm.observe(dict, engine_idx)
                         -> PegaPromMetrics.observe (this file: /metrics)
                         LoggingStatLogger -> build_kv_connector_stats(dict), .aggregate()
                         over its interval, .reduce() -> the "KV Transfer metrics:" log line

So one class (`PegaKVConnectorStats`) carries both roles' numbers; the payload is

  {"counters": {key: number}, "samples": {key: [seconds, ...]}}

counters add up on aggregate (across TP ranks, across roles, across steps) and samples
(latencies) concatenate. Scheduler-side keys count once per engine (one scheduler);
worker-side keys are summed over the TP ranks, each of which moves its own shard: bytes
are the engine's real traffic, blocks are rank-blocks (TP x the blocks of one rank).

`StatsRecorder` is the thread-safe accumulator a role records into (the worker's load
and save threads write while vLLM's step thread takes); `take()` hands vLLM one interval
and starts the next. `PegaPromMetrics` registers the `vllm:pegaflow_*` series per engine
(vLLM's `model_name`/`engine` labels) and feeds them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclasses.dataclass(frozen=True)
class Series:
    key: str  # key in the stats payload
    name: str  # Prometheus name (prometheus_client adds _total to counters)
    doc: str
    role: str  # "scheduler" (once per engine) or "worker" (summed over TP ranks)


COUNTERS: tuple[Series, ...] = (
    Series(
        "lookups",
        "vllm:pegaflow_lookups",
        "Prefix lookups the scheduler sent to pegaflow-server (one per admitted request; vLLM's "
        "repeats for a request still waiting reuse the answer for 1 s).",
        "scheduler",
    ),
    Series(
        "lookup_blocks",
        "vllm:pegaflow_lookup_blocks",
        "Full blocks asked about by prefix lookups that got an answer.",
        "scheduler",
    ),
    Series(
        "lookup_hit_blocks",
        "vllm:pegaflow_lookup_hit_blocks",
        "Leading blocks prefix lookups found stored in pegaflow.",
        "scheduler",
    ),
    Series(
        "hit_tokens",
        "vllm:pegaflow_hit_tokens",
        "Prompt tokens the connector told vLLM to take from pegaflow, beyond vLLM's own prefix-cache hit.",
        "scheduler",
    ),
    Series(
        "lookup_failures",
        "vllm:pegaflow_lookup_failures",
        "Prefix lookups that got no answer (server unreachable, deadline passed, request rejected); "
        "served as misses.",
        "scheduler",
    ),
    Series(
        "lookups_skipped",
        "vllm:pegaflow_lookups_skipped",
        "Prefix lookups not sent: the server is down, slow or not attached yet (circuit breaker open); "
        "served as misses.",
        "scheduler",
    ),
    Series(
        "load_blocks",
        "vllm:pegaflow_load_blocks",
        "Blocks copied from pegaflow into vLLM's KV cache (rank-blocks: summed over TP ranks).",
        "worker",
    ),
    Series(
        "load_bytes",
        "vllm:pegaflow_load_bytes",
        "Bytes copied from pegaflow into vLLM's KV cache (summed over TP ranks).",
        "worker",
    ),
    Series(
        "load_failed_blocks",
        "vllm:pegaflow_load_failed_blocks",
        "Blocks a load could not deliver, reported to vLLM to recompute (rank-blocks).",
        "worker",
    ),
    Series(
        "load_corrupt_blocks",
        "vllm:pegaflow_load_corrupt_blocks",
        "Blocks whose pool bytes did not match their writer's checksum (block_checksums): recomputed.",
        "worker",
    ),
    Series(
        "load_timeouts",
        "vllm:pegaflow_load_timeouts",
        "Steps whose loads missed load_timeout_ms on a rank (what had not landed is recomputed).",
        "worker",
    ),
    Series(
        "save_blocks",
        "vllm:pegaflow_save_blocks",
        "Blocks written to pegaflow and sealed (rank-blocks).",
        "worker",
    ),
    Series(
        "save_bytes",
        "vllm:pegaflow_save_bytes",
        "Bytes written to pegaflow and sealed (summed over TP ranks).",
        "worker",
    ),
    Series(
        "save_deduplicated_blocks",
        "vllm:pegaflow_save_deduplicated_blocks",
        "Blocks a save found stored already (another engine or request saved them): nothing copied.",
        "worker",
    ),
    Series(
        "save_dropped_blocks",
        "vllm:pegaflow_save_dropped_blocks",
        "Blocks not saved: server unavailable, save backlog full, or computed over a failed load.",
        "worker",
    ),
    Series(
        "save_failures",
        "vllm:pegaflow_save_failures",
        "Save batches that failed (RPC error, server gone, rejected).",
        "worker",
    ),
)

# Latency buckets (seconds). Lookups are one local RPC (~0.1-1 ms here, 200 ms deadline);
# loads and saves move up to hundreds of MiB at ~5-20 GB/s (ms to tens of ms, 500 ms deadline).
_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_COPY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

HISTOGRAMS: tuple[tuple[Series, tuple[float, ...]], ...] = (
    (
        Series(
            "lookup_seconds",
            "vllm:pegaflow_lookup_seconds",
            "Duration of one prefix lookup by the scheduler (inside the engine step).",
            "scheduler",
        ),
        _RPC_BUCKETS,
    ),
    (
        Series(
            "load_seconds",
            "vllm:pegaflow_load_seconds",
            "Per step with loads, per TP rank: from start_load_kv until its last layer landed.",
            "worker",
        ),
        _COPY_BUCKETS,
    ),
    (
        Series(
            "load_stall_seconds",
            "vllm:pegaflow_load_stall_seconds",
            "Per step with loads, per TP rank: the step thread's time on them (lease RPC, the copies "
            "it made itself, waits for the load thread); the forward computes nothing meanwhile.",
            "worker",
        ),
        _COPY_BUCKETS,
    ),
    (
        Series(
            "save_seconds",
            "vllm:pegaflow_save_seconds",
            "Per save batch, per TP rank: allocate, copy and seal, off the forward's path.",
            "worker",
        ),
        _COPY_BUCKETS,
    ),
)

COUNTER_KEYS = frozenset(s.key for s in COUNTERS)
SAMPLE_KEYS = frozenset(s.key for s, _ in HISTOGRAMS)


def _empty() -> dict[str, dict]:
    return {"counters": {}, "samples": {}}


@dataclasses.dataclass
class PegaKVConnectorStats(KVConnectorStats):
    """One interval's numbers of one or more connector roles (see the module docstring).

    Built from a payload (`build_kv_connector_stats(data)`) it takes the keys it knows and
    drops the rest, so a payload from another connector version never breaks vLLM's
    loggers; values of unknown shape are an error (a bug here, not version skew)."""

    def __post_init__(self) -> None:
        data = self.data or {}
        self.reset()
        for key, value in dict(data.get("counters") or {}).items():
            if key in COUNTER_KEYS:
                self.data["counters"][key] = float(value) if isinstance(value, float) else int(value)
        for key, values in dict(data.get("samples") or {}).items():
            if key in SAMPLE_KEYS:
                self.data["samples"][key] = [float(v) for v in values]

    def reset(self) -> None:
        self.data = _empty()

    @property
    def counters(self) -> dict[str, int | float]:
        return self.data["counters"]

    @property
    def samples(self) -> dict[str, list[float]]:
        return self.data["samples"]

    def aggregate(self, other: KVConnectorStats) -> PegaKVConnectorStats:
        """Add `other` into this one (vLLM folds TP ranks and the scheduler's part this way)."""
        if not isinstance(other, PegaKVConnectorStats):
            other = PegaKVConnectorStats(data=dict(other.data))
        for key, value in other.counters.items():
            self.counters[key] = self.counters.get(key, 0) + value
        for key, values in other.samples.items():
            self.samples.setdefault(key, []).extend(values)
        return self

    def is_empty(self) -> bool:
        return not any(self.counters.values()) and not any(self.samples.values())

    def reduce(self) -> dict[str, int | float]:
        """The interval in one log line (vLLM's "KV Transfer metrics: ..."), only what happened."""
        c, s = self.counters, self.samples
        out: dict[str, int | float] = {}
        if c.get("lookups") or c.get("lookups_skipped"):
            out["lookups"] = int(c.get("lookups", 0))
            out["hit_tokens"] = int(c.get("hit_tokens", 0))
            asked = c.get("lookup_blocks", 0)
            out["block_hit_rate"] = round(c.get("lookup_hit_blocks", 0) / asked, 4) if asked else 0.0
        _latency(out, "lookup", s.get("lookup_seconds"))
        if c.get("load_blocks") or s.get("load_seconds"):
            out["loaded_MiB"] = round(c.get("load_bytes", 0) / 2**20, 1)
            busy = sum(s.get("load_seconds") or ())
            out["load_GBps"] = round(c.get("load_bytes", 0) / busy / 1e9, 2) if busy else 0.0
        _latency(out, "load", s.get("load_seconds"))
        _latency(out, "load_stall", s.get("load_stall_seconds"))
        if c.get("save_blocks") or c.get("save_deduplicated_blocks"):
            out["saved_MiB"] = round(c.get("save_bytes", 0) / 2**20, 1)
            out["save_deduplicated_blocks"] = int(c.get("save_deduplicated_blocks", 0))
        _latency(out, "save", s.get("save_seconds"))
        for key in (
            "lookup_failures",
            "lookups_skipped",
            "load_failed_blocks",
            "load_corrupt_blocks",
            "load_timeouts",
            "save_dropped_blocks",
            "save_failures",
        ):
            if c.get(key):
                out[key] = int(c[key])
        return out


def _latency(out: dict[str, int | float], name: str, values: list[float] | None) -> None:
    if not values:
        return
    ordered = sorted(values)
    out[f"{name}_avg_ms"] = round(sum(ordered) / len(ordered) * 1e3, 3)
    # nearest-rank P90: the value 90% of the observations do not exceed
    out[f"{name}_p90_ms"] = round(ordered[max(0, -(-9 * len(ordered) // 10) - 1)] * 1e3, 3)


class StatsRecorder:
    """Thread-safe accumulator of one role's numbers: `add`/`observe` from any thread,
    `take()` from vLLM's step thread. Keys must be ones the payload knows (a typo fails
    at once instead of vanishing). `totals` keeps lifetime sums for logs and tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._samples: dict[str, list[float]] = {}
        self.totals: collections.Counter[str] = collections.Counter()

    def add(self, key: str, n: int | float = 1) -> None:
        if key not in COUNTER_KEYS:
            raise KeyError(f"unknown pegaflow counter {key!r}")
        if not n:
            return
        with self._lock:
            self._counters[key] += n
            self.totals[key] += n

    def observe(self, key: str, seconds: float) -> None:
        if key not in SAMPLE_KEYS:
            raise KeyError(f"unknown pegaflow latency {key!r}")
        with self._lock:
            self._samples.setdefault(key, []).append(float(seconds))

    def take(self) -> PegaKVConnectorStats | None:
        """This interval's numbers (None when nothing happened), and start the next one."""
        with self._lock:
            if not self._counters and not self._samples:
                return None
            counters, self._counters = self._counters, collections.Counter()
            samples, self._samples = self._samples, {}
        return PegaKVConnectorStats(data={"counters": dict(counters), "samples": samples})


class PegaPromMetrics(KVConnectorPromMetrics):
    """The `vllm:pegaflow_*` series on vLLM's /metrics, one child per engine (labels
    model_name, engine), fed from each step's aggregated payload."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        self.histograms: dict[str, dict[int, Any]] = {}
        for series in COUNTERS:
            metric = self._counter_cls(name=series.name, documentation=series.doc, labelnames=labelnames)
            self.counters[series.key] = create_metric_per_engine(metric, per_engine_labelvalues)
        for series, buckets in HISTOGRAMS:
            metric = self._histogram_cls(
                name=series.name, documentation=series.doc, buckets=list(buckets), labelnames=labelnames
            )
            self.histograms[series.key] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: Mapping[str, Any], engine_idx: int = 0) -> None:
        stats = PegaKVConnectorStats(data=dict(transfer_stats_data))
        for key, value in stats.counters.items():
            if value > 0:
                self.counters[key][engine_idx].inc(value)
        for key, values in stats.samples.items():
            hist = self.histograms[key][engine_idx]
            for v in values:
                hist.observe(v)
