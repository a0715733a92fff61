"""Times vLLM's own step calls in every engine of a benchmark, the ones without a connector too.

A vLLM general plugin (vLLM calls ``register()`` in each of its processes): with
``PEGAFLOW_STEP_TIMING=<dir>`` set, each process appends one JSON line per call of
``Scheduler.schedule`` (EngineCore: where a connector's lookup runs), ``GPUModelRunner.execute_model``,
``_prepare_inputs`` and ``sample_tokens`` (the worker: the CPU runner inherits them) to
``<dir>/<pid>.jsonl``: name, start and end on the monotonic clock (shared by the host's processes),
and for execute_model the tokens the step scheduled. bench/ttft.py (``--step-timing``) puts this
directory on the engines' PYTHONPATH (so that vLLM finds the entry point beside it) and summarizes
the lines per pass. Without the variable it does nothing. Benchmark instrumentation only: the
connector's own phases are in connector/trace.py.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

ENV = "PEGAFLOW_STEP_TIMING"
_lock = threading.Lock()
_out = None


def _write(line: dict) -> None:
    global _out
    with _lock:
        if _out is None:
            directory = os.environ[ENV]
            os.makedirs(directory, exist_ok=True)
            _out = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
        _out.write(json.dumps(line) + "\n")


def _tokens(args: tuple) -> int | None:
    try:
        return int(args[0].total_num_scheduled_tokens)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def _timed(cls: type, method: str, name: str, count_tokens: bool = False) -> None:
    original = getattr(cls, method, None)
    if original is None or getattr(original, "_pegaflow_timed", False):
        return

    @functools.wraps(original)
    def timed(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            line = {"n": name, "t0": t0, "t1": time.monotonic()}
            if count_tokens:
                line["tokens"] = _tokens(args)
            _write(line)

    timed._pegaflow_timed = True
    setattr(cls, method, timed)


def register() -> None:
    if not os.environ.get(ENV):
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _timed(Scheduler, "schedule", "schedule")
    _timed(GPUModelRunner, "execute_model", "execute_model", count_tokens=True)
    _timed(GPUModelRunner, "_prepare_inputs", "prepare_inputs")
    _timed(GPUModelRunner, "sample_tokens", "sample_tokens")
