"""AsyncPegaClient: the asyncio pegaflow client (same API as PegaClient, coroutines instead of calls).

Behaviour matches the sync client (both build on client/base.py): a deadline
on every call, ServerUnavailable at once on transport failure, and a background
task that heartbeats, watches the pool connection and reconnects with
exponential backoff (new session, pool fd received under the new epoch,
InstanceHandles re-registered in place). Use one client per event loop. The
GPU data path's calls are the sync client's only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import grpc.aio

from pegaflow.client import errors
from pegaflow.client import rpc_codec as codec
from pegaflow.client.base import ClientBase, Connection, HeartbeatWatch, log
from pegaflow.client.pool_map import PoolMapping
from pegaflow.client.types import InstanceHandle, KvLayout, Location, PrefixHit, QueryPurpose, SaveBatch
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc


class AsyncPegaClient(ClientBase):
    def _init_transport(self) -> None:
        self._establish_lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()  # fire-and-forget calls (see _send)

    # ------------------------------------------------------------- lifecycle

    async def connect(self, timeout_s: float | None = None) -> None:
        """Session + pool fd + heartbeat task; raises ServerUnavailable (and keeps trying)."""
        if self._closed:
            raise errors.PegaflowError("client is closed")
        self._start_worker()
        try:
            await self._establish(time.monotonic() + self._timeout(timeout_s))
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
        if self._sending:  # give pending releases / aborts their chance, within the timeout
            await asyncio.wait(list(self._sending), timeout=self._timeout(timeout_s))
        conn = self._take_connection()
        if conn is not None:
            try:
                await conn.stub.CloseSession(
                    pb.CloseSessionRequest(session_id=conn.session_id), timeout=self._timeout(timeout_s)
                )
            except grpc.RpcError:
                pass
            await self._drop_connection(conn)
        self._release_retired()

    async def __aenter__(self) -> AsyncPegaClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------- instances

    async def register_instance(
        self, layout: KvLayout, name: str = "", timeout_s: float | None = None
    ) -> InstanceHandle:
        """As PegaClient.register_instance: an unregistered handle if the server is unreachable."""
        handle, conn = self._track_instance(layout, name)
        if conn is None:
            return handle
        try:
            await self._register(conn, handle, time.monotonic() + self._timeout(timeout_s))
        except errors.InvalidArgument:
            self._untrack_instance(handle)
            raise
        except errors.ServerUnavailable as exc:
            await self._lost(conn, exc)
        return handle

    async def unregister_instance(self, handle: InstanceHandle, timeout_s: float | None = None) -> None:
        self._untrack_instance(handle)
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
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
    ) -> PrefixHit:
        req = self._query_request(inst, hashes, lease, lease_ttl_s, purpose)
        try:
            return codec.prefix_hit(await self._call("QueryPrefix", req, timeout_s))
        except errors.DeadlineExceeded:
            if lease:  # the server may still serve it late: release (or pre-empt) that lease
                self._send("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=req.lease_id))
            raise

    async def load_blocks(
        self, inst: InstanceHandle, lease_id: str, timeout_s: float | None = None
    ) -> list[Location]:
        req = pb.LoadBlocksRequest(instance_id=self._instance_id(inst), lease_id=lease_id)
        return codec.locations((await self._call("LoadBlocks", req, timeout_s)).locations)

    async def release(
        self, lease_id: str, loaded_bytes: int = 0, timeout_s: float | None = None, wait: bool = True
    ) -> None:
        """As PegaClient.release: ``wait=False`` sends it without waiting for the answer."""
        req = pb.ReleaseLeaseRequest(lease_id=lease_id, loaded_bytes=loaded_bytes)
        if wait:
            await self._call("ReleaseLease", req, timeout_s)
        else:
            self._send("ReleaseLease", req, timeout_s)

    async def allocate(
        self, inst: InstanceHandle, hashes: Sequence[bytes], timeout_s: float | None = None
    ) -> SaveBatch:
        req = self._allocate_request(inst, hashes)
        try:
            return codec.save_batch(await self._call("AllocateBlocks", req, timeout_s))
        except errors.DeadlineExceeded:
            self._send("AbortBlocks", pb.AbortBlocksRequest(save_id=req.save_id))
            raise

    async def seal(
        self, save_id: str, hashes: Sequence[bytes] | None = None, timeout_s: float | None = None
    ) -> int:
        return (await self._call("SealBlocks", self._seal_request(save_id, hashes), timeout_s)).sealed

    async def abort(self, save_id: str, timeout_s: float | None = None) -> int:
        return (await self._call("AbortBlocks", pb.AbortBlocksRequest(save_id=save_id), timeout_s)).freed

    async def stats(self, timeout_s: float | None = None) -> pb.GetStatsResponse:
        return await self._call("GetStats", pb.GetStatsRequest(), timeout_s)

    # -------------------------------------------------------------- internals

    async def _call(self, method: str, request, timeout_s: float | None, conn: Connection | None = None):
        conn = conn or self._require()
        if hasattr(request, "session_id"):
            request.session_id = conn.session_id
        try:
            return await getattr(conn.stub, method)(request, timeout=self._timeout(timeout_s))
        except (grpc.RpcError, ValueError, RuntimeError) as err:
            exc = self._translate(err, method)
        if codec.needs_reconnect(exc):
            await self._lost(conn, exc)
        raise exc

    def _send(self, method: str, request, timeout_s: float | None = None) -> None:
        """Fire-and-forget (a release, or the undo of what a timed-out call may still be granted, by
        its id)."""
        conn = self._conn
        if conn is None:
            return  # no session: whatever it held dies with it on the server
        request.session_id = conn.session_id

        async def send() -> None:
            try:
                await getattr(conn.stub, method)(request, timeout=self._timeout(timeout_s))
            except (grpc.RpcError, ValueError, RuntimeError):
                pass

        task = asyncio.get_running_loop().create_task(send())
        self._sending.add(task)  # keep a reference until it is done
        task.add_done_callback(self._sending.discard)

    async def _lost(self, conn: Connection, exc: Exception) -> None:
        if self._detach(conn, exc):
            await self._drop_connection(conn)
            if self._wake is not None:
                self._wake.set()

    async def _drop_connection(self, conn: Connection) -> None:
        self._release_pool(conn)
        await conn.channel.close(grace=None)

    async def _register(self, conn: Connection, handle: InstanceHandle, deadline: float) -> None:
        req = self._register_request(handle)
        resp = await self._call("RegisterInstance", req, max(deadline - time.monotonic(), 0.001), conn=conn)
        handle._set(resp.instance_id, resp.namespace_id)

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
                try:
                    resp = await stub.OpenSession(
                        self._open_session_request(), timeout=max(deadline - time.monotonic(), 0.001)
                    )
                except grpc.RpcError as err:
                    raise codec.translate(err, "OpenSession") from None
                pool = None
                if self.map_pool:
                    remaining = max(deadline - time.monotonic(), 0.001)
                    pool = await asyncio.get_running_loop().run_in_executor(
                        None, PoolMapping.open, resp.pool.fd_socket_path, resp.session_id, remaining
                    )
                conn = Connection(channel, stub, resp, pool)
                with self._lock:
                    handles = list(self._instances)
                for handle in handles:
                    try:
                        await self._register(conn, handle, deadline)
                    except errors.InvalidArgument as exc:
                        self._rejected_after_reconnect(handle, exc)
                if not self._take_current(conn):
                    raise errors.PegaflowError("client is closed")
            except BaseException:
                if conn is not None:
                    await self._drop_connection(conn)
                else:
                    await channel.close(grace=None)
                raise
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
        watch = HeartbeatWatch()
        while not self._closed:
            conn = self._conn
            if conn is None:
                try:
                    await self._establish(time.monotonic() + self.timeout_s)
                    watch.answered()
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
                self._release_retired()
                await self._sleep(delay)
                continue
            await self._sleep(conn.heartbeat_s)
            if self._closed or self._conn is not conn:
                continue
            self._release_retired()
            if conn.pool is not None and conn.pool.server_gone():
                await self._lost(conn, errors.ServerUnavailable("the server closed the pool connection"))
                continue
            try:
                resp = await self._call(
                    "Heartbeat", pb.HeartbeatRequest(), min(conn.heartbeat_s, self.timeout_s), conn
                )
            except errors.DeadlineExceeded:
                if watch.missed(conn):
                    await self._lost(
                        conn, errors.ServerUnavailable("no heartbeat answer within the session TTL")
                    )
                continue
            except errors.PegaflowError:
                continue
            watch.answered()
            if resp.epoch != conn.epoch:
                await self._lost(conn, errors.SessionLost(f"server epoch changed to {resp.epoch}"))
                continue
            for handle in self._stragglers():
                try:
                    await self._register(conn, handle, time.monotonic() + self.timeout_s)
                except errors.InvalidArgument as exc:
                    handle.rejection = str(exc)
                except errors.PegaflowError:
                    break
