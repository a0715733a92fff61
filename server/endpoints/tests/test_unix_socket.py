"""The one Unix-socket server and client end (UnixFrameServer, FrameLink), with a codec of the tests' own:
threads per idle connection, idle timeouts, connection and memory caps, never a request run twice,
socket paths that are never stolen, and a real server process out of file descriptors."""

from __future__ import annotations

import os
import re
import socket
import stat
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from pegaflow.client import PegaClient
from pegaflow.client.frame_link import FrameLink, LinkFailed, NotSent
from pegaflow.client.native import frame_wait
from pegaflow.common.wire import frames
from pegaflow.server.endpoints.base import FrameCodec
from pegaflow.server.endpoints.tests.support import LAYOUT, assert_hung_up, connect_raw, save_and_load
from pegaflow.server.endpoints.unix_socket import UnixFrameServer, prepare_socket_path
from pegaflow.server.testing import wait_for

pytestmark = pytest.mark.timeout(120)
MAGIC = b"ECHO"


class EchoCodec(FrameCodec):
    """Answers b"ok" + the request body; counts what it ran; ``gate`` cleared: requests wait for it."""

    name = "echo"
    hello_magic = MAGIC
    version = 1

    def __init__(self, max_frame_bytes: int = 1 << 20):
        self.max_frame_bytes = max_frame_bytes
        self.ran: list[bytes] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def handle(self, body: bytes, context) -> bytes:
        if body.startswith(b"bad"):
            raise frames.FrameError("not an echo request")
        self.ran.append(body)
        self.entered.set()
        self.gate.wait(30)
        return frames.encode_frame(b"ok" + body)

    def refusal(self, code: grpc.StatusCode, message: str) -> bytes:
        return frames.encode_frame(b"no" + bytes((code.value[0],)) + message.encode())


@pytest.fixture(autouse=True, params=["python-wait", "native-wait"])
def answer_wait(request):
    """Every test with the client's answers waited for both ways: in Python, and natively
    (client/native/frame_wait.py), which must behave the same."""
    was = frame_wait.is_native()
    assert frame_wait.use(request.param == "native-wait"), frame_wait.EXTENSION.probe()
    yield request.param
    frame_wait.use(was)


@pytest.fixture
def echo(sock_dir):
    """``echo(**bounds)`` -> (server, codec) started on a fresh path; stopped afterwards."""
    made: list[UnixFrameServer] = []

    def start(max_frame_bytes: int = 1 << 20, **bounds):
        codec = EchoCodec(max_frame_bytes)
        server = UnixFrameServer(os.path.join(sock_dir, f"e{len(made)}.sock"), codec, "ep", **bounds)
        server.start()
        made.append(server)
        return server, codec

    yield start
    for server in made:
        server.codec.gate.set()
        server.stop(grace_s=1)


def link(server: UnixFrameServer, epoch: str = "ep") -> FrameLink:
    return FrameLink(server.path, MAGIC, 1, epoch, 1 << 20, 0.001, True, "echo socket")


def greeted(path: str) -> socket.socket:
    sock = connect_raw(path)
    assert frames.read_hello(sock, time.monotonic() + 10) == (MAGIC, 1, "ep")
    return sock


def next_frame(sock: socket.socket) -> bytes | None:
    return frames.read_frame(sock, 1 << 20, time.monotonic() + 10)


# ------------------------------------------------------------------ threads and idle connections


def test_idle_connections_hold_no_threads(echo):
    server, codec = echo()
    # The threads alive now, not their count: an earlier test's threads may still be ending.
    threads_before = set(threading.enumerate())
    socks = [greeted(server.path) for _ in range(100)]
    try:
        wait_for(lambda: server.connections == 100, timeout_s=10)
        assert set(threading.enumerate()) - threads_before == set()  # no thread per connection
        # Busy ones get workers; once quiet past the linger time they park again.
        for sock in socks[:5]:
            sock.sendall(frames.encode_frame(b"x"))
        for sock in socks[:5]:
            assert next_frame(sock) == b"okx"
        assert server.worker_threads <= 5
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: server.connections == 0, timeout_s=10)


def test_an_idle_connection_gets_goodbye_and_the_client_reconnects_without_running_twice(echo):
    server, codec = echo(idle_timeout_s=0.3)
    sock = greeted(server.path)
    assert next_frame(sock) == b""  # GOODBYE
    assert next_frame(sock) is None  # then EOF
    sock.close()
    client = link(server)
    try:
        assert client.call(frames.encode_frame(b"a"), time.monotonic() + 5) == b"oka"
        wait_for(lambda: server.idle_closed == 2, timeout_s=10)  # ours too, while it sat idle
        assert client.call(frames.encode_frame(b"b"), time.monotonic() + 5) == b"okb"
        assert codec.ran == [b"a", b"b"]
    finally:
        client.close()


