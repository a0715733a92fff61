"""The thread-pool engine: ``queue_depth`` threads, each running one ``os.pwritev`` /
``os.preadv`` at a time (CPython releases the GIL for the syscall, so the bytes move without it
and straight between the caller's buffer and the disk under O_DIRECT).

With a pacer (engines/base.py IoPacer) a thread that took a read waits until the pacer allows
one more read in flight; writes start at once.

Works wherever Python does; it is the fallback when io_uring is unavailable, and the measured
numbers of both engines are in engines/__init__.py.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
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

_STOP = None


class ThreadEngine(IoEngine):
    name = "threads"

    def __init__(self, queue_depth: int, thread_name: str = "ssd-io", pacer: IoPacer | None = None):
        if queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        self.queue_depth = queue_depth
        self._pacer = pacer
        self._queue: queue.SimpleQueue[IoOp | None] = queue.SimpleQueue()
        self._closing = False
        self._slots = threading.Condition(threading.Lock())  # guards _running, _reads
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
        if self._closing:
            for op in ops:
                _cancel(op)
            return
        for op in ops:
            self._queue.put(op)

    def _work(self) -> None:
        scratch = aligned_buffer(SCRATCH_BYTES)
        while True:
            op = self._queue.get()
            if op is _STOP:
                return
            read = not op.write
            self._start_slot(read)
            try:
                if self._closing:
                    _cancel(op)
                else:
                    _run(op, scratch)
            finally:
                del op  # the caller's buffers are not held past completion
                with self._slots:
                    self._running -= 1
                    self._reads -= read
                    self._slots.notify()

    def _start_slot(self, read: bool) -> None:
        """Counts this thread's op in flight; a read once the pacer allows one more."""
        with self._slots:
            pacer = self._pacer
            while read and pacer is not None and not self._closing:
                limit, recheck_s = pacer.allowed()
                if self._reads < limit:
                    break
                self._slots.wait(min(recheck_s, PACER_MAX_SLEEP_S))
            self._running += 1
            self._reads += read

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        with self._slots:
            self._slots.notify_all()  # threads waiting on the pacer cancel their ops
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join()
        # Ops submitted while closing raced the STOP markers: cancel what is left.
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                break
            if op is not _STOP:
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
