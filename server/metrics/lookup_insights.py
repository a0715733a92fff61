"""What the stream of lookups says beyond hits and misses, as Prometheus families: the miss-ratio
curve (what more or less DRAM would buy; computed by the lookup sketches, lookup_sketches.py, read
here from their snapshot) and the savings (prefill tokens and seconds the cache spared, kept here).

One object is both a sink of the metrics feeder (``add_hits``: the batch of LOOKUP queries
ServerMetrics' feeder thread drains off the request path) and a collector of the server's registry
(``collect``). It owns no thread.

    insights = LookupInsights(windows, registry)        # in ServerMetrics.__init__: registers itself
    insights.bind(engine.namespace_at, sketch_snapshot) # once the engine exists
    insights.add_hits([(ns_index, hashes, hits), ...])  # the feeder, per drained batch
    insights.report_prefill(namespace_id, tokens, seconds)  # the engine's measured prefill cost (RPC)

Exported (names are part of ops/grafana and ops/prometheus; cardinality: 5 factors x windows, and
one series per namespace; ``model`` is the id, or its digest with --metrics-hide-models):
  pegaflow_mrc_predicted_hit_rate{pool_factor, window}   LRU hit rate predicted at 0.25x .. 4x the pool
  pegaflow_mrc_sampling_rate                            SHARDS' current sampling rate R
  pegaflow_mrc_tracked_keys, pegaflow_mrc_memory_bytes  its bounded state
  pegaflow_mrc_sampled_requests_total                   block requests that went through the sample
  pegaflow_prefill_tokens_served_total{namespace, model}     hit blocks x block_tokens
  pegaflow_prefill_seconds_avoided_total{namespace, model}   tokens served x the engine's s/token
  pegaflow_prefill_tokens_unpriced_total{namespace, model}   served before the engine reported a rate
  pegaflow_prefill_seconds_per_token{namespace, model}       the current price (where reported)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pegaflow.server.metrics.lookup_sketches import SketchSnapshot
from pegaflow.server.metrics.model_names import SHOWN, ModelNames
from pegaflow.server.metrics.savings import OVERFLOW, PrefillSavings

log = logging.getLogger(__name__)


def factor_label(factor: float) -> str:
    """0.25 -> "0.25", 1.0 -> "1" (the pool_factor label values)."""
    return f"{factor:g}"


class _NamespaceInfo:
    __slots__ = ("id", "model_id", "block_bytes", "block_tokens", "prefix")

    def __init__(self, index: int, namespace) -> None:
        self.id = namespace.id
        self.model_id = namespace.model_id
        self.block_bytes = namespace.block_bytes
        self.block_tokens = namespace.layout.block_tokens
        self.prefix = index.to_bytes(4, "little")


class LookupInsights:
    def __init__(
        self,
        windows: dict[str, float],
        registry=None,
        model_names: ModelNames = SHOWN,
        sketches: Callable[[], SketchSnapshot | None] | None = None,
    ):
        """``registry``: a prometheus_client CollectorRegistry to register with (or None);
        ``model_names``: the model label as exported (model_names.py: the id, or its digest);
        ``sketches``: returns the lookup sketches' current snapshot (lookup_sketches.py), or None
        while there is none (the miss-ratio families are then left out)."""
        self.windows = dict(windows)
        self._model_names = model_names
        self._sketches = sketches or (lambda: None)
        self.savings = PrefillSavings()
        self._namespace_at: Callable[[int], object] | None = None
        self._namespaces: dict[int, _NamespaceInfo] = {}
        self._unknown: set[int] = set()
        self._lock = threading.Lock()  # bind vs the feeder
        if registry is not None:
            registry.register(self)

    def bind(
        self, namespace_at: Callable[[int], object], sketches: Callable[[], SketchSnapshot | None]
    ) -> None:
        """``namespace_at(index)``: the engine's namespace of a block key's index (an object with id,
        model_id, block_bytes and layout.block_tokens). Namespaces are never renumbered, so each is
        looked up once."""
        with self._lock:
            self._namespace_at = namespace_at
            self._sketches = sketches

    def block_bytes(self, ns_index: int) -> int:
        """The namespace's block size, 0 for one released since (and for one before ``bind``)."""
        with self._lock:
            info = self._namespace(ns_index)
        return info.block_bytes if info is not None else 0

    def _namespace(self, index: int) -> _NamespaceInfo | None:
        info = self._namespaces.get(index)
        if info is None and self._namespace_at is not None:
            try:
                info = self._namespaces[index] = _NamespaceInfo(index, self._namespace_at(index))
            except KeyError:  # released since the lookup (idle namespaces are): nothing to price
                if index not in self._unknown:
                    self._unknown.add(index)
                    log.info("lookup insights: namespace %d was released; its lookups are not priced", index)
        return info

    def add_hits(self, lookups: Sequence[tuple[int, Sequence[bytes], int]]) -> None:
        """LOOKUP queries in the order they ran: (namespace index, requested hashes, leading hits)."""
        with self._lock:
            for ns_index, _hashes, hits in lookups:
                ns = self._namespace(ns_index)
                if ns is not None:
                    self.savings.add_hits(ns.id, ns.model_id, ns.block_tokens, hits)

    def report_prefill(
        self, namespace_id: str, model_id: str, computed_tokens: int, prefill_seconds: float
    ) -> None:
        """The engine's own measured prefill cost (see savings.py); ValueError for a bad report."""
        self.savings.report_prefill(namespace_id, model_id, computed_tokens, prefill_seconds)

    # ------------------------------------------------------------- collector

    def collect(self):
        snap = self._sketches()
        if snap is not None:
            predicted = GaugeMetricFamily(
                "pegaflow_mrc_predicted_hit_rate",
                "Block hit rate LRU would reach with pool_factor x this DRAM pool's bytes, over the window "
                "(SHARDS miss-ratio curve)",
                labels=["pool_factor", "window"],
            )
            for window, rates in snap.mrc_predicted.items():
                for factor, rate in rates.items():
                    predicted.add_metric([factor_label(factor), window], rate)
            yield predicted
            yield _gauge(
                "pegaflow_mrc_sampling_rate", "SHARDS sampling rate R of the miss-ratio curve", snap.mrc_rate
            )
            yield _gauge(
                "pegaflow_mrc_tracked_keys",
                "Block keys the miss-ratio curve tracks (bounded)",
                snap.mrc_tracked_keys,
            )
            yield _gauge(
                "pegaflow_mrc_memory_bytes",
                "Approximate memory of the miss-ratio curve",
                snap.mrc_memory_bytes,
            )
            sampled = CounterMetricFamily(
                "pegaflow_mrc_sampled_requests",
                "Block requests that went through the miss-ratio curve's sample",
            )
            sampled.add_metric([], snap.mrc_sampled_requests)
            yield sampled
        families = {
            "served": CounterMetricFamily(
                "pegaflow_prefill_tokens_served",
                "Prompt tokens served from the cache (lookup hit blocks x block_tokens)",
                labels=["namespace", "model"],
            ),
            "avoided": CounterMetricFamily(
                "pegaflow_prefill_seconds_avoided",
                "Prefill seconds the served tokens would have cost at the engine's measured s per token",
                labels=["namespace", "model"],
            ),
            "unpriced": CounterMetricFamily(
                "pegaflow_prefill_tokens_unpriced",
                "Tokens served while the namespace's engine had reported no prefill rate",
                labels=["namespace", "model"],
            ),
            "price": GaugeMetricFamily(
                "pegaflow_prefill_seconds_per_token",
                "The engine's measured prefill seconds per computed token (rolling), by namespace",
                labels=["namespace", "model"],
            ),
        }
        for s in self.savings.snapshot():
            # The overflow account's "model" is savings.OVERFLOW, no model's name: kept readable.
            model = s.model_id if s.namespace_id == OVERFLOW else self._model_names(s.model_id)
            labels = [s.namespace_id, model]
            families["served"].add_metric(labels, s.tokens_served)
            families["avoided"].add_metric(labels, s.seconds_avoided)
            families["unpriced"].add_metric(labels, s.unpriced_tokens)
            if s.seconds_per_token is not None:
                families["price"].add_metric(labels, s.seconds_per_token)
        yield from families.values()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
