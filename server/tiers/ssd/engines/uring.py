"""The io_uring engine: one ring and one thread. The thread prepares ops (record headers,
checksums), queues up to ``queue_depth`` vectored reads/writes as SQEs, and then sits in one
``io_uring_submit_and_wait`` (GIL released) until a completion arrives; it reaps a batch, runs
the ops' completions and refills the ring. The kernel moves the bytes between the caller's
buffers and the disk (O_DIRECT): no copy, no GIL, no thread per request.

New work must wake a thread that waits in the kernel: a read of an eventfd is always queued in
the ring, and ``submit`` bumps the eventfd, which completes that read. The binding is
engines/uring_binding.py (cffi over the system liburing).

With a pacer (engines/base.py IoPacer) the thread queues no more reads than it allows (writes
wait in their own queue and are never held back); when a read waits, nothing is in flight and no
write is queued, the thread sleeps until it may ask again.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from collections.abc import Sequence

from pegaflow.server.tiers.ssd.engines.base import (
    PACER_MAX_SLEEP_S,
    SCRATCH_BYTES,
    IoEngine,
    IoOp,
    IoPacer,
    aligned_buffer,
)
from pegaflow.server.tiers.ssd.engines.uring_binding import UringUnavailable, load

log = logging.getLogger(__name__)

_WAKE = 0  # user_data of the eventfd read; ops get 1, 2, ...
_MAX_IOV = 8


class UringEngine(IoEngine):
    name = "io_uring"

    def __init__(self, queue_depth: int, thread_name: str = "ssd-uring", pacer: IoPacer | None = None):
        if queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        self.queue_depth = queue_depth
        self._pacer = pacer
        self._ffi, self._lib = load()
        ffi, lib = self._ffi, self._lib
        ring = ffi.new("struct pf_ring **")
        rc = lib.pf_ring_open(ring, queue_depth + 1)
        if rc < 0:
            raise UringUnavailable(f"io_uring_queue_init: {os.strerror(-rc)}")
        self._ring = ring[0]
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._wake_buf = ffi.new("unsigned long long *")
        self._inbox: collections.deque[IoOp] = collections.deque()  # reads (all ops without a pacer)
        self._writes: collections.deque[IoOp] = collections.deque()  # writes, with a pacer
        self._reads = 0  # reads in flight: what the pacer limits
        self._closing = False
        self._running = 0
        # Per in-flight slot: a scratch block and an iovec array, reused (no allocation per op).
        self._scratch = aligned_buffer(SCRATCH_BYTES * queue_depth)
        self._iovs = [ffi.new(f"struct iovec[{_MAX_IOV}]") for _ in range(queue_depth)]
        self._free_slots = list(range(queue_depth))
        self._slot_op: list[tuple[IoOp, list] | None] = [None] * queue_depth
        self._reap = 64
        self._ud = ffi.new(f"unsigned long long[{self._reap}]")
        self._res = ffi.new(f"int[{self._reap}]")
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._running

    def submit(self, ops: Sequence[IoOp]) -> None:
        if self._closing:
            for op in ops:
                _cancel(op)
            return
        if self._pacer is None:
            self._inbox.extend(ops)
        else:
            for op in ops:
                (self._writes if op.write else self._inbox).append(op)
        self._wake()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except BlockingIOError:  # the counter is saturated: the thread is awake anyway
            pass

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wake()
        self._thread.join()
        self._lib.pf_ring_close(self._ring)  # cancels the pending eventfd read
        os.close(self._wake_fd)

    # -- the ring's thread ------------------------------------------------------------------

    def _arm_wake(self) -> None:
        rc = self._lib.pf_queue_read(self._ring, self._wake_fd, self._wake_buf, 8, 0, _WAKE)
        if rc < 0:  # cannot happen: one SQE more than queue_depth is reserved for it
            raise RuntimeError(f"io_uring: cannot queue the wake-up read: {os.strerror(-rc)}")

    def _start(self, op: IoOp) -> bool:
        """Prepares ``op`` and queues its SQE; False when it finished without I/O."""
        slot = self._free_slots.pop()
        scratch = self._scratch[slot * SCRATCH_BYTES : (slot + 1) * SCRATCH_BYTES]
        try:
            buffers = op.prepare(scratch)
        except Exception:
            log.exception("ssd io: prepare failed")
            self._free_slots.append(slot)
            _complete(op, -errno.EINVAL)
            return False
        if buffers is None:
            self._free_slots.append(slot)
            return False
        if len(buffers) > _MAX_IOV:
            self._free_slots.append(slot)
            _complete(op, -errno.EINVAL)
            return False
        ffi = self._ffi
        iov = self._iovs[slot]
        keep = []
        for i, buf in enumerate(buffers):
            ptr = ffi.from_buffer(buf, require_writable=not op.write)
            keep.append(ptr)
            iov[i].iov_base = ptr
            iov[i].iov_len = len(buf)
        rc = self._lib.pf_queue_rw(self._ring, int(op.write), op.fd, iov, len(buffers), op.offset, slot + 1)
        if rc < 0:
            self._free_slots.append(slot)
            _complete(op, rc)
            return False
        self._slot_op[slot] = (op, keep)
        self._running += 1
        self._reads += not op.write
        return True

    def _loop(self) -> None:
        lib = self._lib
        ring_error_logged = False
        self._arm_wake()
        while True:
            if self._closing:
                for queued in (self._inbox, self._writes):
                    while queued:
                        _cancel(queued.popleft())
                if self._running == 0:
                    return
            elif self._pacer is None:
                while self._inbox and self._free_slots:
                    self._start(self._inbox.popleft())
            else:
                while self._writes and self._free_slots:
                    self._start(self._writes.popleft())
                limit, recheck_s = self._pacer.allowed()
                while self._inbox and self._free_slots and self._reads < limit:
                    self._start(self._inbox.popleft())
                if self._inbox and self._running == 0 and not self._writes and self._reads >= limit:
                    # Nothing will complete to wake the ring: wait for the pacer here instead.
                    time.sleep(min(recheck_s, PACER_MAX_SLEEP_S))
                    continue
            n = lib.pf_submit_reap(self._ring, 1, self._ud, self._res, self._reap)
            if n < 0:
                # The ring call itself failed (not one I/O; EINTR/EAGAIN/EBUSY are retried in C).
                # Nothing here can fix it and the kernel may still own buffers: say it once, retry.
                if not ring_error_logged:
                    log.error("ssd io: io_uring_submit_and_wait failed: %s", os.strerror(-n))
                    ring_error_logged = True
                time.sleep(0.001)
                continue
            for i in range(n):
                ud, res = self._ud[i], self._res[i]
                if ud == _WAKE:
                    self._arm_wake()
                    continue
                slot = ud - 1
                entry = self._slot_op[slot]
                self._slot_op[slot] = None
                self._free_slots.append(slot)
                self._running -= 1
                if entry is not None:
                    self._reads -= not entry[0].write
                    _complete(entry[0], res)


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
