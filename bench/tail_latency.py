"""The seed's figure 3: one client's query latency, idle and under background load, per server (run on a
GPU host; ``--dry-run-cpu`` runs the same code paths without a GPU).

What is timed, the same for every server: one client thread's query of 64 block hashes (all hits, a
lease taken; the lease released after each, untimed), 3000 per condition, p50 / p99 / p999 in
microseconds by the anchor harness's rule (``sorted[int(p * n)]``). Conditions:

* ``idle``: nothing else runs;
* ``loaded_proc``: equal offered load from another process: 4 savers each starting one 128-block
  save (2.25 MiB blocks, 288 MiB) every 100.7 ms (12 GB/s together, staggered) and 2 queriers each
  sending the same query + release 250 times a second, open loop (a thread that falls behind does
  not burst); the measurement starts 1 s after the load;
* ``loaded_threads``: the same load as threads of the measuring process (what the recorded anchor
  harness does: shared/reference/anchors/pegaflow_rpc_latency_paced.py).

Servers:

* ``ours``: pegaflow-server (``python -m pegaflow.server.main``, 24 GiB pool, GPU copy mode auto), the
  measuring client a PegaClient over the local RPC socket (``ours-local``) and one over gRPC
  (``ours-grpc``); saves are SaveFromDevice on the GPU doorbell from a real GPU registration;
* ``pegaflow``: PegaFlow 0.25.1 (its Rust server, its Python client), measured in the same run when
  ``--anchor-site`` names its install (a process of its own: both packages are named ``pegaflow``);
* ``asyncio``, ``uvloop``, ``zmq``: plain-Python baselines, as in the seed's figure: a minimal server
  holding the same index (hash -> slot, leases pinning slots, oldest-first eviction) that answers the
  same query over a Unix socket (an asyncio / uvloop stream server, or a ZMQ ROUTER socket on ipc://),
  and runs a save as ours does: the bookkeeping on its loop, the bytes moved GPU -> pinned host
  memory by the copy engine (CuPy) on a worker thread with the GIL released, then sealed on the loop.
  Their client spins 1 ms on its socket before sleeping, as our local RPC client does.

Usage: ``python bench/tail_latency.py [--out DIR] [--anchor-site DIR] [--systems ...]`` ->
DIR/tail_latency.json, DIR/tail_latency.png; ``--plot JSON`` redraws the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import json
import os
import pathlib
import pickle
import queue
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = pathlib.Path(__file__).resolve()
L, NB, BS, H, D = 36, 2048, 16, 8, 128  # Qwen3-8B-like per-layer KV, as the anchor harness
CH = BS * H * D * 2
BLOCK_BYTES = L * 2 * CH  # 2.25 MiB
NQ, SAVE_BLOCKS, N_SAVERS, N_QUERIERS = 64, 128, 4, 2
SAVE_INTERVAL_S = SAVE_BLOCKS * BLOCK_BYTES * N_SAVERS / 12e9  # 100.7 ms: 12 GB/s in all
QUERY_INTERVAL_S = 1 / 250
SETTLE_S = 1.0
SPIN_S = 0.001  # the baselines' client: as our local RPC client (client/local_rpc.py SPIN_S)
ALL_SYSTEMS = (
    "asyncio", "uvloop", "zmq", "ours", "ours-nolane", "ours-nospin", "ours-pywait", "ours-5ms",
    "ours-noinsights", "ours-noreserve", "ours-si", "ours-sketch-thread", "ours-released", "pegaflow",
)  # fmt: skip
# Variants of ours (run_ours): "ours-5ms" leaves CPython's 5 ms GIL switch interval (the GPU data path
# lowers it to 0.2 ms by default); "ours-noinsights" switches the lookup sketches (HLL ceiling and
# miss-ratio curve) and the savings off (what that background work costs the request threads);
# "ours-sketch-thread" runs the sketches on the server's metrics feeder thread as before 2026-12-04
# (--lookup-sketches thread) instead of their own process; "ours-noreserve" runs the server with
# --free-reserve 0 (saves evict for themselves, no evictions ahead on a thread of their own);
# "ours-nolane" runs it with --read-lane off: queries and releases served by the engine (over the local
# RPC socket) instead of the read lane's native thread (server/read_lane/), as before 2026-12-05;
# "ours-nospin": the measuring client waits for each answer in the kernel at once instead of polling
# for up to 1 ms first (client/read_lane.py SPIN_S): one release of its interpreter lock per query,
# not one per poll, which other threads of its process may take meanwhile; "ours-pywait": every client
# of the run (the measuring one and the load's) waits for its answers in Python, polling, as before
# 2026-12-06, instead of natively outside the interpreter lock (client/native/frame_wait.py);
# "ours-released": every client of the run lets go of the interpreter lock at once to wait for a
# query's answer, as before 2026-12-06's fifth session, instead of keeping it for the first
# QUERY_HOLD_LOCK_S (client/sync.py).
OURS_VARIANTS = {
    "ours-nolane": {"args": ["--read-lane", "off"]},
    "ours-nospin": {"client_spin_s": 0.0},
    "ours-pywait": {"python_wait": True},
    "ours-5ms": {"runtime": {"SWITCH_INTERVAL_S": 1.0}},  # never lowered: CPython's 5 ms stays
    "ours-noinsights": {"no_insights": True},
    "ours-noreserve": {"args": ["--free-reserve", "0"]},
    "ours-sketch-thread": {"args": ["--lookup-sketches", "thread"]},
    "ours-released": {"query_hold_lock_s": 0.0},
}


def pct(xs, p):
    """The anchor harness's percentile rule, in microseconds."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1e6, 1)


def summary(ts: list[float], **extra) -> dict:
    out = dict(
        p50_us=pct(ts, 0.5),
        p99_us=pct(ts, 0.99),
        p999_us=pct(ts, 0.999),
        max_us=pct(ts, 1.0),
        mean_us=round(sum(ts) / len(ts) * 1e6, 1) if ts else None,
        n=len(ts),
    )
    out.update(extra)
    return out


