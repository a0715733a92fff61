"""Every wait a GPU call makes is bounded by its deadline (CPU: stand-ins for the GPU, the copier, IPC).

The rule (common/deadlines.py): no handler waits past its call's deadline on anything. Here the
waits reachable from SaveFromDevice / LoadToDevice (gRPC and doorbell), UnregisterDeviceMemory,
RegisterDeviceMemory and CloseSession, each with a stand-in that never ends (a hung GPU, a copy
still running, a copier still compiling), and what stays safe after a call gives up.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.config import ServerConfig
from pegaflow.server.engine import KVEngine
from pegaflow.server.errors import DeadlineExceeded, NotFound
from pegaflow.server.gpu import cuda_runtime, device_copier, service
from pegaflow.server.gpu import rpc as gpu_rpc
from pegaflow.server.gpu.copy_plan import Segment
from pegaflow.server.gpu.device_copier import Copy, CopyCancelled, CopyFailed, CopyResult, DeviceCopier
from pegaflow.server.gpu.ipc import IpcError
from pegaflow.server.gpu.registration import DeviceRegistration, ExportedTensor, layout_of
from pegaflow.server.store.namespace import KvLayout

BLOCK = 64
REG = DeviceRegistration(  # on GPU 0 (FakeIpc: the UUID's last digit, even)
    device_uuid="00112233445566778899aabbccddeefe",
    tensors=(ExportedTensor(b"h" * 64, 0, BLOCK * 100),),
    segments=(Segment(0, 0, BLOCK, BLOCK),),
    num_blocks=100,
)


def _in_thread(fn, *args, **kwargs):
    """Runs ``fn`` on a thread; returns (thread, box): box["value"] / box["error"] once it ended, and
    box["s"], the seconds it took."""
    box: dict = {}

    def run():
        start = time.monotonic()
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["s"] = time.monotonic() - start

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


# ------------------------------------------------------------------ 1. waiting for a copy


class FakeClock:
    """time.monotonic and time.sleep for wait_until: sleeping advances the clock (plus ``cost`` per
    call, what a query and a sleep(0) take), nothing really waits."""

    def __init__(self, cost: float = 1e-6):
        self.now = 1000.0
        self.cost = cost
        self.sleeps: list[tuple[float, float]] = []  # (when, how long)

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.sleeps.append((self.now, s))
        self.now += s + self.cost


def test_wait_until_gives_up_exactly_at_its_deadline_asking_once_more_there():
    fc = FakeClock()
    asked: list[float] = []

    def done():
        asked.append(fc.now)
        return False

    deadline = fc.now + 0.5
    assert not device_copier.wait_until(done, deadline, fc.clock, fc.sleep)
    assert asked[-1] >= deadline  # the last query is at (or just past) the deadline, not before
    assert fc.now <= deadline + 2 * fc.cost  # and no sleep ran past it
    for when, s in fc.sleeps:
        assert when + s <= deadline + 1e-12


def test_wait_until_spins_first_then_sleeps_longer_pauses_up_to_a_cap():
    fc = FakeClock()
    start = fc.now
    assert not device_copier.wait_until(lambda: False, start + 1.0, fc.clock, fc.sleep)
    spin = [s for when, s in fc.sleeps if when - start < device_copier._SPIN_S]
    after = [s for when, s in fc.sleeps if when - start >= device_copier._SPIN_S]
    after = after[:-1]  # the last one: to the deadline
    assert spin and set(spin) == {0.0}  # yields the GIL, sleeps not
    assert device_copier._POLL_S <= after[0] <= 2 * device_copier._POLL_S
    assert after == sorted(after)  # growing with the time waited
    assert max(after) == device_copier._MAX_POLL_S
    # 1 s of waiting costs a bounded number of queries: the spin's, then ~1 per ms.
    assert len(after) < 1.2 / device_copier._MAX_POLL_S + 100


def test_wait_until_returns_as_soon_as_done():
    fc = FakeClock()
    answers = iter([False] * 5 + [True])
    assert device_copier.wait_until(lambda: next(answers), fc.now + 10, fc.clock, fc.sleep)
    assert len(fc.sleeps) == 5 and all(s == 0.0 for _, s in fc.sleeps)


class HungGpu:
    """A lane's ``calls`` and ``rt`` for copies: the event is done once ``finish`` is set (never, for a
    hung GPU); eventSynchronize blocks until then, as the driver's would."""

    def __init__(self):
        self.finish = threading.Event()
        self.synchronized = 0
        self.destroyed: list[int] = []
        self.error: Exception | None = None

    # calls
    def done(self, event) -> bool:
        if self.error is not None:
            raise self.error
        return self.finish.is_set()

    # rt
    def eventSynchronize(self, event) -> None:  # noqa: N802 - CuPy's name
        self.synchronized += 1
        self.finish.wait()

    def eventDestroy(self, event) -> None:  # noqa: N802
        self.destroyed.append(event)


