"""The thread-pool engine: ``queue_depth`` threads, each running one ``os.pwritev`` /
``os.preadv`` at a time (CPython releases the GIL for the syscall, so the bytes move without it
and straight between the caller's buffer and the disk under O_DIRECT).

Reads and writes wait in two queues. A free thread takes the oldest write first, else the oldest
read if the pacer (engines/base.py IoPacer) allows one more read in flight; a read the pacer holds
back waits in its queue, not on a thread, so writes never wait behind held reads (they did when
one queue fed the threads: with every thread holding a paced read, a write waited a whole hold).

Works wherever Python does; it is the fallback when io_uring is unavailable, and the measured
numbers of both engines are in engines/__init__.py.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import deque
from collections.abc import Sequence

from pegaflow.server.tiers.ssd.engines.base import (
    PACER_MAX_SLEEP_S,
    SCRATCH_BYTES,
    IoEngine,
    IoOp,
    IoPacer,
    aligned_buffer,
)

log = logging.getLogger(__name__)


class ThreadEngine(IoEngine):
    name = "threads"

    def __init__(self, queue_depth: int, thread_name: str = "ssd-io", pacer: IoPacer | None = None):
        if queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        self.queue_depth = queue_depth
        self._pacer = pacer
        self._closing = False
        self._slots = threading.Condition(threading.Lock())  # guards everything below
        self._writes: deque[IoOp] = deque()
        self._read_queue: deque[IoOp] = deque()
        self._running = 0
        self._reads = 0  # reads in flight: what the pacer limits
        self._threads = [
            threading.Thread(target=self._work, name=f"{thread_name}-{i}", daemon=True)
            for i in range(queue_depth)
        ]
        for t in self._threads:
            t.start()

    @property
    def in_flight(self) -> int:
        return self._running

    def submit(self, ops: Sequence[IoOp]) -> None:
        with self._slots:
            closing = self._closing  # read under the lock: close() cancels what was queued before it
            if not closing:
                for op in ops:
                    (self._writes if op.write else self._read_queue).append(op)
                self._slots.notify(len(ops))
        if closing:
            for op in ops:
                _cancel(op)

    def _work(self) -> None:
        scratch = aligned_buffer(SCRATCH_BYTES)
        while True:
            op = self._next_op()
            if op is None:
                return
            read = not op.write
            try:
                _run(op, scratch)
            finally:
                del op  # the caller's buffers are not held past completion
                with self._slots:
                    self._running -= 1
                    self._reads -= read
                    if read and self._read_queue:
                        self._slots.notify()  # room for one more read under the pacer

    def _next_op(self) -> IoOp | None:
        """The next op this thread runs, counted in flight; None once the engine closes."""
        with self._slots:
            while not self._closing:
                if self._writes:
                    self._running += 1
                    return self._writes.popleft()
                wait_s = None
                if self._read_queue:
                    limit, recheck_s = self._pacer.allowed() if self._pacer else (self.queue_depth, 0.0)
                    if self._reads < limit:
                        self._running += 1
                        self._reads += 1
                        return self._read_queue.popleft()
                    wait_s = min(recheck_s, PACER_MAX_SLEEP_S)
                self._slots.wait(wait_s)
            return None

    def close(self) -> None:
        if self._closing:
            return
        with self._slots:
            self._closing = True
            self._slots.notify_all()  # idle threads stop; running ops finish first
        for t in self._threads:
            t.join()
        # What never started is cancelled (submit cancels anything that arrives from now on).
        with self._slots:
            left = [*self._writes, *self._read_queue]
            self._writes.clear()
            self._read_queue.clear()
        for op in left:
            _cancel(op)


def _run(op: IoOp, scratch: memoryview) -> None:
    try:
        buffers = op.prepare(scratch)
    except Exception:  # an op's bug must not kill the worker
        log.exception("ssd io: prepare failed")
        buffers = None
        _complete(op, -errno.EINVAL)
    if buffers is None:
        return
    try:
        if op.write:
            result = os.pwritev(op.fd, buffers, op.offset)
        else:
            result = os.preadv(op.fd, buffers, op.offset)
    except OSError as e:
        result = -(e.errno or errno.EIO)
    _complete(op, result)


def _complete(op: IoOp, result: int) -> None:
    try:
        op.complete(result)
    except Exception:
        log.exception("ssd io: completion failed")


def _cancel(op: IoOp) -> None:
    try:
        op.cancel()
    except Exception:
        log.exception("ssd io: cancel failed")
