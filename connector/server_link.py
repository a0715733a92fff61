"""One connector process's link to pegaflow-server, with a circuit breaker that keeps a
down or slow server from stalling vLLM.

- vLLM never waits for the server: `start()` returns at once; a daemon thread creates
  the client, tries to connect and registers this process's instances. If the server is
  down the client keeps reconnecting in the background (new session, pool mapped under
  the new epoch, instances re-registered), also after a server restart later on.
- Every call has a deadline. The first failure (unreachable, deadline exceeded, session
  lost) opens the breaker: `usable()` returns None and callers skip the server, so a
  stopped server costs one deadline, not one per request. A background probe (GetStats)
  closes the breaker once the server answers again within the step-path deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pegaflow.connector.namespace import KvLayoutSpec

log = logging.getLogger("vllm.pegaflow.connector.link")

_FIRST_RETRY_S = 0.1
_DEFAULT_MAX_BATCH = 4096


def batches(items: Sequence[bytes], client: Any) -> list[list[bytes]]:
    """`items` cut into the largest batches the server accepts in one call."""
    limits = getattr(client, "limits", None)
    size = max(int(getattr(limits, "max_batch_blocks", 0) or _DEFAULT_MAX_BATCH), 1)
    items = list(items)
    return [items[i : i + size] for i in range(0, len(items), size)]


class ServerLink:
    def __init__(
        self,
        addr: str | Callable[[], str | None],
        layouts: Sequence[KvLayoutSpec],
        *,
        client_name: str,
        instance_name: str,
        rpc_timeout_s: float,
        retry_interval_s: float,
        probe_timeout_s: float | None = None,
        map_pool: bool = True,
        auth: Any = None,
        read_only: bool = False,
    ):
        """addr: "host:port", or a function that returns it once known (embedded mode).
        probe_timeout_s: how fast the server must answer a probe to be used again: the
        deadline of this process's calls on the engine step's path (a server slower than
        that would only trip the breaker again). Default rpc_timeout_s.
        map_pool: False for a process that only looks up (the scheduler): no pool mapping.
        auth: the client's credentials (a common.auth.ClientAuth, ConnectorConfig.auth); None:
        the client reads PEGAFLOW_AUTH_* / PEGAFLOW_TLS_* itself."""
        self._resolve = addr if callable(addr) else (lambda: addr)
        self._read_only = read_only  # a kv_consumer's worker: it maps the pool read-only
        self.addr = addr if isinstance(addr, str) else "<embedded>"
        self._map_pool = map_pool
        self._auth = auth
        self._layouts = list(layouts)
        self._client_name = client_name
        self._instance_name = instance_name
        self._rpc_timeout_s = rpc_timeout_s
        self._retry_interval_s = max(retry_interval_s, _FIRST_RETRY_S)
        self._probe_timeout_s = probe_timeout_s or rpc_timeout_s
        self._lock = threading.Lock()
        self._client: Any = None
        self._instances: list[Any] = []
        self._healthy = False
        self._rejected = False  # the server refused our layout: stay without a cache
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0  # breaker openings, for logs and tests

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pegaflow-link", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._rpc_timeout_s + 1.0)
        with self._lock:
            client, self._client = self._client, None
            self._healthy = False
        if client is not None:
            try:
                client.close()
            except Exception:  # closing must never raise into vLLM's shutdown
                log.debug("pegaflow client close failed", exc_info=True)

    # --------------------------------------------------------------- status
    def usable(self) -> tuple[Any, list[Any]] | None:
        """(client, instances) when connected, registered and healthy, else None: skip the server."""
        with self._lock:
            client, instances, healthy = self._client, self._instances, self._healthy
        if not healthy or client is None or not client.connected:
            return None
        if not all(inst.registered for inst in instances):
            return None
        return client, instances

    def report_failure(self, exc: BaseException, what: str) -> None:
        """A call failed in a way that says the server is unwell: skip it until a probe answers."""
        with self._lock:
            was_healthy = self._healthy
            self._healthy = False
        if was_healthy:
            self.failures += 1
            log.warning(
                "pegaflow-server at %s: %s failed (%s); running without the cache until it answers",
                self.addr,
                what,
                _short(exc),
            )
        self._wake.set()

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        delay = _FIRST_RETRY_S
        while not self._stop.is_set():
            addr = self._resolve()
            if addr:
                self.addr = addr
                break
            self._stop.wait(delay)  # embedded mode: rank 0 has not published its server yet
            delay = min(delay * 2, self._retry_interval_s)
        if self._stop.is_set() or not self._attach_retrying():
            return
        delay = _FIRST_RETRY_S
        while not self._stop.is_set():
            if self._probe():
                delay = _FIRST_RETRY_S
                self._wake.wait()  # until a failure is reported (or close)
                self._wake.clear()
                continue
            self._stop.wait(delay)
            delay = min(delay * 2, self._retry_interval_s)

    def _attach_retrying(self) -> bool:
        """``_attach``, again after an unexpected error (a bug, the OS out of file descriptors)
        instead of letting it end this thread, which would leave the cache off for the process's life."""
        delay, logged = _FIRST_RETRY_S, False
        while not self._stop.is_set():
            try:
                return self._attach()
            except Exception:
                log.warning(
                    "pegaflow: attaching to %s failed unexpectedly; retrying", self.addr, exc_info=not logged
                )
                logged = True
            self._stop.wait(delay)
            delay = min(delay * 2, self._retry_interval_s)
        return False

    def _attach(self) -> bool:
        """Create the client and register the instances; the server need not be up."""
        from pegaflow.client import PegaClient

        client = PegaClient(
            self.addr,
            timeout_s=self._rpc_timeout_s,
            name=self._client_name,
            map_pool=self._map_pool,
            auth=self._auth,
            read_only=self._read_only,
        )
        try:
            return self._attach_client(client)
        except Exception:
            client.close()
            raise

    def _attach_client(self, client: Any) -> bool:
        """Connects ``client`` and registers the instances: False (for good) when the server rejects
        this engine's layout."""
        from pegaflow.client import errors

        try:
            client.connect()
        except errors.ServerUnavailable as exc:
            log.info(
                "pegaflow-server at %s not reachable yet (%s); serving without the cache until it is",
                self.addr,
                _short(exc),
            )
        except errors.PegaflowError as exc:  # refused credentials (UNAUTHENTICATED), unusable files
            log.error(
                "pegaflow-server at %s refuses this engine (%s); serving without the cache, retrying in "
                "the background",
                self.addr,
                _short(exc),
            )
        try:
            instances = [
                client.register_instance(layout.to_client(), name=f"{self._instance_name}-r{layout.tp_rank}")
                for layout in self._layouts
            ]
        except errors.PegaflowError as exc:
            log.error(
                "pegaflow-server at %s rejects this engine's KV layout (%s); serving without the cache",
                self.addr,
                _short(exc),
            )
            self._rejected = True
            client.close()
            return False
        with self._lock:
            self._client = client
            self._instances = instances
        for layout in self._layouts:
            log.info("pegaflow: namespace %s", layout.describe())
        return True

    def _probe(self) -> bool:
        """True once the server answers and every instance is registered: closes the breaker."""
        from pegaflow.client import errors

        with self._lock:
            client, instances = self._client, self._instances
        if client is None or not client.connected or not all(inst.registered for inst in instances):
            return False  # the client is (re)connecting on its own thread
        try:
            client.stats(timeout_s=self._probe_timeout_s)
        except errors.PegaflowError as exc:
            log.debug("pegaflow-server at %s still unwell: %s", self.addr, _short(exc))
            return False
        except Exception:
            log.exception("pegaflow: health probe of %s failed unexpectedly", self.addr)
            return False
        with self._lock:
            was_healthy, self._healthy = self._healthy, True
        if not was_healthy:
            log.info(
                "pegaflow-server at %s: attached, cache on (%s)",
                self.addr,
                ", ".join(repr(i) for i in instances),
            )
        return True


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 300 else text[:300] + "..."