@pytest.mark.parametrize("closed_before_send", [False, True])
def test_goodbye_racing_a_request_means_it_was_not_run_and_is_sent_again(echo, closed_before_send):
    server, codec = echo()
    client = link(server)
    try:
        assert client.call(frames.encode_frame(b"a"), time.monotonic() + 5) == b"oka"
        wait_for(lambda: server._conns and all(c.state == "parked" for c in server._conns.values()))
        # The server gives up the idle connection just as the request goes out: the request meets
        # the GOODBYE (or, once the socket is closed too, a failed send). The server never reads it;
        # the client sends it again on a new connection.
        conn = next(iter(server._conns.values()))
        with server._lock:
            server._forget(conn)
        conn.sock.send(frames.GOODBYE)
        if closed_before_send:
            conn.sock.close()
        idle = client._idle[-1]
        assert client.call(frames.encode_frame(b"b"), time.monotonic() + 5) == b"okb"
        assert idle not in client._conns
        assert codec.ran == [b"a", b"b"]
        conn.sock.close()
    finally:
        client.close()


def test_a_connection_broken_mid_call_is_reported_as_maybe_run_not_resent(echo):
    server, codec = echo()
    client = link(server)
    codec.gate.clear()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.call(frames.encode_frame(b"a"), time.monotonic() + 20)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert codec.entered.wait(10)
    with server._lock:
        socks = [c.sock for c in server._conns.values()]
    for sock in socks:
        sock.shutdown(socket.SHUT_RDWR)
    t.join(30)
    codec.gate.set()
    assert len(errors) == 1 and isinstance(errors[0], LinkFailed)  # not NotSent: it may have run
    assert codec.ran == [b"a"]
    client.close()


# ------------------------------------------------------------------ caps


def test_at_the_cap_the_longest_idle_connection_is_evicted_and_busy_ones_never(echo):
    server, codec = echo(max_connections=4)
    socks = [greeted(server.path) for _ in range(4)]
    try:
        newest = greeted(server.path)  # a fifth: the oldest idle one gets GOODBYE
        assert next_frame(socks[0]) == b"" and next_frame(socks[0]) is None
        assert server.evicted == 1 and server.connections == 4
        socks[0] = newest
        codec.gate.clear()  # now make all four busy
        for sock in socks:
            sock.sendall(frames.encode_frame(b"x"))
        wait_for(lambda: len(codec.ran) == 4, timeout_s=10)
        with connect_raw(server.path) as refused:  # closed before its greeting: it ran nothing
            assert refused.recv(16) == b""
        assert server.refused == 1
        codec.gate.set()
        for sock in socks:
            assert next_frame(sock) == b"okx"
    finally:
        codec.gate.set()
        for sock in socks:
            sock.close()


def test_frames_are_read_as_they_arrive_under_a_total_memory_cap(echo):
    server, codec = echo(max_frame_bytes=4 << 20, memory_limit_bytes=1 << 20, frame_timeout_s=2.0)
    first = greeted(server.path)
    second = greeted(server.path)
    try:
        # Announced 3 MiB, sent 10 bytes: the server holds 10 bytes, not 3 MiB.
        first.sendall(frames.LEN.pack(3 << 20) + b"0123456789")
        wait_for(lambda: server.budget.used_bytes == 10, timeout_s=10)
        first.sendall(b"x" * (900 << 10))
        wait_for(lambda: server.budget.used_bytes == 10 + (900 << 10), timeout_s=10)
        # The second frame would take the server past its cap: refused, not run, connection closed.
        second.sendall(frames.LEN.pack(3 << 20) + b"y" * (200 << 10))
        answer = next_frame(second)
        assert answer[:3] == b"no" + bytes((grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],))
        assert b"frames in flight" in answer
        # The stalled frame is given up after the frame timeout; all its memory comes back.
        wait_for(lambda: server.connections == 0 and server.budget.used_bytes == 0, timeout_s=10)
        assert codec.ran == []
    finally:
        first.close()
        second.close()
    client = link(server)
    assert client.call(frames.encode_frame(b"after"), time.monotonic() + 5) == b"okafter"
    client.close()


def test_garbage_is_refused_and_closes_only_its_connection(echo):
    server, codec = echo()
    client = link(server)
    try:
        assert client.call(frames.encode_frame(b"a"), time.monotonic() + 5) == b"oka"
        for data in (frames.encode_frame(b"bad frame"), frames.LEN.pack(2 << 20) + b"z", frames.GOODBYE):
            with greeted(server.path) as sock:
                sock.sendall(data)
                assert next_frame(sock)[:2] == b"no"
                assert_hung_up(sock)
        assert client.call(frames.encode_frame(b"b"), time.monotonic() + 5) == b"okb"
        assert codec.ran == [b"a", b"b"]
    finally:
        client.close()


