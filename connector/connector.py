"""PegaKVConnector: vLLM's KV connector (v1 API) over pegaflow-server.

vLLM builds it twice: in EngineCore with role SCHEDULER (-> scheduler.py) and in each
worker with role WORKER (-> worker.py). The API server imports this module only to look
at the class, so importing it loads nothing beyond vLLM's own connector base; gRPC and
the client load when a role starts.

The cache is best effort by construction: a down, dying or slow server turns into cache
misses and recomputation, never into a failed request or a stalled engine (see
config.py for the deadlines and README.md for the bound on one step's stall).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pegaflow.connector import mla
from pegaflow.connector.config import load_config
from pegaflow.connector.metadata import PegaConnectorMetadata, PegaHandshake

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from pegaflow.connector.scheduler import SchedulerConnector
    from pegaflow.connector.worker import WorkerConnector

log = logging.getLogger("vllm.pegaflow.connector")


def _own_log_level() -> None:
    """PEGAFLOW_LOG_LEVEL=DEBUG shows the connector's per-step timings without vLLM's own
    debug logs (vLLM's handler drops records below VLLM_LOGGING_LEVEL, so ours get their own)."""
    level = os.environ.get("PEGAFLOW_LOG_LEVEL", "").upper()
    root = logging.getLogger("vllm.pegaflow")
    if not level or getattr(root, "_pegaflow_handler", False):
        return
    if not isinstance(logging.getLevelName(level), int):  # a typo must not stop vLLM from starting
        log.warning("pegaflow: PEGAFLOW_LOG_LEVEL=%r is not a log level; ignored", level)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [pid %(process)d %(name)s] %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    root._pegaflow_handler = True  # type: ignore[attr-defined]


_own_log_level()


_HIT_SOURCE = {"DRAM": CacheHitSource.HOST, "SSD": CacheHitSource.DISK, "REMOTE": CacheHitSource.P2P}


class PegaKVConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._cfg = load_config(transfer.kv_connector_extra_config)
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        self._link = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker(vllm_config, kv_cache_config)

    def _init_scheduler(self, vllm_config: Any) -> None:
        from pegaflow.connector.scheduler import SchedulerConnector

        transfer = self._kv_transfer_config
        if not self._cfg.honor_kv_load_failure_policy and transfer.kv_load_failure_policy != "recompute":
            # vLLM reads this right after building the scheduler connector: a load the cache
            # cannot complete must cost a recompute, not the request
            transfer.kv_load_failure_policy = "recompute"
            log.info("pegaflow: kv_load_failure_policy set to 'recompute': a failed load is recomputed")
        if mla.rope_workaround_missing(vllm_config):
            log.warning("pegaflow: MLA on CPU: %s", mla.ROPE_WORKAROUND_HINT)
        # Lookups start when the workers report their layouts (set_xfer_handshake_metadata).
        self._scheduler = SchedulerConnector(
            block_size=vllm_config.cache_config.block_size,
            lookup=None,
            loads=transfer.is_kv_consumer,
            saves=transfer.is_kv_producer,
            # with async scheduling the output of step N is seen after step N+1 is built
            steps_in_flight=2 if vllm_config.scheduler_config.async_scheduling else 1,
            max_wait_s=self._cfg.max_lookup_wait_s,
        )
        log.info(
            "pegaflow: scheduler connector for %s (lookup %.0f ms, load %.0f ms: "
            "a step stalls at most %.0f ms)",
            self._cfg.server_addr or "the embedded server",
            self._cfg.lookup_timeout_s * 1e3,
            self._cfg.load_timeout_s * 1e3,
            self._cfg.worst_step_stall_s * 1e3,
        )

    def _init_worker(self, vllm_config: Any, kv_cache_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from pegaflow.connector.namespace import UnsupportedLayout, build_layouts, layout_for_rank
        from pegaflow.connector.worker import WorkerConnector

        tp_rank = get_tensor_model_parallel_rank()
        layout, reason = None, ""
        try:
            layouts = build_layouts(
                vllm_config,
                kv_cache_config,
                self._cfg.model_id,
                self._cfg.namespace_salt,
                self._cfg.mla_store,
            )
            layout = layout_for_rank(layouts, tp_rank)
        except UnsupportedLayout as exc:
            reason = str(exc)
            log.error(
                "pegaflow: this engine's KV cache is not supported (%s); serving without the cache", exc
            )
        except Exception as exc:  # a bug of ours, or a vLLM whose internals moved: vLLM still starts
            reason = f"describing the KV cache failed: {exc!r}"
            log.exception("pegaflow: describing this engine's KV cache failed; serving without the cache")
        group = kv_cache_config.kv_cache_groups[0] if kv_cache_config.kv_cache_groups else None
        self._worker = WorkerConnector(
            self._cfg,
            layout,
            num_blocks=kv_cache_config.num_blocks,
            layer_names=list(group.layer_names) if group is not None else [],
            instance_name=_instance_name(self._kv_transfer_config, "worker"),
            tp_rank=tp_rank,
            unsupported_reason=reason,
            server_addr=_server_address(self._cfg, self._kv_transfer_config),
            engine_id=self._kv_transfer_config.engine_id or "",
            # vLLM zeroes new blocks while it prepares a step for some caches (Mamba, mixed
            # precision): loads must then start after that, in start_load_kv
            early_loads=not getattr(kv_cache_config, "needs_kv_cache_zeroing", True),
            # a pure consumer never writes a pool byte: its worker maps the pool read-only
            read_only=not self._kv_transfer_config.is_kv_producer,
        )

    # ------------------------------------------------------------ handshake
    def get_handshake_metadata(self) -> PegaHandshake | None:
        """Worker -> scheduler, once, after register_kv_caches (vLLM's EngineCore relays it)."""
        if self._worker is None:
            return None
        if self._vllm_config.parallel_config.pipeline_parallel_size > 1:
            return None  # unsupported (and vLLM's relay refuses pipeline ranks > 0)
        return self._worker.handshake()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' layouts: the scheduler registers the same namespaces and starts lookups."""
        from pegaflow.connector.scheduler import ServerPrefixLookup
        from pegaflow.connector.server_link import ServerLink

        if self._scheduler is None or self._link is not None:
            return
        shakes = [m for m in metadata.values() if isinstance(m, PegaHandshake)]
        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        if len(shakes) != tp_size or any(s.layout is None for s in shakes):
            reasons = sorted({s.reason for s in shakes if s.layout is None and s.reason})
            log.error(
                "pegaflow: %d of %d workers registered a cache layout (%s); no lookups: serving without hits",
                sum(s.layout is not None for s in shakes),
                tp_size,
                "; ".join(reasons) or "no layout reported",
            )
            return
        layouts = [s.layout for s in sorted(shakes, key=lambda s: s.tp_rank)]
        if layouts[0].mla:
            layouts = layouts[:1]  # one shared namespace for the whole TP group
        self._link = ServerLink(
            _server_address(self._cfg, self._kv_transfer_config),
            layouts,
            client_name="vllm-scheduler",
            instance_name=_instance_name(self._kv_transfer_config, "sched"),
            rpc_timeout_s=self._cfg.rpc_timeout_s,
            retry_interval_s=self._cfg.retry_interval_s,
            probe_timeout_s=self._cfg.lookup_timeout_s,
            map_pool=False,  # lookups only: the bytes move in the workers
            auth=self._cfg.auth,
        )
        self._link.start()
        self._scheduler.set_lookup(
            ServerPrefixLookup(self._link, self._cfg.lookup_timeout_s, metrics=self._scheduler.metrics)
        )

    # vLLM asks: must a preempted request with a pending hand-off be recomputed? A cache
    # never hands off KV another engine waits for: a dropped save is a future miss.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ============================================================ scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int):
        """vLLM's external hits split by tier: the server's DRAM (HOST), its SSD tier (DISK), another
        node's DRAM (P2P), as the request's first lookup found each block."""
        assert self._scheduler is not None
        by_tier = self._scheduler.hit_sources(request, num_external_tokens)
        return {_HIT_SOURCE.get(tier, CacheHitSource.HOST): n for tier, n in by_tier.items() if n}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    # =============================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, Any]):
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        # vLLM's first connector hook of every worker step, before it prepares the inputs
        if self._worker is not None and isinstance(kv_connector_metadata, PegaConnectorMetadata):
            self._worker.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PegaConnectorMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Whole blocks (all layers) are saved after the forward, in wait_for_save.
        return

    def wait_for_save(self):
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PegaConnectorMetadata)
        self._worker.finish_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        delayed: list[str] = []
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, PegaConnectorMetadata):
                delayed = meta.delayed_free_req_ids
        done = self._worker.finished_sending(delayed)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._link is not None:
            self._link.close()

    def reset_cache(self) -> bool | None:
        # The cache is shared with other engines: one engine's reset must not clear it.
        return False

    # ================================================================ stats
    # vLLM's metrics path (stats.py): each role hands over what it counted since its last
    # call; vLLM folds the TP ranks and the scheduler's part into one object per step.
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.metrics.take()
        if self._scheduler is not None:
            return self._scheduler.metrics.take()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from pegaflow.connector.stats import PegaKVConnectorStats

        return PegaKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from pegaflow.connector.stats import PegaPromMetrics

        return PegaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _server_address(cfg: Any, transfer: Any) -> Any:
    """The server's address, or (embedded mode) a function returning it once rank 0 runs it."""
    if not cfg.embedded:
        return cfg.server_addr
    from pegaflow.connector.embedded import published_address

    engine_id = transfer.engine_id or ""
    return lambda: published_address(engine_id)


def _instance_name(transfer: Any, role: str) -> str:
    return f"vllm-{transfer.engine_id or 'engine'}-{role}-{os.getpid()}"