class StandInCopier:
    def __init__(self):
        self.settled: list[str] = []

    def _copy_settled(self, key: str) -> None:
        self.settled.append(key)


def _copy(gpu: HungGpu) -> Copy:
    lane = type("Lane", (), {})()
    lane.calls, lane.rt, lane.copier = gpu, gpu, StandInCopier()
    now = time.perf_counter()
    return Copy(lane, "g-key", 4096, "direct", 7, None, now, now, now)


def test_a_hung_copy_is_given_up_at_the_deadline_however_far_it_is():
    """Before 2026-12-07 a wait more than 0.25 s from its deadline blocked in cudaEventSynchronize: a
    hung GPU held the call (here 0.6 s from its deadline) for good."""
    gpu = HungGpu()
    copy = _copy(gpu)
    try:
        t, box = _in_thread(copy.wait, time.monotonic() + 0.6)
        t.join(5)
        assert not t.is_alive(), "the wait outlived its deadline (blocked in the driver)"
        assert box.get("value") is False and 0.55 <= box["s"] < 1.5
        assert gpu.synchronized == 0
    finally:
        gpu.finish.set()
    assert copy.wait(time.monotonic() + 1)  # it ended later: the reaper's wait sees it
    assert copy.finish().nbytes == 4096 and gpu.destroyed == [7]


def test_a_copy_ending_within_the_wait_is_seen_at_once():
    gpu = HungGpu()
    copy = _copy(gpu)
    threading.Timer(0.05, gpu.finish.set).start()
    start = time.monotonic()
    assert copy.wait(time.monotonic() + 5)
    assert time.monotonic() - start < 1.0
    assert isinstance(copy.finish(), CopyResult)


def test_a_cuda_error_while_waiting_is_copy_failed():
    gpu = HungGpu()
    gpu.error = cuda_runtime.CudaCallFailed("cuEventQuery", 700)
    with pytest.raises(CopyFailed):
        _copy(gpu).wait(time.monotonic() + 5)


def test_only_the_reaper_without_a_deadline_blocks_in_the_driver():
    gpu = HungGpu()
    copy = _copy(gpu)
    threading.Timer(0.05, gpu.finish.set).start()
    assert copy.wait(None)
    assert gpu.synchronized == 1


class PinnedBuffer(bytearray):
    ptr = 0x1000  # what cupy's pinned memory names its address by


def _ring(gpu: HungGpu, slots: int = 2) -> device_copier._PinnedRing:
    ring = object.__new__(device_copier._PinnedRing)
    ring._rt = gpu
    ring._bufs = [PinnedBuffer(1 << 10) for _ in range(slots)]
    ring._sizes = [1 << 10] * slots
    ring._events = list(range(slots))
    ring._next = 0
    return ring


