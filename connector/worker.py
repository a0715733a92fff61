"""Worker-side PegaKVConnector (runs in each vLLM worker process, one per TP rank).

Per engine step, driven by vLLM's hooks:

  handle_preemptions  saves still reading a preempted request's blocks finish their
                      copy or are dropped before this step may overwrite the blocks
  start_load_kv       leases the step's hits (one RPC per request, on vLLM's step thread,
                      which has nothing else to do before its first layer) and starts the
                      load thread copying pool -> vLLM, layer by layer from the first
  wait_for_layer_load returns once that layer landed; meanwhile the step thread copies
                      too (the layer it needs if unclaimed, else one from the back), so
                      the copies use the compute core instead of idling it; at most until
                      the step's load deadline: a load that misses it is cancelled (no copy
                      lands after that) and its blocks are reported failed, so vLLM
                      recomputes them
  wait_for_save       the step's full blocks go to the save thread (allocate RPC,
                      vLLM -> pool copies, seal RPC), off the forward pass
  get_finished        finished requests whose saves are done give their blocks back

Host KV (vLLM on CPU): this process copies whole pages between vLLM's tensors and the
server's shared-memory pool (kv_pages.py). The pool is mapped by the client; a mapping
stays readable after the server dies, so leased bytes still load, and a location is only
used with the epoch it was handed out under (StaleEpoch otherwise).

CUDA KV: the server copies (gpu_worker.py): a load is one LoadToDevice RPC that lands
every layer at once, a save one SaveFromDevice RPC after a CUDA event recorded at the end
of the forward. Same deadlines, same failure reporting.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pegaflow.connector import mla
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.kv_pages import CopyUnit, KvPages, LayoutMismatch, Run, copy_units, plan_runs
from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata, PegaHandshake
from pegaflow.connector.namespace import KvLayoutSpec
from pegaflow.connector.prefill_rate import PrefillRate
from pegaflow.connector.server_link import ServerLink, batches
from pegaflow.connector.stats import StatsRecorder
from pegaflow.connector.trace import tracer

_trace = tracer("worker")  # PEGAFLOW_TRACE: per-phase spans (trace.py); off by default

log = logging.getLogger("vllm.pegaflow.connector.worker")


_DEVICE_RETRY_S = 30.0  # CUDA path: how often a refused device registration is asked again
# CUDA path: save jobs run this many at a time. The server copies a request's bytes at the link's
# rate but spends ~1.5 ms of each request (its frame, checks, first allocation and launch, its last
# seal and answer) outside the copy; with a second request in flight those pass while the first
# one's bytes move. Streams of 576 MiB saves on the H100 host: 87-89 % of the link one at a time,
# 97.5-98.2 % two at a time (MLA 78 -> 85 %; server/gpu/README.md, 2026-12-07, tenth session).
# The host path stays at one: there this process copies, and a second copy thread only contends.
_CUDA_SAVES_IN_FLIGHT = 2
# How long past the step's load deadline the load thread waits for the helper's last RPC (which
# ends by that deadline) before it counts the step's device loads as failed.
_LOAD_HELPER_GRACE_S = 0.05


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _kv_transfer_cores() -> list[int]:
    """The cores vLLM's CPU platform sets aside for KV transfers (the last physical core of
    each NUMA node); empty when it does not say (then threads stay where vLLM put them)."""
    try:
        from vllm.platforms import current_platform

        groups = current_platform.discover_numa_topology()
    except Exception:  # not the CPU platform, or no topology: leave affinity alone
        return []
    return sorted({max(g) for g in groups if g})


# Host-KV loads are copied in units of about this many bytes (whole pages, one layer each): two
# threads take units in layer order, so the step thread waits at most for one unit the load
# thread holds (2 MiB is ~0.3 ms at the ~7 GB/s one core copies here), while a unit is large
# enough that claiming it (a lock, ~2 us) costs nothing next to its copy.
_UNIT_BYTES = 2 << 20


# A test hook (connector/tests/test_e2e_failover.py): while the file this names exists, a host-KV
# load pauses after taking its leases and before copying (it writes "<file>.leased" first), so a
# test can stop the process at that point. Unset in production: one os.environ lookup at import.
_PAUSE_AFTER_LEASE = os.environ.get("PEGAFLOW_TEST_PAUSE_AFTER_LEASE", "")


def _failpoint_pause_after_lease() -> None:
    if not _PAUSE_AFTER_LEASE or not os.path.exists(_PAUSE_AFTER_LEASE):
        return
    with open(_PAUSE_AFTER_LEASE + ".leased", "w") as f:
        f.write(str(os.getpid()))
    give_up = time.monotonic() + 120
    while os.path.exists(_PAUSE_AFTER_LEASE) and time.monotonic() < give_up:
        time.sleep(0.01)


class _LoadJob:
    """One step's loads. Work in order: the lease RPCs (whoever claims them first: the load
    thread, started as the step begins, or vLLM's step thread if it gets there first), then
    copy units in layer order, each claimed by one of the two threads and copied outside the
    lock. `close()` (and `cancel()`) stops new claims and waits for the copies in progress,
    so after it returns no byte lands any more."""

    def __init__(self, meta: PegaConnectorMetadata, num_layers: int, deadline: float):
        self.meta = meta  # the step's metadata (a new step brings a new object)
        self.transfers = meta.loads
        self.deadline = deadline
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified when a copy ends
        self.cancelled = False
        self.num_layers = num_layers
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()  # every layer landed, or the job ended early
        self.server_copies = False  # CUDA KV: one RPC lands every layer, no copy units
        self.planning = False  # a thread holds the lease work
        self.planned = threading.Event()  # the leases are done: units are claimable (or the job ended)
        self.units: list[CopyUnit] = []  # in layer order
        self.next_unit = 0
        self.units_left: list[int] = [0] * num_layers  # per layer: units not landed yet
        self.copying = 0  # copies in progress (outside the lock)
        self.layers_landed = 0
        self.missing_ids: set[int] = set()  # blocks the server no longer had, or whose lease failed
        self.leases: list[str] = []
        self.leases_released = False
        self.landed_bytes = 0
        self.corrupt: dict[str, list[bytes]] = {}  # lease id -> hashes whose bytes failed their checksum
        # timings for the debug log and the stats (monotonic seconds)
        self.t_submit = time.monotonic()
        self.t_leased = 0.0
        self.t_lease_asked = 0.0  # when the first lease was asked for: a lease's age counts from here
        self.t_landed = 0.0
        self.waited_s = 0.0  # how long the step thread waited for the other thread
        self.stall_s = 0.0  # the step thread's whole time on this job: lease, own copies, waits

    def claim_planning(self) -> bool:
        with self.lock:
            if self.planning or self.cancelled:
                return False
            self.planning = True
            return True

    def publish(self, units: list[CopyUnit]) -> bool:
        """The leases are done: make the copy units claimable. False if the job was closed
        meanwhile (the caller releases the leases it took)."""
        with self.lock:
            if self.cancelled:
                return False
            self.units = units
            for layer, _, _ in units:
                self.units_left[layer] += 1
            empty = [layer for layer in range(self.num_layers) if self.units_left[layer] == 0]
            self.layers_landed = len(empty)
            if self.layers_landed == self.num_layers:
                self.t_landed = time.monotonic()
        for layer in empty:  # nothing to copy for these (e.g. every lease missed)
            self.layer_done[layer].set()
        self.planned.set()
        if len(empty) == self.num_layers:
            self.done.set()
        return True

    def claim(self) -> CopyUnit | None:
        """The next copy unit for the caller (None: all claimed, or the job is over)."""
        with self.lock:
            if self.cancelled or self.next_unit >= len(self.units):
                return None
            unit = self.units[self.next_unit]
            self.next_unit += 1
            self.copying += 1
            return unit

    def landed(self, layer: int, nbytes: int, ok: bool) -> None:
        """A claimed unit's copy ended (ok: every byte of it landed)."""
        layer_complete = job_complete = False
        with self.lock:
            self.copying -= 1
            if ok:
                self.landed_bytes += nbytes
                self.units_left[layer] -= 1
                if self.units_left[layer] == 0:
                    layer_complete = True
                    self.layers_landed += 1
                    job_complete = self.layers_landed == self.num_layers
                    if job_complete:
                        self.t_landed = time.monotonic()
            self.idle.notify_all()
        if layer_complete:
            self.layer_done[layer].set()
        if job_complete:
            self.done.set()

    def add_lease(self, lease_id: str) -> bool:
        """Record a lease to release with the job; False when the job's leases were released
        already (a lease that came back after the step ended): the caller releases it."""
        with self.lock:
            if self.leases_released:
                return False
            self.leases.append(lease_id)
            return True

    def take_leases(self) -> list[str]:
        """The leases to release, once (whoever ends last: the step or a late lease)."""
        with self.lock:
            if self.leases_released:
                return []
            self.leases_released = True
            return list(self.leases)

    def close(self) -> int:
        """No claim from now on; waits for copies in progress; returns the layers landed."""
        with self.lock:
            self.cancelled = True
            while self.copying:
                self.idle.wait()
            return self.layers_landed

    def cancel(self) -> None:
        self.close()
        self.finish()

    def finish(self) -> None:
        self.planned.set()
        for ev in self.layer_done:
            ev.set()
        self.done.set()


