"""The RDMA transport: one-sided READs into local pool slots through pyverbs (rdma-core).

**Never run on RDMA hardware.** The machines this was written on have no RDMA device and no
soft-RoCE (shared/recipes/toolchain.md section 4: ``get_device_list()`` raises
``PyverbsRDMAError``, it does not return []). What is tested on CPU
(server/peers/tests/test_rdma_logic.py): the descriptors and their validation, the handshake's
pairing and MTU rules, the READ plan (blocks round-robin over queue pairs, cut to the device's
message size, each inside the peer's region), and the completion engine's rules, driven by
scripted completions: a window of outstanding READs per queue pair, a failed completion fails its
block, and at the deadline the queue pairs holding READs are moved to the error state and every
flushed completion is reaped *before* the fetch resolves (PegaFlow #403: a timed-out READ that
lands in freed memory). The verbs glue (``_VerbsNic``, ``_VerbsQueuePair``) follows pyverbs' API
as rdma-core's own tests use it and is exercised only by ``detect_rdma``'s "no device" path here.

Shape (when ``--nics`` names devices and ``detect_rdma`` finds them):

* serving side: ``RdmaResponder(nics, pool_view)`` registers the whole pool as one memory region
  per NIC (remote read access) at start. A Handshake with ``transport="rdma"`` carries one
  requester queue pair per requester NIC; the responder makes a reliable-connected queue pair
  for each (on its NIC ``i % n``), connects it to the requester's (RTR, then RTS), and answers its
  own queue pairs and, per pair, the region (address, rkey, length) READs target. The link's
  TTL destroys them when the requester dies.
* requester: ``RdmaTransport(nics, local_pool)`` registers the local pool (where slots live) per
  NIC; ``connect`` creates one queue pair per NIC, shakes hands, brings them to RTS. A fetch asks
  OpenTransfer for block offsets and checksums (``want_checksums``: no frame carries them),
  posts READs (remote ``region.addr + offset`` -> local slot), and verifies each block's XXH3-64
  once its READs completed.

A timed-out or failed READ leaves its queue pair in the error state: the link turns unhealthy
(the remote source reconnects); other links are untouched.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple, Protocol

from pegaflow.common.auth import ClientAuth
from pegaflow.common.wire.checksum import checksum
from pegaflow.server.interpreter_core import release_thread
from pegaflow.server.peers.base import (
    BlockStatus,
    FetchResult,
    LinkClosed,
    PeerAddress,
    PeerError,
    PeerLink,
    RemoteExtent,
    RemoteTransfer,
    Transport,
)
from pegaflow.server.peers.control import ControlClient
from pegaflow.server.peers.metrics import TransportCounters, TransportStats

log = logging.getLogger(__name__)

GID_BYTES = 16
PSN_MASK = (1 << 24) - 1
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # ibv_mtu -> bytes
MAX_DEVICE_NAME = 64
# READs in flight per queue pair: the responder's max_dest_rd_atomic bounds them (mlx5: 16).
DEFAULT_READ_WINDOW = 16
# One READ moves at most this much (the device's max_msg_sz is usually 1 GiB; smaller READs
# spread a big block over the window and keep completions frequent).
DEFAULT_MAX_READ_BYTES = 4 << 20


# ------------------------------------------------------------------ detection


def detect_rdma(nics: Sequence[str]) -> tuple[bool, str]:
    """Whether every NIC in ``nics`` is an RDMA device with an active port; the reason if not.

    Called once at start when ``--nics`` is given: on False the server logs the reason in one
    line and serves and pulls over TCP. pyverbs is imported here, lazily (it is optional).
    """
    if not nics:
        return False, "no --nics given"
    try:
        import pyverbs.device as d
        import pyverbs.enums as e
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        return (
            False,
            f"pyverbs is not installed ({exc}); apt-get install python3-pyverbs or pip install pyverbs",
        )
    try:
        found = {dev.name.decode() for dev in d.get_device_list()}
    except PyverbsError as exc:  # no uverbs in the kernel: raises (ENOSYS), does not return []
        return False, f"no RDMA device: {exc}"
    missing = [n for n in nics if n not in found]
    if missing:
        return (
            False,
            f"no RDMA device named {', '.join(missing)} (found: {', '.join(sorted(found)) or 'none'})",
        )
    for name in nics:
        try:
            ctx = d.Context(name=name)
            try:
                state = ctx.query_port(1).state
            finally:
                ctx.close()
        except PyverbsError as exc:
            return False, f"{name}: cannot open the device: {exc}"
        if state != e.IBV_PORT_ACTIVE:
            return False, f"{name}: port 1 is not active (state {state})"
    return True, f"RDMA on {', '.join(nics)}"


# ------------------------------------------------------------------ descriptors


@dataclasses.dataclass(frozen=True)
class QueuePairInfo:
    """What the other end needs to connect to one queue pair (proto RdmaQueuePair)."""

    device: str
    port_num: int
    gid: bytes
    gid_index: int
    lid: int
    qp_num: int
    psn: int
    mtu: int

    def __post_init__(self):
        if not 0 < len(self.device) <= MAX_DEVICE_NAME:
            raise ValueError(f"device name must be 1..{MAX_DEVICE_NAME} characters")
        if not 1 <= self.port_num <= 255:
            raise ValueError(f"port_num must be 1..255, got {self.port_num}")
        if len(self.gid) != GID_BYTES:
            raise ValueError(f"a GID is {GID_BYTES} bytes, got {len(self.gid)}")
        if not 0 <= self.gid_index <= 255:
            raise ValueError(f"gid_index must be 0..255, got {self.gid_index}")
        if not 0 <= self.lid <= 0xFFFF:
            raise ValueError(f"lid must be 16 bits, got {self.lid}")
        if not 0 < self.qp_num <= PSN_MASK:
            raise ValueError(f"qp_num must be 24 bits and not 0, got {self.qp_num}")
        if not 0 <= self.psn <= PSN_MASK:
            raise ValueError(f"psn must be 24 bits, got {self.psn}")
        if self.mtu not in MTU_BYTES:
            raise ValueError(f"mtu must be an ibv_mtu (1..5), got {self.mtu}")

    def to_proto(self):
        from pegaflow.proto import peer_pb2

        return peer_pb2.RdmaQueuePair(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, msg) -> QueuePairInfo:
        """Raises ValueError for a descriptor that is not one (answered INVALID_ARGUMENT)."""
        return cls(
            device=msg.device,
            port_num=msg.port_num,
            gid=bytes(msg.gid),
            gid_index=msg.gid_index,
            lid=msg.lid,
            qp_num=msg.qp_num,
            psn=msg.psn,
            mtu=msg.mtu,
        )

    @property
    def gid_text(self) -> str:
        """pyverbs' GID notation: 8 groups of 4 hex digits."""
        h = self.gid.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """A registered memory region a peer's READs may target (proto RdmaRegion)."""

    addr: int
    rkey: int
    length: int

    def __post_init__(self):
        if self.length <= 0 or self.addr < 0 or self.addr + self.length > 1 << 64:
            raise ValueError(f"a region of {self.length} bytes at {self.addr:#x} is not one")
        if not 0 <= self.rkey <= 0xFFFFFFFF:
            raise ValueError("an rkey is 32 bits")

    def to_proto(self):
        from pegaflow.proto import peer_pb2

        return peer_pb2.RdmaRegion(addr=self.addr, rkey=self.rkey, length=self.length)

    @classmethod
    def from_proto(cls, msg) -> RegionInfo:
        return cls(addr=msg.addr, rkey=msg.rkey, length=msg.length)