def test_a_full_upload_ring_gives_up_at_the_start_deadline_having_enqueued_nothing():
    """A lane's pinned upload buffers are reused once their upload ran: with the GPU hung that never
    happens, and the launch (holding the lane's lock) blocked in cudaEventSynchronize for good."""
    gpu = HungGpu()
    ring = _ring(gpu)
    try:
        t, box = _in_thread(ring.stage, gpu, [np.arange(4, dtype=np.uint64)], time.monotonic() + 0.3)
        t.join(5)
        assert not t.is_alive(), "staging outlived its deadline (blocked in the driver)"
        assert isinstance(box.get("error"), CopyCancelled) and box["s"] < 1.5
        assert ring._next == 0 and gpu.synchronized == 0  # nothing staged, the slot still next
    finally:
        gpu.finish.set()
    ring.stage(gpu, [np.arange(4, dtype=np.uint64)], time.monotonic() + 1)
    assert ring._next == 1


# ------------------------------------------------------------------ 3. the lane's launch lock


class LaneRuntime(HungGpu):
    def __init__(self):
        super().__init__()
        self.created = 0

    def setDevice(self, ordinal) -> None:  # noqa: N802
        pass

    def eventCreateWithFlags(self, flags) -> int:  # noqa: N802
        self.created += 1
        return 100 + self.created


class Stream:
    def __init__(self):
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _lane_and_copier(gpu: LaneRuntime):
    copier = object.__new__(DeviceCopier)
    copier.ordinal = 0
    copier.host_size = 1 << 20
    copier._lock = threading.Condition()
    copier._layouts = {"g-key": device_copier._Layout(layout_of(REG), 0, 1)}
    copier._pending = collections.Counter()
    copier._closed = False
    lane = object.__new__(device_copier._Lane)
    lane.copier, lane.to_host, lane.name = copier, True, "gpu0-save"
    lane.calls, lane.rt = gpu, gpu
    lane.lock = threading.Lock()
    lane.kernel_stream, lane.copy_stream = Stream(), Stream()
    lane.ks, lane.cs = 1, 2
    copier._lanes = {True: lane, False: lane}
    return lane, copier


def test_a_busy_lane_lock_fails_the_copy_at_its_start_deadline():
    """The lane's lock was taken without a timeout: a launch stuck under it held every later call."""
    gpu = LaneRuntime()
    lane, copier = _lane_and_copier(gpu)
    lane.lock.acquire()  # another request's launch, stuck
    try:
        t, box = _in_thread(copier.start, "g-key", True, [1, 2], [0, BLOCK], "direct", time.monotonic() + 0.3)
        t.join(5)
        assert not t.is_alive(), "the launch waited on the lane's lock past its deadline"
        assert isinstance(box.get("error"), CopyCancelled) and box["s"] < 1.5
        assert copier.pending("g-key") == 0  # counted back: a retire does not wait for it
        assert gpu.created == 0  # nothing was made, nothing enqueued
    finally:
        lane.lock.release()


def test_a_copy_given_up_before_anything_was_enqueued_leaves_the_lane_undrained(monkeypatch):
    """A full upload ring at the deadline: only events were recorded, so no drain (a drain of a hung
    GPU's streams never returns), the events are dropped and the lock is free again."""
    gpu = LaneRuntime()
    lane, copier = _lane_and_copier(gpu)

    def launch(*args, **kwargs):
        raise device_copier._NotEnqueued("the ring is full")

    monkeypatch.setattr(lane, "_launch", launch)
    with pytest.raises(CopyCancelled):
        copier.start("g-key", True, [1], [0], "direct", time.monotonic() + 1)
    assert lane.kernel_stream.synchronized == 0 and lane.copy_stream.synchronized == 0
    assert gpu.destroyed == [101] and not lane.lock.locked()
    assert copier.pending("g-key") == 0


# ------------------------------------------------------------------ the data path, with stand-ins


class FakePinned:
    def __init__(self, addr: int, size: int):
        self.device_addr, self.size, self.host_addr = addr, size, addr

    def close(self) -> None:
        pass


class FakeIpc:
    def __init__(self):
        self.refs: collections.Counter[bytes] = collections.Counter()
        self.closed: list[bytes] = []

    def device_ordinal(self, uuid: str) -> int:
        return int(uuid[-1], 16) % 2  # ...fe -> GPU 0, ...ff -> GPU 1

    def open(self, ordinal: int, handle: bytes, deadline: float | None = None) -> int:
        self.refs[handle] += 1
        return 1 << 40

    def close(self, handle: bytes) -> None:
        self.refs[handle] -= 1
        self.closed.append(handle)


