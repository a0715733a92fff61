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


# ------------------------------------------------------------------ worker process


def worker_main(address: str, key_hex: str) -> None:
    import torch

    from pegaflow.bench.gpu_worker_emulator import build_kv, deepseek_mla, qwen3_8b
    from pegaflow.server.gpu.registration import export_torch_kv

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

        self.ipc = IpcMappings()
        t0 = time.perf_counter()
        self.opened = {}
        for name, info in self.layouts.items():
            reg = info["reg"]
            ordinal = self.ipc.device_ordinal(reg.device_uuid)
            addrs = [self.ipc.open(ordinal, t.ipc_handle) + t.offset for t in reg.tensors]
            self.opened[name] = dict(layout=reg.validate(), addrs=addrs, ordinal=ordinal)
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
                            self.stream,
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
    def copier_runs(self, name, ids, slots, targets, copier, mode) -> dict:
        o = self.opened[name]
        layout = o["layout"]
        key = name  # the caller registered every layout under its name
        offs = np.asarray(slots, dtype=np.uint64) * np.uint64(layout.block_bytes)
        nbytes = len(ids) * layout.block_bytes
        res = {}
        for direction, block_ids in (("save", ids), ("load", targets)):
            to_host = direction == "save"
            modes = []

            def once(block_ids=block_ids, to_host=to_host, modes=modes):
                t0 = time.perf_counter()
                r = copier.submit(key, to_host, block_ids, offs, mode=mode).result(timeout=120)
                modes.append(r.mode)
                return time.perf_counter() - t0

            if to_host:
                self.poison(name, slots)
            else:
                self.zero(name, targets)
            once()
            ok = self.check_saved(name, ids, slots) if to_host else self.check_loaded(name, targets, slots)
            t = median_s(once)
            res[direction] = dict(gbps=gbps(nbytes, t), ms=round(t * 1e3, 3), verified=ok, mode=modes[-1])
        return res

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
    ap.add_argument("--quick", action="store_true", help="skip the kernel launch-shape sweep")
    ap.add_argument("--worker", nargs=2, metavar=("ADDRESS", "KEY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out)
    try:
        run(b, quick=args.quick)
    finally:
        b.save_json()
        if getattr(b, "worker", None) is not None and b.worker.poll() is None:
            os.killpg(b.worker.pid, signal.SIGKILL)


def run(b: Bench, quick: bool = False) -> None:
    from pegaflow.server.gpu.device_copier import DeviceCopier

    b.environment()
    b.make_pool()
    b.ceilings("start")
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

    # 1. the bare kernel (GPU time), contiguous pool slots
    grid = [dict(threads=t, unroll=u) for t, u in itertools.product((256, 512), (2, 4, 8))]
    grid += [dict(threads=256, unroll=4, load_mode=1), dict(threads=256, unroll=4, store_mode=1)]
    if quick:
        grid = [dict(threads=256, unroll=4)]
    sweep = {}
    for name, pieces in (
        ("per_layer", (32 << 10,)),
        ("cross_layer", (32 << 10, 64 << 10, 256 << 10)),
        ("mla", (64 << 10,)),
    ):
        s = sel[name]
        sweep[name] = b.sweep(name, s["ids"], s["contiguous"], s["targets"], grid, pieces)
        for d in ("save", "load"):
            best = sorted(
                (r for r in sweep[name] if r["direction"] == d and "gbps" in r), key=lambda r: -r["gbps"]
            )
            b.log(
                f"kernel_{name}_{d}",
                dict(
                    best=best[0],
                    worst_gbps=best[-1]["gbps"],
                    all_verified=all(r.get("verified", True) for r in best),
                ),
            )
    b.R["sweep"] = sweep
    b.save_json()

    # 2. the copier, as the server runs it: wall time from submit to the future resolving
    copier_res = {}
    configs = [
        ("direct", 32 << 20, 3),
        ("staged", 16 << 20, 3),
        ("staged", 32 << 20, 3),
        ("staged", 64 << 20, 3),
    ]
    for mode, slot_bytes, nslots in configs:
        copier = DeviceCopier(0, b.region.device_addr, POOL_BYTES, slot_bytes=slot_bytes, slots=nslots)
        try:
            for name in sel:
                copier.add_layout(name, b.opened[name]["layout"], b.opened[name]["addrs"])
            for name in ("per_layer", "cross_layer", "mla"):
                s = sel[name]
                for place in ("contiguous", "scattered"):
                    r = b.copier_runs(name, s["ids"], s[place], s["targets"], copier, mode)
                    label = f"{mode}/{slot_bytes >> 20}MiBx{nslots}/{name}/{place}"
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
        k: (v["save"]["gbps"], v["load"]["gbps"], v["save"]["verified"] and v["load"]["verified"])
        for k, v in copier_res.items()
    }
    b.log("copier_summary", summary)


if __name__ == "__main__":
    main()