def new_psn() -> int:
    return secrets.randbelow(PSN_MASK + 1)


def pair_devices(requester_qps: int, responder_nics: Sequence[str]) -> list[str]:
    """The responder NIC each requester queue pair is paired with: queue pair i -> NIC i mod n."""
    if requester_qps <= 0:
        raise ValueError("an rdma handshake carries at least one queue pair")
    if not responder_nics:
        raise ValueError("no responder NIC")
    return [responder_nics[i % len(responder_nics)] for i in range(requester_qps)]


def path_mtu(a: int, b: int) -> int:
    """Both ends use the smaller of their ports' active MTUs."""
    return min(a, b)


def check_handshake_answer(ours: Sequence[QueuePairInfo], theirs: Sequence, regions: Sequence) -> None:
    """A peer's rdma Handshake answer must pair every queue pair we sent with one of its own and
    one region; raises PeerError(PROTOCOL) otherwise."""
    if len(theirs) != len(ours) or len(regions) != len(ours):
        raise PeerError(
            BlockStatus.PROTOCOL,
            f"rdma handshake: {len(ours)} queue pairs sent; {len(theirs)}, and {len(regions)} regions, back",
        )


# ------------------------------------------------------------------ READ plan


class ReadOp(NamedTuple):
    """One RDMA READ: ``length`` bytes from the peer's ``remote_addr`` into ``local_addr``."""

    wr_id: int
    qp: int  # the link's queue pair index
    block: int  # position of its block in the fetch
    local_addr: int
    length: int
    remote_addr: int
    rkey: int


