"""The interpreter's core (server/interpreter_core.py): which threads share one CPU, and which do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from pegaflow.client import KvLayout, PegaClient
from pegaflow.server import interpreter_core
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.interpreter_core import PROCESS_CPUS, InterpreterCore, parse_setting, resolve
from pegaflow.server.movers.block_hasher import BlockHasher
from pegaflow.server.runtime import start_server

CPU = max(PROCESS_CPUS)
several_cpus = pytest.mark.skipif(len(PROCESS_CPUS) < 2, reason="a pin is only visible with 2+ CPUs")


def test_settings_are_checked_and_auto_pins_only_small_hosts():
    assert parse_setting("auto") == "auto" and parse_setting("off") == "off"
    assert parse_setting(str(CPU)) == CPU and parse_setting(CPU) == CPU
    for bad in ("-1", "x", "", True, -3, 1 << 20):
        with pytest.raises(ValueError):
            parse_setting(bad)
    with pytest.raises(ValueError, match="interpreter_cpu"):
        ServerConfig(pool_size_bytes=16 * MIB, interpreter_cpu="fast")
    assert resolve("auto", frozenset({0, 1})) == 1
    assert resolve("auto", frozenset({3})) == 3
    assert resolve("auto", frozenset(range(16))) is None  # not measured there: the kernel places them
    assert resolve("off", frozenset({0, 1})) is None
    assert resolve(CPU) == CPU


def _affinity_of(name: str) -> list[set[int]]:
    return [os.sched_getaffinity(t.native_id) for t in threading.enumerate() if t.name == name]


def _serve_a_save(tmp_path, setting):
    srv = start_server(
        ServerConfig(
            pool_size_bytes=64 * MIB,
            addr="127.0.0.1:0",
            http_addr=None,
            fd_socket_path=str(tmp_path / "pool.sock"),
            free_reserve_bytes=4 * MIB,
            interpreter_cpu=setting,
        )
    )
    try:
        with PegaClient(srv.address, name="core-test", read_lane=False) as client:
            inst = client.register_instance(KvLayout(model_id="m", block_bytes=MIB))
            batch = client.allocate(inst, [b"a%02d" % i for i in range(4)])
            client.seal(batch.save_id)
            assert client._conn.local is not None and client._conn.local.calls["AllocateBlocks"] == 1
        return _affinity_of("pegaflow-local-rpc"), _affinity_of("pegaflow-free-reserve"), srv
    finally:
        srv.stop()


@several_cpus
def test_the_local_rpc_workers_and_the_reserve_share_the_interpreters_cpu(tmp_path):
    workers, reserve, srv = _serve_a_save(tmp_path, CPU)
    assert workers and all(a == {CPU} for a in workers)
    assert reserve == [{CPU}]
    # Only those: the process's other threads keep its CPUs.
    assert os.sched_getaffinity(0) == set(PROCESS_CPUS)
    assert all(a == set(PROCESS_CPUS) for a in _affinity_of("pegaflow-metrics-feeder"))


@several_cpus
def test_off_pins_nothing(tmp_path):
    workers, reserve, _ = _serve_a_save(tmp_path, "off")
    assert workers and all(a == set(PROCESS_CPUS) for a in workers)
    assert reserve == [set(PROCESS_CPUS)]


@several_cpus
def test_what_a_pinned_thread_starts_gets_the_process_cpus_back():
    core = InterpreterCore(CPU)
    seen: dict[str, set[int]] = {}

    def pinned() -> None:
        core.pin()
        seen["pinned"] = os.sched_getaffinity(0)
        hasher = BlockHasher()  # its pool's thread starts here, from a pinned thread
        try:
            seen["hasher"] = hasher._pool.submit(os.sched_getaffinity, 0).result(10)
        finally:
            hasher.close()
        env = interpreter_core.child_environment(dict(os.environ))
        code = (
            "import json, os; from pegaflow.server import interpreter_core as c; c.release_child(); "
            "print(json.dumps(sorted(os.sched_getaffinity(0))))"
        )
        cmd = [sys.executable, "-c", code]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        seen["child"] = set(json.loads(out.stdout))

    t = threading.Thread(target=pinned)
    t.start()
    t.join(60)
    assert seen["pinned"] == {CPU}
    assert seen["hasher"] == set(PROCESS_CPUS)
    assert seen["child"] == set(PROCESS_CPUS)
