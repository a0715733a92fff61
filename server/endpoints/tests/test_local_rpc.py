"""The local RPC socket against a real server process: the same answers as gRPC, deadlines, bad frames,
restarts and the fallback to gRPC. Queries go to the engine here (read_lane=False): the read lane,
which answers them first by default, has its own tests (server/read_lane/tests)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from pegaflow.client import KvLayout, PegaClient, errors
from pegaflow.common.wire import frames
from pegaflow.common.wire import local_rpc as wire
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.endpoints.tests.support import (
    LAYOUT,
    assert_hung_up,
    connect_raw,
    remove_stale_sockets,
    rpc_count,
    save_and_load,
)
from pegaflow.server.testing import ServerProcess, free_port, sigstop, wait_for

DEADLINE_MARGIN_S = 5.0  # generous: a loaded machine may be slow to schedule the waiting thread

pytestmark = pytest.mark.timeout(180)


def read_hello(sock) -> tuple[int, str]:
    magic, version, epoch = frames.read_hello(sock, time.monotonic() + 10)
    assert magic == wire.HELLO_MAGIC
    return version, epoch


def read_answer(sock) -> wire.Response:
    return wire.decode_response(frames.read_frame(sock, 1 << 20, time.monotonic() + 10))


# ------------------------------------------------------------------ same answers


def test_calls_travel_over_the_local_socket_and_bytes_round_trip(server, client):
    path = client.local_rpc_socket
    assert path and pathlib.Path(path).is_socket()
    assert os.stat(path).st_mode & 0o777 == 0o660
    inst = client.register_instance(LAYOUT)
    queries_before = rpc_count(server, "QueryPrefix")
    data, out, hits = save_and_load(client, inst, "roundtrip")
    assert hits == 8 and np.array_equal(out, data)
    calls = client.local_rpc_calls
    for method in ("RegisterInstance", "AllocateBlocks", "SealBlocks", "QueryPrefix", "ReleaseLease"):
        assert calls.get(method) == 1, calls
    # The release went out without an answer; calls on the same connection run in order after it.
    stats = client.stats()
    assert stats.live_leases == 0 and stats.load_bytes == data.nbytes
    assert client.local_rpc_calls["GetStats"] == 1
    # The servicer's own frame ran it: its per-call metric counted the local call.
    assert rpc_count(server, "QueryPrefix") == queries_before + 1


def test_errors_arrive_as_the_exceptions_grpc_gives(server, client):
    grpc_client = PegaClient(server.addr, timeout_s=10.0, local_rpc=False, read_lane=False)
    grpc_client.connect()
    try:
        assert grpc_client.local_rpc_socket == ""
        inst = client.register_instance(LAYOUT)
        grpc_inst = grpc_client.register_instance(LAYOUT)
        bad_layout = KvLayout(model_id="m", block_bytes=0, dtype="bfloat16", block_tokens=16, num_layers=2)
        cases = [
            (lambda c, i: c.release("l-unknown"), errors.NotFound),
            (lambda c, i: c.seal("w-unknown"), errors.NotFound),
            (lambda c, i: c.load_blocks(i, "l-unknown"), errors.NotFound),
            (lambda c, i: c.register_instance(bad_layout), errors.InvalidArgument),
            (lambda c, i: c.query_prefix(i, [b"x"], lease=True, lease_ttl_s=10**6), errors.InvalidArgument),
        ]
        not_found_before = rpc_count(server, "ReleaseLease", "NOT_FOUND")
        for call, expected in cases:
            local_calls = sum(client.local_rpc_calls.values())
            with pytest.raises(expected) as local_err:
                call(client, inst)
            assert sum(client.local_rpc_calls.values()) == local_calls + 1  # answered by the socket
            with pytest.raises(expected) as grpc_err:
                call(grpc_client, grpc_inst)
            assert type(local_err.value) is type(grpc_err.value)
            assert str(local_err.value) == str(grpc_err.value)
            assert getattr(local_err.value, "kind", None) == getattr(grpc_err.value, "kind", None)
        assert rpc_count(server, "ReleaseLease", "NOT_FOUND") == not_found_before + 2
        assert client.connected  # an answered error is not a transport failure
    finally:
        grpc_client.close()


def test_an_unknown_session_is_session_lost_and_the_client_reconnects(server, client):
    inst = client.register_instance(LAYOUT)
    first = client.session_id
    client._conn.session_id = "s-forgotten"  # as if the server had expired this session
    with pytest.raises(errors.SessionLost):
        client.query_prefix(inst, [b"x"])
    wait_for(lambda: client.connected and client.session_id not in (first, "s-forgotten") and inst.registered)
    data, out, hits = save_and_load(client, inst, "after-loss")
    assert hits == 8 and np.array_equal(out, data)
    assert client.local_rpc_calls.get("QueryPrefix") == 1


# ------------------------------------------------------------------ deadlines


def test_a_stopped_server_costs_a_call_no_more_than_its_deadline(tmp_path):
    # A session TTL far beyond the stop: the late lease can only be released by the undo under test.
    srv = ServerProcess(tmp_path, pool_size="64mb", extra_args=["--session-ttl", "300"]).start()
    client = PegaClient(srv.addr, timeout_s=10.0, read_lane=False)
    try:
        client.connect()
        session = client.session_id
        inst = client.register_instance(LAYOUT)
        save_and_load(client, inst, "held")  # this thread's connection is open
        held = [f"held-{i}".encode() for i in range(8)]
        sigstop(srv.proc.pid)
        try:
            for _ in range(2):  # the open connection, then (that one dropped at its deadline) a new one
                t0 = time.monotonic()
                with pytest.raises(errors.ServerUnavailable):  # DeadlineExceeded is one
                    client.query_prefix(inst, held, lease=True, lease_ttl_s=600, timeout_s=1.0)
                assert time.monotonic() - t0 < 1.0 + DEADLINE_MARGIN_S
            elapsed: list[float] = []

            def fresh_thread() -> None:
                t0 = time.monotonic()
                try:
                    client.allocate(inst, [b"y"], timeout_s=1.0)
                except errors.ServerUnavailable:
                    elapsed.append(time.monotonic() - t0)

            t = threading.Thread(target=fresh_thread)
            t.start()
            t.join(30)
            assert elapsed and elapsed[0] < 1.0 + DEADLINE_MARGIN_S
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        # The server read the first query only after it was continued, with its caller gone: the
        # lease it granted was released at once (not at its 600 s TTL, nor with the session).
        wait_for(lambda: client.stats().live_leases == 0, timeout_s=30)
        assert client.session_id == session
        data, out, hits = save_and_load(client, inst, "after-stop")
        assert hits == 8 and np.array_equal(out, data)
        assert client.local_rpc_calls.get("QueryPrefix", 0) >= 2
    finally:
        client.close()
        srv.kill()
        remove_stale_sockets(srv)


def test_a_call_whose_caller_hung_up_is_undone(tmp_path):
    """As over gRPC (a cancelled call): a lease granted to a caller that is gone is released at once."""
    srv = ServerProcess(tmp_path, pool_size="64mb", extra_args=["--session-ttl", "300"]).start()
    client = PegaClient(srv.addr, timeout_s=10.0, read_lane=False)
    try:
        client.connect()
        inst = client.register_instance(LAYOUT)
        save_and_load(client, inst, "held")
        query = pb.QueryPrefixRequest(
            session_id=client.session_id,
            instance_id=inst.instance_id,
            block_hashes=[f"held-{i}".encode() for i in range(8)],
            lease=True,
            lease_ttl_ms=600_000,
        )
        sock = connect_raw(client.local_rpc_socket)
        read_hello(sock)
        sigstop(srv.proc.pid)
        try:  # the request and the hang-up are both waiting when the server next reads
            sock.sendall(wire.encode_request("QueryPrefix", query.SerializeToString(), 30.0))
            sock.close()
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        wait_for(lambda: rpc_count(srv, "QueryPrefix", "DEADLINE_EXCEEDED") == 1, timeout_s=30)
        assert client.stats().live_leases == 0
    finally:
        client.close()
        srv.kill()
        remove_stale_sockets(srv)


# ------------------------------------------------------------------ bad frames


def test_garbage_and_oversized_frames_leave_the_server_serving(server, client):
    inst = client.register_instance(LAYOUT)
    path = client.local_rpc_socket

    # Garbage: read as a length far beyond the limit; answered (not run) and hung up.
    with connect_raw(path) as sock:
        version, epoch = read_hello(sock)
        assert version == wire.VERSION and epoch == client.epoch
        sock.sendall(b"\xff\xff\xff\xff" + os.urandom(4092))
        answer = read_answer(sock)
        assert answer.not_executed and answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_hung_up(sock)

    # A frame longer than the server's message limit, announced by its length: refused unread.
    with connect_raw(path) as sock:
        read_hello(sock)
        sock.sendall(struct.pack("<I", 64 << 20) + b"\0" * 1024)
        answer = read_answer(sock)
        assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds the limit" in answer.message

    # A well-framed body of another protocol version, and one too short for a header.
    for body in (b"\x09" + os.urandom(40), b"\x01"):
        with connect_raw(path) as sock:
            read_hello(sock)
            sock.sendall(struct.pack("<I", len(body)) + body)
            answer = read_answer(sock)
            assert answer.not_executed and answer.code == grpc.StatusCode.UNIMPLEMENTED
            assert_hung_up(sock)

    with connect_raw(path) as sock:
        read_hello(sock)
        # An unknown method: not run; the connection stays usable.
        sock.sendall(wire.encode_request("OpenSession", b"", 5.0))
        answer = read_answer(sock)
        assert answer.not_executed and answer.code == grpc.StatusCode.UNIMPLEMENTED
        # A request message that does not parse: INVALID_ARGUMENT, as over gRPC, and counted.
        undecodable = rpc_count(server, "QueryPrefix", "INVALID_ARGUMENT")
        sock.sendall(wire.encode_request("QueryPrefix", b"\xff\xff\xff\xff", 5.0))
        answer = read_answer(sock)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and not answer.not_executed
        assert "not a valid QueryPrefixRequest" in answer.message
        assert rpc_count(server, "QueryPrefix", "INVALID_ARGUMENT") == undecodable + 1
        # Oneway requests get no answer, not even a refusal: the next answer is the next call's.
        sock.sendall(wire.encode_request("Heartbeat", b"", 5.0, oneway=True))
        sock.sendall(wire.encode_request("ReleaseLease", b"\xff", 5.0, oneway=True))
        request = pb.GetStatsRequest().SerializeToString()
        sock.sendall(wire.encode_request("GetStats", request, 5.0))
        answer = read_answer(sock)
        assert answer.code == grpc.StatusCode.OK and pb.GetStatsResponse.FromString(answer.payload).epoch
        # A well-formed call with a session the server does not know: NOT_FOUND with its metadata.
        query = pb.QueryPrefixRequest(session_id="s-nobody", instance_id="i-x", block_hashes=[b"h"])
        sock.sendall(wire.encode_request("QueryPrefix", query.SerializeToString(), 5.0))
        answer = read_answer(sock)
        assert answer.code == grpc.StatusCode.NOT_FOUND
        assert ("pegaflow-not-found", "session") in answer.metadata

    # Half a frame, then gone; and a connection that never says anything.
    with connect_raw(path) as sock:
        sock.sendall(struct.pack("<I", 100) + b"\x01\x00")
    idle = connect_raw(path)
    try:
        assert server.alive()
        data, out, hits = save_and_load(client, inst, "after-garbage")
        assert hits == 8 and np.array_equal(out, data)
        assert client.local_rpc_calls.get("QueryPrefix") == 1
    finally:
        idle.close()


# ------------------------------------------------------------------ restarts and fallback


def test_after_a_restart_the_client_uses_the_new_servers_socket(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    srv = ServerProcess(tmp_path, pool_size="64mb", addr=addr).start()
    c = PegaClient(addr, timeout_s=5.0, name="restart", read_lane=False)  # queries over the local socket
    try:
        c.connect()
        inst = c.register_instance(LAYOUT)
        save_and_load(c, inst, "before")
        old_path, old_epoch = c.local_rpc_socket, c.epoch
        srv.kill()
        remove_stale_sockets(srv)
        with pytest.raises(errors.ServerUnavailable):
            c.query_prefix(inst, [b"x"])
        srv.start()  # same address, new process: new epoch, new socket
        wait_for(lambda: c.connected and c.epoch == srv.epoch and inst.registered)
        assert c.epoch != old_epoch
        assert c.local_rpc_socket and c.local_rpc_socket != old_path
        data, out, hits = save_and_load(c, inst, "after")
        assert hits == 8 and np.array_equal(out, data)
        assert c.local_rpc_calls.get("QueryPrefix") == 1
    finally:
        c.close()
        srv.kill()
        remove_stale_sockets(srv)


def test_calls_fall_back_to_grpc_when_the_socket_is_unusable(server):
    c = PegaClient(server.addr, timeout_s=10.0, read_lane=False)
    c.connect()
    try:
        path = c.local_rpc_socket
        os.unlink(path)  # before the first call: no connection can be made
        queries_before = rpc_count(server, "QueryPrefix")
        inst = c.register_instance(LAYOUT)
        data, out, hits = save_and_load(c, inst, "fallback")
        assert hits == 8 and np.array_equal(out, data)
        assert c.local_rpc_calls == {}  # all of it went over gRPC
        assert rpc_count(server, "QueryPrefix") == queries_before + 1
        assert c.connected and c.local_rpc_socket == path
    finally:
        c.close()


def test_open_connections_outlive_the_socket_path(server, client):
    inst = client.register_instance(LAYOUT)  # opens a connection, kept for the next calls
    os.unlink(client.local_rpc_socket)
    data, out, hits = save_and_load(client, inst, "still-local")
    assert hits == 8 and np.array_equal(out, data)
    assert client.local_rpc_calls.get("QueryPrefix") == 1


def test_threads_share_connections_and_calls_run_side_by_side(server, client):
    inst = client.register_instance(LAYOUT)
    results: list = []

    def worker(wave: int, k: int) -> None:
        try:
            for r in range(3):
                data, out, hits = save_and_load(client, inst, f"t{wave}-{k}-{r}", n=4)
                results.append(hits == 4 and np.array_equal(out, data))
        except BaseException as exc:  # surfaced below
            results.append(exc)

    for wave in range(2):  # short-lived threads, as a thread per task: the second wave reuses connections
        threads = [threading.Thread(target=worker, args=(wave, k)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results == [True] * 36, results
    assert client.local_rpc_calls.get("QueryPrefix") == 36
    wait_for(lambda: client.stats().live_leases == 0)


def test_a_socket_of_another_server_is_never_used(tmp_path, server):
    """The greeting names the server's pool epoch: a namesake socket (another server) is refused."""
    other = ServerProcess(tmp_path / "other", pool_size="32mb").start()
    try:
        probe = PegaClient(other.addr, timeout_s=10.0, read_lane=False)
        probe.connect()
        other_socket = probe.local_rpc_socket
        probe.close()
        c = PegaClient(server.addr, timeout_s=10.0, read_lane=False)
        c.connect()
        try:
            c._conn.local.path = other_socket  # as if the advertised path led to the other server
            inst = c.register_instance(LAYOUT)
            data, out, hits = save_and_load(c, inst, "namesake")
            assert hits == 8 and np.array_equal(out, data)
            assert c.local_rpc_calls == {}
        finally:
            c.close()
    finally:
        other.stop()