def plan_reads(
    remote: Sequence[RemoteExtent],
    local_addrs: Sequence[int],
    regions: Sequence[RegionInfo],
    max_read_bytes: int,
    first_wr_id: int = 1,
) -> list[ReadOp]:
    """READs for a fetch: block i on queue pair i mod n (as TCP streams: the leading blocks
    complete first on every pair), cut into READs of at most ``max_read_bytes``. Raises
    ValueError for an extent outside the peer's region (a peer bug: never read other memory)."""
    nqp = len(regions)
    if nqp == 0:
        raise ValueError("no queue pair")
    ops: list[ReadOp] = []
    wr_id = first_wr_id
    for pos, (extent, local) in enumerate(zip(remote, local_addrs, strict=True)):
        qp = pos % nqp
        region = regions[qp]
        if extent.offset < 0 or extent.offset + extent.length > region.length:
            raise ValueError(f"block {extent.index} at {extent.offset} is outside the peer's region")
        done = 0
        while done < extent.length:
            n = min(max_read_bytes, extent.length - done)
            ops.append(
                ReadOp(wr_id, qp, pos, local + done, n, region.addr + extent.offset + done, region.rkey)
            )
            wr_id += 1
            done += n
    return ops


# ------------------------------------------------------------------ the completion engine


class QueuePairPort(Protocol):
    """What the engine needs of one queue pair (``_VerbsQueuePair`` on hardware)."""

    def post_reads(self, ops: Sequence[ReadOp]) -> None: ...  # signalled READs, in order

    def poll(self, max_entries: int) -> list[tuple[int, bool]]: ...  # (wr_id, success) per completion

    def to_error(self) -> None: ...  # every posted READ completes, flushed (success False)


class _RdmaFetch:
    def __init__(self, ops: list[ReadOp], lengths: list[int], deadline: float, verify):
        self.deadline = deadline
        self.lengths = lengths
        self.started = time.monotonic()
        self.future: Future[FetchResult] = Future()
        self.unposted: dict[int, collections.deque[ReadOp]] = collections.defaultdict(collections.deque)
        for op in ops:
            self.unposted[op.qp].append(op)
        self.in_flight: dict[int, ReadOp] = {}
        self.reads_left = collections.Counter(op.block for op in ops)
        self.failed: dict[int, BlockStatus] = {}
        self.expired = False
        self.error = ""
        self._verify = verify  # block position -> bool (checksum of the landed bytes)

    @property
    def finished(self) -> bool:
        """Nothing in flight, and nothing more will be posted."""
        if self.in_flight:
            return False
        return self.expired or not any(self.unposted.values())

    def result(self) -> FetchResult:
        statuses = []
        for pos in range(len(self.lengths)):
            if pos in self.failed:
                statuses.append(self.failed[pos])
            elif self.reads_left[pos] > 0:
                statuses.append(BlockStatus.TIMEOUT)
            elif self._verify(pos):
                statuses.append(BlockStatus.OK)
            else:
                statuses.append(BlockStatus.CHECKSUM)
        ok_bytes = sum(n for n, s in zip(self.lengths, statuses, strict=True) if s is BlockStatus.OK)
        if not self.error and any(s is BlockStatus.CHECKSUM for s in statuses):
            self.error = "a block read over RDMA failed its checksum"
        return FetchResult(statuses, ok_bytes, time.monotonic() - self.started, self.error)


