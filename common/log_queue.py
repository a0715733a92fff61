"""A daemon's log lines go to stderr from one thread of their own, never from the thread that logs.

Why: the server logs under its engine lock (a session that ends, a save that timed out, a block
reported corrupt), and a write to stderr blocks when whoever reads it (a supervisor, a pipe, a
terminal on hold) stops reading; every request would then wait for that lock. A logging call only
formats its record and puts it on a bounded queue; the writer thread does the I/O. When the queue
is full (stderr blocked for a long time) a record is dropped and counted, and the writer says how
many were lost once it can write again: the daemon keeps serving, at the price of log lines.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import threading
from typing import TextIO

QUEUE_RECORDS = 10_000


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """QueueHandler that never waits: a record that does not fit is dropped and counted."""

    def __init__(self, q: queue.Queue):
        super().__init__(q)
        self.dropped = 0
        self._lock_dropped = threading.Lock()

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self._lock_dropped:
                self.dropped += 1

    def take_dropped(self) -> int:
        with self._lock_dropped:
            n, self.dropped = self.dropped, 0
        return n


class _Writer(logging.Handler):
    """The writer thread's handler: the stream handler, preceded by a line for records dropped."""

    def __init__(self, stream: TextIO, fmt: logging.Formatter, source: DroppingQueueHandler):
        super().__init__()
        self._out = logging.StreamHandler(stream)
        self._out.setFormatter(fmt)
        self._source = source

    def emit(self, record: logging.LogRecord) -> None:
        dropped = self._source.take_dropped()
        if dropped:
            note = logging.LogRecord(
                "pegaflow.log", logging.WARNING, __file__, 0, "%d log lines dropped: stderr was not read",
                (dropped,), None,
            )  # fmt: skip
            self._out.handle(note)
        self._out.handle(record)


def install(level: int, fmt: str, stream: TextIO, records: int = QUEUE_RECORDS) -> DroppingQueueHandler:
    """Routes the root logger through a bounded queue to ``stream``; the writer is stopped (the
    queue drained) at exit. Returns the handler the callers log into."""
    q: queue.Queue = queue.Queue(maxsize=records)
    handler = DroppingQueueHandler(q)
    listener = logging.handlers.QueueListener(q, _Writer(stream, logging.Formatter(fmt), handler))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    listener.start()
    atexit.register(_stop, listener)
    return handler


def _stop(listener: logging.handlers.QueueListener, timeout_s: float = 2.0) -> None:
    """Lets the writer drain the queue at exit, but not wait on a stderr nobody reads."""
    try:
        listener.enqueue_sentinel()
    except queue.Full:
        return
    thread = listener._thread
    if thread is not None:
        thread.join(timeout_s)
