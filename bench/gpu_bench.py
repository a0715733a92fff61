"""End-to-end GPU data-path benchmark: emulated vLLM workers -> a real pegaflow-server process (run on a GPU).

For each copy mode the server is started as its own process
(``python -m pegaflow.server.main --gpu-copy-mode MODE``). Emulated vLLM
workers (separate processes, torch tensors in vLLM's layouts, see
gpu_worker_emulator.py) connect with the real client, register an instance and
their KV tensors (CUDA IPC), then per run:

* **save**: 256 scattered GPU blocks under fresh hashes: ``SaveFromDevice``
  (server allocates, copies with one batched launch, seals), then a
  ``QueryPrefix`` that must see all 256; timed from the call until that query
  returns (``save_rpc`` is until the save call returns, when they are sealed);
* **load**: 256 other blocks zeroed, then ``LoadToDevice`` of those hashes,
  timed until it returns (the completion signal: the bytes are in GPU memory);
  bytes verified on the GPU after every run (loaded == saved blocks), and the
  pool bytes against plain torch indexing after the first;
* the ceiling: one pinned-host <-> GPU ``copy_`` of the same bytes, each way,
  measured in the same worker process right before its runs.

Scenarios: Qwen3-8B (36 layers, 8 KV heads x 128, bf16, 16-token blocks) with
per-layer K/V tensors and with cross-layer blocks; DeepSeek-V3 MLA (61 layers,
576-wide latent) with several TP ranks sharing one stored copy (rank 0 saves,
the others find every block already stored and load it).

Usage: ``python bench/gpu_bench.py [--out DIR]`` -> gpu_bench.json (+ ``--plot JSON`` -> gpu_bench.png).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve()
ANCHOR = {  # PegaFlow 0.25.1 on the same machine and workload (shared/recipes/gpu.md), its best backend
    "per_layer": {"save": 30.0, "load": 44.9},
    "cross_layer": {"save": 43.3, "load": 49.1},
    "mla": {"save": 15.1, "load": 36.0},
}


# ------------------------------------------------------------------ worker process


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def pinned_ceiling(torch, nbytes: int, reps: int = 5) -> dict:
    """Same-run link ceiling: one pinned host <-> device copy of ``nbytes``, median of ``reps``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host.fill_(1)
    dev.fill_(2)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for i in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_gbps"] = nbytes / statistics.median(times) / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out


