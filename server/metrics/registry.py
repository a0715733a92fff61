"""Prometheus metrics of one server, in a CollectorRegistry of its own.

Its own registry (not prometheus-client's global one) so tests and embedded
servers in one process do not clash. Engine state is read at scrape time by a
custom collector (one short engine lock per scrape); the query path itself only
appends to a deque. A feeder thread drains that deque into the HyperLogLog
measured windowed hit rate and hands the lookups to the lookup sketches (the
HyperLogLog hit-rate ceiling and the miss-ratio curve, lookup_sketches.py), by
default in a process of their own (sketch_process.py: their per-key Python no
longer shares the request path's GIL), so neither that work nor a scrape can
stall a query. The feeder also yields the GIL to engine calls in flight: it
feeds in short slices between them (foreground.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pegaflow.server.engine import EngineObserver, KVEngine
from pegaflow.server.metrics.foreground import ForegroundActivity
from pegaflow.server.metrics.lookup_insights import LookupInsights
from pegaflow.server.metrics.lookup_sketches import LookupRecord, LookupSketches, SketchSnapshot
from pegaflow.server.metrics.model_names import SHOWN, ModelNames
from pegaflow.server.metrics.sketch_process import AgedSnapshot, SketchProcess
from pegaflow.server.metrics.windowed_rate import WindowedHitRate
from pegaflow.server.store.stats import TENANT_METRICS, TIER_METRICS, metric_fields

log = logging.getLogger(__name__)

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FEED_INTERVAL_S = 0.1
# Bounded so a stalled feeder cannot grow memory without limit; what is dropped is counted.
MAX_PENDING_LOOKUPS = 100_000
MAX_KEYS_PER_ADD = 65_536
# The feeder yields to engine calls (foreground.py). It feeds in slices of this many keys (~0.15 ms
# of miss-ratio-curve work on the H200 host's cores) and looks between slices: while a call is in
# flight it waits for the end of it, so a call that starts meanwhile waits for one slice at most.
FEED_SLICE_KEYS = 16
# Under calls without a pause it waits at most this long, then feeds for FORCED_FEED_S with a pause
# after each slice (the calls in flight take the GIL freely meanwhile), so it keeps up with about
# 8,000 keys/s (the miss-ratio curve samples at most 10,000/s) and what it cannot feed is bounded
# by MAX_PENDING_LOOKUPS.
MAX_FEED_DEFER_S = 0.1
FORCED_FEED_S = 0.05
BUSY_PAUSE_S = 0.0005
SKETCH_MODES = ("process", "thread")
# A flush with a deadline (GetStats, a scrape) looks at it after each slice of this many keys,
# and feeds for this long at most: the rest is the feeder's.
DEADLINE_FEED_SLICE_KEYS = 2048
FLUSH_BUDGET_S = 0.1
# A scrape's wait for the lookup sketches (their process may be seconds behind on a busy host): the
# engine's families take up to 2 s of Prometheus' default 10 s scrape timeout, the windows and the
# miss-ratio families this much each (sketch_process.py waits 0.5 s when a recent snapshot can
# stand in: this is for a child with none yet).
SCRAPE_WINDOWS_BUDGET_S = 3.0
# With the sketches in their own process a slice costs the feeder a frame's packing per lookup, not
# the sketches' per-key work: slices are that much longer (one frame, one write each).
PROCESS_FEED_SLICE_KEYS = 1024


class ServerMetrics(EngineObserver):
    """The engine's observer and the Prometheus registry of one server."""

    def __init__(self, windows: dict[str, float], model_names: ModelNames = SHOWN, sketches: str = "thread"):
        """``model_names``: how model ids appear in labels and GetStats (model_names.py);
        ``sketches``: where the lookup sketches run, ``"process"`` (sketch_process.py) or
        ``"thread"`` (this interpreter, on the feeder thread)."""
        if sketches not in SKETCH_MODES:
            raise ValueError(f"sketches must be one of {', '.join(SKETCH_MODES)}, got {sketches!r}")
        self.windows = dict(windows)
        self.sketch_mode = sketches
        self.feed_slice_keys = PROCESS_FEED_SLICE_KEYS if sketches == "process" else FEED_SLICE_KEYS
        self.sketches: LookupSketches | SketchProcess | None = None
        self.model_names = model_names
        self.registry = CollectorRegistry(auto_describe=False)
        self.rpc_duration = Histogram(
            "pegaflow_rpc_duration_seconds",
            "Server-side duration of each gRPC call, by method",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.rpc_calls = Counter(
            "pegaflow_rpc",
            "RPCs (gRPC and the local RPC socket) by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.save_duration = Histogram(
            "pegaflow_save_duration_seconds",
            "Time from AllocateBlocks to the SealBlocks that completed a save",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.load_duration = Histogram(
            "pegaflow_load_duration_seconds",
            "Time from the QueryPrefix that took a lease to its ReleaseLease (loads that read bytes)",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.transfer_duration = Histogram(
            "pegaflow_promotion_duration_seconds",
            "Time from planning a batch of SSD -> DRAM promotions to its completion",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.demotion_duration = Histogram(
            "pegaflow_demotion_duration_seconds",
            "Time from planning a batch of DRAM -> SSD writes to its completion",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self._rpc_children: dict[tuple[str, str], tuple] = {}
        self.hit_rate = WindowedHitRate(self.windows)
        self.dropped_lookups = 0
        self._engine: KVEngine | None = None
        self._pending: deque[tuple[int, Sequence[bytes], int]] = deque()
        # One taker at a time (the feeder, a scrape's flush): a lookup split across slices keeps its
        # head at the front of the queue in place, so the queue never looks empty while keys remain.
        self._take_lock = threading.Lock()
        self._state_lock = threading.Lock()  # hit_rate: feeder writes, scrapes read
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Engine calls in flight (the handler frame counts them): the feeder yields to them.
        self.foreground = ForegroundActivity()
        self.max_feed_defer_s = MAX_FEED_DEFER_S
        self._feeder = threading.Thread(target=self._feed_loop, name="pegaflow-metrics-feeder", daemon=True)
        self.registry.register(_EngineCollector(self))
        # Miss-ratio curve and savings: fed by the same feeder, exported by their own collector.
        self.insights = LookupInsights(self.windows, self.registry, model_names=model_names)

    def bind(self, engine: KVEngine) -> None:
        self._engine = engine
        capacity = engine.stats().pool_capacity_bytes
        if self.sketches is None:
            if self.sketch_mode == "process":
                self.sketches = SketchProcess(self.windows, capacity)
            else:
                self.sketches = LookupSketches(self.windows, capacity)
        self.insights.bind(engine.namespace_at, self._scrape_sketch_snapshot)
        if not self._feeder.is_alive():
            self._feeder.start()

    def add_collector(self, stats) -> None:
        """Families of another part of the server, read at scrape time from ``stats()`` (a dict of its
        plain-number stats): the L2 parts (metrics/peers.py)."""
        from pegaflow.server.metrics.peers import peer_families

        self.registry.register(_StatsCollector(stats, peer_families))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._feeder.is_alive():
            self._feeder.join(timeout=5)
        if self.sketches is not None:
            self.sketches.close()

    # --------------------------------------------------- EngineObserver (hot path)

    def on_lookup(self, namespace_index: int, hashes: Sequence[bytes], hits: int) -> None:
        if len(self._pending) >= MAX_PENDING_LOOKUPS:
            self.dropped_lookups += 1
            return
        self._pending.append((namespace_index, hashes, hits))

    def on_save(self, nbytes: int, seconds: float) -> None:
        self.save_duration.observe(seconds)

    def on_load(self, nbytes: int, seconds: float) -> None:
        self.load_duration.observe(seconds)

    def on_transfer(self, kind: str, nbytes: int, seconds: float, ok: int, failed: int) -> None:
        (self.transfer_duration if kind == "promote" else self.demotion_duration).observe(seconds)

    def on_rpc(self, method: str, code: str, seconds: float) -> None:
        self.observe_rpc(method, code, seconds)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        # The labelled children are looked up once per (method, code): labels() takes the family's
        # lock and builds a key on every call, a few us of every RPC.
        children = self._rpc_children.get((method, code))
        if children is None:
            children = (self.rpc_duration.labels(method), self.rpc_calls.labels(method, code))
            self._rpc_children[(method, code)] = children
        children[0].observe(seconds)
        children[1].inc()

    # ------------------------------------------------------------ windows

    def window_rates(
        self, deadline: float | None = None
    ) -> tuple[dict[str, float | None], dict[str, float | None]]:
        """(measured hit rate, HLL ceiling) per window; None where a window saw no lookups (or the
        sketches are unavailable, or could not answer before ``deadline``)."""
        measured, snap = self.window_state(deadline)
        ceiling = dict(snap.ceiling) if snap is not None else dict.fromkeys(self.windows)
        return measured, ceiling

    def window_state(
        self, deadline: float | None = None
    ) -> tuple[dict[str, float | None], SketchSnapshot | None]:
        """The measured hit rate per window and the sketches' snapshot, both after every pending
        lookup was fed: one snapshot for all a scrape's window families. ``deadline``
        (``time.monotonic``): the caller's; no wait for the sketches goes past it (the snapshot is
        then a recent earlier one, sketch_process.py, or None, and pending lookups the sketches could
        not take in time are dropped and counted).
        With a deadline, the pending lookups are fed for FLUSH_BUDGET_S at most (the feeder thread
        feeds the rest): a caller waits for its answer, not for the feeder's backlog."""
        if deadline is not None:
            deadline_for_flush = min(deadline, time.monotonic() + FLUSH_BUDGET_S)
        else:
            deadline_for_flush = None
        self.flush(deadline=deadline_for_flush)
        with self._state_lock:
            measured = self.hit_rate.rates()
        return measured, self.sketch_snapshot(flush=False, deadline=deadline)

    def sketch_snapshot(self, flush: bool = True, deadline: float | None = None) -> SketchSnapshot | None:
        """The lookup sketches now (every lookup fed so far counted), None while unavailable; with a
        ``deadline``, perhaps a recent earlier one (sketch_process.py)."""
        if flush:
            self.flush(deadline=deadline)
        return self.sketches.snapshot(deadline) if self.sketches is not None else None

    def _scrape_sketch_snapshot(self) -> SketchSnapshot | None:
        """The miss-ratio families' snapshot, on a scrape's terms: without a deadline a scrape
        waited for a child that was behind as long as it made progress, and one stopped for
        ``io_timeout_s`` was killed as stalled."""
        return self.window_state(time.monotonic() + SCRAPE_WINDOWS_BUDGET_S)[1]

    def flush(self, max_rounds: int = 4, deadline: float | None = None) -> None:
        """Feeds pending lookups now, so a scrape sees up-to-date windows; bounded, so a scrape
        never does more than a few batches of the feeder's work when it has fallen behind. With a
        ``deadline`` it feeds in short slices and stops at it: in-process sketches take ~3.4 us a key
        (0.9 s for the four batches on the 2-vCPU VM, more in a busy vLLM worker's interpreter)."""
        budget = max_rounds * MAX_KEYS_PER_ADD
        step = MAX_KEYS_PER_ADD if deadline is None else DEADLINE_FEED_SLICE_KEYS
        while budget > 0 and self._pending:
            if deadline is not None and time.monotonic() >= deadline:
                return
            self._feed_some(min(step, budget), deadline)
            budget -= step

    def _feed_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(FEED_INTERVAL_S)
            self._wake.clear()
            try:
                while self._pending and not self._stop.is_set():
                    if self.foreground.busy and not self.foreground.wait_quiet(self.max_feed_defer_s):
                        until = time.monotonic() + FORCED_FEED_S
                        while self._pending and time.monotonic() < until and not self._stop.is_set():
                            self._feed_some(self.feed_slice_keys)
                            time.sleep(BUSY_PAUSE_S)
                        continue
                    self._feed_some(self.feed_slice_keys)
            except Exception:
                log.exception("metrics feeder failed; continuing")

    def _feed_some(self, max_keys: int, deadline: float | None = None) -> None:
        """Feeds up to ``max_keys`` keys of the pending lookups, oldest first. A lookup longer than
        what is left of ``max_keys`` is split: its tail now (the miss-ratio curve takes a lookup's
        keys tail first), its head left at the front of the queue, its leading hits shared out."""
        records: list[LookupRecord] = []
        batch: list[tuple[int, Sequence[bytes], int]] = []
        hits = requests = keys = 0
        with self._take_lock:  # on_lookup only appends on the right: the front is ours
            while self._pending and keys < max_keys:
                ns_index, hashes, nhits = self._pending[0]
                room = max_keys - keys
                if len(hashes) > room:
                    head = len(hashes) - room
                    self._pending[0] = (ns_index, hashes[:head], min(nhits, head))
                    hashes, nhits = hashes[head:], max(nhits - head, 0)
                else:
                    self._pending.popleft()
                batch.append((ns_index, hashes, nhits))
                records.append(LookupRecord(ns_index, self.insights.block_bytes(ns_index), hashes))
                keys += len(hashes)
                hits += nhits
                requests += len(hashes)
        if not requests:
            return
        with self._state_lock:
            self.hit_rate.add(hits, requests)
        self.insights.add_hits(batch)
        if self.sketches is not None:
            self.sketches.add(records, deadline)


class _StatsCollector:
    def __init__(self, stats, families):
        self._stats, self._families = stats, families

    def collect(self):
        try:
            snapshot = self._stats()
        except Exception as exc:
            log.warning("metrics: stats unavailable: %s", exc)
            return
        yield from self._families(snapshot)


class _EngineCollector:
    """Reads engine state at scrape time: every metric of EngineStats (server/store/stats.py, the one
    definition), one family per metric name, then the per-tier and per-namespace families."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self):
        engine = self._metrics._engine
        if engine is None or engine.closed:
            return
        try:
            stats = engine.stats(deadline=time.monotonic() + 2.0)
        except Exception as exc:
            log.warning("metrics: engine stats unavailable: %s", exc)
            return
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for f in metric_fields():
            family = families.get(f.name)
            if family is None:
                cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
                family = families[f.name] = cls(f.name, f.doc, labels=[k for k, _ in f.labels])
            family.add_metric([v for _, v in f.labels], getattr(stats, f.field))
        yield from families.values()
        yield from self._labelled_families(TIER_METRICS, stats.tiers, "tier")
        ns_blocks = GaugeMetricFamily(
            "pegaflow_namespace_resident_blocks",
            "Sealed blocks per namespace",
            labels=["namespace", "model", "tenant"],
        )
        names = self._metrics.model_names
        for ns in stats.namespaces:
            ns_blocks.add_metric([ns.namespace_id, names(ns.model_id), ns.tenant], ns.resident_blocks)
        yield ns_blocks
        yield from self._labelled_families(TENANT_METRICS, stats.tenants, "tenant")
        g = GaugeMetricFamily(
            "pegaflow_pool_prefault_seconds", "Time taken to allocate and pre-fault the pool at start"
        )
        g.add_metric([], engine.region.prefault_s)
        yield g
        yield from self._window_families()

    @staticmethod
    def _labelled_families(table: dict[str, tuple[str, str, str]], rows, label: str):
        """One family per field of ``table`` (TIER_METRICS, TENANT_METRICS), a series per row
        labelled by its name; no series at all without rows (no tenants: no tenant series)."""
        for field, (kind, name, doc) in table.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, doc, labels=[label])
            for row in rows:
                family.add_metric([row.name], float(getattr(row, field)))
            yield family

    def _window_families(self):
        measured, snap = self._metrics.window_state(time.monotonic() + SCRAPE_WINDOWS_BUDGET_S)
        ceiling = snap.ceiling if snap is not None else {}
        rate = GaugeMetricFamily(
            "pegaflow_measured_hit_rate", "Block hit rate over the window", labels=["window"]
        )
        for name, value in measured.items():
            if value is not None:
                rate.add_metric([name], value)
        yield rate
        est = GaugeMetricFamily(
            "pegaflow_hll_estimated_hit_rate",
            "Hit-rate ceiling r* = (N - U) / N over the window, U estimated with HyperLogLog",
            labels=["window"],
        )
        for name, value in ceiling.items():
            if value is not None:
                est.add_metric([name], value)
        yield est
        mem = GaugeMetricFamily(
            "pegaflow_hll_memory_bytes", "Memory of the HyperLogLog registers per window", labels=["window"]
        )
        if snap is not None:
            for name, nbytes in snap.hll_memory_bytes.items():
                mem.add_metric([name], nbytes)
        yield mem
        c = CounterMetricFamily(
            "pegaflow_metrics_dropped_lookups", "Lookups not fed to the hit-rate windows (feeder behind)"
        )
        c.add_metric([], self._metrics.dropped_lookups)
        yield c
        sketches = self._metrics.sketches
        if isinstance(sketches, SketchProcess):
            c = CounterMetricFamily(
                "pegaflow_lookup_sketch_dropped_lookups",
                "Lookups the sketches' process did not get (it was behind, stalled or restarting)",
            )
            c.add_metric([], sketches.dropped_records)
            yield c
            c = CounterMetricFamily(
                "pegaflow_lookup_sketch_restarts",
                "Restarts of the lookup sketches' process (its windows start empty)",
            )
            c.add_metric([], sketches.restarts)
            yield c
            if isinstance(snap, AgedSnapshot):
                yield GaugeMetricFamily(
                    "pegaflow_lookup_sketch_snapshot_age_seconds",
                    "Age of the sketches' snapshot behind this scrape's ceiling: seconds since it was asked "
                    "for (it counts the lookups fed before); more than a fraction of a second when their "
                    "process was behind and its last snapshot stood in",
                    value=snap.age_s,
                )
