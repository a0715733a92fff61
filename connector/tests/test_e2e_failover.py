"""PegaKVConnector end to end when pegaflow-server fails: one real `vllm serve` (never
restarted) whose server is absent, then appears, dies, comes back and freezes.

(e) vLLM started while no server runs serves normally and starts hitting once one appears;
(d) the server is killed mid-run and restarted: every request is answered correctly and
    hits resume without restarting vLLM;
and a stopped (SIGSTOP) server delays requests by a bounded time, not by its RPC timeout.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import signal
import threading
import time

import pytest

from pegaflow.client import PegaClient
from pegaflow.connector.tests.e2e_support import (
    MAX_TOKENS,
    ask,
    loadable_tokens,
    prompt,
    start_vllm,
    warm_up,
)
from pegaflow.server.testing import ServerProcess, free_port, sigstop
from pegaflow.tools.vllm_cpu.tiny_model import TinyModelSpec, ensure_tiny_model

pytestmark = pytest.mark.timeout(900)

# Far above the step-path deadlines (lookup 200 ms + load 500 ms): a request that waited
# on an RPC without those deadlines would take this long and fail the latency bound.
RPC_TIMEOUT_MS = 30_000
LATENCY_BOUND_S = 10.0
_seeds = itertools.count(1000)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("failover")
    model = ensure_tiny_model(tmp_path_factory.mktemp("models"), TinyModelSpec(arch="qwen3"))
    addr = f"127.0.0.1:{free_port()}"
    server = ServerProcess(work / "pegaflow", pool_size="512mb", addr=addr)  # not started yet
    vllm = start_vllm(model, work / "vllm", addr=addr, extra_config={"rpc_timeout_ms": RPC_TIMEOUT_MS})
    try:
        vllm.wait_ready(timeout_s=600)
        warm_up(vllm)
        yield {"server": server, "vllm": vllm, "pid": vllm.proc.pid}
    finally:
        vllm.stop()
        server.stop()


def hits_resume(vllm, timeout_s: float = 90.0) -> None:
    """Fresh prompts, each sent twice, until the second send takes its full blocks from
    pegaflow (the connector attached, saved, and looked up again on its own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        p = prompt(next(_seeds))
        ask(vllm, p)
        time.sleep(0.3)  # saves are sealed asynchronously, milliseconds after the step
        _, hits, _ = ask(vllm, p)
        if hits == loadable_tokens(vllm, len(p)):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"no external hits within {timeout_s} s:\n{vllm.log_tail()}")