def new_hashes(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes * 2 for _ in range(n)]  # 32 bytes, as the anchor's


def pace(next_t: float, interval: float, stop: threading.Event) -> float:
    """Sleeps until the slot ``next_t``; returns the next slot (no burst after falling behind)."""
    now = time.monotonic()
    if next_t > now:
        stop.wait(next_t - now)
    return max(next_t + interval, time.monotonic() - interval)


def measure(query, n: int, max_s: float) -> dict:
    """The anchor's loop: ``query()`` returns (hits, release callable); only the query is timed."""
    ts, full, errors = [], 0, 0
    end = time.monotonic() + max_s
    for _ in range(n):
        t = time.perf_counter()
        try:
            hits, release = query()
        except Exception:  # noqa: BLE001 - counted; the latency of a failed call is kept too
            ts.append(time.perf_counter() - t)
            errors += 1
            continue
        ts.append(time.perf_counter() - t)
        full += hits == NQ
        release()
        if time.monotonic() > end:
            break
    return summary(ts, full_hits=full, errors=errors)


# ------------------------------------------------------------------ background load


class Load:
    """N_SAVERS saver and N_QUERIERS querier threads, each with its own client, paced open loop.

    ``make_saver(k)`` returns ``save(hashes) -> blocks written``; ``make_querier(k)`` returns
    ``query() -> (hits, release)``; both run on the thread that uses them."""

    def __init__(self, make_saver, make_querier, max_s: float):
        self.make_saver, self.make_querier, self.max_s = make_saver, make_querier, max_s
        self.stop_ev, self.go_ev = threading.Event(), threading.Event()
        n = N_SAVERS + N_QUERIERS
        self.ready = [threading.Event() for _ in range(n)]
        self.counts = [dict(ops=0, blocks=0, errors=0) for _ in range(n)]
        self.notes: list[str] = []
        self.threads = [threading.Thread(target=self._saver, args=(k,), daemon=True) for k in range(N_SAVERS)]
        self.threads += [
            threading.Thread(target=self._querier, args=(N_SAVERS + q, q), daemon=True)
            for q in range(N_QUERIERS)
        ]
        self.deadline = time.monotonic() + max_s + 120

    def start(self, timeout_s: float = 120) -> bool:
        for t in self.threads:
            t.start()
        end = time.monotonic() + timeout_s
        return all(ev.wait(max(end - time.monotonic(), 0)) for ev in self.ready)

    def go(self) -> None:
        self.deadline = time.monotonic() + self.max_s
        self.go_ev.set()

    def snapshot(self) -> dict:
        st = [dict(c) for c in self.counts]
        s, q = st[:N_SAVERS], st[N_SAVERS:]
        return dict(
            t=time.monotonic(),
            saves=sum(c["ops"] for c in s),
            blocks=sum(c["blocks"] for c in s),
            save_errors=sum(c["errors"] for c in s),
            queries=sum(c["ops"] for c in q),
            query_errors=sum(c["errors"] for c in q),
        )

    def stop(self) -> dict:
        self.stop_ev.set()
        self.go_ev.set()
        for t in self.threads:
            t.join(timeout=60)
        return dict(self.snapshot(), alive=sum(t.is_alive() for t in self.threads), notes=self.notes[:10])

    def _running(self) -> bool:
        return not self.stop_ev.is_set() and time.monotonic() < self.deadline

    def _setup(self, k, make):
        try:
            fn = make(k)
        except Exception as exc:  # noqa: BLE001 - recorded; the phase runs with fewer threads
            self.notes.append(f"thread {k} setup: {exc!r}"[:300])
            fn = None
        self.ready[k].set()
        self.go_ev.wait(timeout=max(self.deadline - time.monotonic(), 0))
        return fn if self.go_ev.is_set() and not self.stop_ev.is_set() else None

    def _saver(self, k: int) -> None:
        save = self._setup(k, self.make_saver)
        c = self.counts[k]
        nxt = time.monotonic() + k * SAVE_INTERVAL_S / N_SAVERS
        while save is not None and self._running():
            nxt = pace(nxt, SAVE_INTERVAL_S, self.stop_ev)
            if not self._running():
                break
            try:
                c["blocks"] += save(new_hashes(SAVE_BLOCKS))
                c["ops"] += 1
            except Exception as exc:  # noqa: BLE001
                c["errors"] += 1
                if len(self.notes) < 20:
                    self.notes.append(f"saver {k}: {exc!r}"[:300])

    def _querier(self, k: int, q: int) -> None:
        query = self._setup(k, self.make_querier)
        c = self.counts[k]
        nxt = time.monotonic() + q * QUERY_INTERVAL_S / N_QUERIERS
        while query is not None and self._running():
            nxt = pace(nxt, QUERY_INTERVAL_S, self.stop_ev)
            if not self._running():
                break
            try:
                hits, release = query()
                release()
                c["ops"] += 1
            except Exception as exc:  # noqa: BLE001
                c["errors"] += 1
                if len(self.notes) < 20:
                    self.notes.append(f"querier {q}: {exc!r}"[:300])


def window(s0: dict | None, s1: dict | None) -> dict | None:
    if not s0 or not s1:
        return None
    dt = s1["t"] - s0["t"]
    return dict(
        window_s=round(dt, 3),
        save_gbps=round((s1["blocks"] - s0["blocks"]) * BLOCK_BYTES / dt / 1e9, 2),
        queries_per_s=round((s1["queries"] - s0["queries"]) / dt),
        save_errors=s1["save_errors"] - s0["save_errors"],
        query_errors=s1["query_errors"] - s0["query_errors"],
    )


