"""Prometheus metrics of one metaserver, in a registry of its own.

RPC latency and outcome are observed per call; the index's state (nodes,
entries, evictions, expiries) is read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pegaflow.metaserver.index import GlobalIndex
from pegaflow.metaserver.leadership.base import Leadership

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class MetaServerMetrics:
    """``index`` is a callable: each term a replica wins has an index of its own."""

    def __init__(self, index: Callable[[], GlobalIndex], leadership: Leadership | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.rpc_duration = Histogram(
            "pegaflow_meta_rpc_duration_seconds",
            "Server-side duration of each metaserver gRPC call, by method",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.rpc_calls = Counter(
            "pegaflow_meta_rpc",
            "Metaserver gRPC calls, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.located_blocks = Histogram(
            "pegaflow_meta_locate_best_blocks",
            "Leading blocks held by the best node found by each Locate call (0: none)",
            buckets=(0, 1, 4, 16, 64, 256, 1024, 4096, 16384),
            registry=self.registry,
        )
        self.registry.register(_IndexCollector(index, leadership))

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_duration.labels(method).observe(seconds)
        self.rpc_calls.labels(method, code).inc()


class _IndexCollector:
    def __init__(self, index: Callable[[], GlobalIndex], leadership: Leadership | None) -> None:
        self._index = index
        self._leadership = leadership

    def collect(self):
        stats = self._index().stats()
        if self._leadership is not None:
            view = self._leadership.view()
            yield GaugeMetricFamily(
                "pegaflow_meta_is_leader",
                "1 while this replica serves as the leader",
                value=int(view.serving()),
            )
            yield GaugeMetricFamily("pegaflow_meta_term", "The current leader's term", value=view.term)
            for name, value in self._leadership.stats().items():
                yield CounterMetricFamily(
                    f"pegaflow_meta_leadership_{name}", f"Leadership: {name}", value=value
                )
        batches = CounterMetricFamily(
            "pegaflow_meta_dropped_batches",
            "Publish batches dropped, by reason (this term's index)",
            labels=["reason"],
        )
        batches.add_metric(["duplicate"], stats.duplicate_batches)
        batches.add_metric(["stale_incarnation"], stats.stale_batches)
        batches.add_metric(["sequence_gap"], stats.sequence_gaps)
        yield batches
        yield GaugeMetricFamily("pegaflow_meta_nodes", "Nodes with a live lease", value=len(stats.nodes))
        yield GaugeMetricFamily(
            "pegaflow_meta_entries", "Distinct block keys in the index", value=stats.entries
        )
        yield GaugeMetricFamily(
            "pegaflow_meta_max_entries",
            "Cap on block keys (the oldest are evicted beyond it)",
            value=stats.max_entries,
        )
        yield CounterMetricFamily(
            "pegaflow_meta_evicted_entries",
            "Block keys dropped to stay within the cap",
            value=stats.evicted_entries,
        )
        yield CounterMetricFamily(
            "pegaflow_meta_expired_nodes",
            "Nodes dropped because their lease ran out",
            value=stats.expired_nodes,
        )
        published = CounterMetricFamily(
            "pegaflow_meta_published_blocks", "Block keys published, by operation", labels=["op"]
        )
        published.add_metric(["added"], stats.published_added)
        published.add_metric(["removed"], stats.published_removed)
        yield published
        per_node = GaugeMetricFamily(
            "pegaflow_meta_node_entries", "Block keys the index holds per node", labels=["node_id"]
        )
        for node in stats.nodes:
            per_node.add_metric([node.node_id], node.entries)
        yield per_node
