"""What the two reliability runs share (faults.py: the fault matrix under load; soak.py: a bounded
soak): the engines and their one-thread CPU placement, the seeded trace whose prompts recur, the
reference answers computed once by an engine without the connector, a pegaflow-server on a fixed
address (so it can be killed and restarted where the engines look for it), and the figures' input.

Sizing for a 2-core machine shared with other work: two engines of one OpenMP thread each, prompts
of 1-2.5 K tokens with 8 generated tokens, two closed-loop users with a think time between their
requests, so the engines are busy a part of the time and the machine is not saturated by this run
(the runs measure correctness and stability, not throughput). Every report records the load
average at its start and the JSON of the soak records it at every sample.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
import urllib.request
from collections.abc import Sequence

import numpy as np

from pegaflow.bench.experiments.common import MIB, say
from pegaflow.bench.harness import connector_config, loadgen, models, traces
from pegaflow.bench.harness.reference import ReferenceStore, sweep_cases
from pegaflow.bench.harness.traces import TraceRequest
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig, VllmFleet
from pegaflow.server.testing import ServerProcess, free_port
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec

BLOCK_TOKENS = models.CPU_BLOCK_TOKENS

# The base trace both runs cycle through: 4 shared system prompts (8 blocks each, Zipf), sessions of
# 2-4 turns, 10 % one-off prompts; at most 2,432 prompt tokens (19 blocks of 1 MiB).
BASE_TRACE = traces.TraceSpec(
    seed=12,
    num_requests=72,
    num_system_prompts=4,
    system_prompt_tokens=1024,
    system_zipf=1.0,
    concurrent_sessions=8,
    turns_min=2,
    turns_max=4,
    user_turn_tokens=256,
    assistant_turn_tokens=128,
    one_off_share=0.1,
    one_off_tokens=1024,
    max_tokens=8,
    max_prompt_tokens=3072,
)


@dataclasses.dataclass(frozen=True)
class Setup:
    trace: traces.TraceSpec = BASE_TRACE
    model: TinyModelSpec = models.BENCH_MODEL
    engines: int = 2
    users: int = 2
    think_time_s: float = 0.5
    pool_bytes: int = 256 * MIB
    vllm_kv_cache_bytes: int = 256 * MIB
    max_model_len: int = 4096
    # >= the longest prompt: every prefill is one step, so a prompt's save is one allocate..seal
    max_num_batched_tokens: int = 4096
    # kv_connector_extra_config beyond server_addr: empty = the connector's production defaults
    connector: tuple[tuple[str, int], ...] = ()
    placement: CpuPlacement = CpuPlacement()
    ready_timeout_s: float = 600.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["connector"] = dict(self.connector)
        return d


def served_name(model_dir: pathlib.Path) -> str:
    """Every engine serves the model under its path: the launcher's own requests name it so."""
    return str(model_dir)


def engine_config(setup: Setup, model_dir: pathlib.Path, kv_transfer_config: dict | None) -> VllmConfig:
    return VllmConfig(
        model=str(model_dir),
        served_model_name=served_name(model_dir),
        max_model_len=setup.max_model_len,
        kv_cache_bytes=setup.vllm_kv_cache_bytes,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        kv_transfer_config=kv_transfer_config,
        placement=setup.placement,
        block_tokens=BLOCK_TOKENS,
    )


def connected_config(setup: Setup, model_dir: pathlib.Path, server_addr: str) -> VllmConfig:
    return engine_config(setup, model_dir, connector_config.shared_pool(server_addr, dict(setup.connector)))


def fresh_prompts(base: traces.Trace, count: int, extra_tokens: int, seed: int) -> list[TraceRequest]:
    """`count` prompts no trace request has: a trace prompt's head (its shared system prompt, when it
    has one) and `extra_tokens` new random tokens. Indices are negative (not trace requests)."""
    spec = base.spec
    rng = np.random.default_rng([seed, 7919])
    heads = [r for r in base.requests if r.kind == "session" and r.turn == 0] or list(base.requests)
    out = []
    for k in range(count):
        head = heads[k % len(heads)].prompt[: spec.system_prompt_tokens]
        tail = rng.integers(spec.first_token_id, spec.vocab_size, size=extra_tokens, dtype=np.int32)
        out.append(
            TraceRequest(
                index=-1 - k,
                kind="fresh",
                session=-1,
                turn=0,
                system_prompt=-1,
                prompt=np.concatenate([head, tail]).astype(np.int32),
                max_tokens=spec.max_tokens,
                route=0,
                depends_on=None,
            )
        )
    return out


def reference_identity(setup: Setup, model_dir: pathlib.Path) -> dict:
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {
        "model": model_dir.name,
        "vllm": version("vllm-cpu") or version("vllm"),
        "dtype": "bfloat16",
        "max_model_len": setup.max_model_len,
        "max_num_batched_tokens": setup.max_num_batched_tokens,
        "omp_threads": setup.placement.threads,
    }


