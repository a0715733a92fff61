"""The RDMA transport's logic on CPU: descriptors, handshake rules, READ plans, completions.

No RDMA device exists here (and no soft-RoCE), so the queue pairs below are scripted: they
record posted READs and hand back the completions a test decides. What the scripts check is the
engine's contract, above all that a fetch resolves only after every READ it posted completed
(flushed ones included), so a slot is never freed under a READ still in flight. The verbs glue
is checked against the installed pyverbs where there is one (Debian's python3-pyverbs): its
objects are built for real, and ``detect_rdma`` reports "no device" rather than failing.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from pegaflow.proto import peer_pb2
from pegaflow.server.peers import rdma
from pegaflow.server.peers.base import BlockStatus, PeerError, RemoteExtent
from pegaflow.server.peers.metrics import TransportCounters

QP = dict(device="mlx5_0", port_num=1, gid=bytes(range(16)), gid_index=3, lid=0, qp_num=0x1234, psn=77, mtu=5)
DIST_PACKAGES = "/usr/lib/python3/dist-packages"


def test_queue_pair_descriptors_round_trip_through_the_proto():
    info = rdma.QueuePairInfo(**QP)
    wire = info.to_proto().SerializeToString()
    assert rdma.QueuePairInfo.from_proto(peer_pb2.RdmaQueuePair.FromString(wire)) == info
    assert info.gid_text == "0001:0203:0405:0607:0809:0a0b:0c0d:0e0f"
    region = rdma.RegionInfo(addr=0x7F00_0000_0000, rkey=0xDEAD, length=1 << 30)
    assert (
        rdma.RegionInfo.from_proto(peer_pb2.RdmaRegion.FromString(region.to_proto().SerializeToString()))
        == region
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gid", b"\0" * 15, "GID is 16 bytes"),
        ("qp_num", 0, "qp_num"),
        ("qp_num", 1 << 24, "qp_num"),
        ("psn", 1 << 24, "psn"),
        ("mtu", 6, "mtu"),
        ("device", "", "device name"),
        ("port_num", 0, "port_num"),
        ("lid", 1 << 16, "lid"),
    ],
)
def test_malformed_queue_pair_descriptors_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        rdma.QueuePairInfo(**{**QP, field: value})
    with pytest.raises(ValueError):
        rdma.QueuePairInfo.from_proto(peer_pb2.RdmaQueuePair(**{**QP, field: value}))


def test_regions_and_handshake_rules():
    with pytest.raises(ValueError):
        rdma.RegionInfo(addr=0, rkey=1, length=0)
    with pytest.raises(ValueError):
        rdma.RegionInfo(addr=(1 << 64) - 10, rkey=1, length=100)
    assert rdma.pair_devices(5, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError):
        rdma.pair_devices(0, ["a"])
    assert rdma.path_mtu(5, 3) == 3
    ours = [rdma.QueuePairInfo(**QP)] * 2
    with pytest.raises(PeerError) as info:
        rdma.check_handshake_answer(ours, [object()], [object(), object()])
    assert info.value.cause is BlockStatus.PROTOCOL
    psns = {rdma.new_psn() for _ in range(100)}
    assert len(psns) > 90 and all(0 <= p < 1 << 24 for p in psns)


def extents(lengths, offsets=None):
    offsets = offsets or [i * (8 << 20) for i in range(len(lengths))]
    return [
        RemoteExtent(b"t" * 16, i, n, 0, off) for i, (n, off) in enumerate(zip(lengths, offsets, strict=True))
    ]


def test_reads_go_round_robin_over_queue_pairs_cut_to_the_read_size_and_inside_the_region():
    regions = [rdma.RegionInfo(0x1000_0000, 11, 64 << 20), rdma.RegionInfo(0x9000_0000, 22, 64 << 20)]
    remote = extents([5 << 20, 1 << 20, 2 << 20])
    local = [0x5000_0000, 0x6000_0000, 0x7000_0000]
    ops = rdma.plan_reads(remote, local, regions, max_read_bytes=2 << 20, first_wr_id=100)
    assert [op.wr_id for op in ops] == list(range(100, 100 + len(ops)))
    assert [(op.qp, op.block, op.length) for op in ops] == [
        (0, 0, 2 << 20),
        (0, 0, 2 << 20),
        (0, 0, 1 << 20),
        (1, 1, 1 << 20),
        (0, 2, 2 << 20),
    ]
    assert ops[1].local_addr == local[0] + (2 << 20) and ops[1].remote_addr == regions[0].addr + (2 << 20)
    assert ops[3].remote_addr == regions[1].addr + (8 << 20) and ops[3].rkey == 22
    with pytest.raises(ValueError, match="outside the peer's region"):
        rdma.plan_reads(extents([1 << 20], [(63 << 20) + 1]), local[:1], regions, 1 << 20)


class ScriptedQueuePair:
    """Records posted READs; completes them when the test says; flushes them all after to_error."""

    def __init__(self):
        self.posted: list[rdma.ReadOp] = []
        self.pending: collections.deque[rdma.ReadOp] = collections.deque()
        self.done: collections.deque[tuple[int, bool]] = collections.deque()
        self.errored = False
        self.max_in_flight = 0

    def post_reads(self, ops):
        if self.errored:
            raise RuntimeError("queue pair in the error state")
        self.posted += ops
        self.pending += ops
        self.max_in_flight = max(self.max_in_flight, len(self.pending))

    def complete(self, n: int, ok: bool = True):
        for _ in range(n):
            self.done.append((self.pending.popleft().wr_id, ok))

    def poll(self, max_entries):
        out = []
        while self.done and len(out) < max_entries:
            out.append(self.done.popleft())
        return out

    def to_error(self):
        self.errored = True

    def flush(self, n: int | None = None):
        """The hardware's flushed completions after to_error arrive (maybe a few at a time)."""
        self.complete(len(self.pending) if n is None else n, ok=False)