class CompletionEngine:
    """Posts a link's READs within a window per queue pair, reaps completions, enforces deadlines.

    Driven by one thread (``run_once`` in a loop, or by the tests step by step). The rule that
    makes slot reuse safe: a fetch resolves only when none of its READs is in flight. At a
    fetch's deadline its unposted READs are dropped and every queue pair still holding one of
    its READs is moved to the error state, which flushes all posted READs; the engine keeps
    reaping until they have all completed, and only then resolves the fetch (and any other fetch
    caught on those queue pairs, as CANCELLED for what did not land). Those queue pairs are dead
    from then on (``broken``): the link reports unhealthy.
    """

    def __init__(self, ports: Sequence[QueuePairPort], window: int, counters: TransportCounters):
        self.ports = list(ports)
        self.window = window
        self.counters = counters
        self.fetches: list[_RdmaFetch] = []
        self.by_wr: dict[int, _RdmaFetch] = {}
        self.broken: set[int] = set()
        self._lock = threading.Lock()

    def submit(self, fetch: _RdmaFetch) -> None:
        with self._lock:
            self.fetches.append(fetch)

    def in_flight(self, qp: int) -> int:
        return sum(1 for f in self.fetches for op in f.in_flight.values() if op.qp == qp)

    def run_once(self, now: float | None = None) -> int:
        """One round: deadlines, posts, completions, resolutions. Returns completions reaped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            fetches = list(self.fetches)
        for fetch in fetches:
            if not fetch.expired and now >= fetch.deadline:
                self._expire(fetch)
        for qp, port in enumerate(self.ports):
            if qp in self.broken:
                continue
            room = self.window - self.in_flight(qp)
            batch: list[ReadOp] = []
            for fetch in fetches:
                queue = fetch.unposted.get(qp)
                while room > 0 and queue and not fetch.expired:
                    op = queue.popleft()
                    fetch.in_flight[op.wr_id] = op
                    self.by_wr[op.wr_id] = fetch
                    batch.append(op)
                    room -= 1
            if batch:
                try:
                    port.post_reads(batch)
                except Exception as exc:  # the queue pair refused: nothing of the batch is in flight
                    for op in batch:
                        owner = self.by_wr.pop(op.wr_id)
                        owner.in_flight.pop(op.wr_id, None)
                        owner.failed.setdefault(op.block, BlockStatus.PEER_GONE)
                        owner.error = owner.error or f"posting RDMA READs failed: {exc}"
                    self._break(qp)
        reaped = 0
        for qp, port in enumerate(self.ports):
            for wr_id, success in port.poll(4 * self.window):
                reaped += 1
                fetch = self.by_wr.pop(wr_id, None)
                if fetch is None:
                    continue
                op = fetch.in_flight.pop(wr_id)
                if success:
                    fetch.reads_left[op.block] -= 1
                elif fetch.expired:
                    fetch.failed.setdefault(op.block, BlockStatus.TIMEOUT)
                else:
                    fetch.failed.setdefault(op.block, BlockStatus.PEER_GONE)
                    fetch.error = fetch.error or f"an RDMA READ on queue pair {qp} failed"
                    self._break(qp)
        for fetch in fetches:
            if fetch.finished:
                self._resolve(fetch)
        return reaped

    def _expire(self, fetch: _RdmaFetch) -> None:
        fetch.expired = True
        fetch.error = fetch.error or "the fetch's deadline passed"
        for queue in fetch.unposted.values():
            queue.clear()
        for qp in {op.qp for op in fetch.in_flight.values()}:
            self._break(qp)

    def _break(self, qp: int) -> None:
        """Moves the queue pair to the error state (its posted READs complete, flushed) and drops
        every fetch's unposted READs on it (those blocks fail: they will not be read)."""
        if qp in self.broken:
            return
        self.broken.add(qp)
        try:
            self.ports[qp].to_error()
        except Exception:
            log.exception("moving RDMA queue pair %d to the error state failed", qp)
        for fetch in self.fetches:
            queue = fetch.unposted.get(qp)
            while queue:
                op = queue.popleft()
                fetch.failed.setdefault(op.block, BlockStatus.CANCELLED)

    def cancel_all(self, reason: str) -> None:
        """Link close: every queue pair to the error state; the caller keeps calling ``run_once``
        until ``idle`` so that every flushed completion is reaped before the fetches resolve."""
        for fetch in self.fetches:
            fetch.expired = True
            fetch.error = fetch.error or reason
            for queue in fetch.unposted.values():
                for op in queue:
                    fetch.failed.setdefault(op.block, BlockStatus.CANCELLED)
                queue.clear()
        for qp in range(len(self.ports)):
            self._break(qp)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self.fetches

    def _resolve(self, fetch: _RdmaFetch) -> None:
        with self._lock:
            self.fetches.remove(fetch)
        result = fetch.result()
        self.counters.fetch_done(result.statuses, fetch.lengths, result.seconds)
        fetch.future.set_result(result)


