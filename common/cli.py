"""What the pegaflow-server and pegaflow-metaserver command lines share: argument types,
the log set-up and the wait for SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from pegaflow.common import log_queue

T = TypeVar("T")

LOG_LEVELS = ["debug", "info", "warning", "error"]


def parsed_by(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` that parses with ``parse``: its ValueError becomes a usage error
    naming the flag, instead of a traceback."""

    def arg_type(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return arg_type


def checked_by(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse ``type=`` that keeps the text as written once ``check`` accepts it
    (an address is passed on as text, but a typo must fail at the command line)."""

    def keep_text(text: str) -> str:
        check(text)
        return text

    return parsed_by(keep_text)


def positive_seconds(text: str) -> float:
    """An argparse ``type=`` for a duration in seconds: finite and greater than zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    # Written so that nan fails too (every comparison with nan is False).
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be greater than zero, got {text!r}")
    return value


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="log verbosity on stderr (default %(default)s)",
    )


def configure_logging(level: str) -> None:
    """Logs go to stderr: stdout carries only the daemon's one JSON "ready" line. Written by a
    thread of their own (common/log_queue.py): a stderr that is not read never blocks a caller."""
    log_queue.install(
        getattr(logging, level.upper()), "%(asctime)s %(levelname)s %(name)s: %(message)s", sys.stderr
    )


class StopSignals:
    """SIGTERM and SIGINT ask for a clean shutdown. Create it (on the main thread, which owns signal
    handlers) before announcing "ready": a supervisor may send SIGTERM the moment it reads that."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._stop = threading.Event()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self._log.info("received %s, shutting down", signal.Signals(signum).name)
        self._stop.set()

    def wait(self) -> None:
        """Blocks until one of the signals arrives."""
        # Timed: the main thread returns to the interpreter regularly, which is where Python runs handlers.
        while not self._stop.wait(1.0):
            pass