class FakeCopy:
    """A copy that runs until ``ended`` is set; ``abandon`` hands it to a stand-in reaper that waits
    for it, then runs the clean-up, as DeviceCopier's reaper does."""

    def __init__(self, copier, key: str, nbytes: int):
        self.copier, self.key, self.nbytes = copier, key, nbytes
        self.ended = threading.Event()
        self.abandoned = False

    def wait(self, deadline: float | None) -> bool:
        return self.ended.wait(None if deadline is None else max(deadline - time.monotonic(), 0))

    def finish(self) -> CopyResult:
        self.copier.settle(self.key)
        return CopyResult(self.nbytes, "direct", 0.0, 0.0, 0.0)

    def abandon(self, then=None) -> None:
        self.abandoned = True

        def reap():
            self.ended.wait()
            self.copier.settle(self.key)
            if then is not None:
                then(None)

        threading.Thread(target=reap, daemon=True).start()


class FakeCopier:
    """DeviceCopier's surface for GpuDataPath. ``build_gate`` holds its construction (a compile);
    ``retire`` waits for the key's copies like the real one (``pending``)."""

    built: list[int] = []
    build_gate: threading.Event | None = None
    copies_end = True  # False: copies run until their test ends them

    def __init__(self, ordinal, host_addr, host_size, **kwargs):
        if FakeCopier.build_gate is not None:
            FakeCopier.build_gate.wait()
        FakeCopier.built.append(ordinal)
        self.ordinal = ordinal
        self.layouts: dict = {}
        self.cond = threading.Condition()
        self.pending: collections.Counter[str] = collections.Counter()
        self.copies: list[FakeCopy] = []
        self.closed = False

    def add_layout(self, key, layout, addrs) -> None:
        self.layouts[key] = layout

    def start(self, key, to_host, block_ids, host_offsets, mode="auto", start_by=None, trace=False):
        if key not in self.layouts:
            raise CopyCancelled(f"{key!r} was retired")
        if not block_ids:
            return None
        with self.cond:
            self.pending[key] += 1
        copy = FakeCopy(self, key, len(block_ids) * BLOCK)
        if FakeCopier.copies_end:
            copy.ended.set()
        self.copies.append(copy)
        return copy

    def settle(self, key: str) -> None:
        with self.cond:
            self.pending[key] -= 1
            self.cond.notify_all()

    def retire(self, key: str, timeout_s: float) -> bool:
        self.layouts.pop(key, None)
        with self.cond:
            return self.cond.wait_for(lambda: self.pending[key] <= 0, timeout_s)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def stack(monkeypatch):
    monkeypatch.setattr(service, "PinnedHostRegion", FakePinned)
    monkeypatch.setattr(service, "IpcMappings", FakeIpc)
    monkeypatch.setattr(service, "DeviceCopier", FakeCopier)
    monkeypatch.setattr(FakeCopier, "built", [])
    monkeypatch.setattr(FakeCopier, "build_gate", None)
    monkeypatch.setattr(FakeCopier, "copies_end", True)
    engine = KVEngine(ServerConfig(pool_size_bytes=16 << 20, http_addr=None, read_lane=False))
    gpu = service.GpuDataPath(engine, service.GpuOptions(retire_timeout_s=30.0))
    engine.add_session_listener(gpu.on_session_end)  # as server/runtime.py does
    try:
        yield engine, gpu
    finally:
        for copier in list(gpu._copiers.values()):
            for copy in copier.copies:
                copy.ended.set()
        if FakeCopier.build_gate is not None:
            FakeCopier.build_gate.set()
        gpu.close()
        engine.close()


def _worker(engine, gpu, reg: DeviceRegistration = REG, name: str = "worker"):
    session = engine.open_session(name).session_id
    inst = engine.register_instance(session, KvLayout(model_id="m", block_bytes=BLOCK)).instance_id
    return session, inst, gpu.register(session, inst, reg, time.monotonic() + 5)