class LoadProcess:
    """The same Load in another process (``--load-worker SPEC``), driven over its stdin / stdout."""

    def __init__(self, spec: dict, log_path: pathlib.Path, env: dict | None = None):
        self._log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(
            [sys.executable, str(HERE), "--load-worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            bufsize=0,
            start_new_session=True,
            env=env,
            cwd="/" if env is not None else None,
        )

    def _ask(self, word: str, timeout_s: float = 60) -> dict | None:
        self.p.stdin.write(word.encode() + b"\n")
        self.p.stdin.flush()
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict | None:
        end = time.monotonic() + timeout_s
        buf = b""
        while time.monotonic() < end:
            r, _, _ = select.select([self.p.stdout], [], [], max(end - time.monotonic(), 0))
            if not r:
                return None
            chunk = os.read(self.p.stdout.fileno(), 1)
            if not chunk:
                return None
            buf += chunk
            if chunk == b"\n":
                if buf.startswith(b"{"):
                    return json.loads(buf)
                buf = b""
        return None

    def start(self, timeout_s: float = 180) -> bool:
        msg = self._read(timeout_s)
        return bool(msg and msg.get("ready"))

    def go(self) -> None:
        self._ask("go", 10)

    def snapshot(self) -> dict | None:
        snap = self._ask("snap")
        if snap is not None:
            snap["t"] = time.monotonic()
        return snap

    def stop(self) -> dict | None:
        try:
            return self._ask("stop", 90)
        finally:
            if self.p.poll() is None:
                try:
                    self.p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.p.pid, signal.SIGKILL)
                    self.p.wait()
            self._log.close()


def load_worker(spec: dict) -> None:
    """--load-worker: a Load for ``spec["system"]`` in this process; commands on stdin: go, snap, stop."""
    make_saver, make_querier, closers = load_factories(spec)
    load = Load(make_saver, make_querier, spec["max_s"])
    ok = load.start()
    print(json.dumps(dict(ready=ok, notes=load.notes)), flush=True)
    for line in sys.stdin:
        word = line.strip()
        if word == "go":
            load.go()
            print(json.dumps(dict(ok=True)), flush=True)
        elif word == "snap":
            print(json.dumps(load.snapshot()), flush=True)
        else:
            break
    print(json.dumps(load.stop()), flush=True)
    _close_all(closers)


def _close_all(closers) -> None:
    for close in closers:
        try:
            close()
        except Exception:  # noqa: BLE001 - the server may be gone already
            pass


def load_factories(spec: dict):
    """(make_saver, make_querier, objects to keep alive) for the system a spec names."""
    system = spec["system"]
    hashes = [bytes.fromhex(h) for h in spec["hashes"]]
    if system in ("asyncio", "uvloop", "zmq"):
        cls = ZmqClient if system == "zmq" else FrameClient

        def make_saver(k):
            c = cls(spec["address"])
            return c.save

        def make_querier(k):
            c = cls(spec["address"])
            return lambda: c.query(hashes)

        return make_saver, make_querier, []
    if system == "pegaflow":
        return pegaflow_factories(spec, hashes)
    return ours_factories(spec, hashes)


# ------------------------------------------------------------------ the baselines


class HostMover:
    """--dry-run-cpu: a token share of a save's bytes (at most 4 MiB) moved host -> host (numpy releases
    the GIL for the copy); the dry run checks code paths, not rates."""

    def __init__(self, pool_bytes: int):
        import numpy as np

        self.pool = np.zeros(pool_bytes, dtype=np.uint8)
        self.src = np.ones(4 << 20, dtype=np.uint8)

    def copy(self, offset: int, nbytes: int) -> None:
        n = min(nbytes, self.src.size)
        self.pool[offset : offset + n] = self.src[:n]


class GpuMover:
    """A save's bytes moved GPU -> pinned host memory by the copy engine, as ours: one cudaMemcpyAsync
    on a per-thread stream, waited for with the GIL released (CuPy)."""

    def __init__(self, pool_bytes: int):
        import cupy

        self.cupy = cupy
        self.src = cupy.ones(SAVE_BLOCKS * BLOCK_BYTES, dtype=cupy.uint8)
        self.pool = cupy.cuda.alloc_pinned_memory(pool_bytes)
        self._local = threading.local()

    def copy(self, offset: int, nbytes: int) -> None:
        cupy = self.cupy
        stream = getattr(self._local, "stream", None)
        if stream is None:
            cupy.cuda.Device(0).use()
            stream = self._local.stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.runtime.memcpyAsync(self.pool.ptr + offset, self.src.data.ptr, nbytes, 4, stream.ptr)
        stream.synchronize()