def worker_main(spec: dict) -> None:
    import numpy as np
    import torch

    from pegaflow.bench.gpu_worker_emulator import (
        build_kv,
        deepseek_mla,
        gather_blocks,
        qwen3_8b,
        zero_blocks,
    )
    from pegaflow.client import KvLayout, PegaClient
    from pegaflow.connector.gpu_worker import _layout_tag
    from pegaflow.server.gpu.registration import export_torch_kv

    layout, nb, blocks, runs = spec["layout"], spec["num_blocks"], spec["blocks"], spec["runs"]
    shape = deepseek_mla(nb) if layout == "mla" else qwen3_8b(layout, nb)
    tensors, dims = build_kv(shape, seed=spec["seed"])
    torch.cuda.synchronize()
    result: dict = {
        "layout": layout,
        "role": spec["role"],
        "rank": spec["rank"],
        "block_bytes": shape.block_bytes,
    }
    client = PegaClient(spec["addr"], timeout_s=30.0, name=f"gpu-bench-{layout}-r{spec['rank']}")
    client.connect()
    try:
        inst = client.register_instance(
            KvLayout(
                model_id=spec["model_id"],
                block_bytes=shape.block_bytes,
                dtype="bfloat16",
                layout=_layout_tag(tensors, dims),
                block_tokens=shape.block_tokens,
                num_layers=shape.layers,
                tp_size=spec["tp_size"],
                tp_rank=spec["rank"],
                mla=layout == "mla",
            )
        )
        t_reg, handle = _timed(
            lambda: client.register_device_memory(inst, export_torch_kv(tensors, dims, nb))
        )
        result["register_s"] = t_reg
        nbytes = blocks * shape.block_bytes
        result["ceiling"] = pinned_ceiling(torch, nbytes)
        rng = np.random.default_rng(spec["seed"])
        saves, saves_rpc, loads, verified = [], [], [], []
        for run in range(runs + 1):  # run 0 warms up and is not timed
            perm = rng.permutation(nb)
            ids, targets = perm[:blocks].tolist(), perm[blocks : 2 * blocks].tolist()
            hashes = [f"{spec['hash_prefix']}-{run}-{i}".encode() for i in range(blocks)]
            if spec["role"] in ("solo", "writer"):
                t0 = time.perf_counter()
                out = client.save_from_device(handle, hashes, ids)
                t1 = time.perf_counter()
                hit = client.query_prefix(inst, hashes)
                t2 = time.perf_counter()
                if out.written != blocks or hit.num_hits != blocks:
                    raise RuntimeError(f"run {run}: wrote {out.written}, visible {hit.num_hits} of {blocks}")
                if run:
                    saves.append(t2 - t0)
                    saves_rpc.append(t1 - t0)
                if run == 1:  # the pool holds exactly what plain indexing says
                    want = gather_blocks(shape, tensors, ids).cpu().numpy()
                    pool = client.pool_view(hit.epoch)
                    got = np.stack(
                        [pool[loc.offset : loc.offset + shape.block_bytes] for loc in hit.locations]
                    )
                    result["pool_bytes_verified"] = bool(np.array_equal(got, want))
            else:  # a reader rank of an MLA group: the writer stored these blocks already
                _wait_for(spec["writer_done"])
                out = client.save_from_device(handle, hashes, ids)
                result.setdefault("dedup_written", 0)
                result["dedup_written"] += out.written
            zero_blocks(shape, tensors, dims, targets)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            n = client.load_to_device(handle, hashes, targets)
            t4 = time.perf_counter()
            if n != blocks:
                raise RuntimeError(f"run {run}: loaded {n} of {blocks}")
            ok = bool(torch.equal(gather_blocks(shape, tensors, targets), gather_blocks(shape, tensors, ids)))
            if run:
                loads.append(t4 - t3)
                verified.append(ok)
        if spec["role"] == "writer":
            pathlib.Path(spec["writer_done"]).write_text("done")
        result.update(
            nbytes=nbytes,
            runs=runs,
            save_s=saves,
            save_rpc_s=saves_rpc,
            load_s=loads,
            load_verified=all(verified) and len(verified) == runs,
            stats=_stats(client),
        )
        result["ceiling_after"] = pinned_ceiling(torch, nbytes)
    finally:
        client.close()
    pathlib.Path(spec["result"]).write_text(json.dumps(result))


def _stats(client) -> dict:
    s = client.stats()
    return {"pool_used_bytes": s.pool_used_bytes, "resident_blocks": s.resident_blocks}


def _wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


# ------------------------------------------------------------------ orchestrator


