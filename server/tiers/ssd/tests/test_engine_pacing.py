"""Both I/O engines obey a pacer (engines/base.py IoPacer) for reads: none start while it allows
0, never more in flight than it allows, and they run at their own depth once it lets go; writes
are never held back."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from pegaflow.server.tiers.ssd.engines import uring_binding
from pegaflow.server.tiers.ssd.engines.base import IoOp, aligned_buffer
from pegaflow.server.tiers.ssd.engines.threads import ThreadEngine

BLOCK = 1 << 16


class Pacer:
    def __init__(self, depth: int):
        self.depth = depth
        self.held_s = 0.0

    def allowed(self) -> tuple[int, float]:
        return self.depth, 0.005


class Watch:
    """Counts ops between prepare and complete; the highest count seen is the depth reached."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = self.started = self.done = 0
        self.all_done = threading.Event()
        self.want = 0


class ReadOp(IoOp):
    write = False

    def __init__(self, fd: int, offset: int, buf: memoryview, watch: Watch):
        super().__init__(self.write, fd, offset)
        self.buf, self.watch = buf, watch

    def prepare(self, scratch):
        w = self.watch
        with w.lock:
            w.started += 1
            w.now += 1
            w.peak = max(w.peak, w.now)
        time.sleep(0.002)  # keep it in flight a moment (the threads engine runs prepare in its slot)
        return [self.buf]

    def complete(self, result):
        w = self.watch
        assert result == BLOCK
        with w.lock:
            w.now -= 1
            w.done += 1
            if w.done == w.want:
                w.all_done.set()

    def cancel(self):
        pass


class WriteOp(ReadOp):
    write = True


def engines():
    yield "threads"
    yield "io_uring"


def open_paced(kind: str, depth: int, pacer: Pacer, probe_dir: str):
    if kind == "threads":
        return ThreadEngine(depth, pacer=pacer)
    why = uring_binding.probe(probe_dir)
    if why is not None:
        pytest.skip(f"io_uring unavailable here: {why}")
    from pegaflow.server.tiers.ssd.engines.uring import UringEngine

    return UringEngine(depth, pacer=pacer)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(BLOCK * 64))
    fd = os.open(path, os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("kind", list(engines()))
def test_nothing_starts_while_held_and_the_limit_is_kept(kind, data_file, tmp_path):
    pacer = Pacer(0)
    engine = open_paced(kind, 8, pacer, str(tmp_path))
    watch = Watch()
    watch.want = 48
    bufs = [aligned_buffer(BLOCK) for _ in range(watch.want)]
    try:
        engine.submit([ReadOp(data_file, (i % 64) * BLOCK, bufs[i], watch) for i in range(watch.want)])
        time.sleep(0.1)
        assert watch.started == 0  # held: not one op started
        pacer.depth = 2
        deadline = time.monotonic() + 10
        while watch.done < 16 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert watch.peak <= 2  # paced: never more than it allows
        pacer.depth = math.inf  # let go: the engine's own depth again
        assert watch.all_done.wait(10)
        assert watch.peak > 2 if kind == "threads" else watch.peak >= 2
        assert watch.peak <= 8
    finally:
        engine.close()


@pytest.mark.parametrize("kind", list(engines()))
def test_close_does_not_wait_for_a_pacer_that_holds(kind, data_file, tmp_path):
    pacer = Pacer(0)
    engine = open_paced(kind, 4, pacer, str(tmp_path))
    watch = Watch()
    engine.submit([ReadOp(data_file, 0, aligned_buffer(BLOCK), watch) for _ in range(4)])
    t0 = time.monotonic()
    engine.close()
    assert time.monotonic() - t0 < 2 and watch.started == 0


@pytest.mark.parametrize("kind", list(engines()))
def test_writes_are_not_held_back(kind, tmp_path):
    path = tmp_path / "out"
    path.write_bytes(bytes(BLOCK * 8))
    fd = os.open(path, os.O_RDWR)
    pacer = Pacer(0)
    engine = open_paced(kind, 4, pacer, str(tmp_path))
    watch = Watch()
    watch.want = 8
    try:
        engine.submit([WriteOp(fd, i * BLOCK, aligned_buffer(BLOCK), watch) for i in range(8)])
        assert watch.all_done.wait(10)  # the pacer allows no read, and every write ran
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.parametrize("kind", list(engines()))
def test_writes_do_not_wait_behind_reads_the_pacer_holds(kind, data_file, tmp_path):
    """More held reads than the engine has slots, then writes: the writes run at once."""
    path = tmp_path / "out"
    path.write_bytes(bytes(BLOCK * 8))
    fd = os.open(path, os.O_RDWR)
    pacer = Pacer(0)
    engine = open_paced(kind, 4, pacer, str(tmp_path))
    reads, writes = Watch(), Watch()
    reads.want, writes.want = 8, 8
    try:
        engine.submit([ReadOp(data_file, i * BLOCK, aligned_buffer(BLOCK), reads) for i in range(8)])
        time.sleep(0.05)
        engine.submit([WriteOp(fd, i * BLOCK, aligned_buffer(BLOCK), writes) for i in range(8)])
        assert writes.all_done.wait(2)
        assert reads.started == 0  # still held
        pacer.depth = math.inf
        assert reads.all_done.wait(10)
    finally:
        engine.close()
        os.close(fd)
