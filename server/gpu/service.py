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
worker's session ends, ``on_session_end`` retires its registrations: at once
no call finds them any more, and on the data path's retiring threads (never on
the thread that ended the session, e.g. a CloseSession handler) new copies
are refused, running ones finish, then the IPC mappings are closed.
A request runs on its RPC thread from start to end: it enqueues its copies
on the copier's streams itself and waits for the GPU (GIL released); a copy
it stops waiting for is finished, and cleaned up after, by the copier's
reaper thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence

from pegaflow.server.engine import AllocStatus, KVEngine, QueryPurpose
from pegaflow.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from pegaflow.server.gpu import cuda_runtime
from pegaflow.server.gpu.copy_plan import (
    DEFAULT_MAX_PIECE_BYTES,
    FIRST_CHUNK_BYTES,
    LAST_CHUNK_BYTES,
    BlockLayout,
    LayoutError,
    pipeline_chunks,
)
from pegaflow.server.gpu.device_copier import (
    DEFAULT_SLOT_BYTES,
    DEFAULT_SLOTS,
    DEFAULT_STAGED_MIN_RUN_BYTES,
    MODES,
    Copy,
    CopyCancelled,
    CopyFailed,
    CopyResult,
    DeviceCopier,
)
from pegaflow.server.gpu.ipc import IpcError, IpcMappings, PinnedHostRegion
from pegaflow.server.gpu.kernels import KernelConfig
from pegaflow.server.gpu.registration import DeviceRegistration, layout_of

log = logging.getLogger(__name__)
# Per-request phase timings at DEBUG (enable this logger alone to see where a request's time goes).
timing_log = logging.getLogger("pegaflow.server.gpu.timing")

# A load is only started if it can finish before the caller's deadline at this share of the link
# (55 GB/s on an H200 host), plus a fixed allowance for queueing and launch.
_PLANNING_BYTES_PER_S = 20e9
_PLANNING_FIXED_S = 0.005
# Blocks per engine call when restating a chunked request's chain (see _refresh).
_REFRESH_SEGMENT = 32
# Registrations retired at once (each waits for its own copies, up to retire_timeout_s): one stuck on
# a hung GPU does not keep the others' IPC mappings open.
_RETIRING_THREADS = 4