def test_stop_says_goodbye_to_idle_connections_and_lets_a_call_finish(echo):
    server, codec = echo()
    idle = greeted(server.path)
    busy = greeted(server.path)
    codec.gate.clear()
    busy.sendall(frames.encode_frame(b"slow"))
    assert codec.entered.wait(10)
    stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 10})
    stopper.start()
    assert next_frame(idle) == b""  # GOODBYE
    codec.gate.set()
    assert next_frame(busy) == b"okslow"  # the call in progress completed, then GOODBYE
    assert next_frame(busy) == b""
    stopper.join(15)
    assert not os.path.exists(server.path)
    idle.close()
    busy.close()


# ------------------------------------------------------------------ the socket path


def test_a_live_socket_is_never_unlinked(echo, sock_dir):
    server, codec = echo()
    with pytest.raises(OSError, match="another server is listening"):
        UnixFrameServer(server.path, EchoCodec(), "other")
    assert stat.S_ISSOCK(os.lstat(server.path).st_mode)
    client = link(server)
    assert client.call(frames.encode_frame(b"still"), time.monotonic() + 5) == b"okstill"
    client.close()
    # A live server whose backlog is full (connects time out) is live too.
    full = os.path.join(sock_dir, "full.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(full)
    listener.listen(0)
    waiting = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(full)
        except (BlockingIOError, OSError):
            pass
        waiting.append(s)
    try:
        with pytest.raises(OSError, match="in use|listening"):
            prepare_socket_path(full)
        assert os.path.exists(full)
    finally:
        for s in waiting:
            s.close()
        listener.close()
    # A dead server's leftover is replaced; a file that is not a socket is never touched.
    prepare_socket_path(full)
    assert not os.path.exists(full)
    plain = os.path.join(sock_dir, "plain")
    open(plain, "w").close()
    with pytest.raises(OSError, match="not a socket"):
        prepare_socket_path(plain)
    assert os.path.exists(plain)


def test_socket_permissions_and_directory_checks(echo, sock_dir):
    server, codec = echo()
    assert os.stat(server.path).st_mode & 0o777 == 0o660
    open_dir = os.path.join(sock_dir, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)  # anyone could replace a socket here
    with pytest.raises(OSError, match="sticky"):
        UnixFrameServer(os.path.join(open_dir, "s.sock"), EchoCodec(), "ep")
    os.chmod(open_dir, 0o1777)  # as /tmp: others cannot remove what is ours
    UnixFrameServer(os.path.join(open_dir, "s.sock"), EchoCodec(), "ep").stop()


def test_a_socket_of_another_epoch_is_not_used(echo):
    server, codec = echo()
    client = link(server, epoch="someone-else")
    with pytest.raises(NotSent):
        client.call(frames.encode_frame(b"a"), time.monotonic() + 5)
    assert not client.usable and codec.ran == []
    client.close()


# ------------------------------------------------------------------ a real server out of descriptors


def _launcher(soft: int, hard: int) -> list[str]:
    """Runs the server with RLIMIT_NOFILE (soft, hard), as a shell's ulimit would."""
    code = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", code]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_server_raises_its_open_file_limit(server_process):
    srv = server_process(launcher=_launcher(256, 4096))
    limits = open(f"/proc/{srv.proc.pid}/limits").read()
    assert re.search(r"Max open files\s+4096\s+4096", limits), limits
    assert "open-file limit raised from 256 to 4096" in srv.log_text()


def test_out_of_descriptors_the_server_backs_off_logs_once_and_recovers(server_process):
    srv = server_process(launcher=_launcher(160, 160))
    with PegaClient(srv.addr, timeout_s=10.0) as c:
        inst = c.register_instance(LAYOUT)
        save_and_load(c, inst, "before")
        path = c.local_rpc_socket
        flood: list[socket.socket] = []
        try:
            for target in (path, srv.fd_socket_path) * 100:  # more than the server has descriptors
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(target)
                except (BlockingIOError, OSError):
                    pass
                flood.append(s)
            wait_for(lambda: "accept failed" in srv.log_text(), timeout_s=20)
            cpu_before, t0 = _cpu_seconds(srv.proc.pid), time.monotonic()
            time.sleep(2.0)  # measuring a rate over a window, not waiting for an event
            cpu = (_cpu_seconds(srv.proc.pid) - cpu_before) / (time.monotonic() - t0)
            assert srv.alive()
        finally:
            for s in flood:
                s.close()
        log = srv.log_text()
        # One line per socket per episode (not thousands a second), and the server idles meanwhile.
        assert 1 <= len(re.findall(r"accept failed", log)) <= 4, log[-3000:]
        assert cpu < 0.3, f"the server spun at {cpu:.2f} cores while out of descriptors"
        wait_for(lambda: "accepting again" in srv.log_text(), timeout_s=30)
        data, out, hits = save_and_load(c, inst, "after")
        assert hits == 8 and np.array_equal(out, data)
    with PegaClient(srv.addr, timeout_s=10.0) as fresh:  # new clients get in again
        assert fresh.stats().live_sessions >= 1