def _hashes(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def _eventually(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ------------------------------------------------------------------ 1. after a copy timed out


def test_a_save_whose_copy_outlives_the_deadline_frees_its_slots_only_once_the_copy_ended(stack):
    """What a timed-out copy leaves (unchanged by the bounded wait, checked here): its chunk is not
    sealed, and its pool slots stay granted (WRITING, nobody else's) until the copy really ended;
    only then does the reaper abort them."""
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)
    FakeCopier.copies_end = False
    with pytest.raises(DeadlineExceeded):
        gpu.save(session, rid, _hashes("late", 4), [1, 2, 3, 4], time.monotonic() + 0.2)
    copier = gpu._copiers[0]
    assert [c.abandoned for c in copier.copies] == [True]
    time.sleep(0.1)
    assert engine.stats().writing_blocks == 4  # the GPU may still write them: held
    copier.copies[0].ended.set()
    _eventually(lambda: engine.stats().writing_blocks == 0)
    assert engine.query_prefix(session, inst, _hashes("late", 4)).num_hits == 0  # never sealed


def test_a_load_whose_copy_outlives_the_deadline_keeps_its_blocks_leased_until_it_ended(stack):
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)
    assert gpu.save(session, rid, _hashes("b", 3), [1, 2, 3], time.monotonic() + 5).written == 3
    FakeCopier.copies_end = False
    with pytest.raises(DeadlineExceeded):
        gpu.load(session, rid, _hashes("b", 3), [4, 5, 6], time.monotonic() + 0.2)
    time.sleep(0.1)
    assert engine.stats().pinned_blocks == 3  # the GPU may still read them: not evictable
    gpu._copiers[0].copies[-1].ended.set()
    _eventually(lambda: engine.stats().pinned_blocks == 0)


def test_a_launch_that_could_not_start_by_the_deadline_is_deadline_exceeded(stack, monkeypatch):
    """The lane's lock (or a full upload ring) not had by the deadline: CopyCancelled from the copier,
    DEADLINE_EXCEEDED to the caller, the granted slots aborted at once (nothing was enqueued)."""
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)

    def busy(*args, **kwargs):
        raise CopyCancelled("the gpu0-save lane's earlier launches held it past its deadline")

    monkeypatch.setattr(gpu._copiers[0], "start", busy)
    with pytest.raises(DeadlineExceeded) as err:
        gpu.save(session, rid, _hashes("busy", 2), [1, 2], time.monotonic() + 1)
    assert err.value.status == "DEADLINE_EXCEEDED"
    assert engine.stats().writing_blocks == 0


# ------------------------------------------------------------------ 2. a session's end


def test_close_session_answers_at_once_and_the_mappings_close_after_the_copies(stack):
    """CloseSession ran the retirement on its own thread: up to retire_timeout_s (30 s) per
    registration while a copy still ran, far past the call's deadline."""
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)
    FakeCopier.copies_end = False
    with pytest.raises(DeadlineExceeded):  # a save whose copy still runs on the worker's memory
        gpu.save(session, rid, _hashes("s", 2), [1, 2], time.monotonic() + 0.1)
    copier, ipc = gpu._copiers[0], gpu._ipc
    t, box = _in_thread(engine.close_session, session, time.monotonic() + 0.5)
    t.join(3)
    try:
        assert not t.is_alive(), "CloseSession waited for the registration's copies"
        assert "error" not in box and box["s"] < 0.5
        assert gpu.registrations() == 0
        with pytest.raises(NotFound):
            gpu.save(session, rid, [b"x"], [0], time.monotonic() + 1)
        assert ipc.closed == []  # a copy still uses the mapping: kept
    finally:
        copier.copies[0].ended.set()
    _eventually(lambda: ipc.closed == [REG.tensors[0].ipc_handle])
    assert rid not in copier.layouts


