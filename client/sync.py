"""PegaClient: the synchronous pegaflow client (thread-safe).

Every call carries a deadline (``timeout_s``, default the client's) and never
blocks longer. A transport failure, or the server forgetting our session,
raises ``errors.ServerUnavailable`` at once and hands recovery to a background
thread: with exponential backoff it opens a new session, maps the pool under
the new epoch and re-registers every instance (the InstanceHandle objects the
caller holds stay valid; their ids are updated in place). The same thread
heartbeats while connected and watches the pool connection for the server's
death. Until recovery succeeds, calls fail fast with ServerUnavailable, which a
cache user treats as a miss.

Create the client in the process that uses it (after any fork).
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
from pegaflow.client.types import InstanceHandle, KvLayout, Location, PrefixHit, SaveBatch, ServerLimits
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.server.gpu import doorbell
from pegaflow.server.gpu.registration import (
    DeviceHandle,
    DeviceRegistration,
    DeviceSave,
    registration_to_proto,
)

log = logging.getLogger(__name__)


class _Connection:
    """Everything that belongs to one session; replaced as a whole on reconnect."""

    __slots__ = ("channel", "stub", "session_id", "epoch", "mapping", "heartbeat_s", "ttl_s", "limits")

    def __init__(self, channel, stub, session_id, epoch, mapping, heartbeat_s, ttl_s, limits):
        self.channel: grpc.Channel = channel
        self.stub: pb_grpc.EngineStub = stub
        self.session_id: str = session_id
        self.epoch: str = epoch
        self.mapping: PoolMapping | None = mapping
        self.heartbeat_s: float = heartbeat_s
        self.ttl_s: float = ttl_s
        self.limits: ServerLimits = limits


class PegaClient:
    def __init__(
        self,
        address: str = "127.0.0.1:50055",
        timeout_s: float = 2.0,
        name: str = "pegaflow-client",
        map_pool: bool = True,
        backoff: Backoff | None = None,
    ):
        """``map_pool=False`` skips fd passing (a remote or metadata-only client: no pool_view)."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.address = address
        self.timeout_s = timeout_s
        self.name = name
        self.map_pool = map_pool
        self._backoff = backoff or Backoff()
        self._lock = threading.Lock()  # guards _conn, _instances, _retired
        self._establish_lock = threading.Lock()  # one (re)connect at a time
        self._conn: _Connection | None = None
        self._instances: list[InstanceHandle] = []
        self._devices: list[DeviceHandle] = []  # GPU registrations, re-registered after a reconnect
        self._retired: list[PoolMapping] = []  # old mappings whose views are still alive
        self._wake = threading.Event()
        self._closed = False
        self._worker: threading.Thread | None = None
        self.sessions_opened = 0  # more than 1: the client has reconnected

    # ------------------------------------------------------------- lifecycle

    def connect(self, timeout_s: float | None = None) -> None:
        """Opens a session, maps the pool and starts the heartbeat thread.

        Raises ServerUnavailable if the server cannot be reached in time; the
        background thread keeps trying, so the client becomes usable later.
        """
        if self._closed:
            raise errors.PegaflowError("client is closed")
        self._start_worker()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        try:
            self._establish(deadline)
        except errors.ServerUnavailable:
            self._wake.set()
            raise

    def close(self, timeout_s: float | None = None) -> None:
        """Ends the session (leases and unsealed blocks are released by the server) and stops threads."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout=(timeout_s or self.timeout_s) + 1)
        with self._lock:
            conn, self._conn = self._conn, None
            retired, self._retired = self._retired, []
        if conn is not None:
            try:
                conn.stub.CloseSession(
                    pb.CloseSessionRequest(session_id=conn.session_id), timeout=timeout_s or self.timeout_s
                )
            except grpc.RpcError:
                pass
            self._drop_connection(conn)
        for mapping in retired:
            mapping.release()

    def __enter__(self) -> PegaClient:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    # ------------------------------------------------------------- pool

    def pool_view(self, epoch: str | None = None) -> np.ndarray:
        """The whole mapped pool as a writable uint8 array.

        With ``epoch`` (from a PrefixHit / SaveBatch), raises StaleEpoch if the
        pool has been re-mapped since: those locations mean nothing any more.
        Do not keep views across reconnects: an old mapping is unmapped only
        once its views are gone.
        """
        conn = self._require()
        if conn.mapping is None:
            raise errors.PegaflowError("this client was created with map_pool=False")
        if epoch is not None and epoch != conn.epoch:
            raise errors.StaleEpoch(
                f"locations of epoch {epoch} are stale: the pool is now epoch {conn.epoch}"
            )
        return conn.mapping.view()

    def wait_pool_populated(self, timeout_s: float | None = None) -> bool:
        """Waits until the pool mapping's page tables are filled in the background (first copies then
        no longer fault per 4 KiB page); True when done. Never needed for correctness."""
        conn = self._require()
        if conn.mapping is None:
            return True
        return conn.mapping.populated.wait(timeout_s if timeout_s is not None else self.timeout_s)

    # ------------------------------------------------------------- instances

    def register_instance(
        self, layout: KvLayout, name: str = "", timeout_s: float | None = None
    ) -> InstanceHandle:
        """Registers a KV cache; the handle is re-registered automatically after every reconnect.

        Raises InvalidArgument if the server rejects the layout. If the server
        is unreachable the handle is returned unregistered (``handle.registered``
        is False; calls with it raise ServerUnavailable) and the background
        reconnect registers it.
        """
        handle = InstanceHandle(layout, name or self.name)
        with self._lock:
            self._instances.append(handle)
            conn = self._conn
        if conn is None:
            return handle
        try:
            self._register(conn, handle, time.monotonic() + (timeout_s or self.timeout_s))
        except errors.InvalidArgument:
            with self._lock:
                self._instances.remove(handle)
            raise
        except errors.ServerUnavailable as exc:
            self._lost(conn, exc)
        return handle

    def unregister_instance(self, handle: InstanceHandle, timeout_s: float | None = None) -> None:
        with self._lock:
            if handle in self._instances:
                self._instances.remove(handle)
        if handle.registered:
            instance_id = handle.instance_id
            handle._clear()
            self._call("UnregisterInstance", pb.UnregisterInstanceRequest(instance_id=instance_id), timeout_s)

    # ------------------------------------------------------------- load path

    def query_prefix(
        self,
        inst: InstanceHandle,
        hashes: Sequence[bytes],
        lease: bool = False,
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> PrefixHit:
        """Number of leading stored blocks; with ``lease`` they stay pinned until ``release``."""
        req = pb.QueryPrefixRequest(
            instance_id=self._instance_id(inst),
            block_hashes=codec.check_hashes(hashes, self.limits),
            lease=lease,
            lease_ttl_ms=int(lease_ttl_s * 1000) if lease_ttl_s else 0,
            lease_id=codec.new_id("l-") if lease else "",
        )
        try:
            return codec.prefix_hit(self._call("QueryPrefix", req, timeout_s))
        except errors.DeadlineExceeded:
            if lease:  # the server may still serve it late: release (or pre-empt) that lease
                self._undo("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=req.lease_id))
            raise

    def load_blocks(
        self, inst: InstanceHandle, lease_id: str, timeout_s: float | None = None
    ) -> list[Location]:
        """Locations of a lease's blocks again (the PrefixHit already has them)."""
        req = pb.LoadBlocksRequest(instance_id=self._instance_id(inst), lease_id=lease_id)
        return codec.locations(self._call("LoadBlocks", req, timeout_s).locations)

    def release(self, lease_id: str, loaded_bytes: int = 0, timeout_s: float | None = None) -> None:
        self._call(
            "ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id, loaded_bytes=loaded_bytes), timeout_s
        )

    # ------------------------------------------------------------- save path

    def allocate(
        self, inst: InstanceHandle, hashes: Sequence[bytes], timeout_s: float | None = None
    ) -> SaveBatch:
        """Reserves pool space: write the GRANTED locations, then ``seal`` (or ``abort``)."""
        req = pb.AllocateBlocksRequest(
            instance_id=self._instance_id(inst),
            block_hashes=codec.check_hashes(hashes, self.limits),
            save_id=codec.new_id("w-"),
        )
        try:
            return codec.save_batch(self._call("AllocateBlocks", req, timeout_s))
        except errors.DeadlineExceeded:
            self._undo("AbortBlocks", pb.AbortBlocksRequest(save_id=req.save_id))
            raise

    def seal(
        self, save_id: str, hashes: Sequence[bytes] | None = None, timeout_s: float | None = None
    ) -> int:
        """Makes written blocks visible (all granted blocks of the save, or the listed ones)."""
        req = pb.SealBlocksRequest(
            save_id=save_id, block_hashes=codec.check_hashes(hashes or (), self.limits)
        )
        return self._call("SealBlocks", req, timeout_s).sealed

    def abort(self, save_id: str, timeout_s: float | None = None) -> int:
        return self._call("AbortBlocks", pb.AbortBlocksRequest(save_id=save_id), timeout_s).freed

    # --------------------------------------------------------- GPU data path

    def register_device_memory(
        self, inst: InstanceHandle, registration: DeviceRegistration, timeout_s: float | None = None
    ) -> DeviceHandle:
        """Hands the server a GPU worker's KV tensors (CUDA IPC); re-registered after every reconnect.

        Raises what the server answers (FAILED_PRECONDITION -> ServerError when it has no GPU data path,
        InvalidArgument for a malformed layout) or ServerUnavailable (then nothing is kept: call again
        once the client has reconnected).
        """
        handle = DeviceHandle(inst, registration)
        conn = self._require()
        self._register_device(conn, handle, time.monotonic() + (timeout_s or self.timeout_s))
        with self._lock:
            self._devices.append(handle)
        return handle

    def unregister_device_memory(self, handle: DeviceHandle, timeout_s: float | None = None) -> None:
        with self._lock:
            if handle in self._devices:
                self._devices.remove(handle)
        registration_id = handle.registration_id
        handle._set("")
        if registration_id:
            req = pb.UnregisterDeviceMemoryRequest(registration_id=registration_id)
            self._call("UnregisterDeviceMemory", req, timeout_s)

    def save_from_device(
        self,
        handle: DeviceHandle,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        timeout_s: float | None = None,
    ) -> DeviceSave:
        """The server copies GPU blocks ``block_ids`` into the pool under ``hashes`` and seals them."""
        hashes = codec.check_hashes(hashes, self.limits)
        registration_id = self._device_id(handle)
        if handle.doorbell is not None:  # the local fast path; None back means "use the RPC"
            conn = self._require()
            out = doorbell.ring(
                handle.doorbell,
                doorbell.OP_SAVE,
                conn.session_id,
                registration_id,
                hashes,
                block_ids,
                timeout_s or self.timeout_s,
            )
            if out is not None:
                return DeviceSave(out[1], out[0])
        req = pb.SaveFromDeviceRequest(
            registration_id=registration_id, block_hashes=hashes, block_ids=block_ids
        )
        resp = self._call("SaveFromDevice", req, timeout_s)
        return DeviceSave(list(resp.statuses), resp.written)

    def load_to_device(
        self,
        handle: DeviceHandle,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        timeout_s: float | None = None,
    ) -> int:
        """The server copies the leading stored blocks of ``hashes`` into ``block_ids``; returns how many."""
        hashes = codec.check_hashes(hashes, self.limits)
        registration_id = self._device_id(handle)
        if handle.doorbell is not None:
            conn = self._require()
            out = doorbell.ring(
                handle.doorbell,
                doorbell.OP_LOAD,
                conn.session_id,
                registration_id,
                hashes,
                block_ids,
                timeout_s or self.timeout_s,
            )
            if out is not None:
                return out[0]
        req = pb.LoadToDeviceRequest(
            registration_id=registration_id, block_hashes=hashes, block_ids=block_ids
        )
        return self._call("LoadToDevice", req, timeout_s).num_hits

    def _device_id(self, handle: DeviceHandle) -> str:
        if not handle.registration_id:
            raise errors.ServerUnavailable("GPU memory is not registered yet (server unreachable)")
        return handle.registration_id

    def _register_device(self, conn: _Connection, handle: DeviceHandle, deadline: float) -> None:
        req = registration_to_proto(handle.registration, self._instance_id(handle.instance))
        resp = self._call("RegisterDeviceMemory", req, max(deadline - time.monotonic(), 0.001), conn=conn)
        handle._set(resp.registration_id, resp.doorbell_socket_path)

    # ---------------------------------------------------------- introspection

    def stats(self, timeout_s: float | None = None) -> pb.GetStatsResponse:
        return self._call("GetStats", pb.GetStatsRequest(), timeout_s)

    # -------------------------------------------------------------- internals

    def _require(self) -> _Connection:
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

    def _call(self, method: str, request, timeout_s: float | None, conn: _Connection | None = None):
        conn = conn or self._require()
        if hasattr(request, "session_id"):
            request.session_id = conn.session_id
        try:
            return getattr(conn.stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            exc = codec.translate(err, method)
        except ValueError as err:  # the channel was closed under us by a concurrent reconnect
            exc = errors.ServerUnavailable(f"{method}: {err}")
        if codec.needs_reconnect(exc):
            self._lost(conn, exc)
        raise exc

    def _undo(self, method: str, request) -> None:
        """Fire-and-forget: releases / aborts what a timed-out call may still be granted (by its id)."""
        conn = self._conn
        if conn is None:
            return  # no session: whatever it held dies with it on the server
        request.session_id = conn.session_id
        try:
            getattr(conn.stub, method).future(request, timeout=self.timeout_s)
        except (grpc.RpcError, ValueError):
            pass

    def _lost(self, conn: _Connection, exc: Exception) -> None:
        """Drops ``conn`` (if still current) and wakes the reconnect thread."""
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
        log.warning(
            "pegaflow: lost session %s with %s: %s; reconnecting in the background",
            conn.session_id,
            self.address,
            exc,
        )
        self._drop_connection(conn)
        self._wake.set()

    def _drop_connection(self, conn: _Connection) -> None:
        if conn.mapping is not None and not conn.mapping.release():
            with self._lock:
                self._retired.append(conn.mapping)
        conn.channel.close()

    def _register(self, conn: _Connection, handle: InstanceHandle, deadline: float) -> None:
        req = pb.RegisterInstanceRequest(
            layout=codec.layout_message(handle.layout), instance_name=handle.name
        )
        resp = self._call("RegisterInstance", req, max(deadline - time.monotonic(), 0.001), conn=conn)
        handle._set(resp.instance_id, resp.namespace_id, conn.epoch)

    def _establish(self, deadline: float) -> None:
        """Opens a new session (new channel, pool mapping, instances) and makes it current."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._establish_lock.acquire(timeout=remaining):
            raise errors.DeadlineExceeded("connect: deadline passed waiting for another connect")
        try:
            if self._conn is not None or self._closed:
                return
            channel = grpc.insecure_channel(self.address, options=codec.CHANNEL_OPTIONS)
            conn = None
            try:
                stub = pb_grpc.EngineStub(channel)
                req = pb.OpenSessionRequest(
                    client_name=self.name, pid=os.getpid(), hostname=socket.gethostname()
                )
                try:
                    resp = stub.OpenSession(req, timeout=max(deadline - time.monotonic(), 0.001))
                except grpc.RpcError as err:
                    raise codec.translate(err, "OpenSession") from None
                mapping = None
                if self.map_pool:
                    mapping = PoolMapping.open(
                        resp.pool.fd_socket_path, resp.session_id, max(deadline - time.monotonic(), 0.001)
                    )
                conn = _Connection(
                    channel,
                    stub,
                    resp.session_id,
                    resp.pool.epoch,
                    mapping,
                    resp.heartbeat_interval_ms / 1000.0,
                    resp.ttl_ms / 1000.0,
                    codec.limits_from(resp.limits),
                )
                with self._lock:
                    handles = list(self._instances)
                for handle in handles:
                    try:
                        self._register(conn, handle, deadline)
                    except errors.InvalidArgument as exc:
                        handle._clear()
                        handle.rejection = str(exc)
                        log.error(
                            "pegaflow: server %s rejects instance %r after reconnect: %s",
                            self.address,
                            handle.name,
                            exc,
                        )
                with self._lock:
                    devices = list(self._devices)
                for device in devices:
                    device._set("")
                    if not device.instance.registered:
                        continue
                    try:
                        self._register_device(conn, device, deadline)
                    except errors.ServerUnavailable:
                        raise
                    except errors.PegaflowError as exc:
                        log.error("pegaflow: %s rejects GPU memory on reconnect: %s", self.address, exc)
            except BaseException:
                if conn is not None:
                    self._drop_connection(conn)
                else:
                    channel.close()
                raise
            with self._lock:
                self._conn = conn
                self.sessions_opened += 1
            self._backoff.reset()
            log.info(
                "pegaflow: session %s with %s (pool epoch %s)", conn.session_id, self.address, conn.epoch
            )
        finally:
            self._establish_lock.release()

    def _start_worker(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="pegaflow-client-heartbeat", daemon=True
                )
                self._worker.start()

    def _run(self) -> None:
        missed_since: float | None = None
        while not self._closed:
            conn = self._conn
            if conn is None:
                try:
                    self._establish(time.monotonic() + self.timeout_s)
                    missed_since = None
                    continue
                except errors.PegaflowError as exc:
                    delay = self._backoff.next()
                    log.debug(
                        "pegaflow: reconnect to %s failed (%s); next try in %.2f s", self.address, exc, delay
                    )
                except Exception:
                    delay = self._backoff.next()
                    log.exception("pegaflow: reconnect to %s failed unexpectedly", self.address)
                self._release_retired()
                self._wake.wait(delay)
                self._wake.clear()
                continue
            self._wake.wait(conn.heartbeat_s)
            self._wake.clear()
            if self._closed or self._conn is not conn:
                continue
            self._release_retired()
            if conn.mapping is not None and conn.mapping.server_gone():
                self._lost(conn, errors.ServerUnavailable("the server closed the pool connection"))
                continue
            try:
                resp = self._call(
                    "Heartbeat", pb.HeartbeatRequest(), min(conn.heartbeat_s, self.timeout_s), conn
                )
            except errors.DeadlineExceeded:
                # A busy server, not a dead one: give it until the session TTL before starting over.
                now = time.monotonic()
                missed_since = missed_since or now
                if now - missed_since > conn.ttl_s:
                    self._lost(conn, errors.ServerUnavailable("no heartbeat answer within the session TTL"))
                continue
            except errors.PegaflowError:
                continue  # _call already handed a lost session to the reconnect path
            missed_since = None
            if resp.epoch != conn.epoch:
                self._lost(conn, errors.SessionLost(f"server epoch changed to {resp.epoch}"))
                continue
            self._register_stragglers(conn)

    def _register_stragglers(self, conn: _Connection) -> None:
        """Handles created while a reconnect was in flight missed its registration pass: register them now."""
        with self._lock:
            pending = [h for h in self._instances if not h.registered and not h.rejection]
        for handle in pending:
            try:
                self._register(conn, handle, time.monotonic() + self.timeout_s)
            except errors.InvalidArgument as exc:
                handle.rejection = str(exc)
            except errors.PegaflowError:
                return

    def _release_retired(self) -> None:
        with self._lock:
            retired = self._retired
            self._retired = []
        still = [m for m in retired if not m.release()]
        if still:
            with self._lock:
                self._retired.extend(still)