# ------------------------------------------------------------------ verbs glue (hardware only)


def _buffer_address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def rts_attributes(
    port_num: int, gid_index: int, active_mtu: int, rd_atom: int, psn: int, peer: QueuePairInfo
):
    """The pyverbs QPAttr that brings an RC queue pair to RTS against ``peer`` (the attribute
    values of rdma-core's ibv_rc_pingpong; RoCE: a global route to the peer's GID)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=port_num)
    attr.path_mtu = path_mtu(active_mtu, peer.mtu)
    attr.dest_qp_num = peer.qp_num
    attr.rq_psn = peer.psn
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = rd_atom
    attr.max_rd_atomic = rd_atom
    attr.min_rnr_timer = 12
    attr.timeout = 14  # 4.096 us * 2**14 = 67 ms per retry
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    dgid = GID()
    dgid.gid = peer.gid_text
    gr = GlobalRoute(dgid=dgid, sgid_index=gid_index)
    attr.ah_attr = AHAttr(port_num=port_num, is_global=1, gr=gr, dlid=peer.lid)
    return attr


def read_work_request(op: ReadOp, lkey: int):
    """A signalled one-sided READ work request for ``op``."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    wr = SendWR(
        wr_id=op.wr_id,
        opcode=e.IBV_WR_RDMA_READ,
        num_sge=1,
        sg=[SGE(op.local_addr, op.length, lkey)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(op.rkey, op.remote_addr)
    return wr


def error_state_attributes():
    """(QPAttr, mask) for the move to IBV_QPS_ERR: flushes every posted READ."""
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr

    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_ERR
    return attr, e.IBV_QP_STATE


class _VerbsNic:
    """One RDMA device: context, protection domain, the pool registered as a memory region."""

    def __init__(self, name: str, pool: memoryview, remote_read: bool, port_num: int = 1, gid_index: int = 0):
        import pyverbs.device as d
        import pyverbs.enums as e
        from pyverbs.mr import MR
        from pyverbs.pd import PD

        self.name = name
        self.port_num = port_num
        self.gid_index = gid_index
        self.ctx = d.Context(name=name)
        self.port = self.ctx.query_port(port_num)
        self.max_msg = self.port.max_msg_sz  # bounded again by max_read_bytes
        device = self.ctx.query_device()
        self.max_rd_atom = min(device.max_qp_rd_atom, device.max_qp_init_rd_atom)
        self.gid = bytes.fromhex(self.ctx.query_gid(port_num, gid_index).gid.replace(":", ""))
        self.pd = PD(self.ctx)
        self.pool_addr = _buffer_address(pool)
        self.pool_len = len(pool)
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_READ if remote_read else 0)
        self.mr = MR(self.pd, self.pool_len, access, address=self.pool_addr)

    def region(self) -> RegionInfo:
        return RegionInfo(self.pool_addr, self.mr.rkey, self.pool_len)

    def close(self) -> None:
        self.mr.close()
        self.pd.close()
        self.ctx.close()