def test_unregister_waits_for_the_retirement_by_its_deadline_only(stack):
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)
    FakeCopier.copies_end = False
    with pytest.raises(DeadlineExceeded):
        gpu.save(session, rid, _hashes("u", 2), [1, 2], time.monotonic() + 0.1)
    copier, ipc = gpu._copiers[0], gpu._ipc
    req = pb.UnregisterDeviceMemoryRequest(session_id=session, registration_id=rid)
    t, box = _in_thread(gpu_rpc.handle_unregister, gpu, req, time.monotonic() + 0.3)
    t.join(3)
    try:
        assert not t.is_alive(), "UnregisterDeviceMemory waited past its deadline"
        assert isinstance(box.get("error"), DeadlineExceeded) and box["s"] < 1.5
        assert gpu.registrations() == 0 and ipc.closed == []
        with pytest.raises(NotFound):
            gpu.unregister(session, rid, time.monotonic() + 1)
    finally:
        copier.copies[0].ended.set()
    _eventually(lambda: ipc.closed == [REG.tensors[0].ipc_handle])
    # Without copies in flight it returns once the mappings are closed.
    _, _, rid2 = _worker(engine, gpu, name="second")
    before = len(ipc.closed)
    gpu.unregister(gpu._regs[rid2].session_id, rid2, time.monotonic() + 5)
    assert len(ipc.closed) == before + 1


def test_close_retires_what_session_ends_left_for_the_retiring_thread(stack):
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)
    FakeCopier.copies_end = False
    with pytest.raises(DeadlineExceeded):
        gpu.save(session, rid, _hashes("c", 1), [1], time.monotonic() + 0.1)
    engine.close_session(session)
    copier, ipc = gpu._copiers[0], gpu._ipc
    threading.Timer(0.2, copier.copies[0].ended.set).start()
    gpu.close()  # waits for the retirement, then closes the copiers
    assert ipc.closed == [REG.tensors[0].ipc_handle] and copier.closed


# ------------------------------------------------------------------ 4. the first registration on a GPU


def test_building_a_gpus_copier_holds_no_lock_and_its_waiters_give_up_at_their_deadline(stack):
    """The copier was built under GpuDataPath._lock: every call (each save and load looks its
    registration up under that lock) waited for a compile, without a deadline."""
    engine, gpu = stack
    session, inst, rid = _worker(engine, gpu)  # GPU 0: built at once
    FakeCopier.build_gate = threading.Event()
    reg1 = DeviceRegistration("00112233445566778899aabbccddeeff", REG.tensors, REG.segments, 100)
    other = engine.open_session("gpu1").session_id
    inst1 = engine.register_instance(other, KvLayout(model_id="m", block_bytes=BLOCK)).instance_id
    try:
        t, box = _in_thread(gpu.register, other, inst1, reg1, time.monotonic() + 0.3)
        time.sleep(0.05)
        # Meanwhile the data path answers without waiting for the build.
        q, qbox = _in_thread(gpu.save, session, rid, _hashes("meanwhile", 2), [1, 2], time.monotonic() + 2)
        q.join(1.5)
        assert not q.is_alive(), "a save on GPU 0 waited for GPU 1's copier to be built"
        assert qbox["value"].written == 2
        t.join(3)
        assert not t.is_alive(), "the registration waited for the build past its deadline"
        assert isinstance(box.get("error"), DeadlineExceeded) and box["s"] < 1.5
        assert gpu._ipc.refs[reg1.tensors[0].ipc_handle] == 1  # its own mapping closed again (shared)
        assert gpu.registrations() == 1
    finally:
        FakeCopier.build_gate.set()
    _eventually(lambda: 1 in gpu._copiers)
    rid1 = gpu.register(other, inst1, reg1, time.monotonic() + 1)  # the finished build, published
    assert FakeCopier.built == [0, 1] and gpu._regs[rid1].ordinal == 1