def engine_with(nqp=2, window=4):
    ports = [ScriptedQueuePair() for _ in range(nqp)]
    return rdma.CompletionEngine(ports, window, TransportCounters("rdma")), ports


def fetch_of(lengths, deadline, regions, verify=lambda pos: True, max_read=1 << 20):
    ops = rdma.plan_reads(
        extents(lengths), [0x100000 * (i + 1) for i in range(len(lengths))], regions, max_read
    )
    return rdma._RdmaFetch(ops, lengths, deadline, verify)


REGIONS = [rdma.RegionInfo(0x1000_0000, 1, 1 << 30), rdma.RegionInfo(0x2000_0000, 2, 1 << 30)]


def test_reads_stay_within_the_window_and_blocks_resolve_once_every_read_completed():
    engine, ports = engine_with(window=3)
    fetch = fetch_of([4 << 20, 1 << 20, 2 << 20], deadline=1e9, regions=REGIONS, verify=lambda pos: pos != 2)
    engine.submit(fetch)
    for _ in range(20):
        engine.run_once(now=0)
        for port in ports:
            port.complete(min(1, len(port.pending)))
    engine.run_once(now=0)
    assert fetch.future.done()
    result = fetch.future.result()
    assert result.statuses == [BlockStatus.OK, BlockStatus.OK, BlockStatus.CHECKSUM]
    assert result.bytes_ok == 5 << 20 and "checksum" in result.error
    assert all(p.max_in_flight <= 3 for p in ports) and len(ports[0].posted) == 6  # 4 + 2 READs
    assert engine.idle and not engine.broken


def test_at_the_deadline_the_queue_pairs_go_to_error_and_the_fetch_waits_for_every_flushed_read():
    engine, ports = engine_with(window=2)
    fetch = fetch_of([3 << 20, 3 << 20], deadline=10.0, regions=REGIONS)
    engine.submit(fetch)
    engine.run_once(now=1.0)
    ports[0].complete(1)  # one READ of block 0 landed
    engine.run_once(now=2.0)  # reaps it
    engine.run_once(now=2.0)  # posts the next one in the freed window slot
    assert not fetch.future.done()
    engine.run_once(now=10.0)  # deadline: both queue pairs hold READs
    assert ports[0].errored and ports[1].errored and engine.broken == {0, 1}
    ports[0].flush(1)  # the hardware flushes some now, the rest later
    engine.run_once(now=10.1)
    assert not fetch.future.done(), "resolved while a READ could still land in its slot"
    ports[0].flush()
    ports[1].flush()
    engine.run_once(now=10.2)
    result = fetch.future.result(0)
    assert result.statuses == [BlockStatus.TIMEOUT, BlockStatus.TIMEOUT]
    assert all(not p.pending for p in ports)  # nothing left in flight anywhere
    assert len(ports[0].posted) == 3  # 2, then 1 more after the first completion; the rest never posted