class _VerbsQueuePair:
    """A reliable-connected queue pair with its own completion queue."""

    def __init__(self, nic: _VerbsNic, depth: int):
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.nic = nic
        self.cq = CQ(nic.ctx, 4 * depth, None, None, 0)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr(port_num=nic.port_num)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.qp = QP(nic.pd, init, attr)
        self.psn = new_psn()
        self.depth = depth

    def info(self) -> QueuePairInfo:
        return QueuePairInfo(
            device=self.nic.name,
            port_num=self.nic.port_num,
            gid=self.nic.gid,
            gid_index=self.nic.gid_index,
            lid=self.nic.port.lid,
            qp_num=self.qp.qp_num,
            psn=self.psn,
            mtu=int(self.nic.port.active_mtu),
        )

    def connect(self, peer: QueuePairInfo) -> None:
        """INIT -> RTR -> RTS against the peer's queue pair."""
        self.qp.to_rts(
            rts_attributes(
                self.nic.port_num,
                self.nic.gid_index,
                int(self.nic.port.active_mtu),
                min(self.depth, self.nic.max_rd_atom),
                self.psn,
                peer,
            )
        )

    def post_reads(self, ops: Sequence[ReadOp]) -> None:
        lkey = self.nic.mr.lkey
        for op in ops:
            self.qp.post_send(read_work_request(op, lkey))

    def poll(self, max_entries: int) -> list[tuple[int, bool]]:
        import pyverbs.enums as e

        n, wcs = self.cq.poll(max_entries)
        return [(wc.wr_id, wc.status == e.IBV_WC_SUCCESS) for wc in wcs[:n]]

    def to_error(self) -> None:
        self.qp.modify(*error_state_attributes())

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


# ------------------------------------------------------------------ serving side


class RdmaResponder:
    """The serving side's queue pairs: one per requester queue pair, on NIC ``i % n``."""

    def __init__(self, nics: Sequence[str], pool_view: memoryview, depth: int = DEFAULT_READ_WINDOW):
        self.devices = list(nics)
        self.depth = depth
        self._nics = {name: _VerbsNic(name, pool_view, remote_read=True) for name in nics}

    def accept(self, theirs: Sequence[QueuePairInfo], deadline: float):
        """-> (our queue pairs, the region per pair, on_end). Raises ValueError for a bad request."""
        devices = pair_devices(len(theirs), self.devices)
        made: list[_VerbsQueuePair] = []
        try:
            for peer, device in zip(theirs, devices, strict=True):
                qp = _VerbsQueuePair(self._nics[device], self.depth)
                made.append(qp)
                qp.connect(peer)
        except Exception:
            for qp in made:
                qp.close()
            raise
        ours = [qp.info() for qp in made]
        regions = [self._nics[device].region() for device in devices]

        def on_end() -> None:
            for qp in made:
                qp.close()

        return ours, regions, on_end

    def close(self) -> None:
        for nic in self._nics.values():
            nic.close()


# ------------------------------------------------------------------ requester


class RdmaPeerLink(PeerLink):
    transport = "rdma"

    def __init__(self, owner, peer, control, link_id, qps, regions, max_fetch_bytes):
        self.peer = peer
        self.link_id = link_id
        self.max_fetch_bytes = max_fetch_bytes
        self._owner = owner
        self._control = control
        self._qps = qps
        self._regions = regions
        self._engine = CompletionEngine(qps, owner.window, owner.counters)
        self._wr_ids = 1
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="peer-rdma-poll", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return not self._closed and not self._engine.broken

    def open_transfer(self, namespace_id, hashes, ttl_s, deadline) -> RemoteTransfer:
        if self._closed:
            raise LinkClosed()
        return self._control.open_transfer(self.link_id, namespace_id, hashes, ttl_s, True, deadline)

    def renew_transfer(self, transfer_id, ttl_s, deadline) -> float:
        return self._control.renew_transfer(transfer_id, ttl_s, deadline)

    def close_transfer(self, transfer_id, deadline, wait=True) -> bool:
        return self._control.close_transfer(transfer_id, deadline, wait)

    def fetch(self, remote, into, deadline) -> Future[FetchResult]:
        if self._closed:
            raise LinkClosed()
        if self._engine.broken:
            raise LinkClosed("the RDMA link's queue pairs failed (a timeout or an error): reconnect")
        if len(remote) != len(into):
            raise ValueError(f"{len(remote)} extents but {len(into)} buffers")
        pool_lo = self._owner.pool_addr
        pool_hi = pool_lo + self._owner.pool_len
        addrs, views = [], []
        for i, (extent, buf) in enumerate(zip(remote, into, strict=True)):
            view = memoryview(buf).cast("B")
            addr = _buffer_address(view)
            if len(view) < extent.length or not pool_lo <= addr <= pool_hi - extent.length:
                raise ValueError(f"buffer {i} is too small or outside the registered local pool")
            if extent.checksum is None:
                raise ValueError("an RDMA fetch needs each block's checksum (open_transfer asks for them)")
            addrs.append(addr)
            views.append(view)
        if sum(e.length for e in remote) > self.max_fetch_bytes:
            raise ValueError(f"a fetch over the link's limit of {self.max_fetch_bytes} bytes")
        with self._cond:
            ops = plan_reads(remote, addrs, self._regions, self._owner.max_read_bytes, self._wr_ids)
            self._wr_ids += len(ops)

            def verify(pos: int) -> bool:
                return checksum(views[pos][: remote[pos].length]) == remote[pos].checksum

            fetch = _RdmaFetch(ops, [e.length for e in remote], deadline, verify)
            self._engine.submit(fetch)
            self._cond.notify()
        return fetch.future

    def _run(self) -> None:
        release_thread()  # perhaps started from a pinned request thread (interpreter_core.py)
        # Busy-ish polling with short sleeps: a Python thread cannot wait on a CQ's completion
        # channel and a condition at once without more machinery; 20 us naps keep latency low.
        # Only this thread touches the engine's state after submit.
        cancelled = False
        while True:
            with self._cond:
                while self._engine.idle and not self._closed:
                    self._cond.wait()
                closing = self._closed
            if closing and not cancelled:
                self._engine.cancel_all("the peer link was closed")
                cancelled = True
            if closing and self._engine.idle:
                return
            if self._engine.run_once() == 0:
                time.sleep(20e-6)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join()  # returns once every flushed completion was reaped
        for qp in self._qps:
            qp.close()
        self._control.close_link(self.link_id, time.monotonic() + 1.0)
        self._control.close()
        self._owner._forget(self)


