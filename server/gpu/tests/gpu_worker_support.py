"""Starts the stand-in GPU worker (kv_worker_proc.py) for the CUDA tests and talks to it."""

from __future__ import annotations

import os
import pathlib
import secrets
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Listener

WORKER = pathlib.Path(__file__).with_name("kv_worker_proc.py")


class Worker:
    """The stand-in worker process and its registrations."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory()
        address = os.path.join(self._dir.name, "w.sock")
        key = secrets.token_bytes(16)
        self._listener = Listener(address, authkey=key)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), address, key.hex()], env=env, start_new_session=True
        )
        self.conn = self._listener.accept()
        self.regs = self.conn.recv()

    def ask(self, *msg):
        self.conn.send(msg)
        return self.conn.recv()

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self):
        try:
            if self.proc.poll() is None:
                self.ask("exit")
                self.proc.wait(timeout=30)
        finally:
            self.kill()
            self._listener.close()
            self._dir.cleanup()
