"""Device micro-benchmark of the server's GPU copy path, without gRPC (run on a GPU machine).

What it measures, all in one run so the ratios are fair:
* the host-link ceiling: one large cudaMemcpyAsync each way between the pinned
  (cudaHostRegister'ed memfd) pool and device memory, for 2 GiB and for the
  workload's size;
* CUDA IPC: an emulated vLLM worker (a separate process, torch) exports its KV
  tensors; this process opens them by UUID + handle and times it;
* the batched copy kernel over a sweep of launch shapes, save and load, per
  layout (Qwen3-8B per-layer and cross-layer, DeepSeek MLA), 256 scattered
  blocks, GPU time by CUDA events, bytes verified against plain indexing;
* the DeviceCopier (what the server runs), direct and staged modes, wall time
  from submit to the future resolving, contiguous and scattered pool slots;
* save and load at once (the link is full duplex);
* what happens when the worker dies with copies in flight.

Usage: ``python bench/gpu_copy_microbench.py [--out DIR]`` (writes gpu_copy_microbench.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import pathlib
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener

import numpy as np

HERE = pathlib.Path(__file__).resolve()
NUM_BLOCKS = 1024
REQUEST_BLOCKS = 256
POOL_BYTES = 6 << 30
REPS = 5
RUNS = 10


# ------------------------------------------------------------------ worker process


def worker_main(address: str, key_hex: str) -> None:
    import torch

    from pegaflow.bench.gpu_worker_emulator import build_kv, deepseek_mla, qwen3_8b
    from pegaflow.client.device import export_torch_kv

    conn = Client(address, authkey=bytes.fromhex(key_hex))
    shapes = {
        "per_layer": qwen3_8b("per_layer", NUM_BLOCKS),
        "cross_layer": qwen3_8b("cross_layer", NUM_BLOCKS),
        "mla": deepseek_mla(NUM_BLOCKS),
    }
    t0 = time.perf_counter()
    kv = {name: build_kv(s, seed=i) for i, (name, s) in enumerate(shapes.items())}
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out = {}
    for name, s in shapes.items():
        tensors, dims = kv[name]
        reg = export_torch_kv(tensors, dims, s.num_blocks)
        out[name] = dict(shape=s, reg=reg, tensor_shapes=[tuple(t.shape) for t in tensors])
    t2 = time.perf_counter()
    conn.send(dict(layouts=out, alloc_s=t1 - t0, export_s=t2 - t1, torch=torch.__version__))
    conn.recv()  # "exit" (or the parent kills us)


# ------------------------------------------------------------------ helpers


def median_s(fn, reps: int = REPS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        times.append(fn())
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


class Bench:
    def __init__(self, out_dir: pathlib.Path):
        from pegaflow.server.gpu import cuda_runtime

        self.cuda = cuda_runtime
        self.cp = cuda_runtime.cupy_module()
        self.rt = cuda_runtime.runtime()
        self.out_dir = out_dir
        self.R: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.cp.cuda.Device(0).use()
        self.stream = self.cp.cuda.Stream(non_blocking=True)
        self.calls = cuda_runtime.stream_calls()

    def log(self, key, value):
        self.R[key] = value
        print(f"{key}: {value}", flush=True)

    def save_json(self):
        path = self.out_dir / "gpu_copy_microbench.json"
        path.write_text(json.dumps(self.R, indent=1, default=str))

    # -- environment -------------------------------------------------------------
    def environment(self):
        try:
            self._environment()
        except Exception as exc:  # noqa: BLE001 - the rest of the run does not depend on it
            self.log("env_error", repr(exc)[:500])

    def _environment(self):
        props = self.rt.getDeviceProperties(0)
        env = dict(
            python=platform.python_version(),
            cupy=self.cp.__version__,
            numpy=np.__version__,
            gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            sms=props["multiProcessorCount"],
            uuids=sorted(self.cuda.device_uuids()),
            devices=self.rt.getDeviceCount(),
            can_use_host_ptr=self.rt.deviceGetAttribute(
                self.rt.cudaDevAttrCanUseHostPointerForRegisteredMem, 0
            ),
        )
        for mod in ("grpc", "google.protobuf", "torch", "prometheus_client", "datasketch", "grpc_health"):
            try:
                m = __import__(mod, fromlist=["__version__"])
                env[mod] = getattr(m, "__version__", "present")
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                env[mod] = f"missing: {exc}"
        try:
            from pegaflow.proto import pegaflow_pb2, pegaflow_pb2_grpc  # noqa: F401

            env["stubs"] = "ok"
        except Exception as exc:  # noqa: BLE001
            env["stubs"] = f"failed: {exc!r}"[:300]
        try:
            env["meminfo"] = {
                ln.split(":")[0]: ln.split(":")[1].strip()
                for ln in pathlib.Path("/proc/meminfo").read_text().splitlines()
                if ln.split(":")[0] in ("MemTotal", "MemAvailable", "HugePages_Total")
            }
            env["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,"
                    "clocks.sm,clocks.mem,temperature.gpu,power.draw",
                    "--format=csv",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except Exception as exc:  # noqa: BLE001
            env["probe_error"] = repr(exc)
        self.log("env", env)

    # -- pool and ceilings -------------------------------------------------------
    def make_pool(self):
        from pegaflow.server.gpu.ipc import PinnedHostRegion

        fd = os.memfd_create("pegaflow-bench-pool", os.MFD_CLOEXEC)
        os.ftruncate(fd, POOL_BYTES)
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, POOL_BYTES)
        self.pool_mm = mmap.mmap(fd, POOL_BYTES, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        t1 = time.perf_counter()
        self.pool_np = np.frombuffer(self.pool_mm, dtype=np.uint8)
        self.region = PinnedHostRegion(self.pool_np.ctypes.data, POOL_BYTES)
        t2 = time.perf_counter()
        self.log(
            "pool",
            dict(
                gib=POOL_BYTES >> 30,
                populate_s=round(t1 - t0, 2),
                register_s=round(t2 - t1, 2),
                host_eq_device_addr=self.region.device_addr == self.region.host_addr,
            ),
        )

    def memcpy_s(self, dst, src, n) -> float:
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record(self.stream)
        self.rt.memcpyAsync(dst, src, n, self.cuda.MEMCPY_DEFAULT, self.stream.ptr)
        end.record(self.stream)
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) / 1e3

    def ceilings(self, label: str):
        res = {}
        for n in (2 << 30, REQUEST_BLOCKS * (2 << 20) + REQUEST_BLOCKS * (256 << 10)):
            dev = self.cp.empty(n, dtype=self.cp.uint8)
            dev.fill(3)
            d, h = dev.data.ptr, self.region.device_addr
            res[f"h2d_{n >> 20}MiB"] = gbps(n, median_s(lambda d=d, h=h, n=n: self.memcpy_s(d, h, n)))
            res[f"d2h_{n >> 20}MiB"] = gbps(n, median_s(lambda d=d, h=h, n=n: self.memcpy_s(h, d, n)))
            del dev
        self.log(f"ceiling_{label}", res)
        return res

    # -- worker and IPC ----------------------------------------------------------
    def start_worker(self):
        self._tmp = tempfile.TemporaryDirectory()
        address = os.path.join(self._tmp.name, "w.sock")
        key = secrets.token_bytes(16)
        listener = Listener(address, authkey=key)
        self.worker = subprocess.Popen(
            [sys.executable, str(HERE), "--worker", address, key.hex()], start_new_session=True
        )
        self.wconn = listener.accept()
        msg = self.wconn.recv()
        self.layouts = msg["layouts"]
        from pegaflow.server.gpu.ipc import IpcMappings
        from pegaflow.server.gpu.registration import layout_of

        self.ipc = IpcMappings()
        t0 = time.perf_counter()
        self.opened = {}
        for name, info in self.layouts.items():
            reg = info["reg"]
            ordinal = self.ipc.device_ordinal(reg.device_uuid)
            addrs = [self.ipc.open(ordinal, t.ipc_handle) + t.offset for t in reg.tensors]
            self.opened[name] = dict(layout=layout_of(reg), addrs=addrs, ordinal=ordinal)
        t1 = time.perf_counter()
        self.log(
            "ipc",
            dict(
                worker_alloc_s=round(msg["alloc_s"], 3),
                worker_export_s=round(msg["export_s"], 3),
                open_s=round(t1 - t0, 3),
                tensors=sum(len(i["reg"].tensors) for i in self.layouts.values()),
                mappings=len(self.ipc),
                worker_torch=msg["torch"],
            ),
        )
        # cupy views of the worker's tensors, for verification by plain indexing
        self.views = {}
        for name, info in self.layouts.items():
            views = []
            for addr, shp, t in zip(
                self.opened[name]["addrs"], info["tensor_shapes"], info["reg"].tensors, strict=True
            ):
                mem = self.cp.cuda.UnownedMemory(addr, t.size, owner=None, device_id=0)
                views.append(
                    self.cp.ndarray(shp, dtype=self.cp.uint16, memptr=self.cp.cuda.MemoryPointer(mem, 0))
                )
            self.views[name] = views

    def expected(self, name, ids):
        cp = self.cp
        v = self.views[name]
        ids = cp.asarray(ids)
        if name == "per_layer":
            out = cp.stack([t[:, ids] for t in v]).transpose(2, 0, 1, 3, 4, 5)
        elif name == "cross_layer":
            out = v[0][ids]
        else:
            out = cp.stack([t[ids] for t in v]).transpose(1, 0, 2, 3)
        bb = self.opened[name]["layout"].block_bytes
        return cp.ascontiguousarray(out).view(cp.uint8).reshape(len(ids), bb)

    def zero(self, name, ids):
        ids = self.cp.asarray(ids)
        for t in self.views[name]:
            if name == "per_layer":
                t[:, ids] = 0
            else:
                t[ids] = 0
        self.cp.cuda.Device(0).synchronize()

    def pool_blocks(self, name, slots):
        bb = self.opened[name]["layout"].block_bytes
        nslots = POOL_BYTES // bb
        return self.pool_np[: nslots * bb].reshape(nslots, bb)[np.asarray(slots)]

    def poison(self, name, slots):
        bb = self.opened[name]["layout"].block_bytes
        nslots = POOL_BYTES // bb
        self.pool_np[: nslots * bb].reshape(nslots, bb)[np.asarray(slots)] = 0xCD

    def check_saved(self, name, ids, slots) -> bool:
        got = self.cp.asarray(self.pool_blocks(name, slots))
        return bool((got == self.expected(name, ids)).all())

    def check_loaded(self, name, targets, slots) -> bool:
        got = self.expected(name, targets)
        return bool((got == self.cp.asarray(self.pool_blocks(name, slots))).all())

    # -- kernel sweep -------------------------------------------------------------
    def sweep(self, name, ids, slots, targets, configs, pieces):
        """GPU time (events) of the bare kernel per (piece size, direction, config); bytes verified once."""
        from pegaflow.server.gpu.copy_plan import item_table
        from pegaflow.server.gpu.kernels import BatchedCopyKernel, KernelConfig

        cp = self.cp
        o = self.opened[name]
        layout = o["layout"]
        offs = np.asarray(slots, dtype=np.uint64) * np.uint64(layout.block_bytes)
        nbytes = len(ids) * layout.block_bytes
        dev_offs = cp.asarray(offs)
        dev_ids = {
            "save": cp.asarray(np.asarray(ids, np.uint64)),
            "load": cp.asarray(np.asarray(targets, np.uint64)),
        }
        rows, kernels, verified = [], {}, set()
        for piece in pieces:
            table = item_table(layout, o["addrs"], piece)
            dev_items = cp.asarray(table.packed())
            for direction in ("save", "load"):
                to_host = direction == "save"
                for kw in configs:
                    cfg = KernelConfig(**kw)
                    if cfg not in kernels:
                        try:
                            kernels[cfg] = BatchedCopyKernel(cfg)
                            kernels[cfg].compile(0)
                        except Exception as exc:  # noqa: BLE001 - a variant that does not build is recorded
                            kernels[cfg] = repr(exc)[:300]
                    k = kernels[cfg]
                    row = dict(direction=direction, piece=piece, items=table.items, **kw)
                    if isinstance(k, str):
                        rows.append(dict(row, error=k))
                        continue

                    def once(k=k, to_host=to_host, direction=direction, dev_items=dev_items, table=table):
                        start, end = cp.cuda.Event(), cp.cuda.Event()
                        start.record(self.stream)
                        k.launch(
                            self.calls,
                            self.stream.ptr,
                            0,
                            dev_items.data.ptr,
                            table.items,
                            dev_ids[direction].data.ptr,
                            dev_offs.data.ptr,
                            self.region.device_addr,
                            len(ids),
                            to_host,
                        )
                        end.record(self.stream)
                        end.synchronize()
                        return cp.cuda.get_elapsed_time(start, end) / 1e3

                    if (direction, cfg) not in verified:
                        verified.add((direction, cfg))
                        if to_host:
                            self.poison(name, slots)
                            once()
                            row["verified"] = self.check_saved(name, ids, slots)
                        else:
                            self.zero(name, targets)
                            once()
                            row["verified"] = self.check_loaded(name, targets, slots)
                    rows.append(dict(row, gbps=gbps(nbytes, median_s(once))))
        return rows

    # -- copier (what the server runs) -------------------------------------------
    def copier_runs(self, name, ids, slots, targets, copier, mode, runs: int = RUNS, chunked=False) -> dict:
        """Wall time of ``runs`` copies each way, start() to wait() returning, on this thread (as the
        server's request thread runs them); ``chunked``: cut as the service cuts a request
        (copy_plan.pipeline_chunks), all started, then waited for in order."""
        from pegaflow.server.gpu.copy_plan import pipeline_chunks

        o = self.opened[name]
        layout = o["layout"]
        key = name  # the caller registered every layout under its name
        offs = np.asarray(slots, dtype=np.uint64) * np.uint64(layout.block_bytes)
        nbytes = len(ids) * layout.block_bytes
        bounds = pipeline_chunks(len(ids), layout.block_bytes) if chunked else [(0, len(ids))]
        res = {}
        for direction, block_ids in (("save", ids), ("load", targets)):
            to_host = direction == "save"
            block_ids = np.asarray(block_ids)
            modes, gpu, launch = [], [], []

            def once(block_ids=block_ids, to_host=to_host, modes=modes, gpu=gpu, launch=launch):
                t0 = time.perf_counter()
                copies = [
                    copier.start(key, to_host, block_ids[lo:hi], offs[lo:hi], mode, trace=True)
                    for lo, hi in bounds
                ]
                results = []
                for c in copies:
                    c.wait(time.monotonic() + 60)
                    results.append(c.finish())
                t = time.perf_counter() - t0
                modes.append(results[0].mode)
                gpu.append(sum(r.gpu_s or 0 for r in results))
                launch.append(sum(r.launch_s for r in results))
                return t

            if to_host:
                self.poison(name, slots)
            else:
                self.zero(name, targets)
            once()
            ok = self.check_saved(name, ids, slots) if to_host else self.check_loaded(name, targets, slots)
            times = [once() for _ in range(runs)]
            res[direction] = dict(
                gbps=gbps(nbytes, statistics.median(times)),
                worst_gbps=gbps(nbytes, max(times)),
                ms=round(statistics.median(times) * 1e3, 3),
                gpu_ms_median=round(statistics.median(gpu[1:]) * 1e3, 3),
                launch_ms_median=round(statistics.median(launch[1:]) * 1e3, 3),
                verified=ok,
                mode=modes[-1],
            )
        return res

    # -- diagnostics: where slow runs can come from ----------------------------------
    def _nvml(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return dict(
                link_gen=pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                link_width=pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                sm_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                mem_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                pstate=pynvml.nvmlDeviceGetPerformanceState(h),
            )
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            return dict(error=repr(exc)[:120])

    def idle_gaps(self, keepalive_s: float = 0.0) -> list[dict]:
        """After the GPU and the link idled for a while, how long does a 64 MiB copy take (GPU time
        by events, and wall time from enqueue to completion seen)? With ``keepalive_s``, a 4 KiB
        copy each way every keepalive_s during the gap."""
        import threading

        n = 64 << 20
        dev = self.cp.empty(n, dtype=self.cp.uint8)
        dev.fill(1)
        d, h = dev.data.ptr, self.region.device_addr + (1 << 30)
        tiny = self.cp.empty(4096, dtype=self.cp.uint8)
        ka_stream = self.cp.cuda.Stream(non_blocking=True)
        rows = []
        for gap_ms in (0, 1, 5, 20, 100, 500, 2000):
            for direction in ("d2h", "h2d"):
                stop = threading.Event()

                def keepalive(stop=stop):
                    self.cp.cuda.Device(0).use()
                    while not stop.wait(keepalive_s):
                        self.rt.memcpyAsync(h, tiny.data.ptr, 4096, self.cuda.MEMCPY_DEFAULT, ka_stream.ptr)
                        self.rt.memcpyAsync(tiny.data.ptr, h, 4096, self.cuda.MEMCPY_DEFAULT, ka_stream.ptr)

                th = None
                if keepalive_s > 0:
                    th = threading.Thread(target=keepalive, daemon=True)
                    th.start()
                time.sleep(gap_ms / 1e3)
                before = self._nvml() if gap_ms >= 100 else None
                stop.set()
                if th is not None:
                    th.join()
                t0 = time.perf_counter()
                src, dst = (d, h) if direction == "d2h" else (h, d)
                g = self.memcpy_s(dst, src, n)
                wall = time.perf_counter() - t0
                g2 = self.memcpy_s(dst, src, n)  # right after: the warm rate
                rows.append(
                    dict(
                        gap_ms=gap_ms,
                        direction=direction,
                        gpu_gbps=gbps(n, g),
                        wall_gbps=gbps(n, wall),
                        then_gbps=gbps(n, g2),
                        nvml_before=before,
                    )
                )
        return rows

    def first_launches(self, name, ids, slots) -> list[dict]:
        """A fresh DeviceCopier's first copies (CPU launch time, GPU time) vs its later ones."""
        from pegaflow.server.gpu.device_copier import DeviceCopier

        o = self.opened[name]
        lay = o["layout"]
        offs = np.asarray(slots, np.uint64) * np.uint64(lay.block_bytes)
        t0 = time.perf_counter()
        copier = DeviceCopier(0, self.region.device_addr, POOL_BYTES)
        made = time.perf_counter() - t0
        rows = [dict(copier_create_s=round(made, 3), driver_calls=copier.driver_calls)]
        try:
            copier.add_layout("fresh", lay, o["addrs"])
            for i in range(4):
                for to_host in (True, False):
                    t = time.perf_counter()
                    c = copier.start("fresh", to_host, ids[:16], offs[:16], "auto", trace=True)
                    c.wait(time.monotonic() + 60)
                    r = c.finish()
                    rows.append(
                        dict(
                            i=i,
                            save=to_host,
                            wall_ms=round((time.perf_counter() - t) * 1e3, 3),
                            launch_ms=round(r.launch_s * 1e3, 3),
                            gpu_ms=round((r.gpu_s or 0) * 1e3, 3),
                            mode=r.mode,
                        )
                    )
            copier.retire("fresh", 60)
        finally:
            copier.close()
        return rows

    def wakeups(self) -> dict:
        """What waking a sleeping thread costs on this host: round trips through a socketpair between
        two threads and two processes, the answering side blocked in recv vs spinning."""
        import socket
        import threading

        def ping(sock, n=2000):
            ts = []
            for _ in range(n):
                t = time.perf_counter()
                sock.send(b"x")
                sock.recv(1)
                ts.append(time.perf_counter() - t)
            ts.sort()
            return dict(p50_us=round(ts[n // 2] * 1e6, 1), p99_us=round(ts[int(n * 0.99)] * 1e6, 1))

        out = {}
        for spin in (False, True):
            a, b = socket.socketpair()

            def echo(b=b, spin=spin):
                if spin:
                    b.setblocking(False)
                while True:
                    try:
                        x = b.recv(1)
                    except BlockingIOError:
                        continue
                    if not x:
                        return
                    b.send(x)

            th = threading.Thread(target=echo, daemon=True)
            th.start()
            out[f"threads_{'spin' if spin else 'block'}"] = ping(a, 500 if spin else 2000)
            a.close()
            th.join(5)
        for spin in (False, True):
            a, b = socket.socketpair()
            code = (
                "import socket,sys\n"
                "s=socket.socket(fileno=int(sys.argv[1]))\n"
                + ("s.setblocking(False)\n" if spin else "")
                + "while True:\n"
                "    try: x=s.recv(1)\n"
                "    except BlockingIOError: continue\n"
                "    if not x: break\n"
                "    s.send(x)\n"
            )
            p = subprocess.Popen([sys.executable, "-c", code, str(b.fileno())], pass_fds=(b.fileno(),))
            b.close()
            ping(a, 50)
            out[f"processes_{'spin' if spin else 'block'}"] = ping(a)
            a.close()
            p.wait(10)
        return out

    # -- worker death --------------------------------------------------------------
    def worker_death(self, copier):
        from pegaflow.server.gpu.device_copier import CopyCancelled

        o = self.opened["cross_layer"]
        layout = o["layout"]
        copier.add_layout("dying", layout, o["addrs"])
        ids = list(range(64))
        offs = [i * layout.block_bytes for i in range(64)]
        futs = [copier.submit("dying", True, ids, offs, mode="direct") for _ in range(30)]
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(timeout=30)
        outcome = {"done": 0, "cancelled": 0, "failed": []}
        # Copies already queued still go through the open mappings after the death.
        outcome["retired"] = copier.retire("dying", timeout_s=120)
        for f in futs:
            try:
                f.result(timeout=0)
                outcome["done"] += 1
            except CopyCancelled:
                outcome["cancelled"] += 1
            except Exception as exc:  # noqa: BLE001 - this is what the experiment records
                outcome["failed"].append(repr(exc)[:200])
        for info in self.layouts.values():
            for t in info["reg"].tensors:
                self.ipc.close(t.ipc_handle)
        outcome["mappings_left"] = len(self.ipc)
        try:
            from pegaflow.server.gpu.copy_plan import BlockLayout, Segment

            src = self.cp.full(1 << 20, 9, dtype=self.cp.uint8)
            copier.add_layout(
                "healthy", BlockLayout([Segment(0, 0, 1 << 20, 1 << 20)], [1 << 20], 1), [src.data.ptr]
            )
            copier.submit("healthy", True, [0], [0]).result(timeout=60)
            outcome["context_healthy"] = bool((self.pool_np[: 1 << 20] == 9).all())
        except Exception as exc:  # noqa: BLE001
            outcome["context_healthy"] = repr(exc)[:200]
        self.log("worker_death", outcome)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch shapes")
    ap.add_argument("--worker", nargs=2, metavar=("ADDRESS", "KEY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out)
    try:
        run(b, sweep=args.sweep)
    finally:
        b.save_json()
        if getattr(b, "worker", None) is not None and b.worker.poll() is None:
            os.killpg(b.worker.pid, signal.SIGKILL)


def _step(b: Bench, label: str, fn):
    """One experiment; a failure is recorded and the run goes on."""
    t0 = time.perf_counter()
    try:
        b.log(label, fn())
    except Exception as exc:  # noqa: BLE001 - recorded
        b.log(label + "_error", repr(exc)[:500])
    b.R.setdefault("step_s", {})[label] = round(time.perf_counter() - t0, 2)
    b.save_json()


def run(b: Bench, sweep: bool = False) -> None:
    from pegaflow.server.gpu.device_copier import DeviceCopier

    b.environment()
    b.make_pool()
    b.ceilings("start")
    _step(b, "wakeups", b.wakeups)
    _step(b, "idle_gaps", b.idle_gaps)
    _step(b, "idle_gaps_keepalive_2ms", lambda: b.idle_gaps(0.002))
    b.start_worker()
    rng = np.random.default_rng(42)
    sel = {}
    for name in ("per_layer", "cross_layer", "mla"):
        layout = b.opened[name]["layout"]
        perm = rng.permutation(NUM_BLOCKS)
        nslots = POOL_BYTES // layout.block_bytes
        sel[name] = dict(
            ids=perm[:REQUEST_BLOCKS].tolist(),
            targets=perm[REQUEST_BLOCKS : 2 * REQUEST_BLOCKS].tolist(),
            contiguous=list(range(10, 10 + REQUEST_BLOCKS)),
            scattered=rng.choice(nslots, size=REQUEST_BLOCKS, replace=False).tolist(),
        )
    b.log("request_bytes", {n: REQUEST_BLOCKS * b.opened[n]["layout"].block_bytes for n in sel})
    _step(
        b,
        "first_launches",
        lambda: b.first_launches("cross_layer", sel["cross_layer"]["ids"], range(600, 900)),
    )

    # 1. the bare kernel (GPU time), contiguous pool slots
    grid = [dict(threads=256, unroll=4)]
    if sweep:
        grid = [dict(threads=t, unroll=u) for t, u in itertools.product((256, 512), (2, 4, 8))]
        grid += [dict(threads=256, unroll=4, load_mode=1), dict(threads=256, unroll=4, store_mode=1)]
    kernel = {}
    for name, pieces in (("per_layer", (32 << 10,)), ("cross_layer", (64 << 10,)), ("mla", (64 << 10,))):
        s = sel[name]
        try:
            kernel[name] = b.sweep(name, s["ids"], s["contiguous"], s["targets"], grid, pieces)
        except Exception as exc:  # noqa: BLE001
            kernel[name] = repr(exc)[:300]
    b.log("kernel", kernel)
    b.save_json()

    # 2. the copier, as the server runs it: start() .. wait() on this thread
    copier_res = {}
    for driver in (True, False):
        for mode in ("direct", "staged"):
            copier = DeviceCopier(0, b.region.device_addr, POOL_BYTES, driver_calls=driver)
            try:
                for name in sel:
                    copier.add_layout(name, b.opened[name]["layout"], b.opened[name]["addrs"])
                for name in ("per_layer", "cross_layer", "mla"):
                    s = sel[name]
                    for place in ("contiguous", "scattered"):
                        for chunked in (False, True) if driver else (False,):
                            label = f"{mode}/{name}/{place}/{'driver' if copier.driver_calls else 'cupy'}" + (
                                "/chunked" if chunked else ""
                            )
                            try:
                                r = b.copier_runs(
                                    name, s["ids"], s[place], s["targets"], copier, mode, chunked=chunked
                                )
                            except Exception as exc:  # noqa: BLE001
                                r = dict(error=repr(exc)[:300])
                            copier_res[label] = r
                            print("copier", label, r, flush=True)
            finally:
                copier.close()
    b.R["copier"] = copier_res
    b.save_json()

    # 3. duplex: a save and a load at once on one copier (separate lanes, separate links directions)
    copier = DeviceCopier(0, b.region.device_addr, POOL_BYTES)
    try:
        o = b.opened["cross_layer"]
        lay = o["layout"]
        copier.add_layout("x", lay, o["addrs"])
        s = sel["cross_layer"]
        offs_a = np.asarray(s["contiguous"], np.uint64) * np.uint64(lay.block_bytes)
        offs_b = np.asarray(list(range(400, 400 + REQUEST_BLOCKS)), np.uint64) * np.uint64(lay.block_bytes)
        for mode in ("direct", "staged"):

            def both(mode=mode):
                t0 = time.perf_counter()
                f1 = copier.submit("x", True, s["ids"], offs_a, mode=mode)
                f2 = copier.submit("x", False, s["targets"], offs_b, mode=mode)
                f1.result(timeout=120)
                f2.result(timeout=120)
                return time.perf_counter() - t0

            t = median_s(both)
            b.log(
                f"duplex_{mode}",
                dict(
                    total_gbps_both_ways=gbps(2 * REQUEST_BLOCKS * lay.block_bytes, t), ms=round(t * 1e3, 2)
                ),
            )
        assert copier.retire("x", timeout_s=60)
        b.ceilings("end")
        b.save_json()
        # 4. worker death with copies in flight (last: it may upset the context)
        b.worker_death(copier)
    finally:
        copier.close()
    summary = {
        k: (v["save"]["gbps"], v["save"]["worst_gbps"], v["load"]["gbps"], v["load"]["worst_gbps"])
        for k, v in copier_res.items()
        if "save" in v
    }
    b.log("copier_summary", summary)


if __name__ == "__main__":
    main()
