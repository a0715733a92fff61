"""The faults the reliability runs inject, made real: signals to whole process groups (a vLLM engine
is an API server, an EngineCore and a worker), a watch on the server's GetStats that catches an
engine while it holds unsealed allocations, and a client that hogs the pool with leases.

Catching an engine mid-save. A save is allocate -> copy -> seal, a few milliseconds per step on
this machine, so a kill at a random moment rarely lands inside one. `SaveCatcher` polls GetStats
(over the server's local RPC socket, ~0.1 ms a call) while the engine serves a prompt it has not
seen (so its save has blocks to write) and SIGSTOPs the engine's process group as soon as the
server reports an open save. While the engine is frozen, its unsealed allocations cannot change:
`frozen_unsealed` samples `writing_blocks` over a short window and takes the minimum. Another
engine's saves come and go within milliseconds, so a minimum above zero over the window is the
frozen engine's (the server's `aborted_blocks` after the kill counts the same blocks again, which
the report compares). Then the group gets SIGKILL: a kill -9 that lands while the engine holds
unsealed allocations, verified rather than hoped for. If the minimum is zero, the engine gets
SIGCONT, its request completes, and the next attempt uses the next fresh prompt.

The lease hog. `LeaseHog` is a client of its own namespace that writes a chain of blocks as long
as the pool holds (evicting the engines' blocks), then leases the whole chain again and again (a
new lease right after releasing the previous one) so its blocks stay pinned: the server cuts each
lease at the session's lease quota (half the pool by default) and counts a quota refusal; the hog
also asks for one more lease beyond it each time (refused with RESOURCE_EXHAUSTED, counted here).
Blocks of its chain that the engines' traffic evicted in between are written again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import psutil


class ProcessGroup:
    """Every process of a process group led by `leader` (its own session, as our launchers start
    them): signalled together, and waited on until every thread is stopped."""

    SETTLE_S = 0.5  # every thread of a healthy group reaches T within milliseconds

    def __init__(self, leader: int):
        self.leader = leader
        self.pgid = os.getpgid(leader)

    def pids(self) -> list[int]:
        try:
            root = psutil.Process(self.leader)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                if os.getpgid(p.pid) == self.pgid:
                    out.append(p.pid)
        return out

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        """SIGSTOP the group; returns once every thread of every process is stopped (state T).

        A process caught inside vfork (Python's subprocess spawns that way) cannot stop: it waits,
        uninterruptibly (D), for its child to exec, and the child has just been stopped before it
        could. Such a parent's stopped children get SIGCONT alone (the vfork child execs, which
        ends the parent's wait, and the parent stops on the SIGSTOP it still has pending), then
        the group gets SIGSTOP again, which stops the exec'd child too. On a loaded 2-vCPU machine
        a third of the stops of a spawning group land in a vfork, so releasing the whole group and
        retrying can land in the next one, again and again. Anything else that keeps the group from
        settling for ``SETTLE_S`` gets that remedy: SIGCONT, and SIGSTOP again.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            os.killpg(self.pgid, signal.SIGSTOP)
            settle_by = min(deadline, time.monotonic() + self.SETTLE_S)
            while time.monotonic() < settle_by:
                # Listed again each time: a member may fork while the signal is still on its way,
                # and its child (which does not inherit the pending stop) must keep the group unsettled.
                pids = self.pids()
                if all(_all_threads_stopped(pid) for pid in pids):
                    return pids
                if _release_vfork_children(pids):
                    time.sleep(0.005)  # time to exec
                    os.killpg(self.pgid, signal.SIGSTOP)
                time.sleep(0.002)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"process group {self.pgid} did not stop within {timeout_s} s")
            self.cont()
            time.sleep(0.02)

    def cont(self) -> None:
        os.killpg(self.pgid, signal.SIGCONT)

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the group (a stopped process dies too) and wait until its processes are gone."""
        pids = self.pids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process group {self.pgid} still alive {timeout_s} s after SIGKILL")
            time.sleep(0.01)


_STOPPED = ("T", "t")
# A zombie (Z) or dying (X) thread runs nothing and never becomes T: a spawner's exited child
# stays a zombie while its stopped parent cannot reap it.
_SETTLED = (*_STOPPED, "Z", "X")


# What /proc answers for a process or thread that is gone, or going: ENOENT once it is reaped, ESRCH
# while it exits (a thread listed a moment before; a CI failure of the spawning-group test).
_GONE = (FileNotFoundError, ProcessLookupError)


def _thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (none for threads, or a process, that are gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except _GONE:
        return []
    states = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except _GONE:
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def _all_threads_stopped(pid: int) -> bool:
    return all(state in _SETTLED for state in _thread_states(pid))


def _release_vfork_children(pids: list[int]) -> bool:
    """SIGCONT to the stopped children of group members with a thread waiting in D (a vfork
    parent's spawning thread waits there for its child's exec); whether any got one. A D thread
    waiting on something else has its process's stopped children run for a moment and stopped
    again: harmless."""
    released = False
    for pid in pids:
        if "D" not in _thread_states(pid):
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(pid).children():
                if any(state in _STOPPED for state in _thread_states(child.pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGCONT)
                        released = True
    return released


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# GetStats fields the fault runs watch.
WATCHED_STATS = (
    "epoch",
    "pool_capacity_bytes",
    "pool_used_bytes",
    "resident_blocks",
    "pinned_blocks",
    "writing_blocks",
    "open_saves",
    "live_sessions",
    "live_leases",
    "hits",
    "misses",
    "evictions",
    "sealed_blocks",
    "aborted_blocks",
    "no_space_blocks",
    "quota_refusals",
    "timed_out_saves",
    "expired_leases",
    "sessions_closed",
    "sessions_disconnected",
    "sessions_expired",
    "corrupt_blocks",
)


def watched(stats_message) -> dict:
    """The WATCHED_STATS of a GetStatsResponse as plain values (scalar fields read directly: this
    runs thousands of times a second while a save is being caught)."""
    return {k: getattr(stats_message, k) for k in WATCHED_STATS}


def frozen_unsealed(stats: Callable[[], dict], window_s: float = 0.3, interval_s: float = 0.01) -> dict:
    """Minimum writing_blocks / open_saves over `window_s` (see the module doc), and the last sample."""
    samples = []
    deadline = time.monotonic() + window_s
    while True:
        samples.append(stats())
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    return {
        "samples": len(samples),
        "window_s": window_s,
        "writing_blocks_min": min(s["writing_blocks"] for s in samples),
        "open_saves_min": min(s["open_saves"] for s in samples),
        "last": samples[-1],
    }


@dataclasses.dataclass
class Catch:
    """One attempt of `SaveCatcher.attempt`: how often the engine was frozen on an open save that
    turned out to be another engine's (`false_freezes`), and the freeze that caught it, if any."""

    false_freezes: int
    frozen: dict | None  # frozen_unsealed's answer for the last freeze
    caught: bool  # the engine is left stopped holding unsealed allocations

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class SaveCatcher:
    """Freezes an engine while it holds unsealed allocations (module doc). `stats()` returns the
    server's `watched` GetStats; `group` is the engine's process group."""

    def __init__(self, stats: Callable[[], dict], group: ProcessGroup, poll_s: float = 0.0005):
        self.stats = stats
        self.group = group
        self.poll_s = poll_s

    def attempt(self, send: Callable[[], None], deadline_s: float = 60.0) -> Catch:
        """Runs `send()` (one request to the engine, blocking) on a thread and watches GetStats
        until the request ends. On an open save: freeze and measure; if the frozen engine holds
        unsealed blocks, return with it stopped (`caught`), else resume it and keep watching."""
        done = threading.Event()

        def run() -> None:
            try:
                send()
            finally:
                done.set()

        sender = threading.Thread(target=run, name="victim-request", daemon=True)
        sender.start()
        give_up = time.monotonic() + deadline_s
        false_freezes = 0
        frozen = None
        try:
            while not done.is_set() and time.monotonic() < give_up:
                s = self.stats()
                if s["open_saves"] > 0 or s["writing_blocks"] > 0:
                    self.group.stop()
                    frozen = frozen_unsealed(self.stats)
                    if frozen["writing_blocks_min"] > 0:
                        return Catch(false_freezes, frozen, True)
                    false_freezes += 1
                    self.group.cont()
                    continue
                time.sleep(self.poll_s)
        except BaseException:
            self.group.cont()
            raise
        sender.join(timeout=deadline_s)
        return Catch(false_freezes, frozen, False)


