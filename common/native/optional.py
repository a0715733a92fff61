"""A native function used once it is built and proven, the Python one until then and whenever it
cannot be (no compiler, a crash in the probe's child, or its switch set to 0 in the environment).

The build and the probe (extension.py) run on a thread of their own, started by ``start()``, so that
no caller waits for a compiler; ``get()`` answers which function to call now. Tests and benchmarks
pin one side with ``use()`` (an A/B in one process).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pegaflow.common.native.extension import NativeExtension


class OptionalNative:
    """``extension``'s function ``name``; ``switch``: the environment variable that turns it off
    ("0"); ``fallback``: what the log says runs instead (e.g. "the client waits for answers in
    Python")."""

    def __init__(
        self, extension: NativeExtension, name: str, switch: str, fallback: str, log: logging.Logger
    ):
        self.extension = extension
        self.name = name
        self.switch = switch
        self.fallback = fallback
        self._log = log
        self._native: Callable[..., Any] | None = None
        self._module: Any = None  # the loaded module, while its function is in use
        self._started = False
        self._python_only = False  # use(False): a build still running must not switch to native
        self._lock = threading.Lock()

    def get(self) -> Callable[..., Any] | None:
        """The native function, or None while (or where) the Python one is the one to use."""
        return self._native

    def module(self) -> Any:
        """The native module while its function is in use (for the module's other functions), else None."""
        return self._module if self._native is not None else None

    def start(self) -> None:
        """Builds and proves the module on a thread of its own (once per process)."""
        with self._lock:
            if self._started or os.environ.get(self.switch, "1") == "0":
                return
            self._started = True
        threading.Thread(target=self._load, name=f"pegaflow-native-{self.name}", daemon=True).start()

    def _load(self) -> None:
        why = self.extension.probe()
        if why is not None:
            self._log.info("pegaflow: %s (%s)", self.fallback, why)
            return
        try:
            module = self.extension.load()
            loaded = getattr(module, self.name)
            if not self._python_only:
                self._module = module
                self._native = loaded
        except Exception as exc:  # noqa: BLE001 - the Python function stays
            self._log.info("pegaflow: %s (%s)", self.fallback, exc)

    def wait_until_ready(self, timeout_s: float) -> bool:
        """True once the native function is in use (start() first)."""
        end = time.monotonic() + timeout_s
        while self._native is None and time.monotonic() < end:
            time.sleep(0.01)
        return self._native is not None

    def is_native(self) -> bool:
        return self._native is not None

    def use(self, native: bool, timeout_s: float = 60.0) -> bool:
        """Every caller in this process uses the native function from now on (built and proven first,
        within ``timeout_s``; False if it cannot be), or the Python one."""
        with self._lock:
            self._started = True  # no start() changes it behind the caller's back
        self._python_only = not native
        if not native:
            self._native = None
            return True
        if self._native is None:
            self._load()
        return self.wait_until_ready(timeout_s)
