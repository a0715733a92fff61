"""The GPU doorbell on CPU: a whole in-process server whose GPU data path is a StandInGpu, reached by a
real PegaClient, and a doorbell in a process of its own for stops.

What is tested is everything but the copy: the codec, the shared socket plumbing, the answers and
errors (identical to the RPCs'), metrics, deadlines, and that a request is never run twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pegaflow.client import PegaClient, errors
from pegaflow.client import rpc_codec as codec
from pegaflow.client.device import DeviceRegistration, ExportedTensor
from pegaflow.client.doorbell import OP_LOAD, OP_SAVE, DoorbellClient
from pegaflow.client.frame_link import LocalRpcError
from pegaflow.common.wire import doorbell as wire
from pegaflow.common.wire import frames
from pegaflow.common.wire.device_registration import Segment
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.server.config import ServerConfig
from pegaflow.server.endpoints.doorbell import DoorbellServer
from pegaflow.server.endpoints.tests.support import LAYOUT, StandInGpu, assert_hung_up, connect_raw
from pegaflow.server.testing import sigstop, wait_for

pytestmark = pytest.mark.timeout(120)
DEADLINE_MARGIN_S = 5.0
REG = DeviceRegistration(
    device_uuid="00" * 16,
    tensors=(ExportedTensor(bytes(64), 0, 64 * 100),),
    segments=(Segment(0, 0, 64, 64),),
    num_blocks=100,
)
HASHES = [b"h%d" % i for i in range(8)]


@pytest.fixture
def gpu_client(gpu_server):
    srv, gpu = gpu_server
    c = PegaClient(srv.address, timeout_s=10.0, name="doorbell-test")
    c.connect()
    inst = c.register_instance(LAYOUT)
    dev = c.register_device_memory(inst, REG)
    try:
        yield srv, gpu, c, dev
    finally:
        c.close()


def rpc_total(srv, method: str, code: str = "OK") -> float:
    return (
        srv.metrics.registry.get_sample_value("pegaflow_rpc_total", {"method": method, "code": code}) or 0.0
    )


def served_by_doorbell(gpu: StandInGpu) -> bool:
    return gpu.calls[-1][0].startswith("pegaflow-doorbell")


def test_saves_and_loads_ring_the_doorbell_and_are_counted_like_every_rpc(gpu_client):
    srv, gpu, c, dev = gpu_client
    assert dev.doorbell is not None and dev.doorbell.path == srv.doorbell.path
    assert os.stat(dev.doorbell.path).st_mode & 0o777 == 0o660
    saves, loads = rpc_total(srv, "SaveFromDevice"), rpc_total(srv, "LoadToDevice")
    out = c.save_from_device(dev, HASHES, list(range(8)))
    assert (out.statuses, out.written) == ([1] * 8, 8) and served_by_doorbell(gpu)
    assert c.load_to_device(dev, HASHES, list(range(8))) == 7 and served_by_doorbell(gpu)
    assert c.load_to_device(dev, HASHES, list(range(8)), purpose=1) == 8  # LOAD travels in the flags
    # The servicer's own frame ran them: the RPC metrics count doorbell calls under the RPC's name.
    assert rpc_total(srv, "SaveFromDevice") == saves + 1
    assert rpc_total(srv, "LoadToDevice") == loads + 2


def test_errors_are_the_rpcs_errors(gpu_client):
    srv, gpu, c, dev = gpu_client
    bell = dev.doorbell
    cases = [
        (lambda: c.save_from_device(dev, HASHES, [1000] * 8), errors.InvalidArgument),  # the data path's
        (lambda: c.load_to_device(dev, [b"x" * 65], [1]), errors.InvalidArgument),  # the client's limits
    ]
    for call, expected in cases:
        with pytest.raises(expected) as over_doorbell:
            call()
        dev.doorbell = None  # the same call over gRPC
        try:
            with pytest.raises(expected) as over_grpc:
                call()
        finally:
            dev.doorbell = bell
        assert str(over_doorbell.value) == str(over_grpc.value)
    # What the server checks itself (no client in front): the doorbell answers what the RPC answers.
    stub = pb_grpc.EngineStub(c._conn.channel)
    server_cases = [
        ("", dev.registration_id, HASHES),  # empty session id
        (c.session_id, "g-unknown", HASHES),  # NOT_FOUND, kind "device registration"
        (c.session_id, dev.registration_id, [b"%d" % i for i in range(65)]),  # over max_batch_blocks
        (c.session_id, dev.registration_id, [b"y" * 65]),  # over max_hash_bytes
        ("s-nobody", dev.registration_id, HASHES),  # NOT_FOUND, kind "session": SessionLost
    ]
    for session_id, reg_id, hashes in server_cases:
        ids = list(range(len(hashes)))
        with pytest.raises(LocalRpcError) as bell_err:
            bell.call(OP_SAVE, session_id, reg_id, hashes, ids, time.monotonic() + 10)
        req = pb.SaveFromDeviceRequest(
            session_id=session_id, registration_id=reg_id, block_hashes=hashes, block_ids=ids
        )
        with pytest.raises(grpc.RpcError) as grpc_err:
            stub.SaveFromDevice(req, timeout=10)
        ours, theirs = codec.translate(bell_err.value, "Save"), codec.translate(grpc_err.value, "Save")
        assert type(ours) is type(theirs) and str(ours) == str(theirs), (ours, theirs)
        assert getattr(ours, "kind", None) == getattr(theirs, "kind", None)
    assert isinstance(ours, errors.SessionLost)
    assert rpc_total(srv, "SaveFromDevice", "NOT_FOUND") == 4  # two per transport


def test_a_request_the_frame_cannot_carry_goes_over_grpc(gpu_client):
    srv, gpu, c, dev = gpu_client
    before = len(gpu.calls)
    assert (
        dev.doorbell.call(OP_SAVE, c.session_id, dev.registration_id, HASHES, [1], time.monotonic() + 5)
        is None
    )
    assert len(gpu.calls) == before  # nothing was sent
    with pytest.raises(errors.InvalidArgument, match="8 block_hashes but 1 block_ids"):
        c.save_from_device(dev, HASHES, [1])  # the RPC answers it (its check runs before the data path)
    assert len(gpu.calls) == before


def test_a_call_that_reached_the_server_is_never_run_again_over_grpc(gpu_client):
    srv, gpu, c, dev = gpu_client
    c.save_from_device(dev, HASHES, list(range(8)))  # the connection is open
    gpu.gate.clear()
    gpu.entered.clear()
    calls = len(gpu.calls)
    outcome: list = []

    def save() -> None:
        try:
            outcome.append(c.save_from_device(dev, HASHES, list(range(8)), timeout_s=20))
        except errors.PegaflowError as exc:
            outcome.append(exc)

    t = threading.Thread(target=save)
    t.start()
    assert gpu.entered.wait(10)  # the request is running on the server
    with srv.doorbell._lock:  # the connection dies mid-call (as when the server's process is killed)
        busy = [conn.sock for conn in srv.doorbell._conns.values()]
    for sock in busy:
        sock.shutdown(socket.SHUT_RDWR)
    t.join(30)
    gpu.gate.set()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.ServerUnavailable), outcome
    # A fallback would have run synchronously inside the call that just returned: none did.
    assert len(gpu.calls) == calls + 1 and served_by_doorbell(gpu)
    wait_for(lambda: c.connected and dev.registered, timeout_s=30)
    assert c.save_from_device(dev, HASHES, list(range(8))).written == 8


def test_an_idle_connection_is_closed_and_the_next_call_opens_another(sock_dir):
    gpu = StandInGpu()
    path = os.path.join(sock_dir, "d.sock")
    server = DoorbellServer(path, gpu, "e1", ServerConfig(pool_size_bytes=64 << 20), idle_timeout_s=0.3)
    server.start()
    bell = DoorbellClient(path, "e1")
    try:
        assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 5) == (8, [1] * 8)
        wait_for(lambda: server.idle_closed == 1 and server.connections == 0, timeout_s=10)
        assert bell.call(OP_LOAD, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 5) == (7, [])
        assert len(gpu.calls) == 2  # each request ran exactly once
    finally:
        bell.close()
        server.stop()


def test_a_second_server_never_takes_a_live_doorbell_socket(sock_dir):
    path = os.path.join(sock_dir, "d.sock")
    config = ServerConfig(pool_size_bytes=64 << 20)
    first = DoorbellServer(path, StandInGpu(), "e1", config)
    first.start()
    try:
        with pytest.raises(OSError, match="another server is listening"):
            DoorbellServer(path, StandInGpu(), "e2", config)
        bell = DoorbellClient(path, "e1")
        assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 5)[0] == 8
        bell.close()
    finally:
        first.stop()
    assert not os.path.exists(path)
    # A session of another server (another epoch) never uses it.
    second = DoorbellServer(path, StandInGpu(), "e2", config)
    second.start()
    try:
        assert (
            DoorbellClient(path, "e1").call(OP_SAVE, "s", "g-any", HASHES, [0] * 8, time.monotonic() + 5)
            is None
        )
    finally:
        second.stop()


def test_garbage_closes_only_that_connection(sock_dir):
    path = os.path.join(sock_dir, "d.sock")
    server = DoorbellServer(path, StandInGpu(), "e1", ServerConfig(pool_size_bytes=64 << 20))
    server.start()
    bell = DoorbellClient(path, "e1")
    try:
        assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 5)[0] == 8
        with connect_raw(path) as sock:
            magic, version, epoch = frames.read_hello(sock, time.monotonic() + 5)
            assert (magic, version, epoch) == (wire.HELLO_MAGIC, wire.VERSION, "e1")
            sock.sendall(frames.encode_frame(b"this is not a doorbell frame"))
            answer = wire.decode_response(frames.read_frame(sock, 1 << 16, time.monotonic() + 5))
            assert answer.not_executed and answer.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
            assert_hung_up(sock)
        with connect_raw(path) as sock:  # announced beyond the server's limit: refused unread
            frames.read_hello(sock, time.monotonic() + 5)
            sock.sendall(frames.LEN.pack(64 << 20) + b"\0" * 100)
            answer = wire.decode_response(frames.read_frame(sock, 1 << 16, time.monotonic() + 5))
            assert answer.not_executed and "exceeds the limit" in answer.message
        assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 5)[0] == 8
    finally:
        bell.close()
        server.stop()


def test_a_stopped_doorbell_costs_a_call_no_more_than_its_deadline(sock_dir):
    path = os.path.join(sock_dir, "d.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pegaflow.server.endpoints.tests.doorbell_proc", path, "e1"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        bell = DoorbellClient(path, "e1")
        assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 10)[0] == 8
        sigstop(proc.pid)
        try:
            for _ in range(2):  # the open connection, then (dropped at its deadline) a new one
                t0 = time.monotonic()
                with pytest.raises(LocalRpcError) as err:
                    bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), t0 + 1.0)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - t0 < 1.0 + DEADLINE_MARGIN_S
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 10)[0] == 8
        bell.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def test_the_timing_log_marks_each_call_until_its_answer_is_sent(sock_dir, caplog):
    # bench/gpu_bench.py matches these lines with the client's clock: a request slow at the client but
    # not between "read" and "sent" lost its time outside the server.
    path = os.path.join(sock_dir, "d.sock")
    server = DoorbellServer(path, StandInGpu(), "e1", ServerConfig(pool_size_bytes=64 << 20))
    server.start()
    bell = DoorbellClient(path, "e1")
    try:
        with caplog.at_level(logging.DEBUG, logger="pegaflow.server.gpu.timing"):
            before = time.perf_counter()
            assert bell.call(OP_SAVE, "s", "g-any", HASHES, list(range(8)), time.monotonic() + 5)[0] == 8
            after = time.perf_counter()
            wait_for(lambda: any("doorbell-op" in r.getMessage() for r in caplog.records), timeout_s=10)
    finally:
        bell.close()
        server.stop()
    (line,) = [r.getMessage() for r in caplog.records if "doorbell-op" in r.getMessage()]
    marks = json.loads(line.split("doorbell-op ", 1)[1])
    steps = [marks[k] for k in ("read", "entered", "decoded", "handled", "encoded", "sent")]
    assert steps == sorted(steps) and before <= steps[0] and steps[-1] <= after