class _SaveCancelled(Exception):
    """A save job's copy found the job cancelled (its request preempted): the save stops there."""


class _SaveJob:
    """One step's saves (deduplicated by hash). Preemption cancels it under `lock`, which
    the save thread holds while it copies: a cancelled job never reads the blocks again."""

    def __init__(self, block_ids: list[int], hashes: list[bytes], req_ids: set[str], ready: Any = None):
        self.block_ids = block_ids
        self.hashes = hashes
        self.req_ids = req_ids
        self.ready = ready  # CUDA path: event recorded after the forward that wrote the blocks
        self.lock = threading.Lock()
        self.cancelled = False


class WorkerConnector:
    def __init__(
        self,
        cfg: ConnectorConfig,
        layout: KvLayoutSpec | None,
        *,
        num_blocks: int,
        layer_names: list[str],
        instance_name: str,
        tp_rank: int = 0,
        unsupported_reason: str = "",
        server_addr: Any = None,
        engine_id: str = "",
        early_loads: bool = True,
        read_only: bool = False,
    ):
        """server_addr: "host:port" or a function returning it (embedded mode); default
        cfg.server_addr. engine_id names the embedded server of this engine. early_loads:
        start host-KV loads as the step begins (False when vLLM zeroes newly allocated blocks
        while preparing the step: a copy landed before that would be wiped). read_only: a
        kv_consumer that never saves: its session maps the pool read-only."""
        self.cfg = cfg
        self.read_only = read_only
        self.server_addr = server_addr or cfg.server_addr
        self.engine_id = engine_id
        self.embedded: Any = None  # the in-process server, on TP rank 0 in embedded mode
        self.layout = layout
        self.num_blocks = num_blocks
        self.layer_names = list(layer_names)
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.instance_name = instance_name
        self.tp_rank = tp_rank
        self.disabled_reason = unsupported_reason or ("" if layout is not None else "no layout")
        self.pages: KvPages | None = None  # host KV: this process copies pages
        self.gpu: Any = None  # CUDA KV: a GpuKvTransfer, the server copies
        self.link: ServerLink | None = None
        self.early_loads = early_loads
        # CPU cores for the copy threads (host KV): set in register_kv_caches, applied when
        # the threads start (on their first job)
        self._transfer_cores: list[int] = []
        self._load_thread = ThreadPoolExecutor(1, "pegaflow-load", initializer=self._pin_transfer_thread)
        self._load_helper: ThreadPoolExecutor | None = None  # CUDA KV only: _start_load_helper
        self._save_thread = ThreadPoolExecutor(1, "pegaflow-save", initializer=self._pin_transfer_thread)
        self._housekeeping = ThreadPoolExecutor(1, thread_name_prefix="pegaflow-release")
        self._load_job: _LoadJob | None = None
        self._invalid_ids: set[int] = set()
        self._save_lock = threading.Lock()
        self._save_jobs: list[_SaveJob] = []  # queued or running
        self._pending_saves: collections.Counter[str] = collections.Counter()
        self._awaiting_free: set[str] = set()
        self._device_handle: Any = None
        self._device_lock = threading.Lock()  # one registration at a time (save and load threads)
        self._stats_lock = threading.Lock()  # counters several save threads add to
        self._device_retry_at = 0.0  # CUDA path: no registration attempt before this time
        self._device_refusal = ""  # the server's last refusal, logged once
        self.stats = collections.Counter()  # lifetime detail, for logs and tests
        self.metrics = StatsRecorder()  # vLLM's connector stats (stats.py), this rank
        self._step_t0 = 0.0  # when this step's first hook ran (for the trace)
        self._forward_t0 = 0.0  # when this step's forward started (start_load_kv)
        self.prefill_rate = PrefillRate()  # rank 0: the engine's own prefill cost, reported to the server

    @property
    def active(self) -> bool:
        return self.link is not None

    # ------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.layout is None:
            return
        try:
            # the CUDA path (and its imports) only when vLLM's KV lives on a GPU
            if kv_caches and all(getattr(t, "is_cuda", False) for t in kv_caches.values()):
                self._register_cuda(kv_caches)
            else:
                self._register_host(kv_caches)
        except (LayoutMismatch, ValueError) as exc:
            self.disabled_reason = str(exc)
            self.pages = self.gpu = None
            log.error("pegaflow: %s; serving without the cache", exc)
            return
        except Exception as exc:  # a bug of ours must not stop vLLM from starting
            self.disabled_reason = f"registering the KV caches failed: {exc!r}"
            self.pages = self.gpu = None
            log.exception("pegaflow: registering the KV caches failed; serving without the cache")
            return
        if self.cfg.embedded and self.tp_rank == 0:
            from pegaflow.connector.embedded import EmbeddedServer

            try:
                self.embedded = EmbeddedServer(
                    self.engine_id,
                    self.cfg.embedded_pool_size,
                    self.cfg.embedded_addr,
                    self.cfg.embedded_http_addr,
                )
            except Exception as exc:  # whatever stops it (memory, a port, a bug), vLLM still starts
                self.disabled_reason = f"embedded server did not start: {exc!r}"
                self.pages = self.gpu = None
                log.error("pegaflow: %s; serving without the cache", self.disabled_reason)
                return
        self.link = ServerLink(
            self.server_addr,
            [self.layout],
            client_name="vllm-worker",
            instance_name=self.instance_name,
            rpc_timeout_s=self.cfg.rpc_timeout_s,
            retry_interval_s=self.cfg.retry_interval_s,
            probe_timeout_s=self.cfg.load_timeout_s,
            auth=self.cfg.auth,
            read_only=self.read_only,
        )
        self.link.start()

    def _check_geometry(self, block_bytes: int, num_layers: int) -> None:
        assert self.layout is not None
        if block_bytes != self.layout.block_bytes or num_layers != self.layout.num_layers:
            raise LayoutMismatch(
                f"KV tensors hold {block_bytes} B per block over {num_layers} layers, the namespace "
                f"says {self.layout.block_bytes} B over {self.layout.num_layers}"
            )

    def _register_host(self, kv_caches: dict[str, Any]) -> None:
        pages = KvPages(kv_caches, self.num_blocks, self.layer_names)
        self._check_geometry(pages.block_bytes, pages.num_layers)
        self.pages = pages
        # The reserved cores only. Measured (bench/ttft.py, quiet machine): letting the load
        # thread also run on the worker's own core put it beside the compute thread (half as
        # fast, and the forward copying in its place): a warm step took 44-100 ms instead of
        # 37-46. When the reserved core is busy, the step thread copies what it waits for.
        self._transfer_cores = _kv_transfer_cores()

    def _pin_transfer_thread(self) -> None:
        """vLLM pins a CPU worker (and so every thread it starts) to its compute cores and,
        when a KV connector is configured, reserves the last core of each NUMA node for the
        connector's transfers (as its NIXL connector uses them). The copy threads run there:
        copies overlap the forward instead of time-sharing its core."""
        if not self._transfer_cores:
            return
        try:
            os.sched_setaffinity(0, self._transfer_cores)
        except (OSError, ValueError) as exc:
            log.debug("pegaflow: cannot move a copy thread to cores %s: %s", self._transfer_cores, exc)

    def _register_cuda(self, kv_caches: dict[str, Any]) -> None:
        import dataclasses

        from pegaflow.connector.gpu_worker import GpuKvTransfer

        gpu = GpuKvTransfer(kv_caches, self.num_blocks, self.layer_names)
        self._check_geometry(gpu.block_bytes, gpu.num_layers)
        # the stored byte order comes from the tensors' strides: the scheduler learns it
        # through the handshake, so both roles use this tag
        assert self.layout is not None
        self.layout = dataclasses.replace(self.layout, layout=gpu.layout_tag)
        self.gpu = gpu
        self._start_save_threads(_CUDA_SAVES_IN_FLIGHT)
        self._start_load_helper()

    def _start_load_helper(self) -> None:
        """CUDA KV: a second thread for a step's device loads (``_load_cuda``)."""
        if self._load_helper is None:
            pin = self._pin_transfer_thread
            self._load_helper = ThreadPoolExecutor(1, "pegaflow-load-2", initializer=pin)

    def _start_save_threads(self, n: int) -> None:
        """Runs save jobs ``n`` at a time from now on (before the first save: at registration)."""
        old = self._save_thread
        self._save_thread = ThreadPoolExecutor(n, "pegaflow-save", initializer=self._pin_transfer_thread)
        old.shutdown(wait=True)

    def handshake(self) -> PegaHandshake:
        """The layout this worker stores under, or None (and why) when it runs without cache."""
        if self.active:
            return PegaHandshake(self.tp_rank, self.layout)
        return PegaHandshake(self.tp_rank, None, self.disabled_reason or "KV tensors not registered")

    def _device_handle_for(self, client: Any, inst: Any) -> Any:
        """CUDA path: the device-memory registration (the client renews it after reconnects),
        or None when there is none now: then loads are recomputed and saves skipped.

        A server that refuses the registration (no GPU data path, a layout it cannot copy) is
        asked again at most every _DEVICE_RETRY_S, and the refusal is logged once."""
        if self._device_handle is not None:
            return self._device_handle
        with self._device_lock:  # a second caller waits for the first one's registration
            return self._register_device(client, inst)

    def _register_device(self, client: Any, inst: Any) -> Any:
        from pegaflow.client import errors

        if self._device_handle is not None:
            return self._device_handle
        if time.monotonic() < self._device_retry_at:
            return None
        try:
            self._device_handle = self.gpu.register(client, inst, self.cfg.rpc_timeout_s)
        except errors.ServerUnavailable as exc:
            assert self.link is not None
            self.link.report_failure(exc, "device registration")
            return None
        except errors.PegaflowError as exc:
            self._device_retry_at = time.monotonic() + _DEVICE_RETRY_S
            if str(exc) != self._device_refusal:
                self._device_refusal = str(exc)
                log.error(
                    "pegaflow-server refused this worker's GPU KV (%s); serving without the cache, "
                    "asking again every %.0f s",
                    exc,
                    _DEVICE_RETRY_S,
                )
            return None
        self._device_refusal = ""
        return self._device_handle

    # -------------------------------------------------------------- loads
    def begin_step(self, meta: PegaConnectorMetadata) -> None:
        """vLLM's first connector hook of a step (handle_preemptions), before it prepares the
        step's inputs: saves still reading blocks this step may reuse are settled, then (host
        KV) the step's loads start on the load thread, so the lease RPCs and the first copies
        overlap vLLM's input preparation instead of following it."""
        if _trace.enabled:
            self._step_t0 = time.monotonic()
        self.handle_preemptions(meta.preempted_req_ids)
        if meta.loads and self.early_loads and self.pages is not None and self.gpu is None:
            self._begin_loads(meta)

    def start_load(self, meta: PegaConnectorMetadata) -> None:
        """vLLM's start_load_kv, right before the forward: start the step's loads unless
        begin_step did."""
        self._forward_t0 = time.monotonic()
        for ids in meta.failed_loads.values():
            self._invalid_ids.update(ids)
        if not meta.loads:
            return
        if _trace.enabled:
            _trace.point("start_load")
        job = self._load_job
        if job is not None and job.meta is meta:
            return  # started in begin_step
        self._begin_loads(meta)

    def _begin_loads(self, meta: PegaConnectorMetadata) -> None:
        if self._load_job is not None:  # the previous step did not finish its loads
            self._finish_load()
        job = _LoadJob(meta, len(self.layer_names), time.monotonic() + self.cfg.load_timeout_s)
        self._load_job = job
        if not self.active:
            job.finish()  # nothing lands: _finish_load reports every block
            return
        if self.gpu is not None:
            job.server_copies = True
            self._load_thread.submit(self._run_load, job)  # one RPC per request; the server copies
            return
        # Host KV: the load thread leases and copies from the first layer on; vLLM's step
        # thread joins in wait_for_layer (it takes the lease work itself if the load thread
        # has not started it, and copy units in the same order), so no copy waits for a thread
        # that cannot get a core. Measured (bench/ttft.py, connector/README.md "Where a warm
        # request's time goes"): copies on the load thread alone ran 5-15x slower than on the
        # step thread under the seed's concurrent arrivals, its core being shared with the API
        # server and EngineCore, while the forward waited and its own core idled.
        self._load_thread.submit(self._help_load, job)

    def wait_for_layer(self, layer_name: str) -> None:
        job = self._load_job
        if job is None:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        landed = self._await(job, layer)
        if not landed:
            log.warning(
                "pegaflow: loads missed the %.0f ms deadline at %s; recomputing them",
                self.cfg.load_timeout_s * 1e3,
                layer_name,
            )
            self.stats["load_timeouts"] += 1
            self.metrics.add("load_timeouts")
            job.cancel()

    def _finish_load(self) -> set[str]:
        """End the step's load job: after this no copy lands. Reports the blocks that did not
        land and returns the requests they belong to."""
        job, self._load_job = self._load_job, None
        if job is None:
            return set()
        if not self._await(job, None):
            self.stats["load_timeouts"] += 1
            self.metrics.add("load_timeouts")
        landed = job.close()  # nothing may land after the step
        job.finish()
        leases = job.take_leases()
        lease_lost = False
        if leases and self._lease_may_have_lapsed(job):
            # The copies ran long after the lease was taken (this process was stopped or starved
            # past the session TTL?): the server may have ended the lease and reused the slots
            # while they were read. Ask it before the bytes are trusted (issue 12, item 3).
            lease_lost = not self._release_verified(leases, job.landed_bytes, job.corrupt)
        elif leases:
            self._housekeeping.submit(self._release, leases, job.landed_bytes, job.corrupt)
        complete = self.active and landed == len(self.layer_names) and not lease_lost
        failed_reqs: set[str] = set()
        m = self.metrics
        for t in job.transfers:
            missing = [b for b in t.block_ids if not complete or b in job.missing_ids]
            if missing:
                failed_reqs.add(t.req_id)
                self._invalid_ids.update(missing)
                self.stats["load_failed_blocks"] += len(missing)
                m.add("load_failed_blocks", len(missing))
            self.stats["loaded_blocks"] += len(t.block_ids) - len(missing)
            m.add("load_blocks", len(t.block_ids) - len(missing))
        m.add("load_bytes", job.landed_bytes)
        if complete and job.t_landed:
            m.observe("load_seconds", job.t_landed - job.t_submit)
        m.observe("load_stall_seconds", job.stall_s)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "pegaflow: load of %d blocks (%.1f MiB): lease %.1f ms, copies %.1f ms, "
                "step thread busy %.1f ms of which waiting %.1f ms",
                sum(len(t.block_ids) for t in job.transfers),
                job.landed_bytes / 2**20,
                (job.t_leased - job.t_submit) * 1e3 if job.t_leased else -1,
                (job.t_landed - job.t_leased) * 1e3 if job.t_landed and job.t_leased else -1,
                job.stall_s * 1e3,
                job.waited_s * 1e3,
            )
        return failed_reqs

    def _run_load(self, job: _LoadJob) -> None:
        """CUDA KV, on the load thread: the server leases and copies (one RPC per request)."""
        assert self.link is not None
        try:
            usable = self.link.usable()
            if usable is None:
                return  # nothing lands: every block is reported failed
            client, (inst,) = usable
            self._load_cuda(client, inst, job)
        except Exception:
            log.exception("pegaflow: load failed unexpectedly; recomputing")
        finally:
            job.finish()

    def _plan_host(self, job: _LoadJob) -> None:
        """Host KV, by whichever thread claimed the lease work: lease every transfer's blocks
        and cut the copies into units. Ends the job (its blocks reported failed) when nothing
        can be copied: server unusable, lease failed on a down server, deadline passed."""
        from pegaflow.client import errors

        assert self.pages is not None and self.link is not None
        pages = self.pages
        plans: list[tuple[np.ndarray, list[Run]]] = []
        try:
            usable = self.link.usable()
            if usable is None:
                job.finish()
                return
            client, (inst,) = usable
            for transfer in job.transfers:
                if job.cancelled or job.deadline <= time.monotonic():
                    job.finish()
                    return
                n = 0
                t_lease = time.monotonic()
                job.t_lease_asked = job.t_lease_asked or t_lease
                try:
                    locations, epoch = self._lease(client, inst, transfer.block_hashes, job)
                    if _trace.enabled:
                        _trace.span("lease", t_lease, req=transfer.req_id, blocks=len(transfer.block_hashes))
                    if any(loc.length != pages.block_bytes for loc in locations):
                        raise errors.PegaflowError(
                            f"server returned locations that are not {pages.block_bytes} B"
                        )
                    if locations:
                        pool = self._pool_bytes(client, epoch)
                        runs = plan_runs(
                            transfer.block_ids[: len(locations)],
                            [loc.offset for loc in locations],
                            pages.block_bytes,
                        )
                        plans.append((pool, runs))
                        n = len(locations)
                except errors.ServerUnavailable as exc:
                    self.link.report_failure(exc, "lease")
                    job.finish()
                    return
                except errors.PegaflowError as exc:  # e.g. a stale epoch: this request recomputes
                    log.warning("pegaflow: load of request %s failed (%s); recomputing", transfer.req_id, exc)
                job.missing_ids.update(transfer.block_ids[n:])
        except Exception:
            log.exception("pegaflow: load failed unexpectedly; recomputing")
            job.finish()
            return
        job.t_leased = time.monotonic()
        _failpoint_pause_after_lease()
        if not job.publish(copy_units(plans, pages.num_layers, pages.page_bytes, _UNIT_BYTES)):
            # the step closed the job while the leases were in flight: nothing may land now
            leases = job.take_leases()
            if leases:
                self._housekeeping.submit(self._release, leases, 0)

    def _copy_unit(self, job: _LoadJob, unit: CopyUnit) -> None:
        """Copy one claimed unit (GIL released inside numpy's copy)."""
        assert self.pages is not None
        layer, pieces, nbytes = unit
        t0 = time.monotonic()
        ok = False
        try:
            for pool, runs in pieces:
                self.pages.load_layer(pool, runs, layer)
            ok = True
        except Exception:
            log.exception("pegaflow: copying a unit of layer %d failed; recomputing this step's loads", layer)
        finally:
            job.landed(layer, nbytes, ok)
        if not ok:
            job.cancel()
        elif _trace.enabled:
            _trace.span("load_unit", t0, layer=layer, bytes=nbytes)

    def _help_load(self, job: _LoadJob) -> None:
        """The load thread: the lease work if the step thread has not taken it, then copy
        units until none is left."""
        if job.claim_planning():
            self._plan_host(job)
        if not job.planned.wait(max(job.deadline - time.monotonic(), 0.0)):
            return
        while (unit := job.claim()) is not None:
            if job.deadline <= time.monotonic():
                job.landed(unit[0], 0, False)
                return
            self._copy_unit(job, unit)

    def _await(self, job: _LoadJob, layer: int | None) -> bool:
        """vLLM's step thread until `layer` (None: every layer) has landed or the deadline
        passed, working meanwhile: the lease work if nobody has started it, then copy units in
        order; it waits only for units the load thread holds. False on timeout."""
        target = job.done if layer is None else job.layer_done[layer]
        if target.is_set():
            return True
        started = time.monotonic()
        waited = 0.0
        while not target.is_set():
            if time.monotonic() >= job.deadline:
                break
            if job.server_copies:  # CUDA: one RPC on the load thread, nothing to help with
                pass
            elif not job.planned.is_set():
                if job.claim_planning():
                    self._plan_host(job)
                    continue
            elif (unit := job.claim()) is not None:
                self._copy_unit(job, unit)
                continue
            t0 = time.monotonic()
            wait_on = target if job.server_copies or job.planned.is_set() else job.planned
            wait_on.wait(max(job.deadline - t0, 0.0))
            t1 = time.monotonic()
            waited += t1 - t0
            if _trace.enabled:
                _trace.span("layer_wait", t0, t1, layer=-1 if layer is None else layer)
        job.waited_s += waited
        job.stall_s += time.monotonic() - started
        return target.is_set()

    def _load_cuda(self, client: Any, inst: Any, job: _LoadJob) -> None:
        """The server leases and copies into GPU memory; all layers land at once. It never
        lands a copy after the deadline it was given (the step's load deadline).

        One RPC per request, two requests in flight when the step loads several: this thread
        and the load helper take them in turn, so one request's fixed costs (its frame, checks,
        first lookup and launch, last release and answer: ~1-1.5 ms) pass while another's bytes
        move (server/gpu/README.md, thirteenth session: ten streams of loads each, two in flight
        95.9-97.7 % of the host link at the median, one at a time 82.9-90.9 %)."""
        handle = self._device_handle_for(client, inst)
        job.t_leased = time.monotonic()
        todo = collections.deque(job.transfers)
        helper = None
        if handle is not None and len(todo) > 1 and self._load_helper is not None:
            helper = self._load_helper.submit(self._load_cuda_requests, client, handle, job, todo)
        self._load_cuda_requests(client, handle, job, todo)
        if helper is not None:
            # Its RPCs end by the step's deadline: past that (and a grace), nothing landed.
            concurrent.futures.wait([helper], timeout=_remaining(job.deadline) + _LOAD_HELPER_GRACE_S)
            if not helper.done():
                log.warning("pegaflow: a device load was still running past the step's deadline; recomputing")
                return
            helper.result()  # an error of ours on the helper: _run_load reports every block failed
        with job.lock:
            if not job.cancelled:
                job.layers_landed = len(self.layer_names)
        job.t_landed = time.monotonic()

    def _load_cuda_requests(self, client: Any, handle: Any, job: _LoadJob, todo: collections.deque) -> None:
        """Loads the step's requests taken from ``todo`` until none is left (on one of two threads)."""
        from pegaflow.client import errors

        assert self.link is not None
        while True:
            try:
                transfer = todo.popleft()
            except IndexError:
                return
            if handle is None or job.cancelled or job.deadline <= time.monotonic():
                with job.lock:
                    job.missing_ids.update(transfer.block_ids)
                continue
            n = 0
            try:
                n = self.gpu.load(
                    client, handle, transfer.block_hashes, transfer.block_ids, _remaining(job.deadline)
                )
                n = max(0, min(n, len(transfer.block_ids)))
            except errors.ServerUnavailable as exc:
                self.link.report_failure(exc, "device load")
            except errors.PegaflowError as exc:
                log.warning(
                    "pegaflow: device load of request %s failed (%s); recomputing", transfer.req_id, exc
                )
            with job.lock:
                job.missing_ids.update(transfer.block_ids[n:])
                job.landed_bytes += n * self.gpu.block_bytes

    def _lease(self, client: Any, inst: Any, hashes: list[bytes], job: _LoadJob) -> tuple[list[Any], str]:
        """Pin the leading stored blocks of `hashes` (in batches the server accepts); returns
        their locations, all of one epoch. A lease granted after the step ended is released
        at once."""
        from pegaflow.client import QueryPurpose

        locations: list[Any] = []
        epoch = ""
        for chunk in batches(hashes, client):
            # LOAD: the scheduler's lookup already counted these blocks as requested
            hit = client.query_prefix(
                inst, chunk, lease=True, timeout_s=_remaining(job.deadline), purpose=QueryPurpose.LOAD
            )
            if hit.lease_id and not job.add_lease(hit.lease_id):
                self._housekeeping.submit(self._release, [hit.lease_id], 0)
                return [], hit.epoch
            if epoch and hit.epoch != epoch:
                break  # the server restarted between two batches
            epoch = hit.epoch
            n = min(int(hit.num_hits), len(hit.locations), len(chunk))
            if self.cfg.block_checksums and n:
                good = self._verified(client, hit, n)
                if good < n:
                    job.corrupt.setdefault(hit.lease_id, []).append(chunk[good])
                    locations.extend(hit.locations[:good])
                    break
            locations.extend(hit.locations[:n])
            if n < len(chunk):
                break
        return locations, epoch

    def _verified(self, client: Any, hit: Any, n: int) -> int:
        """How many of the hit's first ``n`` blocks hold the bytes their writer hashed (checked in
        the pool, before any is copied; XXH3 releases the GIL). The first that does not ends the
        prefix: it and the rest are recomputed, and the server is told with the release."""
        from pegaflow.client import verify_blocks

        good = verify_blocks(client.pool_view(hit.epoch), hit.locations[:n])
        if good < n:
            self.stats["load_blocks_corrupt"] += 1
            self.metrics.add("load_corrupt_blocks")
            log.warning(
                "pegaflow: a loaded block does not match its checksum (pool offset %d); recomputing from it",
                hit.locations[good].offset,
            )
        return good

    def _lease_may_have_lapsed(self, job: _LoadJob) -> bool:
        """True when the time since the lease was taken is a fair share of the session's TTL: only
        then could the server have ended the session (and its leases) while the copies ran."""
        if not job.t_lease_asked or self.link is None:
            return False
        usable = self.link.usable()
        ttl = usable[0].session_ttl_s if usable is not None else 0.0
        return time.monotonic() - job.t_lease_asked > max(ttl, 1.0) / 4

    def _release_verified(
        self, leases: list[str], loaded_bytes: int, corrupt: dict[str, list[bytes]] | None = None
    ) -> bool:
        """Releases and waits for the answer: False when the server no longer knew a lease (it
        expired, or its session ended): what was read under it may be another block's bytes."""
        from pegaflow.client import errors

        usable = self.link.usable() if self.link is not None else None
        if usable is None:
            return False
        client, _ = usable
        ok = True
        for i, lease_id in enumerate(leases):
            try:
                client.release(
                    lease_id,
                    loaded_bytes=loaded_bytes if i == 0 else 0,
                    timeout_s=self.cfg.rpc_timeout_s,
                    corrupt_hashes=(corrupt or {}).get(lease_id, ()),
                )
            except errors.PegaflowError as exc:
                ok = False
                log.warning(
                    "pegaflow: lease %s was lost while its blocks were read (%s); recomputing", lease_id, exc
                )
            except Exception as exc:  # not known to be kept: the blocks read under it are not trusted
                ok = False
                log.warning("pegaflow: releasing lease %s failed (%r); recomputing its blocks", lease_id, exc)
        if not ok:
            self.stats["load_leases_lost"] += 1  # its blocks are counted as failed loads
        return ok

    def _release(
        self, leases: list[str], loaded_bytes: int, corrupt: dict[str, list[bytes]] | None = None
    ) -> None:
        from pegaflow.client import errors

        usable = self.link.usable() if self.link is not None else None
        if usable is None:
            return  # the lease dies with its TTL or its session
        client, _ = usable
        t0 = time.monotonic()
        for i, lease_id in enumerate(leases):
            try:
                # one-way: the copies are done, nothing waits for the answer (a release that
                # is lost leaves the lease to its TTL), and the server sends none
                client.release(
                    lease_id,
                    loaded_bytes=loaded_bytes if i == 0 else 0,
                    timeout_s=self.cfg.rpc_timeout_s,
                    wait=False,
                    corrupt_hashes=(corrupt or {}).get(lease_id, ()),
                )
            except errors.PegaflowError as exc:
                log.debug("pegaflow: releasing lease %s failed: %s", lease_id, exc)
            except Exception:  # on the housekeeping thread: said here, or never (the future is not read)
                log.warning("pegaflow: releasing lease %s failed unexpectedly", lease_id, exc_info=True)
        if _trace.enabled:
            _trace.span("release", t0, leases=len(leases))

    def take_load_errors(self) -> set[int]:
        self._finish_load()
        out, self._invalid_ids = self._invalid_ids, set()
        return out

    # -------------------------------------------------------------- saves
    def finish_step(self, meta: PegaConnectorMetadata) -> None:
        """After the step's forward: close its loads, then queue its saves. A request whose
        load failed computed this step on missing KV, so its new blocks are not saved (the
        scheduler saves them again after the recompute)."""
        t0 = time.monotonic()
        if self.tp_rank == 0 and self._forward_t0:
            self._time_forward(meta, t0 - self._forward_t0)
        self._forward_t0 = 0.0
        failed = self._finish_load() | set(meta.failed_loads)
        saves = [t for t in meta.saves if t.req_id not in failed]
        if len(saves) < len(meta.saves):
            skipped = sum(len(t.block_ids) for t in meta.saves if t.req_id in failed)
            self._count("save_blocks_skipped_failed_load", skipped)
            self.metrics.add("save_dropped_blocks", skipped)
        self.submit_saves(saves)
        if _trace.enabled:
            t1 = time.monotonic()
            _trace.span("finish_step", t0, t1)
            if self._step_t0:
                loads = sum(len(t.block_ids) for t in meta.loads)
                _trace.span("step", self._step_t0, t1, load_blocks=loads, save_blocks=len(saves))
            self._step_t0 = 0.0

    def _time_forward(self, meta: PegaConnectorMetadata, seconds: float) -> None:
        """Rank 0: one more step for the engine's prefill cost; every ~10 s the window is reported
        (off the step: the housekeeping thread sends it), pricing what the cache saves it."""
        rate = self.prefill_rate
        rate.observe(meta.prefill_tokens, meta.decode_tokens, seconds)
        if rate.due() and self.active:
            report = rate.take_report()
            if report is not None:
                self._housekeeping.submit(self._report_prefill, *report)

    def _report_prefill(self, tokens: int, seconds: float) -> None:
        from pegaflow.client import errors

        usable = self.link.usable() if self.link is not None else None
        if usable is None:
            return
        client, (inst,) = usable
        try:
            client.report_prefill(inst, tokens, seconds, timeout_s=self.cfg.rpc_timeout_s)
        except errors.PegaflowError as exc:
            log.debug("pegaflow: prefill report not taken: %s", exc)
        except Exception:  # on the housekeeping thread: said here, or never (the future is not read)
            log.warning("pegaflow: reporting the prefill cost failed unexpectedly", exc_info=True)

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        preempted = set(preempted)
        if not preempted:
            return
        with self._save_lock:
            jobs = [j for j in self._save_jobs if j.req_ids & preempted]
        for job in jobs:
            with job.lock:  # waits for a copy in progress, then no copy starts
                job.cancelled = True
            self._count("save_jobs_preempted")

    def submit_saves(self, saves: list[BlockTransfer]) -> None:
        if not saves or not self.active:
            return
        assert self.link is not None and self.layout is not None
        seen: set[bytes] = set()
        block_ids: list[int] = []
        hashes: list[bytes] = []
        req_ids: set[str] = set()
        nblocks = 0  # new blocks (the heads sent along are stored already)
        lay = self.layout
        for t in saves:
            # a namespace shared by the TP group (MLA): each block has one writer rank
            t_ids, t_hashes = mla.own_blocks(lay.mla, lay.tp_rank, lay.tp_size, t.block_ids, t.block_hashes)
            self._count("save_blocks_other_rank", len(t.block_ids) - len(t_ids))
            if not t_ids:
                continue
            # the chain's head goes first: the server restates the whole chain (see BlockTransfer)
            h_ids, h_hashes = mla.own_blocks(
                lay.mla, lay.tp_rank, lay.tp_size, t.head_block_ids, t.head_hashes
            )
            nblocks += len(t_ids)
            for b, h in zip(h_ids + t_ids, h_hashes + t_hashes, strict=True):
                if h not in seen:
                    seen.add(h)
                    block_ids.append(b)
                    hashes.append(h)
                    req_ids.add(t.req_id)
        if not nblocks:
            return
        if self.link.usable() is None:
            self._count("save_blocks_skipped_unavailable", nblocks)
            self.metrics.add("save_dropped_blocks", nblocks)
            return
        try:
            ready = self.gpu.record_ready() if self.gpu is not None else None
        except Exception:  # a CUDA error here is vLLM's to report, at its next call of its own
            log.exception("pegaflow: marking the forward's end for a save failed; not saving this step")
            self._count("save_blocks_dropped_error", nblocks)
            self.metrics.add("save_dropped_blocks", nblocks)
            return
        job = _SaveJob(block_ids, hashes, req_ids, ready)
        with self._save_lock:
            if len(self._save_jobs) > self.cfg.max_pending_saves:
                self._count("save_blocks_dropped_backlog", nblocks)
                self.metrics.add("save_dropped_blocks", nblocks)
                return
            self._save_jobs.append(job)
            for rid in job.req_ids:
                self._pending_saves[rid] += 1
        self._save_thread.submit(self._run_save, job)

    def _run_save(self, job: _SaveJob) -> None:
        from pegaflow.client import errors

        assert self.link is not None
        t0 = time.monotonic()
        try:
            usable = self.link.usable()
            if usable is None or job.cancelled:
                if usable is None:
                    self.metrics.add("save_dropped_blocks", len(job.hashes))
                return
            client, (inst,) = usable
            if self.gpu is not None:
                if not self._save_cuda(client, inst, job):
                    return
            elif not self._save_host(client, inst, job):
                return
            self.metrics.observe("save_seconds", time.monotonic() - t0)
        except errors.ServerUnavailable as exc:
            self.link.report_failure(exc, "save")
            self._save_failed()
        except errors.PegaflowError as exc:
            log.warning("pegaflow: save failed: %s", exc)
            self._save_failed()
        except Exception:
            log.exception("pegaflow: save failed unexpectedly")
            self._save_failed()
        finally:
            with self._save_lock:
                self._save_jobs.remove(job)
                for rid in job.req_ids:
                    self._pending_saves[rid] -= 1
                    if self._pending_saves[rid] <= 0:
                        del self._pending_saves[rid]

    def _save_failed(self) -> None:
        self._count("save_jobs_failed")
        self.metrics.add("save_failures")

    def _count(self, key: str, n: int = 1) -> None:
        """``stats[key] += n`` for the save path's counters: the step thread and the save threads
        (two at once on the CUDA path) add to the same keys, and a Counter's ``+=`` is a read and a
        write another thread can come between."""
        with self._stats_lock:
            self.stats[key] += n

    def _save_host(self, client: Any, inst: Any, job: _SaveJob) -> bool:
        """The job's blocks, in the largest batches the server takes, through the client's save
        pipeline (client/save_pipeline.py: allocate -> copy the granted blocks -> seal, the next
        batch's allocation and the previous one's seal answered while a batch is copied). False
        when the job was cancelled."""
        from pegaflow.client import errors
        from pegaflow.client.save_pipeline import save_batches

        assert self.pages is not None
        block_bytes = self.pages.block_bytes
        chunks = batches(job.hashes, client)
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + len(chunk))

        def write(i: int, batch: Any) -> tuple[int, ...] | list[int]:
            granted = [k for k, a in enumerate(batch.allocations) if a.granted]
            if any(batch.allocations[k].length != block_bytes for k in granted):
                raise errors.PegaflowError(f"granted locations are not {block_bytes} B")
            ids = job.block_ids[starts[i] : starts[i + 1]]
            pool = self._pool_bytes(client, batch.epoch)
            runs = plan_runs(
                [ids[k] for k in granted], [batch.allocations[k].offset for k in granted], block_bytes
            )
            t1 = time.monotonic()
            with job.lock:
                if job.cancelled:
                    raise _SaveCancelled
                self.pages.save_blocks(pool, runs)
            del pool
            checksums: tuple[int, ...] | list[int] = ()
            if self.cfg.block_checksums:
                from pegaflow.client import block_checksums

                checksums = block_checksums(
                    client.pool_view(batch.epoch), [batch.allocations[k] for k in granted]
                )
            if _trace.enabled:
                _trace.span("save_copy", t1, blocks=len(granted))
            return checksums

        t0 = time.monotonic()
        try:
            saved, sealed = save_batches(client, inst, chunks, write, timeout_s=self.cfg.rpc_timeout_s)
        except _SaveCancelled:
            return False
        if _trace.enabled:
            _trace.span("save_batches", t0, batches=len(chunks), blocks=len(job.hashes))
        granted = sum(a.granted for batch in saved for a in batch.allocations)
        self._count("save_blocks_deduplicated", len(job.hashes) - granted)
        self.metrics.add("save_deduplicated_blocks", len(job.hashes) - granted)
        self._count("saved_blocks", sealed)
        self.metrics.add("save_blocks", sealed)
        self.metrics.add("save_bytes", sealed * block_bytes)
        return True

    def _save_cuda(self, client: Any, inst: Any, job: _SaveJob) -> bool:
        """One SaveFromDevice per batch: the server allocates, copies from GPU memory, seals.
        Held under the job lock: a preemption waits for the copy rather than let the
        server read blocks the next forward overwrites (bounded by rpc_timeout_ms).
        False when nothing was saved (no device registration, or cancelled)."""
        handle = self._device_handle_for(client, inst)
        if handle is None:
            self._count("save_blocks_skipped_unavailable", len(job.hashes))
            self.metrics.add("save_dropped_blocks", len(job.hashes))
            return False
        start = 0
        for chunk in batches(job.hashes, client):
            ids = job.block_ids[start : start + len(chunk)]
            start += len(chunk)
            with job.lock:
                if job.cancelled:
                    return False
                result = self.gpu.save(client, handle, chunk, ids, self.cfg.rpc_timeout_s, ready=job.ready)
            written = int(result[1]) if isinstance(result, tuple) else int(getattr(result, "written", 0))
            self._count("saved_blocks", written)
            self._count("save_blocks_deduplicated", len(chunk) - written)
            self.metrics.add("save_blocks", written)
            self.metrics.add("save_bytes", written * self.gpu.block_bytes)
            self.metrics.add("save_deduplicated_blocks", len(chunk) - written)
        return True

    def finished_sending(self, delayed_free_req_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks vLLM kept for our saves and whose saves are now done."""
        self._awaiting_free.update(delayed_free_req_ids)
        if not self._awaiting_free:
            return set()
        with self._save_lock:
            done = {rid for rid in self._awaiting_free if rid not in self._pending_saves}
        self._awaiting_free -= done
        return done

    # ------------------------------------------------------------- shared
    @staticmethod
    def _pool_bytes(client: Any, epoch: str) -> np.ndarray:
        """The pool of `epoch` as one flat byte array (StaleEpoch for an old epoch). Made
        per job and dropped with it: a live view would keep an old mapping (a whole pool
        of memory) from being unmapped after a server restart."""
        return client.pool_view(epoch)

    def shutdown(self) -> None:
        steps = [
            self._finish_load,
            lambda: self._load_thread.shutdown(wait=True, cancel_futures=True),
            lambda: self._load_helper and self._load_helper.shutdown(wait=True, cancel_futures=True),
            lambda: self._save_thread.shutdown(wait=True, cancel_futures=True),
            lambda: self._housekeeping.shutdown(wait=True, cancel_futures=True),
        ]
        if self.link is not None:
            steps.append(self.link.close)
        if self.embedded is not None:
            steps.append(self.embedded.stop)
        for step in steps:  # each one, whatever an earlier one raised: the engine is stopping anyway
            try:
                step()
            except Exception:
                log.exception("pegaflow: a step of the worker's shutdown failed; going on")
        log.info("pegaflow: worker connector stopped: %s", dict(self.stats))
