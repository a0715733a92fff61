"""Child processes the harness starts itself (the locust load generator): in their own session so
they can be stopped with their whole tree, output to a log file and optionally echoed live; and
memory accounting of process trees (vLLM, pegaflow-server)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

import psutil


class ManagedProcess:
    """A command run in a new session (its own process group), stdout+stderr to `log_path`, and
    optionally echoed line by line to our stdout with a prefix (for live progress)."""

    def __init__(
        self,
        cmd: Sequence[str],
        log_path: pathlib.Path,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        echo_prefix: str | None = None,
    ):
        self.cmd = list(cmd)
        self.log_path = pathlib.Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.echo_prefix = echo_prefix
        self.proc: subprocess.Popen | None = None
        self._echo_thread: threading.Thread | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        log.write("$ " + " ".join(self.cmd) + "\n")
        log.flush()
        if self.echo_prefix is None:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
            log.close()
            return
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self._echo_thread = threading.Thread(target=self._echo, args=(log,), daemon=True)
        self._echo_thread.start()

    def _echo(self, log) -> None:
        with log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                sys.stdout.write(self.echo_prefix + line)
                sys.stdout.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        """Waits for exit; on timeout stops the process group and raises TimeoutError."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"{self.cmd[:3]} still running after {timeout_s:.0f} s; stopped it") from None
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=10)
        return code

    def stop(self, grace_s: float = 30.0, sig: int = signal.SIGINT) -> int | None:
        """Sends `sig` to the whole process group, waits `grace_s`, then SIGKILLs what is left."""
        if self.proc is None:
            return None
        pgid = self.proc.pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Children of the group may outlive its leader.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=10)
        return self.proc.returncode


def tree_memory(pid: int) -> dict:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"processes": 0, "rss_bytes": 0, "pss_bytes": 0}
    rss = pss = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            info = p.memory_full_info()
            rss += info.rss
            pss += info.pss
    return {"processes": len(procs), "rss_bytes": rss, "pss_bytes": pss}


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process and its live descendants so far."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def machine_busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine spent not idle, since boot (all processes)."""
    t = psutil.cpu_times()
    return (
        t.user
        + t.nice
        + t.system
        + getattr(t, "irq", 0.0)
        + getattr(t, "softirq", 0.0)
        + getattr(t, "steal", 0.0)
    )


def mem_available_bytes() -> int:
    return psutil.virtual_memory().available
