"""The anchor, measured beside ours: the real PegaFlow (PyPI ``pegaflow-llm-cu13==0.25.1``, Rust server) on
the same GPU, workload and timing rules as bench/gpu_bench.py (run on a GPU host).

PegaFlow's Python package is also named ``pegaflow``, so this runs as its own process with only
PegaFlow's install on ``sys.path`` (``--site DIR``; gpu_bench.py ``--anchor-site`` starts it) and
imports nothing of ours. It follows the recorded anchor harness
(shared/reference/anchors/pegaflow_gpu_bench.py): one emulated vLLM worker registers its KV
tensors with ``pegaflow-server-py`` through CUDA IPC, then per run saves 256 scattered blocks
under fresh hashes and loads them into 256 other (zeroed) blocks, bytes verified on the GPU after
every load. Per layout, PegaFlow's best backend on this machine (recipes/gpu.md): per-layer K/V
tensors with its kernel backend, cross-layer blocks with its direct (merged cuMemcpyAsync)
backend, the MLA shape (61 x 576 latent) with its kernel backend.

Timings, both kinds, as ours: ``save_call_s`` until ``save`` returns; ``save_s`` until a
``query_prefetch`` sees all 256 blocks (polled every 0.5 ms, what the anchor harness does: its
save returns before the blocks are visible); ``load_s`` until the load's completion flag is set.
Same-run ceiling: one pinned-host <-> GPU copy of the same bytes, each way, before and after.

Usage: ``python bench/pegaflow_anchor.py --site /tmp/site --out DIR [--runs 10]`` -> DIR/pegaflow_anchor.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
import uuid

NSEL = 256


def _log(result: dict, key: str, value) -> None:
    result[key] = value
    print(f"anchor {key}: {value}", flush=True)


def pinned_ceiling(torch, nbytes: int, reps: int = 5) -> dict:
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


def _visible(client, QueryReady, inst, hashes, tag, t0, limit_s=60.0) -> float:
    """Polls until a prefix query sees every block (the anchor harness's rule); returns the time."""
    while True:
        q = client.query_prefetch(inst, hashes, f"{tag}-{uuid.uuid4().hex[:6]}")
        if isinstance(q, QueryReady) and q.num_hit_blocks == len(hashes):
            t = time.perf_counter() - t0
            client.release(q.lease)
            return t
        if isinstance(q, QueryReady) and q.num_hit_blocks > 0:
            client.release(q.lease)
        time.sleep(0.0005)
        if time.perf_counter() - t0 > limit_s:
            raise TimeoutError(f"{tag}: saved blocks never all visible")


def scenario(pf, torch, client, name: str, backend: str, runs: int, nb: int) -> dict:
    EngineRpcClient, PyLoadState, QueryReady, CudaIPCWrapper = pf  # noqa: N806 - PegaFlow's names
    L, BS, H, D = 36, 16, 8, 128  # noqa: N806 - the anchor's names
    if name == "mla":
        layers, ch = 61, 16 * 576 * 2
        kv = [torch.randn(nb, 16, 576, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        reg = (names, [nb] * layers, [ch] * layers, [0] * layers, [1] * layers)
        block_bytes = layers * ch
    elif name == "cross_layer":
        ch = BS * H * D * 2
        kv = [torch.randn(nb, L, 2, BS, H, D, dtype=torch.bfloat16, device="cuda")]
        names = ["ALL_LAYERS"]
        reg = (names, [nb], [L * 2 * ch], [0], [1])
        block_bytes = L * 2 * ch
    else:
        ch = BS * H * D * 2
        kv = [torch.randn(2, nb, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
        names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        reg = (names, [nb] * L, [ch] * L, [nb * ch] * L, [2] * L)
        block_bytes = L * 2 * ch
    torch.cuda.synchronize()
    inst = f"anchor-{name}-{uuid.uuid4().hex[:6]}"
    ns = f"ns-{name}-{backend}"
    wrappers = [pickle.dumps(CudaIPCWrapper(t)) for t in kv]
    ok, msg = client.register_context_batch(
        inst, ns, 0, 0, 1, 1, 0, reg[0], wrappers, *reg[1:], backend, False
    )
    if not ok:
        raise RuntimeError(f"register_context_batch: {msg}")
    client.start_session_watcher(inst, ns, 1, 1)
    nbytes = NSEL * block_bytes
    out: dict = dict(layout=name, backend=backend, nbytes=nbytes, runs=runs)
    out["ceiling"] = pinned_ceiling(torch, nbytes)
    save_call, save_vis, loads, verified = [], [], [], []
    for run in range(runs + 1):  # run 0 warms up, untimed
        perm = torch.randperm(nb)
        sel, dst = perm[:NSEL].tolist(), perm[NSEL : 2 * NSEL].tolist()
        hashes = [uuid.uuid4().bytes + uuid.uuid4().bytes for _ in sel]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok, msg = client.save(inst, 0, 0, 0, [(n, sel, hashes) for n in names])
        t_call = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"save: {msg}")
        t_vis = _visible(client, QueryReady, inst, hashes, f"r{run}", t0)
        q = client.query_prefetch(inst, hashes, f"load-{run}-{uuid.uuid4().hex[:6]}")
        if not (isinstance(q, QueryReady) and q.num_hit_blocks == NSEL):
            raise RuntimeError("the saved blocks vanished before the load")
        idx = torch.as_tensor(sel, device="cuda")
        didx = torch.as_tensor(dst, device="cuda")
        if name == "per_layer":
            ref = [t.index_select(1, idx) for t in kv]
            for t in kv:
                t.index_fill_(1, didx, 0)
        else:
            ref = [t.index_select(0, idx) for t in kv]
            for t in kv:
                t.index_fill_(0, didx, 0)
        torch.cuda.synchronize()
        st = PyLoadState()
        t0 = time.perf_counter()
        client.load(inst, 0, 0, st.shm_name(), [names], [(q.lease, [dst])])
        while not st.is_ready():
            if time.perf_counter() - t0 > 60:
                raise TimeoutError("load never completed")
        t_load = time.perf_counter() - t0
        torch.cuda.synchronize()
        dim = 1 if name == "per_layer" else 0
        good = st.get_state() == 1 and all(
            torch.equal(t.index_select(dim, didx), r) for t, r in zip(kv, ref, strict=True)
        )
        if run:
            save_call.append(t_call)
            save_vis.append(t_vis)
            loads.append(t_load)
            verified.append(bool(good))
    out.update(save_call_s=save_call, save_s=save_vis, load_s=loads, load_verified=all(verified))
    out["ceiling_after"] = pinned_ceiling(torch, nbytes)
    client.unregister_context(inst)
    del kv
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", required=True, help="folder holding PegaFlow's install (pip --target)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--pool-size", default="24gb")
    ap.add_argument("--scenarios", default="per_layer:kernel,cross_layer:direct,mla:kernel")
    args = ap.parse_args()
    sys.path.insert(0, args.site)
    import torch

    from pegaflow._bin_utils import binary_env, find_binary
    from pegaflow.ipc_wrapper import CudaIPCWrapper
    from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryReady

    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "scenarios": {}}
    port = 50155
    log_path = os.path.join(args.out, "pegaflow_anchor_server.log")
    os.makedirs(args.out, exist_ok=True)
    srv = subprocess.Popen(
        [
            find_binary("pegaflow-server-py"),
            "--addr",
            f"127.0.0.1:{port}",
            "--pool-size",
            args.pool_size,
            "--http-addr",
            "127.0.0.1:9191",
            "--devices",
            "0",
        ],
        env=binary_env(),
        stdout=open(log_path, "w"),  # noqa: SIM115 - the server's output, for its life
        stderr=subprocess.STDOUT,
    )
    try:
        t0 = time.time()
        client = None
        while time.time() - t0 < 180:
            if srv.poll() is not None:
                raise RuntimeError(f"pegaflow-server-py exited (rc {srv.returncode}); see {log_path}")
            try:
                client = EngineRpcClient(f"http://127.0.0.1:{port}")
                if client.health()[0]:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.5)
        _log(result, "server_ready_s", round(time.time() - t0, 1))
        pf = (EngineRpcClient, PyLoadState, QueryReady, CudaIPCWrapper)
        for item in args.scenarios.split(","):
            name, backend = item.split(":")
            try:
                result["scenarios"][name] = scenario(
                    pf, torch, client, name, backend, args.runs, args.num_blocks
                )
                r = result["scenarios"][name]
                print(
                    "anchor",
                    name,
                    backend,
                    "median save/load GB/s",
                    round(r["nbytes"] / statistics.median(r["save_s"]) / 1e9, 1),
                    round(r["nbytes"] / statistics.median(r["load_s"]) / 1e9, 1),
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - recorded, the other scenarios still run
                result["scenarios"][name] = dict(error=repr(exc)[:500], backend=backend)
                print("anchor", name, "failed:", exc, flush=True)
            with open(os.path.join(args.out, "pegaflow_anchor.json"), "w") as f:
                json.dump(result, f, indent=1)
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
        with open(os.path.join(args.out, "pegaflow_anchor.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