class Traffic:
    """Sends the given prompts round-robin from a thread and records every answer."""

    def __init__(self, vllm, prompts: list[list[int]]):
        self.vllm = vllm
        self.prompts = prompts
        self.results: list[tuple[int, list[int] | None, float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for i in itertools.cycle(range(len(self.prompts))):
            if self._stop.is_set():
                return
            t0 = time.monotonic()
            try:
                out = self.vllm.complete(self.prompts[i], max_tokens=MAX_TOKENS, timeout_s=120)
                self.results.append((i, out.token_ids, time.monotonic() - t0, ""))
            except Exception as exc:  # recorded and asserted on, never swallowed
                self.results.append((i, None, time.monotonic() - t0, repr(exc)))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


def test_e_serves_without_a_server_and_attaches_when_one_appears(setup):
    vllm, server = setup["vllm"], setup["server"]
    p = prompt(1)
    first, hits1, _ = ask(vllm, p)
    second, hits2, _ = ask(vllm, p)
    assert hits1 == hits2 == 0
    assert len(first.token_ids) == MAX_TOKENS and second.token_ids == first.token_ids
    server.start()
    hits_resume(vllm)
    assert vllm.proc.pid == setup["pid"]


def test_d_server_killed_mid_run_and_restarted(setup):
    vllm, server = setup["vllm"], setup["server"]
    if not server.alive():
        server.start()
        hits_resume(vllm)
    prompts = [prompt(next(_seeds)) for _ in range(4)]
    expected = [vllm.complete(p, max_tokens=MAX_TOKENS).token_ids for p in prompts]
    with Traffic(vllm, prompts) as traffic:
        time.sleep(2.0)
        server.kill()  # SIGKILL: no goodbye, in-flight loads and saves lose their server
        killed_at = len(traffic.results)
        time.sleep(4.0)
        server.start()  # same address, new pool and epoch
        restarted_at = len(traffic.results)
        time.sleep(4.0)
    hits_resume(vllm)  # after the traffic: its own hits would blur the metric deltas
    results = traffic.results
    assert 0 < killed_at < restarted_at < len(results), "traffic did not run across the kill and restart"
    errors = [r for r in results if r[3]]
    assert not errors, errors[:3]
    wrong = [(i, got) for i, got, _, _ in results if got != expected[i]]
    assert not wrong, f"{len(wrong)} of {len(results)} answers differ, e.g. {wrong[:2]} vs {expected}"
    assert vllm.proc.pid == setup["pid"]  # the same vLLM throughout


def test_a_stopped_server_delays_requests_by_a_bounded_time(setup):
    vllm, server = setup["vllm"], setup["server"]
    if not server.alive():
        server.start()
    hits_resume(vllm)
    stats = PegaClient(server.addr, timeout_s=5.0, name="e2e-stats", map_pool=False)
    prompts = [prompt(next(_seeds)) for _ in range(3)]
    expected = [vllm.complete(p, max_tokens=MAX_TOKENS).token_ids for p in prompts]
    sigstop(server.proc.pid)
    try:
        with Traffic(vllm, prompts + [prompt(next(_seeds))]) as traffic:
            time.sleep(4.0)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    results = traffic.results
    assert len(results) >= 3
    assert not [r for r in results if r[3]]
    assert all(got == expected[i] for i, got, _, _ in results if i < len(expected))
    worst = max(latency for _, _, latency, _ in results)
    print(f"{len(results)} requests while the server was stopped; slowest {worst * 1e3:.0f} ms")
    assert worst < LATENCY_BOUND_S, f"a request took {worst:.1f} s while the server was stopped"
    hits_resume(vllm)
    try:
        stats.connect()
        assert stats.stats().resident_blocks > 0
    finally:
        stats.close()


@pytest.fixture(scope="module")
def slow_loader(tmp_path_factory):
    """A second engine whose loads may take longer than the server's session TTL (a load deadline of
    30 s), with the test hook that pauses a load between its lease and its copies."""
    work = tmp_path_factory.mktemp("stalled")
    model = ensure_tiny_model(tmp_path_factory.mktemp("models2"), TinyModelSpec(arch="qwen3"))
    server = ServerProcess(work / "pegaflow", pool_size="128mb").start()
    pause = work / "pause-after-lease"
    vllm = start_vllm(
        model,
        work / "vllm",
        addr=server.addr,
        extra_config={"load_timeout_ms": 30_000, "rpc_timeout_ms": 5_000},
        env={"PEGAFLOW_TEST_PAUSE_AFTER_LEASE": str(pause)},
    )
    try:
        vllm.wait_ready(timeout_s=600)
        warm_up(vllm)
        yield {"server": server, "vllm": vllm, "pause": pause}
    finally:
        vllm.stop()
        server.stop()


def test_a_reader_stopped_past_its_session_ttl_recomputes_instead_of_reading_reused_memory(slow_loader):
    """Issue 12, item 3 (finding F8): the engine process is SIGSTOPped after its worker leased a
    prompt's blocks and before it copied them, for longer than the server's session TTL; the server
    ends the session and the slots are reused for other bytes. Resumed, the worker copies, learns
    its lease was lost (the release is answered NOT_FOUND) and reports a load error: vLLM
    recomputes, and the answer equals the one computed cold. Without the check, the engine would
    compute on other blocks' bytes."""
    import numpy as np

    from pegaflow.client import KvLayout as Layout
    from pegaflow.client import write_blocks

    vllm, server, pause = slow_loader["vllm"], slow_loader["server"], slow_loader["pause"]
    p = prompt(next(_seeds))
    cold = vllm.complete(p, max_tokens=MAX_TOKENS).token_ids
    time.sleep(0.5)  # the asynchronous save lands
    failed_before = vllm.metrics().value("vllm:pegaflow_load_failed_blocks_total")
    pause.write_text("")
    answer: dict = {}
    t = threading.Thread(
        target=lambda: answer.update(out=vllm.complete(p, max_tokens=MAX_TOKENS, timeout_s=120))
    )
    t.start()
    leased = pathlib.Path(str(pause) + ".leased")
    deadline = time.monotonic() + 60
    while not leased.exists():
        assert time.monotonic() < deadline, vllm.log_tail()
        time.sleep(0.01)
    group = os.getpgid(vllm.proc.pid)
    os.killpg(group, signal.SIGSTOP)
    try:
        time.sleep(7.0)  # past the 5 s session TTL: the server ends the session and drops its leases
        with PegaClient(server.addr, timeout_s=10.0, name="e2e-reuser") as reuser:
            layout = Layout(model_id="reuser", model_fingerprint="f", dtype="bf16", layout="t",
                            block_tokens=16, block_bytes=1 << 20, num_layers=1, tp_size=1, tp_rank=0,
                            mla=False, extra="")  # fmt: skip
            inst = reuser.register_instance(layout)
            row = np.full(1 << 20, 0x5A, dtype=np.uint8)
            for i in range(3 * 128 // 16):  # 3x the pool: every slot the stopped reader leased is reused
                batch = reuser.allocate(inst, [f"reuse-{i}-{j}".encode() for j in range(16)])
                write_blocks(reuser.pool_view(batch.epoch), batch.allocations, [row] * len(batch.allocations))
                if batch.save_id:
                    reuser.seal(batch.save_id)
        pause.unlink()
    finally:
        os.killpg(group, signal.SIGCONT)
    t.join(120)
    assert answer["out"].token_ids == cold  # recomputed, not computed over reused memory
    assert vllm.metrics().value("vllm:pegaflow_load_failed_blocks_total") > failed_before