@dataclasses.dataclass(frozen=True)
class GpuOptions:
    copy_mode: str = "auto"  # auto | direct | staged (see device_copier)
    slot_bytes: int = DEFAULT_SLOT_BYTES
    slots: int = DEFAULT_SLOTS
    max_piece_bytes: int = DEFAULT_MAX_PIECE_BYTES
    staged_min_run_bytes: int = DEFAULT_STAGED_MIN_RUN_BYTES
    # How a request is cut (copy_plan.pipeline_chunks): its first and last chunks.
    first_chunk_bytes: int = FIRST_CHUNK_BYTES
    last_chunk_bytes: int = LAST_CHUNK_BYTES
    kernel: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    retire_timeout_s: float = 30.0
    # Enqueue copies through the driver holding the GIL (cuda_runtime.StreamCalls), else CuPy's calls.
    driver_calls: bool = True
    # The GIL switch interval and gc.freeze() the measured slow runs called for are set for the
    # whole pegaflow-server process at start (server/runtime.py, tune_serving_process).

    def __post_init__(self) -> None:
        if self.copy_mode not in MODES:
            raise ValueError(f"copy_mode must be one of {MODES}, got {self.copy_mode!r}")
        if self.first_chunk_bytes <= 0 or self.last_chunk_bytes <= 0:
            raise ValueError("first_chunk_bytes and last_chunk_bytes must be > 0")


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
        # A GPU's copier while its first registration builds it (kernel compile, streams, self-test),
        # on a thread of its own and outside self._lock: every caller waits for it by its deadline.
        self._building: dict[int, concurrent.futures.Future] = {}
        self._regs: dict[str, _Registration] = {}
        self._closed = False
        # What may run after a call answered: restating a chunked save's chain (LRU order).
        self._housekeeping = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pegaflow-gpu-release"
        )
        # Retiring registrations (waiting for their copies in flight, up to retire_timeout_s, then
        # closing their IPC mappings): off the thread of the call that ended them, which has a deadline.
        self._retirer = concurrent.futures.ThreadPoolExecutor(
            _RETIRING_THREADS, thread_name_prefix="pegaflow-gpu-retire"
        )
        # The Unix socket of the local fast path for saves and loads, named in RegisterDeviceMemory's
        # answer: set by the runtime once its doorbell (server/endpoints/doorbell.py) listens; "" = none.
        self.doorbell_path = ""
        try:
            self._session = engine.open_session(
                "pegaflow-gpu-datapath", pid=os.getpid(), expires=False, trusted=True
            ).session_id
        except Exception:
            self._pinned.close()
            raise

    # -------------------------------------------------------------- registration

    def register(
        self, session_id: str, instance_id: str, reg: DeviceRegistration, deadline: float | None = None
    ) -> str:
        """Opens a worker's KV tensors; returns the registration id its saves and loads name."""
        self._engine.heartbeat(session_id, deadline)  # the caller's session must be live
        try:
            layout = layout_of(reg)
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
                addrs.append(self._ipc.open(ordinal, t.ipc_handle, deadline) + t.offset)
                handles.append(t.ipc_handle)
            reg_id = "g-" + secrets.token_hex(12)
            self._copier(ordinal, deadline).add_layout(reg_id, layout, addrs)
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

    def unregister(self, session_id: str, reg_id: str, deadline: float | None = None) -> None:
        """Drops a registration: no call finds it from now on. Returns once its copies in flight ended
        and its IPC mappings are closed; DeadlineExceeded if that takes past ``deadline`` (the
        retirement goes on: the mappings are closed once those copies end)."""
        reg = self._get(session_id, reg_id)
        with self._lock:
            if self._regs.pop(reg.id, None) is None:
                raise NotFound("device registration", reg_id)
        retired = self._retire_later(reg)
        try:
            retired.result(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(
                f"registration {reg_id} is dropped, but its copies in flight did not end by the deadline; "
                "its IPC mappings are closed once they do"
            ) from None

    def on_session_end(self, session_id: str) -> None:
        """The worker's session ended (closed, disconnected or expired): drop its registrations. Returns
        at once (it runs on the thread that ended the session, e.g. a CloseSession handler): they are
        gone from the table now, and retired (copies in flight waited for, then the IPC mappings
        closed) on the retiring threads."""
        with self._lock:
            regs = [r for r in self._regs.values() if r.session_id == session_id]
            for reg in regs:
                del self._regs[reg.id]
        for reg in regs:
            self._retire_later(reg)

    def _retire_later(self, reg: _Registration) -> concurrent.futures.Future:
        """Retires ``reg`` (already out of self._regs) on a retiring thread; inline once they have
        been shut down (close())."""
        try:
            return self._retirer.submit(self._retire, reg)
        except RuntimeError:  # shut down: the data path is closing
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._retire(reg)
            done.set_result(None)
            return done

    def _retire(self, reg: _Registration) -> None:
        """Refuses new copies of ``reg`` (out of self._regs already), waits for those in flight (up to
        retire_timeout_s), then closes its IPC mappings; keeps them if a copy still runs."""
        with self._lock:
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

    def _copier(self, ordinal: int, deadline: float | None = None) -> DeviceCopier:
        """GPU ``ordinal``'s copier. The first registration on a GPU has it built (a kernel compile,
        streams and buffers, a self-test: up to seconds) on a thread of its own, outside self._lock,
        so that no other call waits on the lock meanwhile; it and any registration arriving meanwhile
        wait for the build by their deadline (DeadlineExceeded; the build goes on and is published
        for the next one). A failed build is every waiter's error; the next registration tries again."""
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the GPU data path is shutting down")
            copier = self._copiers.get(ordinal)
            if copier is not None:
                return copier
            building = self._building.get(ordinal)
            if building is None:
                building = self._building[ordinal] = concurrent.futures.Future()
                threading.Thread(
                    target=self._build_copier,
                    args=(ordinal, building),
                    name=f"pegaflow-gpu{ordinal}-copier-build",
                    daemon=True,
                ).start()
        try:
            return building.result(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(
                f"GPU {ordinal}'s copier (built at its first registration) was not ready by the deadline"
            ) from None

    def _build_copier(self, ordinal: int, building: concurrent.futures.Future) -> None:
        """Builds GPU ``ordinal``'s copier, publishes it under self._lock, then resolves ``building``."""
        o = self.options
        try:
            copier = DeviceCopier(
                ordinal,
                self._pinned.device_addr,
                self._pinned.size,
                kernel_config=o.kernel,
                slot_bytes=o.slot_bytes,
                slots=o.slots,
                max_piece_bytes=o.max_piece_bytes,
                staged_min_run_bytes=o.staged_min_run_bytes,
                driver_calls=o.driver_calls,
            )
        except BaseException as exc:
            log.exception("gpu: building GPU %d's copier failed", ordinal)
            with self._lock:
                del self._building[ordinal]
            building.set_exception(exc)
            return
        with self._lock:
            del self._building[ordinal]
            closed = self._closed
            if not closed:
                self._copiers[ordinal] = copier
        if closed:  # close() ran meanwhile and did not see it
            copier.close()
            building.set_exception(FailedPrecondition("the GPU data path is shutting down"))
            return
        building.set_result(copier)

    # -------------------------------------------------------------- data path

    def save(
        self, session_id: str, reg_id: str, hashes: Sequence[bytes], block_ids: Sequence[int], deadline: float
    ) -> SaveOutcome:
        """Stores GPU blocks ``block_ids`` under ``hashes``; returns once they are sealed (visible).

        All on the calling thread, no hand-offs (each would be a thread wake-up, 0.2-0.3 ms on the
        H200 host): the request is cut into chunks that ramp up and back down
        (``copy_plan.pipeline_chunks``); each chunk is allocated and its copy enqueued while the
        GPU still moves the previous one, then the chunks are waited for in order and each is
        sealed while the later ones still copy, so only the last, small seal is left after the last
        byte arrives. A chunk whose copy completed after ``deadline`` is aborted, never sealed
        (the caller may already reuse its GPU blocks); so is every chunk after an error, once its
        copy no longer runs.
        """
        t0 = time.perf_counter()
        reg = self._get(session_id, reg_id)
        _check_ids(hashes, block_ids, reg.layout)
        engine, copier = self._engine, self._copiers[reg.ordinal]
        trace = _Trace(t0) if timing_log.isEnabledFor(logging.DEBUG) else None
        statuses: list[AllocStatus] = []
        inflight: collections.deque = collections.deque()  # (alloc, copy), in chain order
        written, mode = 0, ""
        chunks = self._chunks(len(hashes), reg.layout.block_bytes)
        if trace is not None:
            trace.mark("planned")
        try:
            for lo, hi in chunks:
                # whole_write: each granted block is overwritten whole by this chunk's copy (the
                # registration's segments tile the block, checked below) or aborted, never sealed
                # half-written; so slots another model's blocks last held skip their memset (~13 ms for
                # 127 MLA blocks of 1.07 MiB on the H100 host, on this thread, before the copy starts).
                alloc = engine.allocate_blocks(
                    self._session, reg.instance_id, hashes[lo:hi], deadline, whole_write=True
                )
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
                    t_launch = time.perf_counter()
                    copy = copier.start(
                        reg.id,
                        True,
                        granted,
                        alloc.offsets,
                        self.options.copy_mode,
                        deadline,
                        trace is not None,
                    )
                except BaseException:
                    engine.abort_blocks(self._session, alloc.save_id)
                    raise
                inflight.append((alloc, copy))
                if trace is not None:
                    trace.chunk(hi - lo, t_launch)
            while inflight:
                alloc, copy = inflight[0]
                result = self._wait(copy, deadline, "its blocks will not be sealed")
                if time.monotonic() > deadline:
                    raise DeadlineExceeded("the copy completed after the caller's deadline; not sealed")
                inflight.popleft()
                try:
                    engine.seal_blocks(self._session, alloc.save_id)
                except BaseException:
                    self._abort(alloc)
                    raise
                written += len(alloc.offsets)
                mode = mode or result.mode
                if trace is not None:
                    trace.done(result)
        except (CopyCancelled, CopyFailed) as exc:
            self._abort_all(inflight)
            _raise_copy_error(exc)
        except BaseException:
            self._abort_all(inflight)
            raise
        if trace is not None:
            timing_log.debug("gpu-op %s", trace.report("save", len(hashes), written))
        if len(chunks) > 1 and written:
            # Each chunk's seal left that chunk head-first, but a later chunk (the chain's tail)
            # after an earlier one: restate the whole chain, off the caller's critical path.
            self._housekeeping.submit(self._refresh, reg.instance_id, hashes)
        return SaveOutcome(statuses, written, mode or "none")

    def _wait(self, copy: Copy | None, deadline: float, what: str) -> CopyResult:
        """Waits for a chunk's copy (None: an empty one); DeadlineExceeded if it runs past ``deadline``."""
        if copy is None:
            return CopyResult(0, "none", 0.0, 0.0, 0.0)
        if not copy.wait(deadline):
            raise DeadlineExceeded(f"the copy did not finish before the deadline; {what}")
        return copy.finish()

    def _abort(self, alloc) -> None:
        try:
            self._engine.abort_blocks(self._session, alloc.save_id)
        except Exception:
            log.exception("gpu: aborting save %s failed", alloc.save_id)

    def _abort_all(self, inflight) -> None:
        """Aborts the chunks not sealed, each once its copy no longer writes into its pool slots."""
        for alloc, copy in inflight:
            if copy is None:
                self._abort(alloc)
            else:
                copy.abandon(_after(self._abort, alloc))
        inflight.clear()

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

        Chunked like ``save``, on the calling thread: each chunk is looked up (leased) and its copy
        enqueued while the GPU moves the previous one; the lookup stops at the first miss. While
        the copies run, the chunks' lookups are accounted as one query of ``hashes`` (``purpose``,
        QueryPurpose); then each chunk's lease is released once its copy has landed. A chunk that
        cannot land before the deadline is not started (the caller recomputes after its deadline).
        """
        t0 = time.perf_counter()
        reg = self._get(session_id, reg_id)
        _check_ids(hashes, block_ids, reg.layout)
        engine, copier = self._engine, self._copiers[reg.ordinal]
        bb = reg.layout.block_bytes
        trace = _Trace(t0) if timing_log.isEnabledFor(logging.DEBUG) else None
        inflight: collections.deque = collections.deque()  # (lease_id, bytes, copy)
        hits = chunks = 0
        mode = ""
        if trace is not None:
            trace.mark("planned")
        try:
            for lo, hi in self._chunks(len(hashes), bb):
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
                n = hit.num_hits
                if not n:
                    if hit.lease_id:  # blocks still being promoted are leased too
                        self._release(hit.lease_id, 0)
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
                    t_launch = time.perf_counter()
                    copy = copier.start(
                        reg.id,
                        False,
                        list(block_ids[lo : lo + n]),
                        hit.offsets,
                        self.options.copy_mode,
                        start_by,
                        trace is not None,
                    )
                except BaseException:
                    self._release(hit.lease_id, 0)
                    raise
                inflight.append((hit.lease_id, n * bb, copy))
                if trace is not None:
                    trace.chunk(n, t_launch)
                hits += n
                if n < hi - lo:
                    break
            # While the GPU works: the chunks' lookups, accounted as one query of the whole request.
            self._account_load(reg.instance_id, hashes, hits, purpose, chunks)
            while inflight:
                lease_id, nbytes, copy = inflight[0]
                result = self._wait(copy, deadline, "the blocks are not loaded")
                inflight.popleft()
                self._release(lease_id, nbytes)
                mode = mode or result.mode
                if trace is not None:
                    trace.done(result)
        except (CopyCancelled, CopyFailed) as exc:
            self._release_all(inflight)
            _raise_copy_error(exc)
        except BaseException:
            self._release_all(inflight)
            raise
        if trace is not None:
            timing_log.debug("gpu-op %s", trace.report("load", len(hashes), hits))
        return LoadOutcome(hits, mode or "none")

    def _release_all(self, inflight) -> None:
        """Releases the leases of chunks not waited for, each once its copy no longer reads its blocks."""
        for lease_id, _, copy in inflight:
            copy.abandon(_after(self._release, lease_id, 0))
        inflight.clear()

    def _account_load(
        self, instance_id: str, hashes: Sequence[bytes], hits: int, purpose: QueryPurpose, chunks: int
    ) -> None:
        """The chunks' queries as one (hits and misses of the whole request, if it is a LOOKUP); after
        several chunks, the hits restated so that the head of the prefix ends the most recent."""
        try:
            self._engine.account_query(self._session, instance_id, hashes, hits, purpose)
            if chunks > 1 and hits:
                self._refresh(instance_id, hashes[:hits])
        except Exception:
            log.exception("gpu: accounting a load of %d blocks failed", len(hashes))

    def _chunks(self, n: int, block_bytes: int) -> list[tuple[int, int]]:
        o = self.options
        return pipeline_chunks(n, block_bytes, o.first_chunk_bytes, o.last_chunk_bytes)

    def _refresh(self, instance_id: str, hashes: Sequence[bytes]) -> None:
        """Restates the chain tail first, in segments: the engine lock is given up between them, so a
        request arriving meanwhile (the caller's own confirming query) waits for one segment, not
        for the whole chain (~0.5 ms for 256 blocks)."""
        try:
            for hi in range(len(hashes), 0, -_REFRESH_SEGMENT):
                self._engine.refresh_chain(
                    self._session, instance_id, hashes[max(hi - _REFRESH_SEGMENT, 0) : hi]
                )
        except Exception:
            log.exception("gpu: restating a chain of %d blocks failed", len(hashes))

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
            self._regs.clear()
        for reg in regs:
            self._retire_later(reg)
        self._retirer.shutdown(wait=True)  # these, and those of sessions ended before
        for copier in self._copiers.values():
            copier.close()
        self._copiers.clear()
        self._housekeeping.shutdown(wait=True)
        self._pinned.close()
        try:
            self._engine.close_session(self._session)
        except Exception:  # the engine may already be closed
            log.debug("gpu: closing the data path's session failed", exc_info=True)


def _after(cleanup, *args):
    """A clean-up for Copy.abandon: runs whatever the copy's outcome (its error is logged there)."""

    def run(error) -> None:
        cleanup(*args)

    return run


class _Trace:
    """Per-request timings for the timing log (DEBUG): one JSON line per save or load, with each
    chunk's blocks, when its engine work and launch ended, its launch and queueing CPU time, its GPU
    time (events) and when its completion was seen, in ms from the call's start."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.chunks: list[dict] = []
        self.marks: dict[str, float] = {}
        self._done = 0

    def mark(self, name: str) -> None:
        self.marks[name] = self._ms(time.perf_counter())

    def _ms(self, t: float) -> float:
        return round((t - self.t0) * 1e3, 3)

    def chunk(self, blocks: int, t_launch: float) -> None:
        self.chunks.append(
            dict(blocks=blocks, engine_done=self._ms(t_launch), launched=self._ms(time.perf_counter()))
        )

    def done(self, result: CopyResult) -> None:
        if self._done < len(self.chunks):
            c = self.chunks[self._done]
            c.update(
                mode=result.mode,
                launch_ms=round(result.launch_s * 1e3, 3),
                lock_ms=round(result.queued_s * 1e3, 3),
                gpu_ms=None if result.gpu_s is None else round(result.gpu_s * 1e3, 3),
                seen=self._ms(time.perf_counter()),
            )
            if result.marks:
                c["steps"] = dict(result.marks)  # ms from the copier's start() call
        self._done += 1

    def report(self, op: str, blocks: int, moved: int) -> str:
        end = time.perf_counter()
        # t0 / t1: perf_counter (CLOCK_MONOTONIC, one clock for every process of the host), so a caller
        # can tell its own time before and after the call apart from the server's.
        return json.dumps(
            dict(
                op=op,
                blocks=blocks,
                moved=moved,
                total_ms=self._ms(end),
                t0=self.t0,
                t1=end,
                marks=self.marks,
                chunks=self.chunks,
            )
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