class BaselineStore:
    """The baselines' index: hash -> slot in LRU order, leases pinning slots, least recently used
    unpinned slots evicted for new ones. A save's bytes land in a ring over the pool (``ring``),
    apart from its slots' bookkeeping: the baseline moves the same bytes, its index stays simple."""

    def __init__(self, pool_bytes: int):
        self.pool_bytes = pool_bytes
        self.slots = pool_bytes // BLOCK_BYTES
        self.free = collections.deque(range(self.slots))
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.pins: collections.Counter[int] = collections.Counter()
        self.leases: dict[int, list[int]] = {}
        self.next_lease = 1
        self.cursor = 0

    def query(self, hashes: list[bytes], lease: bool) -> tuple[int, int, list[int]]:
        offsets = []
        for h in hashes:
            slot = self.index.get(h)
            if slot is None:
                break
            self.index.move_to_end(h)
            offsets.append(slot * BLOCK_BYTES)
        lease_id = 0
        if lease and offsets:
            lease_id, self.next_lease = self.next_lease, self.next_lease + 1
            held = [o // BLOCK_BYTES for o in offsets]
            self.leases[lease_id] = held
            for s in held:
                self.pins[s] += 1
        return len(offsets), lease_id, offsets

    def release(self, lease_id: int) -> None:
        for s in self.leases.pop(lease_id, ()):
            self.pins[s] -= 1
            if self.pins[s] <= 0:
                del self.pins[s]

    def allocate(self, n: int) -> tuple[list[int], int]:
        """``n`` slots (evicting the least recently used unpinned ones) and the ring offset the
        save's bytes go to."""
        skipped = []
        while len(self.free) < n and self.index:
            h, slot = self.index.popitem(last=False)
            if slot in self.pins:
                skipped.append((h, slot))
            else:
                self.free.append(slot)
        for h, slot in reversed(skipped):  # pinned: back to the cold end, in order
            self.index[h] = slot
            self.index.move_to_end(h, last=False)
        slots = [self.free.popleft() for _ in range(min(n, len(self.free)))]
        nbytes = n * BLOCK_BYTES
        if self.cursor + nbytes > self.pool_bytes:
            self.cursor = 0
        ring, self.cursor = self.cursor, self.cursor + nbytes
        return slots, ring

    def seal(self, hashes: list[bytes], slots: list[int]) -> None:
        for h, slot in zip(hashes, slots, strict=False):
            self.index[h] = slot


# Frames of the baselines (little-endian): u32 length | u8 op | body.
OP_QUERY, OP_RELEASE, OP_SAVE = 1, 2, 3
_HASH = 32


def _hashes_of(body: bytes, at: int) -> list[bytes]:
    return [body[i : i + _HASH] for i in range(at, len(body), _HASH)]


def _answer_query(store: BaselineStore, body: bytes) -> bytes:
    hits, lease_id, offsets = store.query(_hashes_of(body, 2), body[1] == 1)
    return struct.pack(f"<IQ{len(offsets)}Q", hits, lease_id, *offsets)


def serve_asyncio(path: str, pool_bytes: int, use_uvloop: bool, gpu: bool) -> None:
    store = BaselineStore(pool_bytes)
    mover = GpuMover(pool_bytes) if gpu else HostMover(pool_bytes)
    pool = concurrent.futures.ThreadPoolExecutor(N_SAVERS)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                head = await reader.readexactly(4)
                body = await reader.readexactly(struct.unpack("<I", head)[0])
                op = body[0]
                if op == OP_QUERY:
                    out = _answer_query(store, body)
                elif op == OP_RELEASE:
                    store.release(struct.unpack_from("<Q", body, 1)[0])
                    out = b"\x01"
                else:
                    hashes = _hashes_of(body, 1)
                    slots, ring = store.allocate(len(hashes))
                    await loop.run_in_executor(pool, mover.copy, ring, len(hashes) * BLOCK_BYTES)
                    store.seal(hashes, slots)
                    out = struct.pack("<I", len(slots))
                writer.write(struct.pack("<I", len(out)) + out)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(handle, path=path)
        print(json.dumps(dict(ready=True, address=path)), flush=True)
        async with server:
            await server.serve_forever()

    if use_uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def serve_zmq(address: str, pool_bytes: int, gpu: bool) -> None:
    import zmq

    store = BaselineStore(pool_bytes)
    mover = GpuMover(pool_bytes) if gpu else HostMover(pool_bytes)
    pool = concurrent.futures.ThreadPoolExecutor(N_SAVERS)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    done: queue.SimpleQueue = queue.SimpleQueue()
    wake_r, wake_w = os.pipe()
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    print(json.dumps(dict(ready=True, address=address)), flush=True)

    def finished(ident, hashes, slots, fut) -> None:
        done.put((ident, hashes, slots))
        os.write(wake_w, b"x")

    while True:
        events = dict(poller.poll())
        if wake_r in events:
            os.read(wake_r, 4096)
            while True:
                try:
                    ident, hashes, slots = done.get_nowait()
                except queue.Empty:
                    break
                store.seal(hashes, slots)
                router.send_multipart([ident, b"", struct.pack("<I", len(slots))])
        if router in events:
            while True:
                try:
                    ident, _, body = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                op = body[0]
                if op == OP_QUERY:
                    router.send_multipart([ident, b"", _answer_query(store, body)])
                elif op == OP_RELEASE:
                    store.release(struct.unpack_from("<Q", body, 1)[0])
                    router.send_multipart([ident, b"", b"\x01"])
                else:
                    hashes = _hashes_of(body, 1)
                    slots, ring = store.allocate(len(hashes))
                    fut = pool.submit(mover.copy, ring, len(hashes) * BLOCK_BYTES)
                    fut.add_done_callback(lambda f, i=ident, h=hashes, s=slots: finished(i, h, s, f))


def _spin_recv_ready(sock, spin_s: float) -> None:
    """Spin (yielding the CPU) until ``sock`` is readable or ``spin_s`` passed, as our local client."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    end = time.perf_counter() + spin_s
    while not poller.poll(0) and time.perf_counter() < end:
        os.sched_yield()


class FrameClient:
    """A baseline's client over its Unix socket (asyncio / uvloop servers)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)

    def _call(self, body: bytes) -> bytes:
        self.sock.sendall(struct.pack("<I", len(body)) + body)
        _spin_recv_ready(self.sock, SPIN_S)
        head = self._exact(4)
        return self._exact(struct.unpack("<I", head)[0])

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("baseline server closed the connection")
            buf += chunk
        return buf

    def query(self, hashes: list[bytes]):
        out = self._call(bytes((OP_QUERY, 1)) + b"".join(hashes))
        hits, lease_id = struct.unpack_from("<IQ", out)
        return hits, (lambda: self._call(bytes((OP_RELEASE,)) + struct.pack("<Q", lease_id)))

    def save(self, hashes: list[bytes]) -> int:
        return struct.unpack("<I", self._call(bytes((OP_SAVE,)) + b"".join(hashes)))[0]


class ZmqClient(FrameClient):
    """A baseline's client over ZMQ (REQ socket on ipc://)."""

    def __init__(self, address: str):
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.req = self.ctx.socket(zmq.REQ)
        self.req.connect(address)

    def _call(self, body: bytes) -> bytes:
        self.req.send(body)
        end = time.perf_counter() + SPIN_S
        while not self.req.poll(0) and time.perf_counter() < end:
            os.sched_yield()
        return self.req.recv()


def baseline_main(kind: str, address: str, pool_bytes: int, gpu: bool) -> None:
    if kind == "zmq":
        serve_zmq(address, pool_bytes, gpu)
    else:
        serve_asyncio(address, pool_bytes, kind == "uvloop", gpu)


def run_baseline(kind: str, args, out: pathlib.Path) -> dict:
    tmp = tempfile.mkdtemp(prefix="tail-")
    address = f"ipc://{tmp}/zmq.sock" if kind == "zmq" else f"{tmp}/{kind}.sock"
    log = open(out / f"tail_{kind}_server.log", "w")  # noqa: SIM115 - the server's output
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE),
            "--baseline-server",
            kind,
            address,
            str(args.baseline_pool_bytes),
            "0" if args.dry_run_cpu else "1",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
    )
    res: dict = dict(server=f"plain Python {kind}", address=address)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{kind} baseline server exited (rc {proc.wait()})")
        cls = ZmqClient if kind == "zmq" else FrameClient
        client = cls(address)
        hashes = new_hashes(NQ)
        if client.save(hashes) != NQ:
            raise RuntimeError("the initial save did not store 64 blocks")
        spec = dict(
            system=kind, address=address, hashes=[h.hex() for h in hashes], max_s=args.phase_max_s + 30
        )
        res.update(phases(args, lambda: client.query(hashes), spec, out, placements=("proc",)))
    except Exception as exc:  # noqa: BLE001 - recorded; the next server still runs
        res["error"] = repr(exc)[:500]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    return res


