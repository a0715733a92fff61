"""The interpreter's core: the threads that run the save and query path's Python share one CPU.

Only one thread runs Python at a time (the interpreter lock), so the local RPC socket's workers
(server/endpoints/unix_socket.py) and the free-slot reserve's thread (engine.py) gain nothing from
running on different CPUs; they lose by it. Each hand-off of the interpreter lock between threads on
two CPUs is a cross-CPU wake-up, and the index, policy and allocator the next thread touches are in
the other CPU's cache. Measured on the 2-vCPU VM, 16 MiB saves from two client threads into a full pool
(bench/README.md, "The interpreter's core"): pinning these threads to one CPU cut the server's CPU per
batch and its context switches, and the two client threads copied more batches per second.

``InterpreterCore(setting)``: ``"off"`` pins nothing; a CPU number pins to it; ``"auto"`` pins to the
highest-numbered CPU this process may use, on hosts where it may use at most ``AUTO_MAX_CPUS`` (where
it was measured and the clients and the server share the few CPUs; larger hosts, the GPU hosts
among them, keep the kernel's placement until it is measured there). ``pin()`` is called by each
such thread for itself; Linux applies an affinity to the calling thread only.

A thread or process started by a pinned thread inherits its pin. Those started on the request path
(the block hasher's and the remote reads' pools, the peer links' threads, the lookup-sketch child) call
``release_thread()`` first, which gives them the CPUs the process started with.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

AUTO_MAX_CPUS = 2
# The CPUs the process may use, as it started (read at import, before any thread pinned itself); the
# sketch child gets them in its environment.
CPUS_ENV = "PEGAFLOW_PROCESS_CPUS"


def _allowed() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset()


PROCESS_CPUS = _allowed()


def parse_setting(value: str | int) -> str | int:
    """``"auto"``, ``"off"`` or a CPU number (ValueError otherwise): the CLI's and the config's check."""
    if value in ("auto", "off") and isinstance(value, str):
        return value
    try:
        cpu = int(value) if isinstance(value, str | int) and not isinstance(value, bool) else -1
    except ValueError:
        cpu = -1
    if cpu < 0:
        raise ValueError(f"interpreter_cpu must be auto, off or a CPU number, got {value!r}")
    if PROCESS_CPUS and cpu not in PROCESS_CPUS:
        raise ValueError(f"CPU {cpu} is not one this process may use ({format_cpus(PROCESS_CPUS)})")
    return cpu


def format_cpus(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def resolve(setting: str | int, cpus: frozenset[int] = PROCESS_CPUS) -> int | None:
    """The CPU ``setting`` pins to, None for none."""
    setting = parse_setting(setting)
    if setting == "off" or not cpus:
        return None
    if setting == "auto":
        return max(cpus) if len(cpus) <= AUTO_MAX_CPUS else None
    return setting


class InterpreterCore:
    def __init__(self, setting: str | int = "auto"):
        self.cpu = resolve(setting)
        self._pinned = threading.local()
        self._failed = False

    def pin(self) -> None:
        """Pins the calling thread to the interpreter's CPU (once per thread; nothing when off). A
        refusal (a cpuset changed under the process) is logged once and pins nothing after it."""
        if self.cpu is None or self._failed or getattr(self._pinned, "done", False):
            return
        try:
            os.sched_setaffinity(0, {self.cpu})
        except OSError as exc:
            self._failed = True
            log.warning("interpreter core: cannot pin to CPU %d (%s); threads stay unpinned", self.cpu, exc)
            return
        self._pinned.done = True


def release_thread() -> None:
    """Gives the calling thread the CPUs the process started with (a thread that a pinned thread
    started inherits its pin)."""
    if PROCESS_CPUS:
        try:
            os.sched_setaffinity(0, PROCESS_CPUS)
        except OSError:
            pass  # a cpuset shrunk since: the kernel's placement within it stands


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child process, naming the CPUs it is to use (``release_child``)."""
    if PROCESS_CPUS:
        env = {**env, CPUS_ENV: format_cpus(PROCESS_CPUS)}
    return env


def release_child() -> None:
    """In a child process started from the server: the CPUs named by ``child_environment``."""
    value = os.environ.get(CPUS_ENV)
    if not value:
        return
    try:
        os.sched_setaffinity(0, {int(c) for c in value.split(",")})
    except (ValueError, OSError):
        pass
