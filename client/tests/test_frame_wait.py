"""The client's native frame wait (client/native/frame_wait.c) against the Python one it replaces:
the same body, GOODBYE, EOF, cut frame, oversized frame, timeout and error for the same bytes."""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import threading
import time

import pytest

from pegaflow.client.native import frame_wait
from pegaflow.common.wire import frames

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["python", "native"])
def wait_mode(request):
    was = frame_wait.is_native()
    assert frame_wait.use(request.param == "native"), frame_wait.EXTENSION.probe()
    yield request.param
    frame_wait.use(was)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def recv(sock: socket.socket, limit: int = 1 << 20, spin_s: float = 0.001, timeout_s: float = 5.0):
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return frame_wait.recv_frame(sock, poller, limit, spin_s, True, time.monotonic() + timeout_s)


def test_frames_goodbye_and_eof(wait_mode, pair):
    a, b = pair
    big = os.urandom(600_000)  # more than a socket buffer: read while the sender still writes
    sender = threading.Thread(
        target=b.sendall, args=(frames.encode_frame(b"hello") + frames.GOODBYE + frames.encode_frame(big),)
    )
    sender.start()
    assert recv(a) == b"hello"
    assert recv(a) == b""
    assert recv(a) == big
    sender.join()
    b.close()
    assert recv(a) is None


def test_a_frame_cut_off_or_too_long_or_late(wait_mode, pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        recv(a, spin_s=0.0, timeout_s=0.05)
    assert 0.04 <= time.monotonic() - t0 < 2.0
    b.sendall(struct.pack("<I", 1000))
    with pytest.raises(frames.FrameTooLarge):
        recv(a, limit=999)
    b.sendall(struct.pack("<I", 10) + b"abc")
    with pytest.raises(TimeoutError):  # the rest never comes: the deadline bounds the body too
        recv(a, timeout_s=0.05)


def test_a_frame_cut_off_by_eof(wait_mode, pair):
    a, b = pair
    b.sendall(struct.pack("<I", 10) + b"abc")
    b.close()
    with pytest.raises(ConnectionError):
        recv(a)


def test_a_socket_that_cannot_be_read_is_an_os_error(wait_mode):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # never connected: recv fails (ENOTCONN)
    sock.setblocking(False)
    try:
        with pytest.raises(OSError):
            recv(sock, timeout_s=0.2)
    finally:
        sock.close()


def test_a_signal_during_the_wait_runs_its_handler(wait_mode, pair):
    a, b = pair
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            recv(a, spin_s=0.0, timeout_s=10)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert seen == [signal.SIGUSR1] and time.monotonic() - t0 < 5


def test_the_native_wait_is_proven_and_waits_without_the_interpreter_lock(pair):
    """Native: while one thread waits (a hot spin, no yield), another Python thread runs freely."""
    assert frame_wait.use(True), frame_wait.EXTENSION.probe()
    a, b = pair
    counted = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1

    waiter = threading.Thread(target=lambda: counted.append(recv(a, spin_s=0.3, timeout_s=5)))
    waiter.start()
    worker = threading.Thread(target=count)
    worker.start()
    time.sleep(0.2)
    before = counted[0]
    time.sleep(0.05)
    b.sendall(frames.encode_frame(b"x"))
    waiter.join(5)
    stop.set()
    worker.join()
    assert counted[-1] == b"x"
    assert counted[0] > before


def test_a_signal_inside_a_frame_runs_its_handler_and_the_read_goes_on(wait_mode, pair):
    a, b = pair
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))

    def send_in_parts():
        b.sendall(struct.pack("<I", 6) + b"abc")
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)  # while the reader waits for the body's rest
        time.sleep(0.1)
        b.sendall(b"def")

    sender = threading.Thread(target=send_in_parts)
    sender.start()
    try:
        assert recv(a, spin_s=0.0, timeout_s=10) == b"abcdef"
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, old)
    assert seen == [signal.SIGUSR1]


def test_a_socket_closed_by_another_thread_fails_at_once(wait_mode):
    """A session that ends closes its connections from another thread; a wait that starts on one
    after that must fail at once (EBADF), not sit until the deadline (fileno() is -1 then)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    poller = select.poll()
    poller.register(a, select.POLLIN)  # as FrameLink's connections are, when opened
    a.close()
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError):
            frame_wait.recv_frame(a, poller, 1 << 20, 0.001, True, time.monotonic() + 5)
    finally:
        b.close()
    assert time.monotonic() - t0 < 1.0


def _python_progress(during) -> int:
    """How far a thread running Python got while ``during()`` ran on this one."""
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.02)  # it runs now
    try:
        before = ticks[0]
        during()
        return ticks[0] - before
    finally:
        stop.set()
        t.join()


def test_a_held_wait_keeps_the_lock_then_lets_go(pair):
    """held_s: the first part of the wait keeps the interpreter lock (no other thread runs Python),
    so an answer in that time needs no switch interval to take the lock back; past it, the wait
    lets go as a plain one does. Same answers either way."""
    assert frame_wait.use(True), frame_wait.EXTENSION.probe()
    a, b = pair
    poller = select.poll()
    poller.register(a, select.POLLIN)

    def wait(held_s: float, timeout_s: float):
        with pytest.raises(TimeoutError):
            frame_wait.recv_frame(a, poller, 1 << 20, 0.0, True, time.monotonic() + timeout_s, held_s)

    # Progress is counted from before the call: the other thread may take the lock for one switch
    # interval (5 ms) on the way in. Held for the whole 100 ms it gets no more than that; released,
    # it runs the whole time.
    held = _python_progress(lambda: wait(0.1, 0.1))
    free = _python_progress(lambda: wait(0.0, 0.1))
    assert held * 4 < free
    assert _python_progress(lambda: wait(0.02, 0.2)) > 4 * held  # held 20 ms, then released
    assert frame_wait.send_now(b, frames.encode_frame(b"held")) == 4 + 4
    assert frame_wait.recv_frame(a, poller, 1 << 20, 0.0, True, time.monotonic() + 5, 0.01) == b"held"
    b.close()
    with pytest.raises(OSError):
        frame_wait.send_now(a, b"x")


def test_without_the_native_module_send_now_leaves_the_send_to_the_caller(pair):
    was = frame_wait.is_native()
    frame_wait.use(False)
    try:
        assert frame_wait.send_now(pair[0], b"x") is None
    finally:
        frame_wait.use(was)
