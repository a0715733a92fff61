"""A real pegaflow-server process with several real client processes.

Covers the data path across processes (bytes saved equal bytes loaded),
concurrency, namespace sharing/isolation (MLA shared across ranks, non-MLA
not), eviction that never touches leased blocks, lease expiry, clients killed
with SIGKILL mid-save or holding leases, bad input and garbage bytes on both
sockets, deadlines, a server restart, /metrics and gRPC health.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.client import KvLayout, PegaClient, QueryPurpose, errors, read_blocks, write_blocks
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.server.testing import ServerProcess, free_port

WORKER = pathlib.Path(__file__).resolve().parent / "client_worker.py"
BLOCK = 256 * 1024
LAYOUT = dict(
    model_id="tiny-llama",
    block_bytes=BLOCK,
    dtype="bfloat16",
    layout="test",
    block_tokens=16,
    num_layers=4,
    tp_size=1,
    tp_rank=0,
)

pytestmark = pytest.mark.timeout(300)


def hexes(n: int, tag: str) -> list[str]:
    return [f"{tag}-{i:05d}".encode().hex() for i in range(n)]


def run_worker(
    addr: str, action: str, hashes: list[str], tag: str, layout: dict | None = None, **extra
) -> dict:
    spec = dict(addr=addr, action=action, hashes=hashes, tag=tag, layout=layout or LAYOUT, **extra)
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)],
        capture_output=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def spawn_worker(addr: str, action: str, hashes: list[str], tag: str, layout: dict | None = None):
    spec = dict(addr=addr, action=action, hashes=hashes, tag=tag, layout=layout or LAYOUT)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    line = proc.stdout.readline()
    assert line, proc.stderr.read().decode()[-3000:]
    return proc, json.loads(line)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Polls until predicate() is truthy; returns its value (fails the test after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {timeout_s} s")
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A generous heartbeat TTL keeps a starved client alive on a loaded CI machine; dead clients are
    # still reclaimed at once through their pool connection (asserted below).
    with ServerProcess(
        tmp_path_factory.mktemp("server"), pool_size="128mb", extra_args=["--session-ttl", "30"]
    ) as srv:
        yield srv
        assert srv.alive(), srv.log_text()


@pytest.fixture
def client(server):
    c = PegaClient(server.addr, timeout_s=10.0, name="test")
    c.connect()
    yield c
    c.close()


def test_bytes_saved_by_one_process_are_loaded_by_another(server):
    hs = hexes(48, "xproc")
    saved = run_worker(server.addr, "save", hs, "xproc")
    assert saved["statuses"] == ["GRANTED"] * 48 and saved["sealed"] == 48
    loaded = run_worker(server.addr, "load", hs, "xproc")
    assert loaded["hits"] == 48 and loaded["match"] is True


def test_concurrent_clients_save_and_load_consistently(server, client):
    shared = hexes(16, "shared")
    procs = []
    for k in range(4):
        spec = dict(
            addr=server.addr, action="save", hashes=shared + hexes(16, f"own{k}"), tag="conc", layout=LAYOUT
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()[-3000:]
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
    # Each shared block was written by exactly one process; the others deduped.
    for i in range(16):
        statuses = [r["statuses"][i] for r in results]
        assert statuses.count("GRANTED") == 1
        assert set(statuses) <= {"GRANTED", "EXISTS", "IN_PROGRESS"}
    for r in results:
        assert r["statuses"][16:] == ["GRANTED"] * 16
    for k in range(4):
        loaded = run_worker(server.addr, "load", shared + hexes(16, f"own{k}"), "conc")
        # a shared block skipped as IN_PROGRESS by a writer that was still writing is sealed by now
        assert loaded["hits"] == 32 and loaded["match"] is True


def test_sharing_within_a_namespace_and_isolation_across(server):
    hs = hexes(8, "iso")
    run_worker(server.addr, "save", hs, "iso")
    same = run_worker(server.addr, "load", hs, "iso")
    other_model = run_worker(server.addr, "load", hs, "iso", layout={**LAYOUT, "model_id": "other-model"})
    other_dtype = run_worker(server.addr, "load", hs, "iso", layout={**LAYOUT, "dtype": "float16"})
    assert same["hits"] == 8 and same["match"]
    assert other_model["hits"] == 0 and other_dtype["hits"] == 0
    assert len({same["namespace_id"], other_model["namespace_id"], other_dtype["namespace_id"]}) == 3


def test_mla_namespace_is_shared_across_ranks_and_non_mla_is_not(server):
    hs = hexes(8, "tp")
    tp = {**LAYOUT, "tp_size": 2}
    run_worker(server.addr, "save", hs, "tp-mla", layout={**tp, "tp_rank": 0, "mla": True})
    mla_rank1 = run_worker(server.addr, "load", hs, "tp-mla", layout={**tp, "tp_rank": 1, "mla": True})
    assert mla_rank1["hits"] == 8 and mla_rank1["match"]
    run_worker(server.addr, "save", hs, "tp-plain", layout={**tp, "tp_rank": 0})
    plain_rank1 = run_worker(server.addr, "load", hs, "tp-plain", layout={**tp, "tp_rank": 1})
    plain_rank0 = run_worker(server.addr, "load", hs, "tp-plain", layout={**tp, "tp_rank": 0})
    assert plain_rank1["hits"] == 0 and plain_rank0["hits"] == 8 and plain_rank0["match"]


def metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://{server.http_addr}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def test_client_killed_mid_save_leaves_nothing_visible_and_leaks_nothing(server, client):
    disconnected = 'pegaflow_sessions_ended_total{cause="disconnected"}'
    timed_out = 'pegaflow_sessions_ended_total{cause="heartbeat_timeout"}'
    before = client.stats()
    disconnects_before, timeouts_before = metric(server, disconnected), metric(server, timed_out)
    proc, out = spawn_worker(server.addr, "half-save-hang", hexes(40, "killed"), "killed")
    try:
        assert out["granted"] == 40
        during = client.stats()
        assert during.writing_blocks == before.writing_blocks + 40
        assert during.pool_used_bytes == before.pool_used_bytes + 40 * BLOCK
    finally:
        kill_group(proc)
    after = wait_for(lambda: (s := client.stats()).writing_blocks == before.writing_blocks and s)
    assert after.pool_used_bytes == before.pool_used_bytes
    assert after.live_sessions == before.live_sessions
    # Reclaimed because its pool connection closed, not by waiting out the heartbeat TTL.
    assert metric(server, disconnected) == disconnects_before + 1
    assert metric(server, timed_out) == timeouts_before
    inst = client.register_instance(KvLayout(**LAYOUT))
    assert client.query_prefix(inst, [bytes.fromhex(h) for h in hexes(40, "killed")]).num_hits == 0


def test_client_killed_holding_a_lease_unpins_its_blocks(server, client):
    hs = hexes(10, "leasekill")
    run_worker(server.addr, "save", hs, "leasekill")
    base_pinned = client.stats().pinned_blocks
    disconnected = 'pegaflow_sessions_ended_total{cause="disconnected"}'
    disconnects_before = metric(server, disconnected)
    # The worker leases and never reads: it never maps the pool, yet holds its pool connection.
    proc, out = spawn_worker(server.addr, "lease-hang", hs, "leasekill")
    try:
        assert out["hits"] == 10
        assert client.stats().pinned_blocks == base_pinned + 10
    finally:
        kill_group(proc)
    wait_for(lambda: client.stats().pinned_blocks == base_pinned)
    assert metric(server, disconnected) == disconnects_before + 1  # at once, not after the session TTL
    with pytest.raises(errors.NotFound) as info:
        client.release(out["lease_id"])
    assert info.value.kind == "lease"


def test_lease_expires_at_its_ttl(server, client):
    inst = client.register_instance(KvLayout(**LAYOUT))
    hs = [bytes.fromhex(h) for h in hexes(3, "ttl")]
    batch = client.allocate(inst, hs)
    client.seal(batch.save_id)
    hit = client.query_prefix(inst, hs, lease=True, lease_ttl_s=0.3)
    assert hit.num_hits == 3
    leases_before = client.stats().live_leases
    wait_for(lambda: client.stats().live_leases == leases_before - 1)
    with pytest.raises(errors.NotFound):
        client.release(hit.lease_id)


def test_eviction_under_pressure_never_touches_leased_blocks(tmp_path):
    with ServerProcess(tmp_path, pool_size="32mb") as srv, PegaClient(srv.addr, timeout_s=10.0) as c:
        inst = c.register_instance(KvLayout(**LAYOUT))
        pinned = [f"pinned-{i}".encode() for i in range(16)]
        data = np.random.default_rng(1).integers(0, 256, size=(16, BLOCK), dtype=np.uint8)
        batch = c.allocate(inst, pinned)
        write_blocks(c.pool_view(batch.epoch), batch.allocations, data)
        c.seal(batch.save_id)
        hit = c.query_prefix(inst, pinned, lease=True)
        assert hit.num_hits == 16
        capacity_blocks = (32 << 20) // BLOCK
        churn = np.zeros((64, BLOCK), dtype=np.uint8)
        for r in range(4 * capacity_blocks // 64):  # 4x the pool through it, in batches of 64
            hs = [f"churn-{r}-{i}".encode() for i in range(64)]
            b = c.allocate(inst, hs)
            assert all(a.granted for a in b.allocations)
            write_blocks(c.pool_view(b.epoch), b.allocations, churn)
            c.seal(b.save_id)
        stats = c.stats()
        assert stats.evictions >= 3 * capacity_blocks
        assert stats.pinned_blocks == 16
        out = np.empty_like(data)
        read_blocks(c.pool_view(hit.epoch), hit.locations, out)
        assert np.array_equal(out, data)
        assert c.query_prefix(inst, pinned).num_hits == 16
        c.release(hit.lease_id)


def raw_stub(addr: str):
    channel = grpc.insecure_channel(addr)
    return channel, pb_grpc.EngineStub(channel)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_bad_inputs_get_invalid_argument_or_not_found_and_the_server_stays_up(server, client):
    inst = client.register_instance(KvLayout(**LAYOUT))
    channel, stub = raw_stub(server.addr)
    sid, iid = client.session_id, inst.instance_id
    t = 10.0
    try:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        missing = grpc.StatusCode.NOT_FOUND
        q = pb.QueryPrefixRequest
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id=sid, instance_id="i-nope", block_hashes=[b"a"]), timeout=t
                )
            )
            == missing
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id="s-nope", instance_id=iid, block_hashes=[b"a"]), timeout=t
                )
            )
            == missing
        )
        assert (
            code_of(lambda: stub.QueryPrefix(q(session_id=sid, instance_id=iid, block_hashes=[]), timeout=t))
            == bad
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id=sid, instance_id=iid, block_hashes=[b"x" * 65]), timeout=t
                )
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(q(session_id=sid, instance_id=iid, block_hashes=[b""]), timeout=t)
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id=sid, instance_id=iid, block_hashes=[b"a"] * 5000), timeout=t
                )
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id=sid, instance_id=iid, block_hashes=[b"a"], lease=True, lease_ttl_ms=10**9),
                    timeout=t,
                )
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id=sid, instance_id=iid, block_hashes=[b"a"], purpose=7), timeout=t
                )
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.AllocateBlocks(
                    pb.AllocateBlocksRequest(session_id=sid, instance_id=iid, block_hashes=[b"a"] * 5000),
                    timeout=t,
                )
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.QueryPrefix(q(session_id="", instance_id=iid, block_hashes=[b"a"]), timeout=t)
            )
            == bad
        )
        assert (
            code_of(
                lambda: stub.ReleaseLease(
                    pb.ReleaseLeaseRequest(session_id=sid, lease_id="l-nope"), timeout=t
                )
            )
            == missing
        )
        assert (
            code_of(
                lambda: stub.SealBlocks(pb.SealBlocksRequest(session_id=sid, save_id="w-nope"), timeout=t)
            )
            == missing
        )
        assert (
            code_of(
                lambda: stub.AbortBlocks(pb.AbortBlocksRequest(session_id=sid, save_id="w-nope"), timeout=t)
            )
            == missing
        )
        assert code_of(lambda: stub.Heartbeat(pb.HeartbeatRequest(session_id="s-nope"), timeout=t)) == missing
        huge = pb.KvLayout(**{**LAYOUT, "block_bytes": client.limits.max_block_bytes + 1})
        assert (
            code_of(
                lambda: stub.RegisterInstance(
                    pb.RegisterInstanceRequest(session_id=sid, layout=huge), timeout=t
                )
            )
            == bad
        )
        zero = pb.KvLayout(**{**LAYOUT, "block_bytes": 0})
        assert (
            code_of(
                lambda: stub.RegisterInstance(
                    pb.RegisterInstanceRequest(session_id=sid, layout=zero), timeout=t
                )
            )
            == bad
        )
        rank = pb.KvLayout(**{**LAYOUT, "tp_size": 2, "tp_rank": 5})
        assert (
            code_of(
                lambda: stub.RegisterInstance(
                    pb.RegisterInstanceRequest(session_id=sid, layout=rank), timeout=t
                )
            )
            == bad
        )
        assert (
            code_of(lambda: stub.RegisterInstance(pb.RegisterInstanceRequest(session_id=sid), timeout=t))
            == bad
        )
        batch = client.allocate(inst, [b"granted-one"])
        assert (
            code_of(
                lambda: stub.SealBlocks(
                    pb.SealBlocksRequest(
                        session_id=sid, save_id=batch.save_id, block_hashes=[b"never-granted"]
                    ),
                    timeout=t,
                )
            )
            == bad
        )
        client.abort(batch.save_id)
        # Through the client: typed exceptions, and the client-side batch check.
        with pytest.raises(errors.InvalidArgument):
            client.query_prefix(inst, [b"a"] * 5000)
        with pytest.raises(errors.InvalidArgument):
            client.register_instance(KvLayout(**{**LAYOUT, "block_bytes": 0}))
        with pytest.raises(errors.NotFound) as info:
            client.seal("w-nope")
        assert info.value.kind == "save"
        # A message bigger than the server accepts is refused by gRPC itself, not by a crash.
        assert (
            code_of(
                lambda: stub.QueryPrefix(
                    q(session_id=sid, instance_id=iid, block_hashes=[b"a" * 64] * 200_000), timeout=t
                )
            )
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
    finally:
        channel.close()
    assert server.alive()
    assert client.query_prefix(inst, [b"a"]).num_hits == 0


def test_garbage_bytes_on_the_grpc_port_and_the_fd_socket_do_not_hurt(server, client):
    host, port = server.addr.rsplit(":", 1)
    rng = np.random.default_rng(7)
    for payload in (
        rng.bytes(4096),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.bytes(4096),
        b"GET / HTTP/1.1\r\n\r\n",
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(2)
            try:
                s.recv(4096)
            except (TimeoutError, ConnectionResetError):
                pass
    answers = []
    for payload in (
        rng.bytes(300),
        b"x" * 1000,
        b"PEGAFLOW-POOL 1 s-not-a-session\n",
        b"PEGAFLOW-POOL 1 \xff\xfe\n",
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(server.fd_socket_path)
            s.sendall(payload)
            data, fds, _, _ = socket.recv_fds(s, 4096, 4)
            for fd in fds:
                os.close(fd)
            answers.append((data, fds))
    for data, fds in answers:
        assert fds == [] and b"error" in data
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects and never speaks
    idle.connect(server.fd_socket_path)
    try:
        loaded = run_worker(server.addr, "save", hexes(4, "aftergarbage"), "g")
        assert loaded["sealed"] == 4
        assert run_worker(server.addr, "load", hexes(4, "aftergarbage"), "g")["match"]
    finally:
        idle.close()
    assert server.alive()


def thread_states(pid: int) -> str:
    """One letter per thread of ``pid`` (R running, S sleeping, T stopped, ...), from /proc."""
    states = []
    for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread exited meanwhile
            continue
        states.append(text[text.rindex(")") + 2])
    return "".join(states)


def test_deadlines_are_honoured_and_do_not_break_the_client(server, client):
    inst = client.register_instance(KvLayout(**LAYOUT))
    os.kill(server.proc.pid, signal.SIGSTOP)  # a server that answers nothing at all
    try:
        # kill() returns before the stop lands: a call sent at once can still be served by a thread
        # that is running at that moment. Only once every thread is stopped does nothing answer.
        wait_for(lambda: set(thread_states(server.proc.pid)) == {"T"}, timeout_s=30, interval_s=0.001)
        for call in (
            lambda: client.query_prefix(inst, [b"a"], lease=True, timeout_s=0.3),
            lambda: client.allocate(inst, [b"stopped"], timeout_s=0.3),
            lambda: client.stats(timeout_s=0.3),
        ):
            with pytest.raises(errors.DeadlineExceeded):
                call()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert client.connected  # a missed deadline is not a lost server
    assert client.query_prefix(inst, [b"a"]).num_hits == 0
    # The server dropped what it granted to callers that had gone (or never served them).
    wait_for(lambda: (s := client.stats()).writing_blocks == 0 and s.live_leases == 0)


def test_a_lookup_then_leasing_loads_count_each_requested_block_once(tmp_path):
    """vLLM's scheduler looks a prompt up once; each worker rank then leases what it found (LOAD).
    Hits, misses, the measured hit rate and the HLL ceiling count the lookup only."""
    with ServerProcess(tmp_path, pool_size="64mb") as srv, PegaClient(srv.addr, timeout_s=10.0) as c:
        inst = c.register_instance(KvLayout(**LAYOUT))
        stored = [f"count-{i}".encode() for i in range(50)]
        c.seal(c.allocate(inst, stored).save_id)
        prompt = stored + [f"new-{i}".encode() for i in range(10)]
        found = c.query_prefix(inst, prompt).num_hits  # the scheduler's lookup (LOOKUP is the default)
        assert found == 50
        for _rank in range(2):
            hit = c.query_prefix(inst, prompt[:found], lease=True, purpose=QueryPurpose.LOAD)
            assert hit.num_hits == 50
            c.release(hit.lease_id, loaded_bytes=50 * BLOCK)
        stats = c.stats()
        assert (stats.hits, stats.misses) == (50, 10)
        assert (stats.lookup_queries, stats.load_queries, stats.load_missed_blocks) == (1, 2, 0)
        for window in ("15m", "1h", "24h"):
            assert stats.measured_hit_rate[window] == pytest.approx(50 / 60)
            # 60 distinct blocks requested once each: nothing could have been a hit. Counting the
            # loads as requests too would give 100 / 160 = 0.625.
            assert stats.hll_ceiling[window] == pytest.approx(0.0, abs=0.02)
        assert metric(srv, 'pegaflow_block_hits_total{tier="dram"}') == 50
        assert metric(srv, "pegaflow_load_queries_total") == 2


def test_grpc_health_and_metrics_endpoints(server, client):
    channel = grpc.insecure_channel(server.addr)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pegaflow.v1.Engine"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
    inst = client.register_instance(KvLayout(**LAYOUT))
    client.query_prefix(inst, [b"metrics-a", b"metrics-b"])
    with urllib.request.urlopen(f"http://{server.http_addr}/health", timeout=5) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    with urllib.request.urlopen(f"http://{server.http_addr}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for series in (
        "pegaflow_pool_capacity_bytes 1.34217728e+08",
        "pegaflow_pool_used_bytes",
        "pegaflow_resident_blocks",
        'pegaflow_block_hits_total{tier="dram"}',
        "pegaflow_block_misses_total",
        "pegaflow_evictions_total",
        "pegaflow_admission_rejections_total",
        "pegaflow_save_bytes_total",
        "pegaflow_load_bytes_total",
        "pegaflow_save_duration_seconds_bucket",
        "pegaflow_load_duration_seconds_bucket",
        'pegaflow_rpc_duration_seconds_bucket{le="0.001",method="QueryPrefix"}',
        "pegaflow_live_sessions",
        "pegaflow_live_instances",
        "pegaflow_live_leases",
        'pegaflow_measured_hit_rate{window="15m"}',
        'pegaflow_measured_hit_rate{window="24h"}',
    ):
        assert series in text, series


def test_server_restart_client_reconnects_and_reregisters(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    srv = ServerProcess(tmp_path, pool_size="64mb", addr=addr).start()
    c = PegaClient(addr, timeout_s=5.0, name="restart")
    try:
        c.connect()
        inst = c.register_instance(KvLayout(**LAYOUT))
        old_instance, old_epoch = inst.instance_id, c.epoch
        b = c.allocate(inst, [b"before"])
        c.seal(b.save_id)
        srv.kill()
        with pytest.raises(errors.ServerUnavailable):
            c.query_prefix(inst, [b"before"])
        srv.start()
        wait_for(lambda: c.connected and inst.registered and c.epoch == srv.epoch)
        assert inst.instance_id != old_instance and c.sessions_opened == 2
        with pytest.raises(errors.StaleEpoch):
            c.pool_view(old_epoch)
        assert c.query_prefix(inst, [b"before"]).num_hits == 0  # a new, empty pool
        data = np.full((1, BLOCK), 9, dtype=np.uint8)
        b = c.allocate(inst, [b"after"])
        write_blocks(c.pool_view(b.epoch), b.allocations, data)
        c.seal(b.save_id)
        hit = c.query_prefix(inst, [b"after"], lease=True)
        out = np.empty_like(data)
        read_blocks(c.pool_view(hit.epoch), hit.locations, out)
        c.release(hit.lease_id)
        assert np.array_equal(out, data)
    finally:
        c.close()
        srv.stop()