class LeaseHog:
    """A client pinning as much of the pool as its session may, on a thread (module doc).

    `block_bytes`: its blocks' size (the engines' block size, so it competes for the same slots);
    `blocks`: the length of its chain (what the pool holds: a longer chain would evict its own
    head, which a prefix lease needs);
    `renew_s`: how often it takes a new lease on its chain. `counts` says what it was granted and
    refused."""

    def __init__(self, addr: str, block_bytes: int, blocks: int, renew_s: float = 1.0, batch: int = 8):
        from pegaflow.client import KvLayout, PegaClient

        self.client = PegaClient(addr, timeout_s=5.0, name="bench-lease-hog")
        self.layout = KvLayout(model_id="bench-lease-hog", block_bytes=block_bytes, block_tokens=128)
        self.block_bytes = block_bytes
        self.hashes = [f"hog-{i:06d}".encode() for i in range(blocks)]
        self.renew_s = renew_s
        self.batch = batch
        self.row = np.full(block_bytes, 0xA5, dtype=np.uint8)
        self.counts = {
            "granted": 0,
            "exists": 0,
            "no_space": 0,
            "rejected": 0,
            "in_progress": 0,
            "sealed": 0,
            "leases": 0,
            "lease_cut": 0,  # leases the server cut short of the chain's stored prefix
            "extra_leases_refused": 0,  # leases beyond the quota, refused with RESOURCE_EXHAUSTED
            "extra_leases_granted": 0,
            "errors": 0,
        }
        self.pinned_blocks: list[int] = []  # per renewal: blocks the current lease pins
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-hog", daemon=True)
        self._lease = ""
        self._inst = None

    def start(self, timeout_s: float = 30.0) -> LeaseHog:
        self.client.connect(timeout_s=timeout_s)
        self._inst = self.client.register_instance(self.layout)
        self.fill()
        self._thread.start()
        return self

    def fill(self) -> int:
        """Writes the chain's missing blocks until the pool refuses; returns blocks sealed now."""
        from pegaflow.client import AllocStatus, write_blocks

        sealed = 0
        for i in range(0, len(self.hashes), self.batch):
            batch = self.client.allocate(self._inst, self.hashes[i : i + self.batch])
            statuses = [a.status for a in batch.allocations]
            self.counts["granted"] += statuses.count(AllocStatus.GRANTED)
            self.counts["exists"] += statuses.count(AllocStatus.EXISTS)
            self.counts["no_space"] += statuses.count(AllocStatus.NO_SPACE)
            self.counts["rejected"] += statuses.count(AllocStatus.REJECTED)
            self.counts["in_progress"] += statuses.count(AllocStatus.IN_PROGRESS)
            if batch.save_id:
                write_blocks(
                    self.client.pool_view(batch.epoch), batch.allocations, [self.row] * len(batch.allocations)
                )
                n = self.client.seal(batch.save_id)
                sealed += n
                self.counts["sealed"] += n
            if AllocStatus.NO_SPACE in statuses or AllocStatus.REJECTED in statuses:
                break  # the pool (or the session's quota) is full: the rest would be refused too
        return sealed

    def _renew(self) -> None:
        """A new lease on the chain. The old one goes first: the quota counts what the session
        holds, so with the old lease still held the new one would be refused."""
        from pegaflow.client import errors

        old, self._lease = self._lease, ""
        if old:
            self.client.release(old)
        ttl = max(5.0, 4 * self.renew_s)
        hit = self.client.query_prefix(self._inst, self.hashes, lease=True, lease_ttl_s=ttl)
        self.counts["leases"] += 1
        self._lease = hit.lease_id
        self.pinned_blocks.append(hit.num_hits)
        # A second lease on top of the first: the quota is spent, so the server must refuse it.
        try:
            extra = self.client.query_prefix(self._inst, self.hashes[:1], lease=True)
            if extra.lease_id:
                self.counts["extra_leases_granted"] += 1
                self.client.release(extra.lease_id)
        except errors.ResourceExhausted:
            self.counts["extra_leases_refused"] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stored_before = self.client.query_prefix(self._inst, self.hashes).num_hits
                self._renew()
                if self.pinned_blocks[-1] < stored_before:
                    self.counts["lease_cut"] += 1
                if stored_before < len(self.hashes):
                    self.fill()  # evicted (or never stored) blocks of the chain: write them again
            except Exception as exc:  # counted and shown in the report; the hog keeps going
                self.counts["errors"] += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.renew_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=30)
        with contextlib.suppress(Exception):
            if self._lease:
                self.client.release(self._lease)
        self.client.close()
        return {
            **self.counts,
            "pinned_blocks_max": max(self.pinned_blocks, default=0),
            "pinned_blocks_median": float(np.median(self.pinned_blocks)) if self.pinned_blocks else 0.0,
            "last_error": self.last_error,
        }