def ensure_reference(
    setup: Setup,
    model_dir: pathlib.Path,
    requests: Sequence[TraceRequest],
    run_dir: pathlib.Path,
    cache_dir: pathlib.Path,
) -> tuple[ReferenceStore, dict]:
    """The reference answers of `requests`, computing the missing ones on one engine without the
    connector (one request at a time). Returns the store and what it took."""
    identity = reference_identity(setup, model_dir)
    store = ReferenceStore(ReferenceStore.file_for(cache_dir, identity), identity)
    todo = store.missing(requests)
    info = {"file": str(store.path), "identity": identity, "computed": len(todo), "seconds": 0.0}
    if not todo:
        say(f"reference: all {len(store.answers)} answers cached in {store.path}")
        return store, info
    t0 = time.monotonic()
    say(f"reference: {len(todo)} prompts to answer on an engine without the connector")
    with VllmFleet([engine_config(setup, model_dir, None)], run_dir, name_prefix="reference") as fleet:
        fleet.start(setup.ready_timeout_s)
        engine = fleet.servers[0]
        store.fill(
            requests,
            lambda r: engine.complete(r.prompt.tolist(), max_tokens=r.max_tokens, timeout_s=300).token_ids,
            progress=lambda n, total: say(f"reference: {n}/{total}") if n % 20 == 0 or n == total else None,
        )
    info["seconds"] = time.monotonic() - t0
    return store, info


def ensure_hit_references(
    setup: Setup,
    model_dir: pathlib.Path,
    records: Sequence[dict],
    requests: Sequence[TraceRequest],
    store: ReferenceStore,
    run_dir: pathlib.Path,
) -> dict:
    """vLLM's own answers with a prefix cached, for the prompts whose answers differ from the full
    prefill (bench/harness/reference.py: a prefix-cache hit can move a near-tie argmax). One engine
    WITHOUT the connector, its prefix cache on, dev endpoints on; per prompt and block-aligned k:
    cache reset, the prompt's first k tokens, then the prompt. An answer counts only when the
    engine's own prefix-cache hit counter grew by exactly k."""
    cases = sweep_cases(records, requests, store, BLOCK_TOKENS)
    info = {"prompts": len(cases), "computed": 0, "not_exact": 0, "seconds": 0.0}
    if not cases:
        return info
    t0 = time.monotonic()
    say(f"hit references: {len(cases)} prompt(s) differ from the full prefill; sweeping vLLM's own answers")
    config = dataclasses.replace(
        engine_config(setup, model_dir, None), prefix_caching=True, extra_env={"VLLM_SERVER_DEV_MODE": "1"}
    )
    with VllmFleet([config], run_dir, name_prefix="hit-reference") as fleet:
        fleet.start(setup.ready_timeout_s)
        engine = fleet.servers[0]

        def answer(request: TraceRequest, cached: int) -> list[int] | None:
            reset = urllib.request.Request(engine.base_url + "/reset_prefix_cache", data=b"", method="POST")
            urllib.request.urlopen(reset, timeout=30).close()
            engine.complete(request.prompt[:cached].tolist(), max_tokens=1, timeout_s=300)
            before = engine.metrics().local_hit_tokens
            got = engine.complete(request.prompt.tolist(), max_tokens=request.max_tokens, timeout_s=300)
            if engine.metrics().local_hit_tokens - before != cached:
                info["not_exact"] += 1
                return None
            return got.token_ids

        for request in cases:
            info["computed"] += store.fill_sweep(request, BLOCK_TOKENS, answer)
    info["seconds"] = time.monotonic() - t0
    return info


class FixedAddressServer:
    """A pegaflow-server that can be killed and started again on the same gRPC address (the engines'
    connector keeps dialling it), with a new pool each start. `pool_bytes` may change between
    starts (the pool-exhaustion scenario)."""

    def __init__(self, run_dir: pathlib.Path, pool_bytes: int, extra_args: Sequence[str] = ()):
        self.addr = f"127.0.0.1:{free_port()}"
        self.run_dir = run_dir
        self.extra_args = tuple(extra_args)
        self.configurations = 0
        self.proc = self._process(pool_bytes)

    def _process(self, pool_bytes: int) -> ServerProcess:
        """A server of this address with this pool; its logs in a folder of their own
        (pegaflow-server-<k>/server-<start>.log)."""
        self.pool_bytes = pool_bytes
        self.configurations += 1
        return ServerProcess(
            self.run_dir / f"pegaflow-server-{self.configurations}",
            pool_size=f"{pool_bytes}b",
            addr=self.addr,
            extra_args=self.extra_args,
        )

    def start(self) -> float:
        """Starts it and waits for its ready line (the pool allocated and pre-faulted); seconds taken."""
        t0 = time.monotonic()
        self.proc.start()
        return time.monotonic() - t0

    def restart_with_pool(self, pool_bytes: int) -> float:
        """Graceful stop, then a start with another pool size on the same address."""
        self.proc.stop()
        self.proc = self._process(pool_bytes)
        return self.start()

    @property
    def pid(self) -> int:
        return self.proc.proc.pid

    def logs(self) -> list[pathlib.Path]:
        return sorted(self.run_dir.glob("pegaflow-server-*/server-*.log"))

    def stop(self) -> None:
        self.proc.stop()


def start_fleet(setup: Setup, model_dir: pathlib.Path, server_addr: str, run_dir: pathlib.Path) -> VllmFleet:
    fleet = VllmFleet([connected_config(setup, model_dir, server_addr)] * setup.engines, run_dir, "engine")
    say(f"starting {setup.engines} engine(s) attached to {server_addr}")
    ready = fleet.start(setup.ready_timeout_s)
    say(f"engines ready in {', '.join(f'{r:.1f}' for r in ready)} s")
    loadgen.run_warmup(fleet.endpoints, served_name(model_dir))
    return fleet


def count_log_lines(path: pathlib.Path, start_offset: int, needles: Sequence[str]) -> dict:
    """Lines after byte `start_offset` of a log holding each needle (ERROR, Traceback, ...)."""
    try:
        with open(path, "rb") as f:
            f.seek(start_offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return dict.fromkeys(needles, 0)
    lines = text.splitlines()
    return {n: sum(n in line for line in lines) for n in needles}


def log_size(path: pathlib.Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