def phases(args, query, spec: dict, out: pathlib.Path, placements, env=None, in_process=None) -> dict:
    """idle, then loaded with the load in another process ("proc") and/or in threads of this one."""
    res = {"idle": measure(query, args.iters, args.phase_max_s)}
    print(spec["system"], "idle", res["idle"], flush=True)
    for placement in placements:
        closers: list = []
        if placement == "threads":
            make_saver, make_querier, closers = in_process()
            load = Load(make_saver, make_querier, spec["max_s"])
            ready = load.start()
        else:
            load = LoadProcess(spec, out / f"tail_{spec['system']}_load.log", env)
            ready = load.start()
        tag = f"loaded_{placement}"
        try:
            if not ready:
                res[tag] = dict(error="the background load did not get ready")
                continue
            load.go()
            time.sleep(SETTLE_S)
            s0 = load.snapshot()
            res[tag] = measure(query, args.iters, args.phase_max_s)
            s1 = load.snapshot()
            res[tag]["load_during_measurement"] = window(s0, s1)
        finally:
            final = load.stop()
            _close_all(closers)
        res[tag]["load_final"] = final
        print(spec["system"], tag, res[tag], flush=True)
    return res


# ------------------------------------------------------------------ ours


def configure_client_waits(system: str) -> str:
    """Sets how this process's pegaflow clients wait for answers in this system's run (the read
    lane's held-lock window; native or Python waits) and returns which wait is in use: natively
    (the client as shipped, once its module is proven) or in Python (the "ours-pywait" variant)."""
    from pegaflow.client import sync
    from pegaflow.client.native import frame_wait

    variant = OURS_VARIANTS.get(system, {})
    sync.QUERY_HOLD_LOCK_S = variant.get("query_hold_lock_s", sync.QUERY_HOLD_LOCK_S)
    if variant.get("python_wait"):
        frame_wait.use(False)
        return "python"
    return "native" if frame_wait.use(True) else f"python ({frame_wait.EXTENSION.probe()})"


def ours_factories(spec: dict, hashes: list[bytes]):
    from pegaflow.client import PegaClient

    configure_client_waits(spec["system"])

    layout = _ours_layout(spec["layout_tag"])
    registration = pickle.loads(base64.b64decode(spec["registration"])) if spec.get("registration") else None

    closers: list = []

    def client(name):
        c = PegaClient(spec["addr"], timeout_s=30.0, name=name)
        c.connect()
        closers.append(c.close)
        return c, c.register_instance(layout)

    def make_saver(k):
        c, inst = client(f"tail-saver{k}")
        ids = list(range(NQ + SAVE_BLOCKS * k, NQ + SAVE_BLOCKS * (k + 1)))
        if registration is None:  # --dry-run-cpu: allocate + seal, no bytes

            def save(hs):
                batch = c.allocate(inst, hs)
                if batch.save_id:
                    c.seal(batch.save_id)
                return len(batch.granted)

            return save
        dev = c.register_device_memory(inst, registration)
        return lambda hs: c.save_from_device(dev, hs, ids).written

    def make_querier(k):
        c, inst = client(f"tail-querier{k}")
        return lambda: _ours_query(c, inst, hashes)

    return make_saver, make_querier, closers


def _ours_layout(tag: str):
    from pegaflow.client import KvLayout

    return KvLayout(
        model_id="qwen3-8b-tail",
        block_bytes=BLOCK_BYTES,
        dtype="bfloat16",
        layout=tag,
        block_tokens=BS,
        num_layers=L,
        tp_size=1,
        tp_rank=0,
    )


def _ours_query(c, inst, hashes):
    q = c.query_prefix(inst, hashes, lease=True)
    lease = q.lease_id
    return q.num_hits, (lambda: c.release(lease) if lease else None)


