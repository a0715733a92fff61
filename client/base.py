"""The client's state and rules, apart from its transport (PegaClient in sync.py adds that).

One session's state (``Connection``), the checks every call makes, the request
messages, and the rules of the background loop (when a missed heartbeat means a
dead server, which handles to register). AsyncPegaClient (aio.py) wraps PegaClient.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from pegaflow.client import errors
from pegaflow.client import rpc_codec as codec
from pegaflow.client.backoff import Backoff
from pegaflow.client.pool_map import PoolMapping
from pegaflow.client.types import InstanceHandle, KvLayout, QueryPurpose, ServerLimits
from pegaflow.common.auth import AuthConfigError, ClientAuth
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

log = logging.getLogger("pegaflow.client")


class Connection:
    """Everything that belongs to one session; replaced as a whole on reconnect."""

    __slots__ = (
        "channel",
        "stub",
        "session_id",
        "epoch",
        "pool",
        "heartbeat_s",
        "ttl_s",
        "limits",
        "local",
        "lane",
    )

    def __init__(
        self, channel, stub: pb_grpc.EngineStub, resp: pb.OpenSessionResponse, pool: PoolMapping | None
    ):
        self.channel = channel  # grpc.Channel
        self.stub = stub
        self.session_id: str = resp.session_id
        self.epoch: str = resp.pool.epoch
        self.pool = pool  # None for a client created with map_pool=False
        self.heartbeat_s: float = resp.heartbeat_interval_ms / 1000.0
        self.ttl_s: float = resp.ttl_ms / 1000.0
        self.limits: ServerLimits = codec.limits_from(resp.limits)
        self.local = None  # LocalRpcClient: the session's local RPC socket, when the client uses one
        self.lane = None  # ReadLaneClient: the server's read lane, when it offers one and it is here


class HeartbeatWatch:
    """Tells a busy server from a dead one: missed heartbeats are tolerated up to the session TTL."""

    def __init__(self) -> None:
        self._missed_since: float | None = None

    def answered(self) -> None:
        self._missed_since = None

    def missed(self, conn: Connection) -> bool:
        """One more unanswered heartbeat; True once they have gone on for longer than the TTL."""
        now = time.monotonic()
        if self._missed_since is None:
            self._missed_since = now
        return now - self._missed_since > conn.ttl_s


class ClientBase:
    def __init__(
        self,
        address: str = "127.0.0.1:50055",
        timeout_s: float = 2.0,
        name: str = "pegaflow-client",
        map_pool: bool = True,
        backoff: Backoff | None = None,
        auth: ClientAuth | None = None,
        read_only: bool = False,
    ):
        """``map_pool=False`` skips fd passing (a remote or metadata-only client: no pool_view).
        ``read_only``: a reader (vLLM's kv_consumer): the server passes a read-only pool fd, so the
        pool view is read-only, and allocate / seal are refused (FailedPrecondition).

        Otherwise the pool fd is received at connect (its connection is the session's liveness
        signal) and the pool is mapped on the first ``pool_view``.

        ``auth``: the token / TLS a server started with --auth-token-file / --tls-* asks for
        (``pegaflow.common.auth.ClientAuth``); None reads them from the environment
        (PEGAFLOW_AUTH_TOKEN or PEGAFLOW_AUTH_TOKEN_FILE, PEGAFLOW_TLS_CA, PEGAFLOW_TLS_CERT +
        PEGAFLOW_TLS_KEY, PEGAFLOW_TLS_SERVER_NAME): none set, plaintext and no token, as before.
        ``ClientAuth()`` ignores the environment. A refused token is ``ServerError``
        (UNAUTHENTICATED); a refused TLS handshake looks like an unreachable server.
        The local sockets (pool fd, local RPC) carry no token: their file permissions gate them.
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.auth = ClientAuth.from_env() if auth is None else auth  # AuthConfigError: a bad combination
        self.address = address
        self.timeout_s = timeout_s
        self.name = name
        self.map_pool = map_pool
        self.read_only = read_only
        self._backoff = backoff or Backoff()
        self._lock = threading.Lock()  # guards _conn, _instances, _retired (never held across an await)
        self._conn: Connection | None = None
        self._instances: list[InstanceHandle] = []
        self._retired: list[PoolMapping] = []  # old pools whose views are still alive
        self._closed = False
        self.sessions_opened = 0  # more than 1: the client has reconnected
        self._init_transport()

    def _init_transport(self) -> None:
        """The subclass's own state (threads and events, or tasks): set up once, by ``__init__``."""
        raise NotImplementedError

    # ------------------------------------------------------------- state

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def session_id(self) -> str:
        conn = self._conn
        return conn.session_id if conn else ""

    @property
    def epoch(self) -> str:
        conn = self._conn
        return conn.epoch if conn else ""

    @property
    def limits(self) -> ServerLimits | None:
        conn = self._conn
        return conn.limits if conn else None

    @property
    def local_rpc_socket(self) -> str:
        """The local RPC socket this session's calls use ("" when they all go over gRPC)."""
        conn = self._conn
        return conn.local.path if conn and conn.local else ""

    @property
    def local_rpc_calls(self) -> dict[str, int]:
        """Calls of this session that the server ran from the local RPC socket, by method."""
        conn = self._conn
        return conn.local.call_counts() if conn and conn.local else {}

    def pool_view(self, epoch: str | None = None) -> np.ndarray:
        """The whole pool as a writable uint8 array (mapped into this process on the first call).

        With ``epoch`` (from a PrefixHit / SaveBatch), raises StaleEpoch if the
        pool has been re-mapped since: those locations mean nothing any more.
        Do not keep views across reconnects: an old mapping is unmapped only
        once its views are gone.
        """
        conn = self._require()
        if conn.pool is None:
            raise errors.PegaflowError("this client was created with map_pool=False")
        if epoch is not None and epoch != conn.epoch:
            raise errors.StaleEpoch(
                f"locations of epoch {epoch} are stale: the pool is now epoch {conn.epoch}"
            )
        return conn.pool.view()

    # ------------------------------------------------------------- checks

    def _timeout(self, timeout_s: float | None) -> float:
        return timeout_s or self.timeout_s

    def _new_channel(self) -> grpc.Channel:
        """A channel to the server with the client's credentials (files read now, so a renewed
        certificate or token file is used from the next reconnect on)."""
        try:
            return self.auth.channel(self.address, codec.CHANNEL_OPTIONS)
        except AuthConfigError as exc:
            raise errors.PegaflowError(f"pegaflow client credentials: {exc}") from None

    def _require(self) -> Connection:
        conn = self._conn
        if conn is None:
            if self._closed:
                raise errors.PegaflowError("client is closed")
            raise errors.ServerUnavailable(
                f"not connected to {self.address} (reconnecting in the background)"
            )
        return conn

    def _instance_id(self, inst: InstanceHandle) -> str:
        instance_id = inst.instance_id
        if not instance_id and inst.rejection:
            raise errors.InvalidArgument(f"instance {inst.name!r} rejected by the server: {inst.rejection}")
        if not instance_id:
            raise errors.ServerUnavailable(
                f"instance {inst.name!r} is not registered yet (server unreachable)"
            )
        return instance_id

    def _hashes(self, hashes: Sequence[bytes]) -> list[bytes]:
        return codec.check_hashes(hashes, self.limits)

    # ------------------------------------------------------------- instances

    def _track_instance(self, layout: KvLayout, name: str) -> tuple[InstanceHandle, Connection | None]:
        """A new handle, kept for registering again after every reconnect, and the session to register
        it in now (None: not connected; the background reconnect registers it)."""
        handle = InstanceHandle(layout, name or self.name)
        with self._lock:
            self._instances.append(handle)
            return handle, self._conn

    def _untrack_instance(self, handle: InstanceHandle) -> None:
        with self._lock:
            if handle in self._instances:
                self._instances.remove(handle)

    # ------------------------------------------------------------- requests

    @property
    def session_ttl_s(self) -> float:
        """The current session's TTL (what silence ends it after); 0.0 while not connected."""
        conn = self._conn
        return conn.ttl_s if conn is not None else 0.0

    def _open_session_request(self) -> pb.OpenSessionRequest:
        return pb.OpenSessionRequest(
            client_name=self.name, pid=os.getpid(), hostname=socket.gethostname(), read_only=self.read_only
        )

    def _register_request(self, handle: InstanceHandle) -> pb.RegisterInstanceRequest:
        return pb.RegisterInstanceRequest(
            layout=codec.layout_message(handle.layout), instance_name=handle.name
        )

    def _query_request(
        self,
        inst: InstanceHandle,
        hashes: Sequence[bytes],
        lease: bool,
        lease_ttl_s: float | None,
        purpose: QueryPurpose,
    ) -> pb.QueryPrefixRequest:
        return pb.QueryPrefixRequest(
            instance_id=self._instance_id(inst),
            block_hashes=self._hashes(hashes),
            lease=lease,
            lease_ttl_ms=int(lease_ttl_s * 1000) if lease_ttl_s else 0,
            # client-chosen: if the call times out, the lease can be released by this id
            lease_id=codec.new_id("l-") if lease else "",
            purpose=int(QueryPurpose(purpose)),
        )

    def _allocate_request(self, inst: InstanceHandle, hashes: Sequence[bytes]) -> pb.AllocateBlocksRequest:
        return pb.AllocateBlocksRequest(
            instance_id=self._instance_id(inst), block_hashes=self._hashes(hashes), save_id=codec.new_id("w-")
        )

    def _seal_request(
        self, save_id: str, hashes: Sequence[bytes] | None, checksums: Sequence[int] = ()
    ) -> pb.SealBlocksRequest:
        return pb.SealBlocksRequest(
            save_id=save_id, block_hashes=self._hashes(hashes or ()), checksums=list(checksums)
        )

    # ------------------------------------------------------------- reconnect rules

    def _rejected_after_reconnect(self, handle: InstanceHandle, exc: errors.PegaflowError) -> None:
        handle._clear()
        handle.rejection = str(exc)
        log.error(
            "pegaflow: server %s rejects instance %r after reconnect: %s", self.address, handle.name, exc
        )

    def _stragglers(self) -> list[InstanceHandle]:
        """Handles created while a reconnect was in flight (it missed them): registered by the loop."""
        with self._lock:
            return [h for h in self._instances if not h.registered and not h.rejection]

    def _take_current(self, conn: Connection) -> bool:
        """Makes ``conn`` the current session (after a successful connect)."""
        with self._lock:
            if self._closed:
                return False
            self._conn = conn
            self.sessions_opened += 1
        self._backoff.reset()
        log.info("pegaflow: session %s with %s (pool epoch %s)", conn.session_id, self.address, conn.epoch)
        return True

    def _detach(self, conn: Connection, exc: Exception) -> bool:
        """Drops ``conn`` if it is still the current session; False if it was already replaced."""
        with self._lock:
            if self._conn is not conn:
                return False
            self._conn = None
        log.warning(
            "pegaflow: lost session %s with %s: %s; reconnecting in the background",
            conn.session_id,
            self.address,
            exc,
        )
        return True

    def _take_connection(self) -> Connection | None:
        """Detaches the current session for ``close`` (which ends it on the server)."""
        with self._lock:
            conn, self._conn = self._conn, None
        return conn

    def _release_pool(self, conn: Connection) -> None:
        """Ends the session's pool connection; a pool whose views are still alive is unmapped later."""
        if conn.pool is not None and not conn.pool.release():
            with self._lock:
                self._retired.append(conn.pool)

    def _release_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        still = [pool for pool in retired if not pool.release()]
        if still:
            with self._lock:
                self._retired.extend(still)

    @staticmethod
    def _translate(err: Exception, method: str) -> errors.PegaflowError:
        if isinstance(err, grpc.RpcError):
            return codec.translate(err, method)
        # ValueError / RuntimeError: the channel was closed under us by a concurrent reconnect
        return errors.ServerUnavailable(f"{method}: {err}")
