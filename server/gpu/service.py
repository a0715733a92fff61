"""The server's GPU data path: workers' KV tensors opened by CUDA IPC, copied to and from the pool.

``GpuDataPath`` composes the engine's bookkeeping with one ``DeviceCopier``
per GPU. The same rules as for CPU clients hold, only the server moves the
bytes:

* **save**: allocate (dedup, admission, eviction) -> batched copy GPU -> pool
  -> seal. Blocks are sealed only when the copy completed before the caller's
  deadline: a caller that gave up may already reuse its GPU blocks, so a copy
  that finished later could have read other data, and is aborted instead.
  Nothing half-copied ever becomes visible.
* **load**: query with a lease (pins the hits) -> batched copy pool -> GPU ->
  release. A copy must land before the caller's deadline or not at all (the
  caller recomputes those blocks after its deadline), so a load that cannot
  start in time is cancelled rather than started late.

Leases and unsealed saves are taken under the data path's own engine session,
so the worker's death cannot free pool blocks under a running copy. When the
worker's session ends, ``on_session_end`` retires its registrations: queued
copies are cancelled, running ones finish, then the IPC mappings are closed.
Copies run on the copiers' threads and streams; an RPC thread only waits on
a future, and the GIL is released while the GPU works.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Sequence

from pegaflow.server.engine import AllocStatus, KVEngine, QueryPurpose
from pegaflow.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from pegaflow.server.gpu import cuda_runtime
from pegaflow.server.gpu.copy_plan import DEFAULT_MAX_PIECE_BYTES, BlockLayout, LayoutError
from pegaflow.server.gpu.device_copier import (
    DEFAULT_SLOT_BYTES,
    DEFAULT_SLOTS,
    DEFAULT_STAGED_MIN_RUN_BYTES,
    MODES,
    CopyCancelled,
    CopyFailed,
    DeviceCopier,
)
from pegaflow.server.gpu.doorbell import DoorbellServer
from pegaflow.server.gpu.ipc import IpcError, IpcMappings, PinnedHostRegion
from pegaflow.server.gpu.kernels import KernelConfig
from pegaflow.server.gpu.registration import DeviceRegistration

log = logging.getLogger(__name__)
# Per-request phase timings at DEBUG (enable this logger alone to see where a request's time goes).
timing_log = logging.getLogger("pegaflow.server.gpu.timing")

# A load is only started if it can finish before the caller's deadline at this share of the link
# (55 GB/s on an H200 host), plus a fixed allowance for queueing and launch.
_PLANNING_BYTES_PER_S = 20e9
_PLANNING_FIXED_S = 0.005


@dataclasses.dataclass(frozen=True)
class GpuOptions:
    copy_mode: str = "auto"  # auto | direct | staged (see device_copier)
    slot_bytes: int = DEFAULT_SLOT_BYTES
    slots: int = DEFAULT_SLOTS
    max_piece_bytes: int = DEFAULT_MAX_PIECE_BYTES
    staged_min_run_bytes: int = DEFAULT_STAGED_MIN_RUN_BYTES
    kernel: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    retire_timeout_s: float = 30.0
    # The local fast path for saves and loads (doorbell.py); doorbell_path None: a fresh temp path.
    doorbell: bool = True
    doorbell_path: str | None = None

    def __post_init__(self) -> None:
        if self.copy_mode not in MODES:
            raise ValueError(f"copy_mode must be one of {MODES}, got {self.copy_mode!r}")


@dataclasses.dataclass(frozen=True)
class SaveOutcome:
    statuses: list[AllocStatus]  # one per hash, as AllocateBlocks reports them
    written: int  # blocks this call copied and sealed
    mode: str  # how the bytes moved: direct | staged | none


@dataclasses.dataclass(frozen=True)
class LoadOutcome:
    num_hits: int  # leading stored blocks found, all loaded
    mode: str


@dataclasses.dataclass
class _Registration:
    id: str
    session_id: str
    instance_id: str
    ordinal: int
    layout: BlockLayout
    handles: list[bytes]


class GpuDataPath:
    """Registrations, IPC mappings and per-GPU copiers of one server. Thread-safe."""

    def __init__(self, engine: KVEngine, options: GpuOptions | None = None):
        self._engine = engine
        self.options = options or GpuOptions()
        pool = engine.pool_view()
        start = time.perf_counter()
        self._pinned = PinnedHostRegion(pool.ctypes.data, pool.nbytes)
        log.info(
            "gpu: pool of %d bytes registered for DMA in %.2f s", pool.nbytes, time.perf_counter() - start
        )
        del pool
        self._ipc = IpcMappings()
        self._lock = threading.Lock()
        self._copiers: dict[int, DeviceCopier] = {}
        self._regs: dict[str, _Registration] = {}
        self._closed = False
        # Lease releases after loads run here, off the copier threads and off the callers' critical path.
        self._housekeeping = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pegaflow-gpu-release"
        )
        self._doorbell: DoorbellServer | None = None
        try:
            self._session = engine.open_session(
                "pegaflow-gpu-datapath", pid=os.getpid(), expires=False
            ).session_id
            if self.options.doorbell:
                path = self.options.doorbell_path or os.path.join(
                    tempfile.gettempdir(), f"pegaflow-gpu-{os.getpid()}-{engine.epoch}.sock"
                )
                cfg = engine.config
                self._doorbell = DoorbellServer(path, self, cfg.max_batch_blocks, cfg.max_hash_bytes)
        except Exception:
            self._pinned.close()
            raise

    @property
    def doorbell_path(self) -> str:
        """The Unix socket of the local fast path ("" when off)."""
        return self._doorbell.path if self._doorbell is not None else ""

    # -------------------------------------------------------------- registration

    def register(
        self, session_id: str, instance_id: str, reg: DeviceRegistration, deadline: float | None = None
    ) -> str:
        """Opens a worker's KV tensors; returns the registration id its saves and loads name."""
        self._engine.heartbeat(session_id, deadline)  # the caller's session must be live
        try:
            layout = reg.validate()
        except (ValueError, LayoutError) as exc:
            raise InvalidArgument(f"device registration: {exc}") from exc
        try:
            ordinal = self._ipc.device_ordinal(reg.device_uuid)
        except ValueError as exc:
            raise InvalidArgument(f"device registration: {exc}") from exc
        except IpcError as exc:
            raise FailedPrecondition(str(exc)) from exc
        handles: list[bytes] = []
        try:
            addrs = []
            for t in reg.tensors:
                addrs.append(self._ipc.open(ordinal, t.ipc_handle) + t.offset)
                handles.append(t.ipc_handle)
            reg_id = "g-" + secrets.token_hex(12)
            self._copier(ordinal).add_layout(reg_id, layout, addrs)
        except IpcError as exc:
            self._close_handles(handles)
            raise FailedPrecondition(f"device registration: {exc}") from exc
        except BaseException:
            self._close_handles(handles)
            raise
        with self._lock:
            self._regs[reg_id] = _Registration(reg_id, session_id, instance_id, ordinal, layout, handles)
        log.info(
            "gpu: registration %s of session %s: GPU %d, %d tensors, %d segments, %d blocks of %d bytes",
            reg_id,
            session_id,
            ordinal,
            len(reg.tensors),
            len(reg.segments),
            layout.num_blocks,
            layout.block_bytes,
        )
        return reg_id

    def unregister(self, session_id: str, reg_id: str) -> None:
        reg = self._get(session_id, reg_id)
        self._retire(reg)

    def on_session_end(self, session_id: str) -> None:
        """The worker's session ended (closed, disconnected or expired): drop its registrations."""
        with self._lock:
            regs = [r for r in self._regs.values() if r.session_id == session_id]
        for reg in regs:
            self._retire(reg)

    def _retire(self, reg: _Registration) -> None:
        with self._lock:
            if self._regs.pop(reg.id, None) is None:
                return
            copier = self._copiers.get(reg.ordinal)
        if copier is not None and not copier.retire(reg.id, self.options.retire_timeout_s):
            # A copy still runs on that memory: keep it mapped (leaked) rather than unmap it under the GPU.
            log.error("gpu: registration %s still has copies running; its IPC mappings are kept", reg.id)
            return
        self._close_handles(reg.handles)
        log.info("gpu: registration %s dropped", reg.id)

    def _close_handles(self, handles: Sequence[bytes]) -> None:
        for handle in handles:
            self._ipc.close(handle)

    def _get(self, session_id: str, reg_id: str) -> _Registration:
        with self._lock:
            reg = self._regs.get(reg_id)
        if reg is None or reg.session_id != session_id:
            raise NotFound("device registration", reg_id)
        return reg

    def _copier(self, ordinal: int) -> DeviceCopier:
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the GPU data path is shutting down")
            copier = self._copiers.get(ordinal)
            if copier is None:
                o = self.options
                copier = DeviceCopier(
                    ordinal,
                    self._pinned.device_addr,
                    self._pinned.size,
                    kernel_config=o.kernel,
                    slot_bytes=o.slot_bytes,
                    slots=o.slots,
                    max_piece_bytes=o.max_piece_bytes,
                    staged_min_run_bytes=o.staged_min_run_bytes,
                )
                self._copiers[ordinal] = copier
            return copier

    # -------------------------------------------------------------- data path

    def save(
        self, session_id: str, reg_id: str, hashes: Sequence[bytes], block_ids: Sequence[int], deadline: float
    ) -> SaveOutcome:
        """Stores GPU blocks ``block_ids`` under ``hashes``; returns once they are sealed (visible).

        The request is cut into chunks (a small first one, so the GPU starts
        early): while one chunk copies, the next is allocated, and each chunk is
        sealed as soon as its own copy completes, so only the last, small seal
        is left after the last byte arrives. The next chunk is allocated only
        once the previous one is enqueued on the GPU: allocating (Python, under
        the GIL) while the copier thread tries to launch would hold the launch
        back and leave the GPU idle.
        """
        t0 = time.perf_counter()
        reg = self._get(session_id, reg_id)
        _check_ids(hashes, block_ids, reg.layout)
        engine, copier = self._engine, self._copiers[reg.ordinal]
        tracker = _Countdown(timing_log.isEnabledFor(logging.DEBUG))
        statuses: list[AllocStatus] = []
        chunks = _save_chunks(len(hashes))
        try:
            for lo, hi in chunks:
                alloc = engine.allocate_blocks(self._session, reg.instance_id, hashes[lo:hi], deadline)
                statuses += alloc.statuses
                if not alloc.save_id:
                    continue
                try:
                    if alloc.block_bytes != reg.layout.block_bytes:
                        raise InvalidArgument(
                            f"the instance stores {alloc.block_bytes}-byte blocks but registration {reg_id} "
                            f"describes {reg.layout.block_bytes}-byte blocks"
                        )
                    granted = [
                        b
                        for b, st in zip(block_ids[lo:hi], alloc.statuses, strict=True)
                        if st == AllocStatus.GRANTED
                    ]
                    launched = threading.Event()
                    future = copier.submit(
                        reg.id,
                        True,
                        granted,
                        alloc.offsets,
                        self.options.copy_mode,
                        start_by=deadline,
                        on_launch=launched,
                    )
                except BaseException:
                    engine.abort_blocks(self._session, alloc.save_id)
                    raise
                tracker.add()
                future.add_done_callback(functools.partial(self._finish_save, alloc, deadline, tracker))
                launched.wait(max(deadline - time.monotonic(), 0.0))
                tracker.mark("launched")
        finally:
            tracker.close()
        if not tracker.wait(deadline):
            raise DeadlineExceeded(
                "the copy did not finish before the deadline; its blocks will not be sealed"
            )
        if tracker.marks is not None:
            tracker.mark("woken")
            timing_log.debug("save %d blocks: %s", len(hashes), tracker.report(t0))
        _raise_copy_error(tracker.error)
        if len(chunks) > 1:
            # Each chunk's seal left that chunk head-first, but a later chunk (the chain's tail)
            # after an earlier one: restate the whole chain, off the caller's critical path.
            self._housekeeping.submit(self._refresh, reg.instance_id, hashes)
        return SaveOutcome(statuses, tracker.written, tracker.mode or "none")

    def _finish_save(self, alloc, deadline: float, tracker: _Countdown, fut) -> None:
        """On a copier thread: seal a chunk copied completely before the caller's deadline, else abort it."""
        try:
            result = fut.result()
            tracker.mark(f"copied(q{result.queued_s * 1e3:.2f},l{result.launch_s * 1e3:.2f})")
            if time.monotonic() > deadline:
                raise DeadlineExceeded("the copy completed after the caller's deadline")
            self._engine.seal_blocks(self._session, alloc.save_id)
            tracker.mark("sealed")
            tracker.done(written=len(alloc.offsets), mode=result.mode)
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting RPC
            try:
                self._engine.abort_blocks(self._session, alloc.save_id)
            except Exception:
                log.exception("gpu: aborting save %s failed", alloc.save_id)
            tracker.done(error=exc)

    def load(
        self,
        session_id: str,
        reg_id: str,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        deadline: float,
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
    ) -> LoadOutcome:
        """Copies the leading stored blocks of ``hashes`` into GPU blocks ``block_ids``, then returns.

        Chunked like ``save``: the first, small chunk is looked up (leased) and
        its copy started while the rest is looked up; the lookup stops at the
        first miss. Each chunk's lease is released off the critical path once
        its copy has landed. A chunk that cannot land before the deadline is
        not started (the caller recomputes after its deadline). ``purpose`` is
        the query's (QueryPurpose): the chunks are accounted as one query of
        ``hashes``, after the copies, off the critical path.
        """
        t0 = time.perf_counter()
        reg = self._get(session_id, reg_id)
        _check_ids(hashes, block_ids, reg.layout)
        engine, copier = self._engine, self._copiers[reg.ordinal]
        bb = reg.layout.block_bytes
        tracker = _Countdown(timing_log.isEnabledFor(logging.DEBUG))
        hits = chunks = 0
        try:
            for lo, hi in _save_chunks(len(hashes)):
                hit = engine.query_prefix(
                    self._session,
                    reg.instance_id,
                    hashes[lo:hi],
                    lease=True,
                    deadline=deadline,
                    purpose=purpose,
                    account=False,
                )
                chunks += 1
                tracker.mark("queried")
                n = hit.num_hits
                if not n:
                    break
                try:
                    if hit.block_bytes != bb:
                        raise InvalidArgument(
                            f"the instance stores {hit.block_bytes}-byte blocks but registration {reg_id} "
                            f"describes {bb}-byte blocks"
                        )
                    # Start this chunk only if everything left of the request can still land in time.
                    left = (len(hashes) - lo) * bb
                    start_by = deadline - _PLANNING_FIXED_S - left / _PLANNING_BYTES_PER_S
                    launched = threading.Event()
                    future = copier.submit(
                        reg.id,
                        False,
                        list(block_ids[lo : lo + n]),
                        hit.offsets,
                        self.options.copy_mode,
                        start_by=start_by,
                        on_launch=launched,
                    )
                except BaseException:
                    engine.release_lease(self._session, hit.lease_id)
                    raise
                tracker.add()
                future.add_done_callback(functools.partial(self._finish_load, hit.lease_id, n * bb, tracker))
                hits += n
                if n < hi - lo:
                    break
                launched.wait(max(deadline - time.monotonic(), 0.0))
                tracker.mark("launched")
        finally:
            tracker.close()
        self._housekeeping.submit(self._account_load, reg.instance_id, hashes, hits, purpose, chunks)
        if not tracker.wait(deadline):
            raise DeadlineExceeded("the copy did not finish before the deadline")
        if tracker.marks is not None:
            tracker.mark("woken")
            timing_log.debug("load %d blocks: %s", len(hashes), tracker.report(t0))
        _raise_copy_error(tracker.error)
        return LoadOutcome(hits, tracker.mode or "none")

    def _account_load(
        self, instance_id: str, hashes: Sequence[bytes], hits: int, purpose: QueryPurpose, chunks: int
    ) -> None:
        """The chunks' queries as one (hits and misses of the whole request, if it is a LOOKUP); after
        several chunks, the hits restated so that the head of the prefix ends the most recent."""
        try:
            self._engine.account_query(self._session, instance_id, hashes, hits, purpose)
            if chunks > 1 and hits:
                self._engine.refresh_chain(self._session, instance_id, hashes[:hits])
        except Exception:
            log.exception("gpu: accounting a load of %d blocks failed", len(hashes))

    def _refresh(self, instance_id: str, hashes: Sequence[bytes]) -> None:
        try:
            self._engine.refresh_chain(self._session, instance_id, hashes)
        except Exception:
            log.exception("gpu: restating a saved chain of %d blocks failed", len(hashes))

    def _finish_load(self, lease_id: str, nbytes: int, tracker: _Countdown, fut) -> None:
        """On a copier thread: report the chunk, then hand the lease release to the housekeeping thread."""
        try:
            result = fut.result()
            tracker.mark(f"copied(q{result.queued_s * 1e3:.2f},l{result.launch_s * 1e3:.2f})")
            tracker.done(written=nbytes, mode=result.mode)
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting RPC
            nbytes = 0
            tracker.done(error=exc)
        self._housekeeping.submit(self._release, lease_id, nbytes)

    def _release(self, lease_id: str, loaded_bytes: int) -> None:
        try:
            self._engine.release_lease(self._session, lease_id, loaded_bytes=loaded_bytes)
        except Exception:
            log.exception("gpu: releasing lease %s failed", lease_id)

    # -------------------------------------------------------------- lifecycle

    def registrations(self) -> int:
        with self._lock:
            return len(self._regs)

    def close(self) -> None:
        """Retires every registration, stops the copiers and unpins the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regs = list(self._regs.values())
        if self._doorbell is not None:
            self._doorbell.close()
        for reg in regs:
            self._retire(reg)
        for copier in self._copiers.values():
            copier.close()
        self._copiers.clear()
        self._housekeeping.shutdown(wait=True)
        self._pinned.close()
        try:
            self._engine.close_session(self._session)
        except Exception:  # the engine may already be closed
            log.debug("gpu: closing the data path's session failed", exc_info=True)


# A save's chunks: the first small so the GPU starts at once, the rest large enough to keep it busy.
_FIRST_CHUNK = 8
_CHUNK = 96


def _save_chunks(n: int) -> list[tuple[int, int]]:
    bounds = [0, min(n, _FIRST_CHUNK)]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + _CHUNK))
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


class _Countdown:
    """Waits for a save's chunks: counts the copies in flight, collects what they wrote or the first error."""

    def __init__(self, trace: bool = False):
        self._cond = threading.Condition()
        self._pending = 0
        self._closed = False
        self.written = 0
        self.mode = ""
        self.error: BaseException | None = None
        self.marks: list[tuple[str, float]] | None = [] if trace else None

    def mark(self, label: str) -> None:
        if self.marks is not None:
            self.marks.append((label, time.perf_counter()))

    def report(self, t0: float) -> str:
        return ", ".join(f"{label} {(t - t0) * 1e3:.2f}" for label, t in self.marks or ())

    def add(self) -> None:
        with self._cond:
            self._pending += 1

    def close(self) -> None:
        """No more chunks will be added."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def done(self, written: int = 0, mode: str = "", error: BaseException | None = None) -> None:
        with self._cond:
            self._pending -= 1
            self.written += written
            self.mode = self.mode or mode
            if error is not None and self.error is None:
                self.error = error
            self._cond.notify_all()

    def wait(self, deadline: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed and self._pending == 0, timeout=max(deadline - time.monotonic(), 0.0)
            )


def _check_ids(hashes: Sequence[bytes], block_ids: Sequence[int], layout: BlockLayout) -> None:
    if len(hashes) != len(block_ids):
        raise InvalidArgument(f"{len(hashes)} block hashes but {len(block_ids)} GPU block ids")
    if block_ids and max(block_ids) >= layout.num_blocks:
        raise InvalidArgument(f"GPU block id {max(block_ids)} is outside the {layout.num_blocks} registered")


def _raise_copy_error(error: BaseException | None) -> None:
    if error is None:
        return
    if isinstance(error, CopyCancelled):
        raise DeadlineExceeded(f"copy not started: {error}") from error
    if isinstance(error, CopyFailed):
        raise FailedPrecondition(f"GPU copy failed: {error}") from error
    raise error


def available() -> bool:
    """Whether this process can run the GPU data path (CuPy and a GPU)."""
    return cuda_runtime.available()