# ------------------------------------------------------------------ bounded resources (issue 12 F3, F11)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_idle_connections_hold_no_server_threads(server, client):
    path = client.local_rpc_socket
    pid = server.proc.pid
    before = _threads(pid)
    socks = []
    try:
        for _ in range(200):
            sock = connect_raw(path)
            read_hello(sock)
            socks.append(sock)
        assert _threads(pid) <= before + 2  # (the old server: one thread per connection, for good)
    finally:
        for sock in socks:
            sock.close()


def test_announced_frames_cost_the_server_only_the_bytes_that_arrived(server, client):
    path = client.local_rpc_socket
    pid = server.proc.pid
    threads, rss = _threads(pid), _rss_bytes(pid)
    socks = []
    try:
        for _ in range(40):  # each announces a frame just under the limit, sends 1 KiB and stalls
            sock = connect_raw(path)
            read_hello(sock)
            sock.sendall(struct.pack("<I", 8 << 20) + b"\x01" * 1024)
            socks.append(sock)
        wait_for(lambda: _threads(pid) >= threads + 40, timeout_s=30)  # all 40 are being read
        grown = _rss_bytes(pid) - rss
        # The old server allocated each announced frame at once: +8.3 MB a connection, +330 MB here.
        assert grown < 40 << 20, f"the server grew by {grown >> 20} MiB"
    finally:
        for sock in socks:
            sock.close()
    data, out, hits = save_and_load(client, client.register_instance(LAYOUT), "after-announcements")
    assert hits == 8 and np.array_equal(out, data)


