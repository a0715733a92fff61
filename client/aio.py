"""AsyncPegaClient: the asyncio pegaflow client (same API as PegaClient, coroutines instead of calls).

Behaviour matches the sync client: a deadline on every call, ServerUnavailable
at once on transport failure, and a background task that heartbeats, watches
the pool connection and reconnects with exponential backoff (new session, pool
re-mapped under the new epoch, InstanceHandles re-registered in place). Use one
client per event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence

import grpc
import grpc.aio
import numpy as np

from pegaflow.client import errors
from pegaflow.client import rpc_codec as codec
from pegaflow.client.backoff import Backoff
from pegaflow.client.pool_map import PoolMapping
from pegaflow.client.types import InstanceHandle, KvLayout, Location, PrefixHit, SaveBatch, ServerLimits
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class _Connection:
    __slots__ = ("channel", "stub", "session_id", "epoch", "mapping", "heartbeat_s", "ttl_s", "limits")

    def __init__(self, channel, stub, session_id, epoch, mapping, heartbeat_s, ttl_s, limits):
        self.channel: grpc.aio.Channel = channel
        self.stub: pb_grpc.EngineStub = stub
        self.session_id: str = session_id
        self.epoch: str = epoch
        self.mapping: PoolMapping | None = mapping
        self.heartbeat_s: float = heartbeat_s
        self.ttl_s: float = ttl_s
        self.limits: ServerLimits = limits


class AsyncPegaClient:
    def __init__(
        self,
        address: str = "127.0.0.1:50055",
        timeout_s: float = 2.0,
        name: str = "pegaflow-client",
        map_pool: bool = True,
        backoff: Backoff | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.address = address
        self.timeout_s = timeout_s
        self.name = name
        self.map_pool = map_pool
        self._backoff = backoff or Backoff()
        self._establish_lock: asyncio.Lock | None = None
        self._conn: _Connection | None = None
        self._instances: list[InstanceHandle] = []
        self._retired: list[PoolMapping] = []
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._worker: asyncio.Task | None = None
        self._undo_tasks: set[asyncio.Task] = set()
        self.sessions_opened = 0

    # ------------------------------------------------------------- lifecycle

    async def connect(self, timeout_s: float | None = None) -> None:
        """Session + pool mapping + heartbeat task; raises ServerUnavailable (and keeps trying)."""
        if self._closed:
            raise errors.PegaflowError("client is closed")
        self._start_worker()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        try:
            await self._establish(deadline)
        except errors.ServerUnavailable:
            self._wake.set()
            raise

    async def close(self, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):
                pass
        if self._undo_tasks:  # give pending releases / aborts their chance, within the timeout
            await asyncio.wait(list(self._undo_tasks), timeout=timeout_s or self.timeout_s)
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.stub.CloseSession(
                    pb.CloseSessionRequest(session_id=conn.session_id), timeout=timeout_s or self.timeout_s
                )
            except grpc.RpcError:
                pass
            await self._drop_connection(conn)
        for mapping in self._retired:
            mapping.release()
        self._retired = []

    async def __aenter__(self) -> AsyncPegaClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def session_id(self) -> str:
        return self._conn.session_id if self._conn else ""

    @property
    def epoch(self) -> str:
        return self._conn.epoch if self._conn else ""

    @property
    def limits(self) -> ServerLimits | None:
        return self._conn.limits if self._conn else None

    def pool_view(self, epoch: str | None = None) -> np.ndarray:
        """The mapped pool as a uint8 array; StaleEpoch if ``epoch`` is not the current mapping's."""
        conn = self._require()
        if conn.mapping is None:
            raise errors.PegaflowError("this client was created with map_pool=False")
        if epoch is not None and epoch != conn.epoch:
            raise errors.StaleEpoch(
                f"locations of epoch {epoch} are stale: the pool is now epoch {conn.epoch}"
            )
        return conn.mapping.view()

    # ------------------------------------------------------------- instances

    async def register_instance(
        self, layout: KvLayout, name: str = "", timeout_s: float | None = None
    ) -> InstanceHandle:
        """As PegaClient.register_instance: an unregistered handle if the server is unreachable."""
        handle = InstanceHandle(layout, name or self.name)
        self._instances.append(handle)
        conn = self._conn
        if conn is None:
            return handle
        try:
            await self._register(conn, handle, time.monotonic() + (timeout_s or self.timeout_s))
        except errors.InvalidArgument:
            self._instances.remove(handle)
            raise
        except errors.ServerUnavailable as exc:
            await self._lost(conn, exc)
        return handle

    async def unregister_instance(self, handle: InstanceHandle, timeout_s: float | None = None) -> None:
        if handle in self._instances:
            self._instances.remove(handle)
        if handle.registered:
            instance_id = handle.instance_id
            handle._clear()
            await self._call(
                "UnregisterInstance", pb.UnregisterInstanceRequest(instance_id=instance_id), timeout_s
            )

    # ------------------------------------------------------------- load / save

    async def query_prefix(
        self,
        inst: InstanceHandle,
        hashes: Sequence[bytes],
        lease: bool = False,
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> PrefixHit:
        req = pb.QueryPrefixRequest(
            instance_id=self._instance_id(inst),
            block_hashes=codec.check_hashes(hashes, self.limits),
            lease=lease,
            lease_ttl_ms=int(lease_ttl_s * 1000) if lease_ttl_s else 0,
            lease_id=codec.new_id("l-") if lease else "",
        )
        try:
            return codec.prefix_hit(await self._call("QueryPrefix", req, timeout_s))
        except errors.DeadlineExceeded:
            if lease:  # the server may still serve it late: release (or pre-empt) that lease
                self._undo("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=req.lease_id))
            raise

    async def load_blocks(
        self, inst: InstanceHandle, lease_id: str, timeout_s: float | None = None
    ) -> list[Location]:
        req = pb.LoadBlocksRequest(instance_id=self._instance_id(inst), lease_id=lease_id)
        return codec.locations((await self._call("LoadBlocks", req, timeout_s)).locations)

    async def release(self, lease_id: str, loaded_bytes: int = 0, timeout_s: float | None = None) -> None:
        await self._call(
            "ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id, loaded_bytes=loaded_bytes), timeout_s
        )

    async def allocate(
        self, inst: InstanceHandle, hashes: Sequence[bytes], timeout_s: float | None = None
    ) -> SaveBatch:
        req = pb.AllocateBlocksRequest(
            instance_id=self._instance_id(inst),
            block_hashes=codec.check_hashes(hashes, self.limits),
            save_id=codec.new_id("w-"),
        )
        try:
            return codec.save_batch(await self._call("AllocateBlocks", req, timeout_s))
        except errors.DeadlineExceeded:
            self._undo("AbortBlocks", pb.AbortBlocksRequest(save_id=req.save_id))
            raise

    async def seal(
        self, save_id: str, hashes: Sequence[bytes] | None = None, timeout_s: float | None = None
    ) -> int:
        req = pb.SealBlocksRequest(
            save_id=save_id, block_hashes=codec.check_hashes(hashes or (), self.limits)
        )
        return (await self._call("SealBlocks", req, timeout_s)).sealed

    async def abort(self, save_id: str, timeout_s: float | None = None) -> int:
        return (await self._call("AbortBlocks", pb.AbortBlocksRequest(save_id=save_id), timeout_s)).freed

    async def stats(self, timeout_s: float | None = None) -> pb.GetStatsResponse:
        return await self._call("GetStats", pb.GetStatsRequest(), timeout_s)

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
        if not inst.instance_id and inst.rejection:
            raise errors.InvalidArgument(f"instance {inst.name!r} rejected by the server: {inst.rejection}")
        if not inst.instance_id:
            raise errors.ServerUnavailable(
                f"instance {inst.name!r} is not registered yet (server unreachable)"
            )
        return inst.instance_id

    async def _call(self, method: str, request, timeout_s: float | None, conn: _Connection | None = None):
        conn = conn or self._require()
        if hasattr(request, "session_id"):
            request.session_id = conn.session_id
        try:
            return await getattr(conn.stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            exc = codec.translate(err, method)
        except (ValueError, RuntimeError) as err:  # channel closed by a concurrent reconnect
            exc = errors.ServerUnavailable(f"{method}: {err}")
        if codec.needs_reconnect(exc):
            await self._lost(conn, exc)
        raise exc

    def _undo(self, method: str, request) -> None:
        """Fire-and-forget: releases / aborts what a timed-out call may still be granted (by its id)."""
        conn = self._conn
        if conn is None:
            return  # no session: whatever it held dies with it on the server
        request.session_id = conn.session_id

        async def send() -> None:
            try:
                await getattr(conn.stub, method)(request, timeout=self.timeout_s)
            except (grpc.RpcError, ValueError, RuntimeError):
                pass

        task = asyncio.get_running_loop().create_task(send())
        self._undo_tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._undo_tasks.discard)

    async def _lost(self, conn: _Connection, exc: Exception) -> None:
        if self._conn is not conn:
            return
        self._conn = None
        log.warning(
            "pegaflow: lost session %s with %s: %s; reconnecting in the background",
            conn.session_id,
            self.address,
            exc,
        )
        await self._drop_connection(conn)
        if self._wake is not None:
            self._wake.set()

    async def _drop_connection(self, conn: _Connection) -> None:
        if conn.mapping is not None and not conn.mapping.release():
            self._retired.append(conn.mapping)
        await conn.channel.close(grace=None)

    async def _register(self, conn: _Connection, handle: InstanceHandle, deadline: float) -> None:
        req = pb.RegisterInstanceRequest(
            layout=codec.layout_message(handle.layout), instance_name=handle.name
        )
        resp = await self._call("RegisterInstance", req, max(deadline - time.monotonic(), 0.001), conn=conn)
        handle._set(resp.instance_id, resp.namespace_id, conn.epoch)

    async def _establish(self, deadline: float) -> None:
        if self._establish_lock is None:
            self._establish_lock = asyncio.Lock()
        try:
            await asyncio.wait_for(self._establish_lock.acquire(), max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise errors.DeadlineExceeded("connect: deadline passed waiting for another connect") from None
        try:
            if self._conn is not None or self._closed:
                return
            channel = grpc.aio.insecure_channel(self.address, options=codec.CHANNEL_OPTIONS)
            conn = None
            try:
                stub = pb_grpc.EngineStub(channel)
                req = pb.OpenSessionRequest(
                    client_name=self.name, pid=os.getpid(), hostname=socket.gethostname()
                )
                try:
                    resp = await stub.OpenSession(req, timeout=max(deadline - time.monotonic(), 0.001))
                except grpc.RpcError as err:
                    raise codec.translate(err, "OpenSession") from None
                mapping = None
                if self.map_pool:
                    remaining = max(deadline - time.monotonic(), 0.001)
                    mapping = await asyncio.get_running_loop().run_in_executor(
                        None, PoolMapping.open, resp.pool.fd_socket_path, resp.session_id, remaining
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
                for handle in list(self._instances):
                    try:
                        await self._register(conn, handle, deadline)
                    except errors.InvalidArgument as exc:
                        handle._clear()
                        handle.rejection = str(exc)
                        log.error(
                            "pegaflow: server %s rejects instance %r after reconnect: %s",
                            self.address,
                            handle.name,
                            exc,
                        )
            except BaseException:
                if conn is not None:
                    await self._drop_connection(conn)
                else:
                    await channel.close(grace=None)
                raise
            self._conn = conn
            self.sessions_opened += 1
            self._backoff.reset()
            log.info(
                "pegaflow: session %s with %s (pool epoch %s)", conn.session_id, self.address, conn.epoch
            )
        finally:
            self._establish_lock.release()

    def _start_worker(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(
                self._run(), name="pegaflow-client-heartbeat"
            )

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass
        self._wake.clear()

    async def _run(self) -> None:
        missed_since: float | None = None
        while not self._closed:
            conn = self._conn
            if conn is None:
                try:
                    await self._establish(time.monotonic() + self.timeout_s)
                    missed_since = None
                    continue
                except errors.PegaflowError as exc:
                    delay = self._backoff.next()
                    log.debug(
                        "pegaflow: reconnect to %s failed (%s); next try in %.2f s", self.address, exc, delay
                    )
                except asyncio.CancelledError:
                    raise
                except Exception:
                    delay = self._backoff.next()
                    log.exception("pegaflow: reconnect to %s failed unexpectedly", self.address)
                await self._sleep(delay)
                continue
            await self._sleep(conn.heartbeat_s)
            if self._closed or self._conn is not conn:
                continue
            self._retired = [m for m in self._retired if not m.release()]
            if conn.mapping is not None and conn.mapping.server_gone():
                await self._lost(conn, errors.ServerUnavailable("the server closed the pool connection"))
                continue
            try:
                resp = await self._call(
                    "Heartbeat", pb.HeartbeatRequest(), min(conn.heartbeat_s, self.timeout_s), conn
                )
            except errors.DeadlineExceeded:
                now = time.monotonic()
                missed_since = missed_since or now
                if now - missed_since > conn.ttl_s:
                    await self._lost(
                        conn, errors.ServerUnavailable("no heartbeat answer within the session TTL")
                    )
                continue
            except errors.PegaflowError:
                continue
            missed_since = None
            if resp.epoch != conn.epoch:
                await self._lost(conn, errors.SessionLost(f"server epoch changed to {resp.epoch}"))
                continue
            for handle in [h for h in self._instances if not h.registered and not h.rejection]:
                try:
                    await self._register(conn, handle, time.monotonic() + self.timeout_s)
                except errors.InvalidArgument as exc:
                    handle.rejection = str(exc)
                except errors.PegaflowError:
                    break