def run_ours(args, out: pathlib.Path, system: str = "ours", switch_interval: float = 0.0) -> dict:
    from pegaflow.client import PegaClient

    # The server under test is `python -m pegaflow.server.main`; a variant changes one thing first:
    # the GIL switch interval (0: what the server sets itself), the GPU data path's options, or the
    # metrics feeder's lookup insights (miss-ratio curve, savings) switched off, to measure their cost.
    boot = (
        "import functools, json, sys\n"
        "interval, v = float(sys.argv[1]), json.loads(sys.argv[2]); del sys.argv[1:3]\n"
        "from pegaflow.server import runtime\n"
        "for name, value in v.get('runtime', {}).items(): setattr(runtime, name, value)\n"
        "if v.get('gpu_options'):\n"
        "    from pegaflow.server.gpu import service\n"
        "    service.GpuOptions = functools.partial(service.GpuOptions, **v['gpu_options'])\n"
        "if v.get('no_insights'):\n"
        "    from pegaflow.server.metrics.lookup_insights import LookupInsights\n"
        "    from pegaflow.server.metrics.lookup_sketches import LookupSketches\n"
        "    from pegaflow.server.metrics.sketch_process import SketchProcess\n"
        "    LookupInsights.add_hits = lambda self, lookups: None\n"
        "    LookupSketches.add = SketchProcess.add = lambda self, records: None\n"
        "if interval > 0: sys.setswitchinterval(interval)\n"
        "from pegaflow.server.main import main; sys.exit(main(sys.argv[1:]))"
    )
    cmd = [
        sys.executable,
        "-c",
        boot,
        str(switch_interval),
        json.dumps(OURS_VARIANTS.get(system, {})),
        "--pool-size",
        "2gb" if args.dry_run_cpu else args.pool_size,
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--gpu-copy-mode",
        "off" if args.dry_run_cpu else "auto",
        *OURS_VARIANTS.get(system, {}).get("args", []),
    ]
    log = open(out / f"tail_{system}_server.log", "w")  # noqa: SIM115 - the server's stderr
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    res: dict = dict(server="pegaflow-server (Python)", switch_interval_s=switch_interval or None)
    tensors = None
    clients = []
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pegaflow-server exited (rc {proc.wait()})")
        addr = json.loads(line)["addr"]
        res["server_start_s"] = round(time.monotonic() - t0, 1)
        registration, tag = None, "cuda:bfloat16:36x2x16x8x128"
        if not args.dry_run_cpu:
            import torch

            from pegaflow.client.device import export_torch_kv
            from pegaflow.connector.gpu_worker import _layout_tag

            tensors = [torch.randn(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
            torch.cuda.synchronize()
            registration = export_torch_kv(tensors, [1] * L, NB)
            tag = _layout_tag(tensors, [1] * L)
        hashes = new_hashes(NQ)
        res["client_answer_wait"] = configure_client_waits(system)
        from pegaflow.client import sync as client_sync

        res["query_hold_lock_s"] = client_sync.QUERY_HOLD_LOCK_S
        local = PegaClient(addr, timeout_s=30.0, name="tail-local")
        local.connect()
        clients.append(local)
        spin = OURS_VARIANTS.get(system, {}).get("client_spin_s")
        if spin is not None and local._conn.lane is not None:
            local._conn.lane._link.spin_s = spin
        inst = local.register_instance(_ours_layout(tag))
        if registration is not None:
            dev = local.register_device_memory(inst, registration)
            written = local.save_from_device(dev, hashes, list(range(NQ))).written
        else:
            batch = local.allocate(inst, hashes)
            local.seal(batch.save_id)
            written = len(batch.granted)
        if written != NQ:
            raise RuntimeError(f"the initial save stored {written} of {NQ} blocks")
        grpc_c = PegaClient(addr, timeout_s=30.0, name="tail-grpc", local_rpc=False)
        grpc_c.connect()
        clients.append(grpc_c)
        inst_g = grpc_c.register_instance(_ours_layout(tag))
        spec = dict(
            system=system,
            addr=addr,
            layout_tag=tag,
            hashes=[h.hex() for h in hashes],
            registration=base64.b64encode(pickle.dumps(registration)).decode() if registration else "",
            max_s=args.phase_max_s + 30,
        )
        in_process = lambda: ours_factories(spec, hashes)  # noqa: E731 - fresh clients per phase
        res["local"] = phases(
            args,
            lambda: _ours_query(local, inst, hashes),
            spec,
            out,
            ("proc", "threads"),
            in_process=in_process,
        )
        res["grpc"] = phases(args, lambda: _ours_query(grpc_c, inst_g, hashes), spec, out, ("proc",))
        res["transports"] = dict(
            local=local.local_rpc_socket or "(gRPC)",
            grpc=grpc_c.local_rpc_socket or "(gRPC)",
            read_lane=local._conn.lane is not None,  # the "local" queries went to the read lane first
        )
    except Exception as exc:  # noqa: BLE001 - recorded
        res["error"] = repr(exc)[:500]
    finally:
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        del tensors
    return res


# ------------------------------------------------------------------ PegaFlow (its own process)


def pegaflow_factories(spec: dict, hashes: list[bytes]):
    sys.path.insert(0, spec["site"])
    from pegaflow.pegaflow import EngineRpcClient, QueryReady

    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    url, inst = spec["url"], spec["instance"]

    def make_saver(k):
        c = EngineRpcClient(url)
        ids = list(range(NQ + SAVE_BLOCKS * k, NQ + SAVE_BLOCKS * (k + 1)))

        def save(hs):
            ok, msg = c.save(inst, 0, 0, 0, [(n, ids, hs) for n in names])
            if not ok:
                raise RuntimeError(msg)
            return len(hs)

        return save

    def make_querier(k):
        c = EngineRpcClient(url)
        return lambda: _pf_query(c, QueryReady, inst, hashes)

    return make_saver, make_querier, []


def _pf_query(c, QueryReady, inst, hashes):  # noqa: N803 - PegaFlow's class
    q = c.query_prefetch(inst, hashes, uuid.uuid4().hex[:12])
    if isinstance(q, QueryReady) and q.num_hit_blocks:
        return q.num_hit_blocks, (lambda: c.release(q.lease))
    return 0, (lambda: None)


def pegaflow_worker(spec: dict) -> None:
    """--pegaflow-worker: PegaFlow's server, its tensors and the phases, in this process (its package on
    sys.path only); prints the result as one JSON line."""
    site = spec["site"]
    sys.path.insert(0, site)
    import torch

    from pegaflow._bin_utils import binary_env, find_binary
    from pegaflow.ipc_wrapper import CudaIPCWrapper
    from pegaflow.pegaflow import EngineRpcClient, QueryReady

    args = argparse.Namespace(**spec["args"])
    out = pathlib.Path(spec["out"])
    port = 50255
    srv = subprocess.Popen(
        [
            find_binary("pegaflow-server-py"),
            "--addr",
            f"127.0.0.1:{port}",
            "--pool-size",
            args.pool_size,
            "--http-addr",
            "127.0.0.1:9291",
            "--devices",
            "0",
        ],
        env=binary_env(),
        stdout=open(out / "tail_pegaflow_server.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    res: dict = dict(server="PegaFlow 0.25.1 (Rust)")
    try:
        t0 = time.time()
        client = None
        while time.time() - t0 < 180:
            try:
                client = EngineRpcClient(f"http://127.0.0.1:{port}")
                if client.health()[0]:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        res["server_start_s"] = round(time.time() - t0, 1)
        kv = [torch.randn(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
        names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        inst = "tail-" + uuid.uuid4().hex[:6]
        wr = [pickle.dumps(CudaIPCWrapper(t)) for t in kv]
        client.register_context_batch(
            inst,
            "ns-tail",
            0,
            0,
            1,
            1,
            0,
            names,
            wr,
            [NB] * L,
            [CH] * L,
            [NB * CH] * L,
            [2] * L,
            "kernel",
            False,
        )
        client.start_session_watcher(inst, "ns-tail", 1, 1)
        hashes = new_hashes(NQ)
        client.save(inst, 0, 0, 0, [(n, list(range(NQ)), hashes) for n in names])
        end = time.monotonic() + 30
        while time.monotonic() < end:
            hits, release = _pf_query(client, QueryReady, inst, hashes)
            release()
            if hits == NQ:
                break
            time.sleep(0.001)
        pspec = dict(
            system="pegaflow",
            site=site,
            url=f"http://127.0.0.1:{port}",
            instance=inst,
            hashes=[h.hex() for h in hashes],
            max_s=args.phase_max_s + 30,
        )
        env = dict(os.environ, PYTHONPATH=site)
        in_process = lambda: pegaflow_factories(pspec, hashes)  # noqa: E731
        res.update(
            phases(
                args,
                lambda: _pf_query(client, QueryReady, inst, hashes),
                pspec,
                out,
                ("proc", "threads"),
                env=env,
                in_process=in_process,
            )
        )
        del kv
    except Exception as exc:  # noqa: BLE001 - recorded
        res["error"] = repr(exc)[:500]
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
    print("RESULT " + json.dumps(res), flush=True)


def run_pegaflow(args, out: pathlib.Path) -> dict:
    spec = dict(site=args.anchor_site, out=str(out), args=vars(args))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = args.anchor_site
    try:
        p = subprocess.run(
            [sys.executable, str(HERE), "--pegaflow-worker", json.dumps(spec)],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=600,
        )
        (out / "tail_pegaflow_worker.log").write_text(
            p.stdout[-20000:] + "\n--- stderr\n" + p.stderr[-20000:]
        )
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        return dict(error=f"no result (rc {p.returncode}): {p.stderr[-500:]}")
    except Exception as exc:  # noqa: BLE001
        return dict(error=repr(exc)[:500])


# ------------------------------------------------------------------ report


def rows_of(report: dict) -> list[tuple[str, str, dict]]:
    """(server label, condition, stats) for every measured cell."""
    rows = []
    for system, res in report["systems"].items():
        if system.startswith("ours"):
            parts = ((f"{system}-local", res.get("local", {})), (f"{system}-grpc", res.get("grpc", {})))
        else:
            parts = ((system, res),)
        for label, r in parts:
            for cond in ("idle", "loaded_proc", "loaded_threads"):
                if isinstance(r.get(cond), dict) and r[cond].get("p50_us") is not None:
                    rows.append((label, cond, r[cond]))
    return rows


def merge(reports: list[dict]) -> dict:
    """Several runs of the same systems as one report: per cell the median over the runs (the fields
    ``p50_us`` ...), the worst (``*_worst``: the largest) and every run's value (``*_runs``)."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for report in reports:
        for label, cond, cell in rows_of(report):
            cells.setdefault((label, cond), []).append(cell)
    systems: dict[str, dict] = {}
    for (label, cond), runs in cells.items():
        merged: dict = {"n_runs": len(runs)}
        for stat in ("p50_us", "p99_us", "p999_us"):
            values = [r[stat] for r in runs]
            merged[stat] = statistics.median(values)
            merged[f"{stat}_worst"] = max(values)
            merged[f"{stat}_runs"] = values
        system, _, transport = label.rpartition("-") if label.startswith("ours") else (label, "", "")
        target = systems.setdefault(system, {})
        (target.setdefault(transport, {}) if transport else target)[cond] = merged
    return dict(
        started=[r.get("started") for r in reports],
        args=reports[0].get("args"),
        workload=reports[0].get("workload"),
        merged_runs=len(reports),
        systems=systems,
    )


def plot(report: dict, path: pathlib.Path) -> None:
    """Like the seed's figure 3: per server, p50 and p99 idle vs under load (log scale; p999 ticks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_of(report)
    labels = list(dict.fromkeys(r[0] for r in rows))
    conds = [c for c in ("idle", "loaded_proc", "loaded_threads") if any(r[1] == c for r in rows)]
    colors = {"idle": "#4c72b0", "loaded_proc": "#dd8452", "loaded_threads": "#c44e52"}
    names = {
        "idle": "idle",
        "loaded_proc": "12 GB/s saves + 500 q/s (other process)",
        "loaded_threads": "same load, threads of the client's process",
    }
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    for ax, stat in zip(axes, ("p50_us", "p99_us"), strict=True):
        w = 0.8 / max(len(conds), 1)
        for k, cond in enumerate(conds):
            xs, ys, tails = [], [], []
            for i, label in enumerate(labels):
                cell = next((r[2] for r in rows if r[0] == label and r[1] == cond), None)
                if cell is None:
                    continue
                xs.append(i + (k - (len(conds) - 1) / 2) * w)
                ys.append(cell[stat])
                tails.append(cell["p999_us"])
            ax.bar(xs, ys, w, color=colors[cond], label=names[cond])
            worst = [
                next(r[2] for r in rows if r[0] == label and r[1] == cond).get(f"{stat}_worst")
                for label in labels
                if any(r[0] == label and r[1] == cond for r in rows)
            ]
            if all(v is not None for v in worst):  # a merged report: the worst run of each cell
                label = "worst run" if k == 0 else None
                ax.scatter(xs, worst, marker="v", s=14, color="0.3", zorder=3, label=label)
            for x, y in zip(xs, ys, strict=True):
                ax.text(x, y * 1.05, f"{y:.0f}", ha="center", fontsize=6)
            if stat == "p99_us":
                ax.scatter(
                    xs, tails, marker="_", s=120, color="k", zorder=3, label="p999" if k == 0 else None
                )
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=20, ha="right")
        ax.set_title(f"{stat[:-3]} of a 64-hash query + lease (us)", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(
        "Query latency idle and under background load, one host (bench/tail_latency.py)", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(HERE.parent / "results")))
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma-separated, in order")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--phase-max-s", type=float, default=60.0)
    ap.add_argument("--pool-size", default="24gb")
    ap.add_argument("--baseline-pool-bytes", type=int, default=4 << 30)
    ap.add_argument(
        "--ours-switch-interval",
        type=float,
        default=0.0,
        help="ours-si: sys.setswitchinterval (default 0.5 ms)",
    )
    ap.add_argument("--anchor-site", default="", help="PegaFlow's install (else the pegaflow row is skipped)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="no GPU: host saves, small pools")
    ap.add_argument("--plot", metavar="JSON")
    ap.add_argument(
        "--merge", nargs="+", metavar="JSON", help="runs' tail_latency.json -> --out DIR: medians and worst"
    )
    ap.add_argument("--load-worker", help=argparse.SUPPRESS)
    ap.add_argument("--pegaflow-worker", help=argparse.SUPPRESS)
    ap.add_argument("--baseline-server", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_worker:
        load_worker(json.loads(args.load_worker))
        return
    if args.pegaflow_worker:
        pegaflow_worker(json.loads(args.pegaflow_worker))
        return
    if args.baseline_server:
        kind, address, pool_bytes, gpu = args.baseline_server
        baseline_main(kind, address, int(pool_bytes), gpu == "1")
        return
    if args.plot:
        plot(json.loads(pathlib.Path(args.plot).read_text()), pathlib.Path(args.plot).with_suffix(".png"))
        return
    if args.merge:
        report = merge([json.loads(pathlib.Path(p).read_text()) for p in args.merge])
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tail_latency.json").write_text(json.dumps(report, indent=1, default=str))
        plot(report, out / "tail_latency.png")
        for label, cond, cell in rows_of(report):
            print(
                f"{label:26s} {cond:15s} p50 {cell['p50_us']:7.0f} (worst {cell['p50_us_worst']:7.0f})  "
                f"p99 {cell['p99_us']:7.0f} (worst {cell['p99_us_worst']:7.0f})"
            )
        return
    if args.dry_run_cpu:
        args.baseline_pool_bytes = min(args.baseline_pool_bytes, 1 << 30)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        args=vars(args),
        workload=dict(
            query_hashes=NQ,
            save_blocks=SAVE_BLOCKS,
            block_bytes=BLOCK_BYTES,
            savers=N_SAVERS,
            queriers=N_QUERIERS,
            save_gbps_offered=12.0,
            queries_per_s_offered=N_QUERIERS / QUERY_INTERVAL_S,
        ),
        systems={},
    )
    for system in args.systems.split(","):
        t0 = time.monotonic()
        if system == "ours":
            report["systems"][system] = run_ours(args, out)
        elif system == "ours-si":  # the same server with a shorter GIL switch interval
            report["systems"][system] = run_ours(args, out, system, args.ours_switch_interval or 5e-4)
        elif system in OURS_VARIANTS:
            report["systems"][system] = run_ours(args, out, system)
        elif system == "pegaflow":
            if not args.anchor_site:
                continue
            report["systems"][system] = run_pegaflow(args, out)
        elif system in ("asyncio", "uvloop", "zmq"):
            report["systems"][system] = run_baseline(system, args, out)
        else:
            raise SystemExit(f"unknown system {system!r}; known: {', '.join(ALL_SYSTEMS)}")
        report["systems"][system]["wall_s"] = round(time.monotonic() - t0, 1)
        (out / "tail_latency.json").write_text(json.dumps(report, indent=1, default=str))
    try:
        plot(report, out / "tail_latency.png")
    except Exception as exc:  # noqa: BLE001 - the JSON is what matters; --plot redraws
        print("plot failed:", exc)
    for label, cond, cell in rows_of(report):
        print(
            f"{label:12s} {cond:15s} p50 {cell['p50_us']:8.1f}  p99 {cell['p99_us']:8.1f}  "
            f"p999 {cell['p999_us']:8.1f}"
        )


if __name__ == "__main__":
    main()