class ServerProcess:
    def __init__(self, pool_size: str, mode: str, log_path: pathlib.Path):
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pegaflow.server.main",
                "--pool-size",
                pool_size,
                "--addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
                "--gpu-copy-mode",
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pegaflow-server exited (rc {self.proc.wait()}); see {log_path}")
        self.ready = json.loads(line)
        self.addr = self.ready["addr"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def run_workers(specs: list[dict], timeout_s: float) -> list[dict]:
    procs = []
    try:
        for spec in specs:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE), "--worker", json.dumps(spec)], start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout_s
        for p in procs:
            rc = p.wait(timeout=max(deadline - time.monotonic(), 1))
            if rc:
                raise RuntimeError(f"a worker failed with rc {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [json.loads(pathlib.Path(s["result"]).read_text()) for s in specs]


def summarize(r: dict) -> dict:
    nbytes = r["nbytes"]
    out = {"layout": r["layout"], "rank": r["rank"], "role": r["role"], "nbytes": nbytes}
    ceil_h2d = min(r["ceiling"]["h2d_gbps"], r["ceiling_after"]["h2d_gbps"])
    ceil_d2h = min(r["ceiling"]["d2h_gbps"], r["ceiling_after"]["d2h_gbps"])
    out["ceiling_h2d_gbps"] = round(ceil_h2d, 2)
    out["ceiling_d2h_gbps"] = round(ceil_d2h, 2)
    if r["save_s"]:
        save = nbytes / statistics.median(r["save_s"]) / 1e9
        save_rpc = nbytes / statistics.median(r["save_rpc_s"]) / 1e9
        out.update(
            save_gbps=round(save, 2),
            save_ratio=round(save / ceil_d2h, 4),
            save_rpc_gbps=round(save_rpc, 2),
            save_rpc_ratio=round(save_rpc / ceil_d2h, 4),
            pool_bytes_verified=r.get("pool_bytes_verified"),
        )
    load = nbytes / statistics.median(r["load_s"]) / 1e9
    out.update(
        load_gbps=round(load, 2),
        load_ratio=round(load / ceil_h2d, 4),
        load_verified=r["load_verified"],
        runs=r["runs"],
    )
    if "dedup_written" in r:
        out["dedup_written"] = r["dedup_written"]
    return out


def orchestrate(args) -> dict:
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "modes": {}}
    for mode in args.modes.split(","):
        server = ServerProcess(args.pool_size, mode, out_dir / f"server-{mode}.log")
        try:
            rows, raw = [], []
            common = dict(addr=server.addr, blocks=args.blocks, runs=args.runs, num_blocks=args.num_blocks)
            for i, layout in enumerate(("per_layer", "cross_layer")):
                spec = dict(
                    common,
                    layout=layout,
                    role="solo",
                    rank=0,
                    tp_size=1,
                    seed=i,
                    model_id="qwen3-8b",
                    hash_prefix=f"{mode}-{layout}",
                    result=str(tmp / f"{mode}-{layout}.json"),
                )
                res = run_workers([spec], args.timeout)[0]
                raw.append(res)
                rows.append(summarize(res))
                print(mode, rows[-1], flush=True)
            done = str(tmp / f"{mode}-mla-writer-done")
            specs = [
                dict(
                    common,
                    layout="mla",
                    role="writer" if r == 0 else "reader",
                    rank=r,
                    tp_size=args.tp,
                    seed=7,
                    model_id="deepseek-v3",
                    hash_prefix=f"{mode}-mla",
                    writer_done=done,
                    result=str(tmp / f"{mode}-mla-{r}.json"),
                )
                for r in range(args.tp)
            ]
            mla = run_workers(specs, args.timeout)
            raw += mla
            for res in mla:
                rows.append(summarize(res))
                print(mode, rows[-1], flush=True)
            report["modes"][mode] = {"rows": rows, "raw": raw, "server_ready": server.ready}
        finally:
            server.stop()
        (out_dir / "gpu_bench.json").write_text(json.dumps(report, indent=1))
    return report


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, direction in zip(axes, ("save", "load"), strict=True):
        labels, ours, ceil, anchor = [], [], [], []
        for mode in modes:
            for row in report["modes"][mode]["rows"]:
                if f"{direction}_gbps" not in row or (row["layout"] == "mla" and row["rank"] > 1):
                    continue
                labels.append(
                    f"{row['layout']}\n{mode}" + (f" r{row['rank']}" if row["layout"] == "mla" else "")
                )
                ours.append(row[f"{direction}_gbps"])
                ceil.append(row["ceiling_d2h_gbps" if direction == "save" else "ceiling_h2d_gbps"])
                anchor.append(ANCHOR[row["layout"]][direction])
        x = range(len(labels))
        ax.bar([i - 0.27 for i in x], ceil, 0.27, label="pinned memcpy ceiling (same run)", color="#bbbbbb")
        ax.bar(list(x), ours, 0.27, label="pegaflow (ours)", color="#1f77b4")
        ax.bar([i + 0.27 for i in x], anchor, 0.27, label="anchor (PegaFlow 0.25.1)", color="#ff7f0e")
        for i, (o, c) in enumerate(zip(ours, ceil, strict=True)):
            ax.text(i, o + 0.5, f"{o / c:.0%}", ha="center", fontsize=8)
        ax.axhline(0.93 * statistics.median(ceil), ls="--", lw=1, color="k", label="93% of the ceiling")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{direction}: 256 scattered blocks, end to end (GB/s)")
        ax.set_ylabel("GB/s")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(HERE.parent / "results")))
    ap.add_argument("--modes", default="auto,direct", help="server --gpu-copy-mode values to run")
    ap.add_argument("--runs", type=int, default=6, help="timed runs per scenario (median reported)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per save/load")
    ap.add_argument("--num-blocks", type=int, default=2048, help="GPU blocks per worker")
    ap.add_argument("--tp", type=int, default=4, help="emulated TP ranks sharing the MLA cache")
    ap.add_argument("--pool-size", default="12gb")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--plot", metavar="JSON", help="only draw gpu_bench.png from a results file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    if args.plot:
        plot(json.loads(pathlib.Path(args.plot).read_text()), pathlib.Path(args.plot).with_suffix(".png"))
        return
    report = orchestrate(args)
    try:
        plot(report, pathlib.Path(args.out) / "gpu_bench.png")
    except Exception as exc:  # noqa: BLE001 - the JSON is what matters; the plot can be redrawn with --plot
        print("plot failed:", exc)


if __name__ == "__main__":
    main()