def test_a_failed_read_fails_its_block_breaks_only_its_queue_pair_and_cancels_what_was_queued_there():
    engine, ports = engine_with(window=1)
    fetch = fetch_of([2 << 20, 1 << 20, 1 << 20], deadline=1e9, regions=REGIONS)
    engine.submit(fetch)
    engine.run_once(now=0)
    ports[0].complete(1, ok=False)  # block 0's first READ fails (remote access error, say)
    ports[1].complete(1)
    engine.run_once(now=0)
    assert engine.broken == {0}
    engine.run_once(now=0)
    result = fetch.future.result(0)
    assert result.statuses == [BlockStatus.PEER_GONE, BlockStatus.OK, BlockStatus.CANCELLED]
    assert "queue pair 0" in result.error


def test_close_cancels_everything_but_still_reaps_the_flushed_reads_first():
    engine, ports = engine_with(window=2)
    fetch = fetch_of([4 << 20, 4 << 20], deadline=1e9, regions=REGIONS)
    engine.submit(fetch)
    engine.run_once(now=0)
    engine.cancel_all("closed")
    engine.run_once(now=0)
    assert not fetch.future.done()
    for p in ports:
        p.flush()
    engine.run_once(now=0)
    assert fetch.future.result(0).statuses == [BlockStatus.CANCELLED, BlockStatus.CANCELLED]
    assert engine.idle


def _with_system_pyverbs(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` with Debian's pyverbs on the path (after the venv's packages)."""
    prelude = f"import sys; sys.path.append({DIST_PACKAGES!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60)


needs_pyverbs = pytest.mark.skipif(
    not os.path.isdir(os.path.join(DIST_PACKAGES, "pyverbs")),
    reason="Debian's python3-pyverbs is not installed (apt-get install python3-pyverbs)",
)


def test_detect_rdma_without_pyverbs_or_nics_says_why():
    assert rdma.detect_rdma([]) == (False, "no --nics given")
    ok, reason = rdma.detect_rdma(["mlx5_0"])
    assert not ok and reason


@needs_pyverbs
def test_detect_rdma_reports_no_device_here_instead_of_failing():
    proc = _with_system_pyverbs(
        "from pegaflow.server.peers.rdma import detect_rdma; print(detect_rdma(['mlx5_0', 'mlx5_1']))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(False, 'no RDMA device: Failed to get devices list')"


@needs_pyverbs
def test_the_verbs_glue_builds_real_pyverbs_objects():
    proc = _with_system_pyverbs(
        """
import pyverbs.enums as e
from pegaflow.server.peers import rdma
peer = rdma.QueuePairInfo(
    device="x", port_num=1, gid=bytes(range(16)), gid_index=0, lid=7, qp_num=99, psn=5, mtu=3
)
attr = rdma.rts_attributes(1, 0, 5, 16, 1234, peer)
assert (attr.path_mtu, attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (3, 99, 5, 1234)
assert attr.ah_attr.dlid == 7 and attr.ah_attr.is_global == 1
op = rdma.ReadOp(wr_id=42, qp=0, block=0, local_addr=4096, length=1 << 20, remote_addr=1 << 33, rkey=9)
wr = rdma.read_work_request(op, lkey=3)
assert wr.wr_id == 42 and wr.opcode == e.IBV_WR_RDMA_READ and wr.num_sge == 1
attr, mask = rdma.error_state_attributes()
assert attr.qp_state == e.IBV_QPS_ERR and mask == e.IBV_QP_STATE
print("ok")
"""
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
