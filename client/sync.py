"""PegaClient: the synchronous pegaflow client (thread-safe).

Every call carries a deadline (``timeout_s``, default the client's) and never
blocks longer. A transport failure, or the server forgetting our session,
raises ``errors.ServerUnavailable`` at once and hands recovery to a background
thread: with exponential backoff it opens a new session, receives the pool
under the new epoch and re-registers every instance (the InstanceHandle
objects the caller holds stay valid; their ids are updated in place). The same
thread heartbeats while connected and watches the pool connection for the
server's death. Until recovery succeeds, calls fail fast with
ServerUnavailable, which a cache user treats as a miss.

On the server's host the frequent unary calls (queries, saves, releases, registrations, stats)
travel over the server's local RPC socket (``client/local_rpc.py``): the same messages and
semantics for ~0.05 ms instead of a gRPC round trip's ~0.7 ms; a call falls back to gRPC
whenever that socket cannot take it. Prefix queries, and the releases of the leases they take, go
first to the server's read lane (``client/read_lane.py``), which answers them out of the server's
interpreter; what it leaves to the engine goes the way above.

Create the client in the process that uses it (after any fork).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import grpc

from pegaflow.client import doorbell, errors, pending_rpc
from pegaflow.client import rpc_codec as codec
from pegaflow.client.base import ClientBase, Connection, HeartbeatWatch, log
from pegaflow.client.device import DeviceHandle, DeviceSave, registration_request
from pegaflow.client.local_rpc import LocalRpcClient
from pegaflow.client.pending_rpc import PendingRpc
from pegaflow.client.pool_map import PoolMapping
from pegaflow.client.read_lane import NOT_RUN, ReadLaneClient
from pegaflow.client.types import InstanceHandle, KvLayout, Location, PrefixHit, QueryPurpose, SaveBatch
from pegaflow.common.wire import read_lane as lane_wire
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

# A query's answer comes back over the read lane in ~0.05-0.2 ms. Waited for with the interpreter
# lock released, the caller must then win the lock back, which any busy Python thread of its process
# can delay by a switch interval (5 ms). So a query keeps the lock while it waits, for up to this
# long (FrameLink.call's held_s); other threads' Python waits at most this long per query. Read at
# each call (bench/tail_latency.py's "ours-released" sets 0: every wait lets go, as before).
QUERY_HOLD_LOCK_S = 0.0005


class PegaClient(ClientBase):
    def __init__(self, *args, local_rpc: bool = True, read_lane: bool = True, **kwargs):
        """Arguments as ``ClientBase``'s. ``local_rpc=False``: every call over gRPC, even where the
        server offers its local RPC socket (and no read lane). ``read_lane=False``: queries go to the
        engine even where the server offers its read lane."""
        self.local_rpc = local_rpc
        self.read_lane = read_lane and local_rpc
        super().__init__(*args, **kwargs)

    def _init_transport(self) -> None:
        self._establish_lock = threading.Lock()  # one (re)connect at a time
        self._devices: list[DeviceHandle] = []  # GPU registrations, re-registered after a reconnect
        self._wake = threading.Event()
        self._worker: threading.Thread | None = None
        self._sending: set = set()  # futures of fire-and-forget calls (see _send)

    # ------------------------------------------------------------- lifecycle

    def connect(self, timeout_s: float | None = None) -> None:
        """Opens a session, receives the pool fd and starts the heartbeat thread.

        Raises ServerUnavailable if the server cannot be reached in time; the
        background thread keeps trying, so the client becomes usable later.
        """
        if self._closed:
            raise errors.PegaflowError("client is closed")
        self._start_worker()
        try:
            self._establish(time.monotonic() + self._timeout(timeout_s))
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
            self._worker.join(timeout=self._timeout(timeout_s) + 1)
        with self._lock:
            sending = list(self._sending)
        if sending:  # give pending releases / aborts their chance, within the timeout
            end = time.monotonic() + self._timeout(timeout_s)
            for future in sending:  # grpc futures: concurrent.futures.wait cannot take them
                try:
                    future.exception(timeout=max(end - time.monotonic(), 0))
                except Exception:  # not done in time, or cancelled: the lease's TTL is the backstop
                    pass
        conn = self._take_connection()
        if conn is not None:
            try:
                conn.stub.CloseSession(
                    pb.CloseSessionRequest(session_id=conn.session_id), timeout=self._timeout(timeout_s)
                )
            except grpc.RpcError:
                pass
            self._drop_connection(conn)
        self._release_retired()

    def __enter__(self) -> PegaClient:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_pool_populated(self, timeout_s: float | None = None) -> bool:
        """Maps the pool (if not yet) and waits until its page tables are filled in the background (first
        copies then no longer fault per 4 KiB page); True when done. Never needed for correctness."""
        pool = self._require().pool
        if pool is None:
            return True  # map_pool=False: nothing to populate
        pool.view()
        return pool.populated.wait(timeout_s if timeout_s is not None else self.timeout_s)

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
        handle, conn = self._track_instance(layout, name)
        if conn is None:
            return handle
        try:
            self._register(conn, handle, time.monotonic() + self._timeout(timeout_s))
        except errors.InvalidArgument:
            self._untrack_instance(handle)
            raise
        except errors.ServerUnavailable as exc:
            self._lost(conn, exc)
        return handle

    def unregister_instance(self, handle: InstanceHandle, timeout_s: float | None = None) -> None:
        self._untrack_instance(handle)
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
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
        hold_lock_s: float | None = None,
    ) -> PrefixHit:
        """Number of leading stored blocks; with ``lease`` they stay pinned until ``release``.

        ``purpose``: LOOKUP (a block request, counted in the server's hit statistics) or LOAD (the
        load of blocks a LOOKUP already counted, e.g. a worker leasing what its scheduler found).
        ``hold_lock_s``: through the read lane, the request is sent and its answer waited for up to
        this long without releasing the interpreter lock (client/frame_link.py says when that pays);
        None: ``QUERY_HOLD_LOCK_S``.
        """
        if hold_lock_s is None:
            hold_lock_s = QUERY_HOLD_LOCK_S
        conn = self._require()
        if conn.lane is not None:
            hit = self._lane_query(conn, inst, hashes, lease, lease_ttl_s, timeout_s, purpose, hold_lock_s)
            if hit is not NOT_RUN:
                return hit
        req = self._query_request(inst, hashes, lease, lease_ttl_s, purpose)
        try:
            return codec.prefix_hit(self._call("QueryPrefix", req, timeout_s, conn=conn))
        except errors.DeadlineExceeded:
            if lease:  # the server may still serve it late: release (or pre-empt) that lease
                self._send("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=req.lease_id))
            raise

    def report_prefill(
        self,
        inst: InstanceHandle,
        computed_tokens: int,
        prefill_seconds: float,
        timeout_s: float | None = None,
    ) -> None:
        """The engine's own measured prefill cost since its previous report (prompt tokens it computed,
        the seconds they took): the server prices the prefill its cache saved this namespace with it."""
        req = pb.ReportPrefillRequest(
            instance_id=self._instance_id(inst),
            computed_tokens=int(computed_tokens),
            prefill_seconds=float(prefill_seconds),
        )
        self._call("ReportPrefill", req, timeout_s)

    def load_blocks(
        self, inst: InstanceHandle, lease_id: str, timeout_s: float | None = None
    ) -> list[Location]:
        """Locations of a lease's leading blocks once readable: the server waits (within the timeout)
        for the ones its PrefixHit counted as ``pending``; a block that could not be made resident
        ends the list there."""
        req = pb.LoadBlocksRequest(instance_id=self._instance_id(inst), lease_id=lease_id)
        return codec.locations(self._call("LoadBlocks", req, timeout_s).locations)

    def release(
        self,
        lease_id: str,
        loaded_bytes: int = 0,
        timeout_s: float | None = None,
        wait: bool = True,
        corrupt_hashes: Sequence[bytes] = (),
    ) -> None:
        """Ends a lease. ``wait=False`` sends the release without waiting for its answer: a load is
        done once its bytes are copied, and a release that fails leaves the lease to its TTL.
        ``corrupt_hashes``: blocks of the lease whose bytes failed their checksum (``verify_blocks``):
        the server checks them itself and drops those that fail."""
        lane_lease = lane_wire.parse_lease_name(lease_id)
        if lane_lease is not None and not corrupt_hashes:  # the engine checks reported blocks
            conn = self._conn
            if conn is not None and conn.lane is not None:
                deadline = time.monotonic() + self._timeout(timeout_s)
                try:
                    if conn.lane.release(conn.session_id, lane_lease, loaded_bytes, deadline) is not NOT_RUN:
                        return
                except grpc.RpcError as err:
                    if wait:
                        raise self._failed(conn, err, "ReleaseLease") from None
                    return
        req = pb.ReleaseLeaseRequest(
            lease_id=lease_id, loaded_bytes=loaded_bytes, corrupt_block_hashes=list(corrupt_hashes)
        )
        # A corrupt report is waited for: once it returns the server has dropped what failed, and a
        # query that follows (on the read lane's socket, which does not queue behind this one) cannot
        # be served those blocks again.
        if wait or corrupt_hashes:
            self._call("ReleaseLease", req, timeout_s)
        else:
            self._send("ReleaseLease", req, timeout_s)

    # ------------------------------------------------------------- save path

    def allocate(
        self, inst: InstanceHandle, hashes: Sequence[bytes], timeout_s: float | None = None
    ) -> SaveBatch:
        """Reserves pool space: write the GRANTED locations, then ``seal`` (or ``abort``).

        ``hashes`` is an ordered chain (head first). Blocks already stored come back EXISTS (nothing
        to write); sending them anyway, e.g. the prefix a request loaded, keeps the chain's head ahead
        of its tail for eviction.
        """
        req = self._allocate_request(inst, hashes)
        try:
            return codec.save_batch(self._call("AllocateBlocks", req, timeout_s))
        except errors.DeadlineExceeded:
            self._send("AbortBlocks", pb.AbortBlocksRequest(save_id=req.save_id))
            raise

    def seal(
        self,
        save_id: str,
        hashes: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
        checksums: Sequence[int] = (),
    ) -> int:
        """Makes written blocks visible (all granted blocks of the save, or the listed ones).
        ``checksums``: one per sealed block (``block_checksums`` of what was written), handed back
        to readers with each block's location."""
        req = self._seal_request(save_id, hashes, checksums)
        return self._call("SealBlocks", req, timeout_s).sealed

    def allocate_async(
        self, inst: InstanceHandle, hashes: Sequence[bytes], timeout_s: float | None = None
    ) -> PendingRpc[SaveBatch]:
        """``allocate``, sent now and answered by ``result()`` (client/pending_rpc.py): a save
        allocates its next batch while it copies this one. An abandoned allocation is aborted."""
        req = self._allocate_request(inst, hashes)
        conn = self._require()
        req.session_id = conn.session_id
        deadline = time.monotonic() + self._timeout(timeout_s)

        def undo() -> None:
            self._send("AbortBlocks", pb.AbortBlocksRequest(save_id=req.save_id))

        return pending_rpc.start(self, conn, "AllocateBlocks", req, deadline, codec.save_batch, undo)

    def seal_async(
        self,
        save_id: str,
        hashes: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
        checksums: Sequence[int] = (),
    ) -> PendingRpc[int]:
        """``seal``, sent now and answered by ``result()``: a save seals a batch while it copies the next."""
        req = self._seal_request(save_id, hashes, checksums)
        conn = self._require()
        req.session_id = conn.session_id
        deadline = time.monotonic() + self._timeout(timeout_s)
        return pending_rpc.start(self, conn, "SealBlocks", req, deadline, lambda resp: resp.sealed)

    def abort(self, save_id: str, timeout_s: float | None = None, wait: bool = True) -> int:
        """Frees a save's unsealed allocations; the number freed (0 with ``wait=False``: sent
        without waiting for the answer, as an undo on an error path is)."""
        req = pb.AbortBlocksRequest(save_id=save_id)
        if not wait:
            self._send("AbortBlocks", req, timeout_s)
            return 0
        return self._call("AbortBlocks", req, timeout_s).freed

    # --------------------------------------------------------- GPU data path

    def register_device_memory(self, inst: InstanceHandle, registration, timeout_s: float | None = None):
        """Hands the server a GPU worker's KV tensors (CUDA IPC; a DeviceRegistration from
        ``pegaflow.client.device.export_torch_kv``); re-registered after every reconnect.

        Returns a DeviceHandle. Raises what the server answers (FAILED_PRECONDITION -> ServerError when
        it has no GPU data path, InvalidArgument for a malformed layout) or ServerUnavailable (then
        nothing is kept: call again once the client has reconnected).
        """
        handle = DeviceHandle(inst, registration)
        conn = self._require()
        self._register_device(conn, handle, time.monotonic() + self._timeout(timeout_s))
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
        hashes = self._hashes(hashes)
        registration_id = self._device_id(handle)
        deadline = time.monotonic() + self._timeout(timeout_s)
        out = self._ring(handle, doorbell.OP_SAVE, registration_id, hashes, block_ids, deadline)
        if out is not None:
            return DeviceSave(out[1], out[0])
        req = pb.SaveFromDeviceRequest(
            registration_id=registration_id, block_hashes=hashes, block_ids=block_ids
        )
        resp = self._call("SaveFromDevice", req, max(deadline - time.monotonic(), 0.001))
        return DeviceSave(list(resp.statuses), resp.written)

    def load_to_device(
        self,
        handle: DeviceHandle,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        timeout_s: float | None = None,
        purpose: QueryPurpose = QueryPurpose.LOOKUP,
    ) -> int:
        """The server copies the leading stored blocks of ``hashes`` into ``block_ids``; returns how many.

        ``purpose`` as for ``query_prefix``: LOAD when a lookup already counted these blocks.
        """
        hashes = self._hashes(hashes)
        purpose = QueryPurpose(purpose)
        registration_id = self._device_id(handle)
        deadline = time.monotonic() + self._timeout(timeout_s)
        out = self._ring(handle, doorbell.OP_LOAD, registration_id, hashes, block_ids, deadline, purpose)
        if out is not None:
            return out[0]
        req = pb.LoadToDeviceRequest(
            registration_id=registration_id, block_hashes=hashes, block_ids=block_ids, purpose=int(purpose)
        )
        return self._call("LoadToDevice", req, max(deadline - time.monotonic(), 0.001)).num_hits

    def _ring(
        self, handle: DeviceHandle, op: int, registration_id: str, hashes, block_ids, deadline, purpose=0
    ):
        """The request on the server's local fast path when it offers one; None means "not sent, use
        the RPC" (only when the server surely did not run it). Errors are the RPC's exceptions."""
        bell = handle.doorbell
        if bell is None:
            return None
        conn = self._require()
        try:
            return bell.call(op, conn.session_id, registration_id, hashes, block_ids, deadline, int(purpose))
        except grpc.RpcError as err:
            exc = self._translate(err, doorbell.METHODS[op])
        if codec.needs_reconnect(exc):
            self._lost(conn, exc)
        raise exc

    def _device_id(self, handle: DeviceHandle) -> str:
        if not handle.registration_id:
            raise errors.ServerUnavailable("GPU memory is not registered yet (server unreachable)")
        return handle.registration_id

    def _register_device(self, conn: Connection, handle: DeviceHandle, deadline: float) -> None:
        req = registration_request(handle.registration, self._instance_id(handle.instance))
        resp = self._call("RegisterDeviceMemory", req, max(deadline - time.monotonic(), 0.001), conn=conn)
        handle._set(resp.registration_id, resp.doorbell_socket_path, conn.epoch)

    # ---------------------------------------------------------- introspection

    def stats(self, timeout_s: float | None = None) -> pb.GetStatsResponse:
        return self._call("GetStats", pb.GetStatsRequest(), timeout_s)

    # -------------------------------------------------------------- internals

    def _lane_query(
        self,
        conn: Connection,
        inst: InstanceHandle,
        hashes: Sequence[bytes],
        lease: bool,
        lease_ttl_s: float | None,
        timeout_s: float | None,
        purpose: QueryPurpose,
        hold_lock_s: float = 0.0,
    ):
        """The query through the read lane: a PrefixHit, or NOT_RUN (send it to the engine)."""
        hashes = self._hashes(hashes)
        deadline = time.monotonic() + self._timeout(timeout_s)
        lease_id = conn.lane.new_lease_id() if lease else 0
        try:
            hit = conn.lane.query(
                conn.session_id,
                self._instance_id(inst),
                hashes,
                lease_id,
                lease_ttl_s,
                QueryPurpose(purpose) == QueryPurpose.LOAD,
                deadline,
                hold_lock_s,
            )
        except grpc.RpcError as err:
            exc = self._failed(conn, err, "QueryPrefix")
            if lease and isinstance(exc, errors.DeadlineExceeded):
                # The server may still serve it late: release (or pre-empt) that lease, as below.
                self._send("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lane_wire.lease_name(lease_id)))
            raise exc from None
        return hit

    def _call(self, method: str, request, timeout_s: float | None, conn: Connection | None = None):
        conn = conn or self._require()
        if hasattr(request, "session_id"):
            request.session_id = conn.session_id
        timeout = self._timeout(timeout_s)
        try:
            if conn.local is not None:
                deadline = time.monotonic() + timeout
                response = conn.local.call(method, request, deadline)
                if response is not None:
                    return response
                timeout = max(deadline - time.monotonic(), 0.001)  # not sent there: gRPC, same deadline
            return getattr(conn.stub, method)(request, timeout=timeout)
        except (grpc.RpcError, ValueError) as err:
            raise self._failed(conn, err, method) from None

    def _failed(self, conn: Connection, err: Exception, method: str) -> errors.PegaflowError:
        """The error a failed call raises (the connection dropped first when it is lost)."""
        exc = self._translate(err, method)
        if codec.needs_reconnect(exc):
            self._lost(conn, exc)
        return exc

    def _send(self, method: str, request, timeout_s: float | None = None) -> None:
        """Fire-and-forget (a release, or the undo of what a timed-out call may still be granted, by its
        id). The call's future is kept until it completes: grpc cancels a call whose future is
        garbage-collected, possibly before the request went out."""
        conn = self._conn
        if conn is None:
            return  # no session: whatever it held dies with it on the server
        request.session_id = conn.session_id
        if conn.local is not None and conn.local.send(method, request, self._timeout(timeout_s)):
            return
        try:
            future = getattr(conn.stub, method).future(request, timeout=self._timeout(timeout_s))
        except (grpc.RpcError, ValueError):
            return
        with self._lock:
            self._sending.add(future)
        future.add_done_callback(self._sent)

    def _sent(self, future) -> None:
        with self._lock:
            self._sending.discard(future)

    def _lost(self, conn: Connection, exc: Exception) -> None:
        """Drops ``conn`` (if still current) and wakes the reconnect thread."""
        if self._detach(conn, exc):
            self._drop_connection(conn)
            self._wake.set()

    def _drop_connection(self, conn: Connection) -> None:
        if conn.local is not None:
            conn.local.close()
        if conn.lane is not None:
            conn.lane.close()
        self._release_pool(conn)
        conn.channel.close()

    def _register(self, conn: Connection, handle: InstanceHandle, deadline: float) -> None:
        req = self._register_request(handle)
        resp = self._call("RegisterInstance", req, max(deadline - time.monotonic(), 0.001), conn=conn)
        handle._set(resp.instance_id, resp.namespace_id)

    def _establish(self, deadline: float) -> None:
        """Opens a new session (new channel, pool fd, instances) and makes it current."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._establish_lock.acquire(timeout=remaining):
            raise errors.DeadlineExceeded("connect: deadline passed waiting for another connect")
        try:
            if self._conn is not None or self._closed:
                return
            channel = self._new_channel()
            conn = None
            try:
                stub = pb_grpc.EngineStub(channel)
                try:
                    resp = stub.OpenSession(
                        self._open_session_request(), timeout=max(deadline - time.monotonic(), 0.001)
                    )
                except grpc.RpcError as err:
                    raise codec.translate(err, "OpenSession") from None
                pool = None
                if self.map_pool:
                    pool = PoolMapping.open(
                        resp.pool.fd_socket_path, resp.session_id, max(deadline - time.monotonic(), 0.001)
                    )
                conn = Connection(channel, stub, resp, pool)
                conn.local = self._local_rpc_client(resp)
                conn.lane = self._read_lane_client(resp)
                with self._lock:
                    handles, devices = list(self._instances), list(self._devices)
                for handle in handles:
                    try:
                        self._register(conn, handle, deadline)
                    except errors.InvalidArgument as exc:
                        self._rejected_after_reconnect(handle, exc)
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
                if not self._take_current(conn):
                    raise errors.PegaflowError("client is closed")
            except BaseException:
                if conn is not None:
                    self._drop_connection(conn)
                else:
                    channel.close()
                raise
        finally:
            self._establish_lock.release()

    def _local_rpc_client(self, resp: pb.OpenSessionResponse) -> LocalRpcClient | None:
        """The session's local RPC socket, when the server offers one and it exists here (on another
        host the path names nothing; the greeting's epoch check catches a namesake)."""
        path = resp.local_rpc_socket_path
        if not self.local_rpc or not path or not os.path.exists(path):
            return None
        return LocalRpcClient(path, resp.pool.epoch, codec.MAX_MESSAGE_BYTES)

    def _read_lane_client(self, resp: pb.OpenSessionResponse) -> ReadLaneClient | None:
        """The server's read lane, when it offers one and its socket exists here (the greeting's epoch
        check catches a namesake on another host)."""
        path = resp.read_lane_socket_path
        if not self.read_lane or not path or not os.path.exists(path):
            return None
        return ReadLaneClient(path, resp.pool.epoch, codec.limits_from(resp.limits).max_batch_blocks or 4096)

    def _start_worker(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="pegaflow-client-heartbeat", daemon=True
                )
                self._worker.start()

    def _run(self) -> None:
        watch = HeartbeatWatch()
        while not self._closed:
            conn = self._conn
            if conn is None:
                try:
                    self._establish(time.monotonic() + self.timeout_s)
                    watch.answered()
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
            if conn.pool is not None and conn.pool.server_gone():
                self._lost(conn, errors.ServerUnavailable("the server closed the pool connection"))
                continue
            try:
                resp = self._call(
                    "Heartbeat", pb.HeartbeatRequest(), min(conn.heartbeat_s, self.timeout_s), conn
                )
            except errors.DeadlineExceeded:
                # A busy server, not a dead one: give it until the session TTL before starting over.
                if watch.missed(conn):
                    self._lost(conn, errors.ServerUnavailable("no heartbeat answer within the session TTL"))
                continue
            except errors.PegaflowError:
                continue  # _call already handed a lost session to the reconnect path
            watch.answered()
            if resp.epoch != conn.epoch:
                self._lost(conn, errors.SessionLost(f"server epoch changed to {resp.epoch}"))
                continue
            for handle in self._stragglers():
                try:
                    self._register(conn, handle, time.monotonic() + self.timeout_s)
                except errors.InvalidArgument as exc:
                    handle.rejection = str(exc)
                except errors.PegaflowError:
                    break