def test_a_failed_copier_build_fails_its_waiters_and_the_next_registration_tries_again(stack, monkeypatch):
    engine, gpu = stack
    calls = []

    def broken(*args, **kwargs):
        calls.append(args[0])
        raise cuda_runtime.CudaCallFailed("the self-test copy (wrong bytes)", -1)

    monkeypatch.setattr(service, "DeviceCopier", broken)
    session = engine.open_session("w").session_id
    inst = engine.register_instance(session, KvLayout(model_id="m", block_bytes=BLOCK)).instance_id
    with pytest.raises(cuda_runtime.CudaCallFailed):
        gpu.register(session, inst, REG, time.monotonic() + 2)
    assert gpu._ipc.refs[REG.tensors[0].ipc_handle] == 0 and gpu._building == {}
    monkeypatch.setattr(service, "DeviceCopier", FakeCopier)
    assert gpu.register(session, inst, REG, time.monotonic() + 2).startswith("g-")
    assert calls == [0]


# ------------------------------------------------------------------ 5. opening a worker's IPC handles


class SlowDriver:
    """cuda_runtime's cupy_module() and runtime() for IpcMappings: ``ipcOpenMemHandle`` of a handle
    blocks until ``release[handle]`` is set (a driver call that takes its time), or raises if
    ``fail`` names the handle."""

    IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1

    def __init__(self):
        self.release: collections.defaultdict[bytes, threading.Event] = collections.defaultdict(
            threading.Event
        )
        self.calls: list[bytes] = []
        self.fail: set[bytes] = set()

    class _Device:
        def __init__(self, ordinal):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    @property
    def cuda(self):
        return self

    Device = _Device

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(handle)
        self.release[handle].wait(10)
        if handle in self.fail:
            raise RuntimeError("cudaErrorInvalidResourceHandle")
        return 0x7000_0000 + handle[0] * 0x1000


@pytest.fixture
def slow_driver(monkeypatch):
    from pegaflow.server.gpu import ipc

    drv = SlowDriver()
    monkeypatch.setattr(ipc.cuda_runtime, "cupy_module", lambda: drv)
    monkeypatch.setattr(ipc.cuda_runtime, "runtime", lambda: drv)
    monkeypatch.setattr(ipc.cuda_runtime, "IPC_MEM_LAZY_ENABLE_PEER_ACCESS", 1, raising=False)
    return ipc.IpcMappings(), drv


def test_an_ipc_open_waits_for_no_other_handle_and_for_its_own_only_by_its_deadline(slow_driver):
    """Before, the table's lock was held through the driver call: every registration waited, with no
    deadline, for any other registration's cudaIpcOpenMemHandle."""
    mappings, drv = slow_driver
    x, y = b"x" * 64, b"y" * 64
    opener, first = _in_thread(mappings.open, 0, x, time.monotonic() + 10)
    _eventually(lambda: drv.calls == [x])  # x's driver call is in progress
    drv.release[y].set()
    start = time.monotonic()
    assert mappings.open(0, y, time.monotonic() + 10) == 0x7000_0000 + ord("y") * 0x1000  # not behind x
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        mappings.open(0, x, time.monotonic() + 0.3)  # the same handle: it waits, by its deadline
    assert 0.25 < time.monotonic() - start < 2.0
    drv.release[x].set()
    opener.join(5)
    assert first["value"] == 0x7000_0000 + ord("x") * 0x1000
    assert mappings.open(0, x, time.monotonic() + 1) == first["value"]  # shared: no second driver call
    assert drv.calls == [x, y]
    mappings.close(x)
    assert len(mappings) == 2  # x still has a reference (the caller that gave up took none)
    mappings.close(x)
    assert len(mappings) == 1


def test_a_failed_ipc_open_fails_its_waiters_and_the_next_open_tries_again(slow_driver):
    mappings, drv = slow_driver
    x = b"x" * 64
    drv.fail.add(x)
    opener, first = _in_thread(mappings.open, 0, x)
    _eventually(lambda: drv.calls == [x])
    waiter, second = _in_thread(mappings.open, 0, x, time.monotonic() + 10)
    time.sleep(0.05)
    drv.release[x].set()
    opener.join(5), waiter.join(5)
    assert isinstance(first["error"], IpcError) and isinstance(second["error"], IpcError)
    assert len(mappings) == 0
    drv.fail.clear()
    assert mappings.open(0, x) == 0x7000_0000 + ord("x") * 0x1000
    assert drv.calls == [x, x]