def test_a_call_that_reached_the_server_is_never_run_again_over_grpc(sock_dir):
    from pegaflow.server.config import MIB, ServerConfig
    from pegaflow.server.runtime import start_server

    srv = start_server(
        ServerConfig(
            pool_size_bytes=32 * MIB,
            addr="127.0.0.1:0",
            http_addr=None,
            fd_socket_path=os.path.join(sock_dir, "p.sock"),
            session_ttl_s=30.0,
        )
    )
    c = PegaClient(srv.address, timeout_s=20.0, read_lane=False)
    try:
        c.connect()
        inst = c.register_instance(LAYOUT)

        def allocations() -> float:
            samples = srv.metrics.registry.collect()
            return sum(
                s.value
                for metric in samples
                for s in metric.samples
                if s.name == "pegaflow_rpc_total" and s.labels.get("method") == "AllocateBlocks"
            )

        outcome: list = []
        with srv.engine._lock:  # the call reaches the server and waits there for the engine
            t = threading.Thread(target=lambda: outcome.append(_attempt(c.allocate, inst, [b"once"])))
            t.start()
            # The request was read (its bytes are held until its handler returns) and waits.
            wait_for(lambda: srv.local_rpc.budget.used_bytes > 0, timeout_s=10)
            with srv.local_rpc._lock:  # its connection dies mid-call, as when the server is killed
                socks = [x.sock for x in srv.local_rpc._conns.values()]
            for sock in socks:
                sock.shutdown(socket.SHUT_RDWR)
            t.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], errors.ServerUnavailable), outcome
        assert not isinstance(outcome[0], errors.DeadlineExceeded)
        wait_for(lambda: allocations() == 1, timeout_s=10)  # the server finished it (and undid it)
        assert allocations() == 1  # and gRPC never got it a second time
    finally:
        c.close()
        srv.stop(grace_s=0)


def _attempt(call, *args):
    try:
        return call(*args)
    except errors.PegaflowError as exc:
        return exc