class RdmaTransport(Transport):
    """One queue pair per local NIC per peer; ``local_pool``: the memory slots live in."""

    name = "rdma"

    def __init__(
        self,
        nics: Sequence[str],
        local_pool: memoryview,
        node_id: str = "",
        window: int = DEFAULT_READ_WINDOW,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        max_fetch_bytes: int = 64 << 30,
        counters: TransportCounters | None = None,
        control_auth: ClientAuth | None = None,
    ):
        """``control_auth``: what this node presents to peers' PeerTransfer (token, TLS; None: nothing)."""
        self.control_auth = control_auth
        self.node_id = node_id
        self.window = window
        self.max_fetch_bytes = max_fetch_bytes
        self.counters = counters or TransportCounters(self.name)
        self._nics = [_VerbsNic(name, local_pool, remote_read=False) for name in nics]
        self.max_read_bytes = min(max_read_bytes, *(nic.max_msg for nic in self._nics))
        self.pool_addr = _buffer_address(local_pool)
        self.pool_len = len(local_pool)
        self._links: set[RdmaPeerLink] = set()
        self._lock = threading.Lock()

    def connect(self, peer: PeerAddress, deadline: float) -> RdmaPeerLink:
        control = ControlClient(peer, self.counters, self.control_auth)
        qps = [_VerbsQueuePair(nic, self.window) for nic in self._nics]
        try:
            ours = [qp.info() for qp in qps]
            hs = control.handshake("rdma", self.node_id, deadline, [q.to_proto() for q in ours])
            check_handshake_answer(ours, hs.queue_pairs, hs.regions)
            try:
                theirs = [QueuePairInfo.from_proto(q) for q in hs.queue_pairs]
                regions = [RegionInfo.from_proto(r) for r in hs.regions]
            except ValueError as exc:
                raise PeerError(BlockStatus.PROTOCOL, f"rdma handshake answer: {exc}") from None
            for qp, their in zip(qps, theirs, strict=True):
                qp.connect(their)
        except PeerError as exc:
            self.counters.connect_failed(exc.cause)
            for qp in qps:
                qp.close()
            control.close()
            raise
        link = RdmaPeerLink(self, peer, control, hs.link_id, qps, regions, self.max_fetch_bytes)
        with self._lock:
            self._links.add(link)
        self.counters.add("links_opened")
        self.counters.add("streams_up", len(qps))
        return link

    def _forget(self, link: RdmaPeerLink) -> None:
        with self._lock:
            if link in self._links:
                self._links.discard(link)
                self.counters.add("links_closed")
                self.counters.add("streams_down", len(link._qps))

    def stats(self) -> TransportStats:
        return self.counters.snapshot()

    def close(self) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()
        for nic in self._nics:
            nic.close()
