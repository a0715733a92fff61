"""Runs a real pegaflow-server process for tests and benchmarks.

    with ServerProcess(tmp_path, pool_size="256mb") as srv:
        client = PegaClient(srv.addr)

The process is started in its own session (process group) on free ports
(port 0, real ports read from its "ready" line) and killed with its group on
exit; its stderr goes to a log file under the given directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import selectors
import signal
import subprocess
import sys
import threading
import time


class ServerStartError(RuntimeError):
    def __init__(self, message: str, returncode: int | None, log: str):
        super().__init__(f"{message} (exit code {returncode})\n--- server log ---\n{log}")
        self.returncode = returncode
        self.log = log


class ServerProcess:
    def __init__(
        self,
        workdir: str | os.PathLike,
        pool_size: str = "256mb",
        extra_args: list[str] | tuple[str, ...] = (),
        addr: str = "127.0.0.1:0",
        http_addr: str | None = "127.0.0.1:0",
        start_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        launcher: list[str] | tuple[str, ...] = (),
    ):
        """``launcher`` prefixes the command line (e.g. an ``unshare`` wrapper that mounts a pool dir)."""
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = [*launcher, sys.executable, "-m", "pegaflow.server", "--pool-size", pool_size]
        self.args += ["--addr", addr]
        # The CLI always serves /metrics; "no HTTP wanted" still needs a free port, never the default one.
        self.args += ["--http-addr", http_addr or "127.0.0.1:0"]
        self.args += list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self._starts = 0

    @property
    def addr(self) -> str:
        return self.ready["addr"]

    @property
    def http_addr(self) -> str:
        return self.ready["http_addr"]

    @property
    def fd_socket_path(self) -> str:
        return self.ready["fd_socket_path"]

    @property
    def epoch(self) -> str:
        return self.ready["epoch"]

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / f"server-{self._starts}.log"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def start(self) -> ServerProcess:
        self._starts += 1
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.args,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )
        finally:
            log.close()
        line = self._read_ready_line()
        try:
            self.ready = json.loads(line)
        except json.JSONDecodeError:
            self.kill()
            raise ServerStartError(
                f"unexpected first line from the server: {line!r}", None, self.log_text()
            ) from None
        return self

    def _read_ready_line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.kill()
                    raise ServerStartError("server did not become ready in time", None, self.log_text())
                if sel.select(timeout=min(remaining, 0.5)):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        code = self.proc.wait(timeout=10)
                        raise ServerStartError("server exited before it was ready", code, self.log_text())
                    buf += chunk
        return buf.split(b"\n", 1)[0].decode()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole group if it does not exit in time."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for tests that must restart a server on the same address)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.05, what: str = "condition") -> None:
    """Polls ``predicate`` until it is true; after ``timeout_s`` raises AssertionError (a test failure)
    naming ``what``. For tests and benchmarks of every part: the one polling helper, so none sleeps
    and hopes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (state T): a frozen server, as
    a hung host would leave it. Raises TimeoutError if it does not stop in time."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = pathlib.Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop: thread states {states}")
        time.sleep(0.01)


@contextlib.contextmanager
def held_elsewhere(lock, seconds: float):
    """``lock`` taken by another thread for ``seconds`` (a slow holder: a starved thread, a write to a
    failing disk) from before the body runs; joined after it."""
    taken = threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            time.sleep(seconds)

    holder = threading.Thread(target=hold, name="held-elsewhere")
    holder.start()
    try:
        if not taken.wait(10):
            raise TimeoutError("the holder never took the lock")
        yield
    finally:
        holder.join()
