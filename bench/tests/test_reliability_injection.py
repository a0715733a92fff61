"""Process-group faults, /proc sampling, catching an engine mid-save and the lease hog
(bench/harness/fault_injection.py, proc_sampler.py), on real processes and a real server."""

import os
import subprocess
import sys
import time

import pytest

from pegaflow.bench.harness import fault_injection, models, proc_sampler
from pegaflow.bench.harness.fault_injection import LeaseHog, ProcessGroup, SaveCatcher, frozen_unsealed
from pegaflow.client import PegaClient
from pegaflow.server.testing import ServerProcess

CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


@pytest.fixture
def group():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True)
    g = ProcessGroup(proc.pid)
    deadline = time.monotonic() + 10
    while len(g.pids()) < 2:
        assert time.monotonic() < deadline, "the child's child did not start"
        time.sleep(0.02)
    yield g, proc
    g.kill()
    proc.wait()


def _state(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_group_stop_cont_and_kill_reach_every_process(group):
    g, proc = group
    pids = g.stop()
    assert len(pids) == 2 and all(_state(p) in "Tt" for p in pids)
    g.cont()
    assert all(_state(p) not in "Tt" for p in pids)
    g.stop()
    g.kill()  # a stopped group dies too
    assert proc.wait(timeout=10) == -9
    assert g.pids() == []


ZOMBIE_PARENT = "import os, time\nif os.fork() == 0:\n    os._exit(0)\ntime.sleep(60)"


def test_thread_states_skip_threads_that_exit_while_they_are_read(monkeypatch):
    # /proc/PID/task lists a thread; it exits before its stat is opened: ESRCH (a CI failure), not
    # ENOENT. Such a thread is gone, not an error of the group stop.
    def exiting(path, *args, **kwargs):
        raise ProcessLookupError(3, "No such process")

    assert fault_injection._thread_states(os.getpid())  # this process: at least its main thread
    monkeypatch.setattr(fault_injection, "open", exiting, raising=False)
    assert fault_injection._thread_states(os.getpid()) == []


def test_group_stop_settles_with_a_zombie_in_the_group():
    # A child that exited and was not reaped yet (a spawner's, under load) is Z, never T.
    proc = subprocess.Popen([sys.executable, "-c", ZOMBIE_PARENT], start_new_session=True)
    g = ProcessGroup(proc.pid)
    try:
        deadline = time.monotonic() + 10
        while not any(_state(p) == "Z" for p in g.pids() if p != proc.pid):
            assert time.monotonic() < deadline, "the child did not become a zombie"
            time.sleep(0.02)
        pids = g.stop(timeout_s=3.0)
        assert _state(proc.pid) in "Tt" and len(pids) == 2
    finally:
        g.kill()
        proc.wait()


SPAWNER = "import subprocess\nwhile True: subprocess.run(['/bin/true'])"
# The same from a second thread, as a multi-threaded engine would: the main thread is not the one in vfork.
THREAD_SPAWNER = (
    "import subprocess, threading, time\n"
    "def spawn():\n    while True: subprocess.run(['/bin/true'])\n"
    "threading.Thread(target=spawn, daemon=True).start()\ntime.sleep(600)"
)


@pytest.mark.parametrize("spawner", [SPAWNER, THREAD_SPAWNER], ids=["main-thread", "other-thread"])
def test_group_stop_settles_while_the_group_is_spawning(spawner):
    # subprocess spawns with vfork: a stop that lands between the vfork and the exec leaves the
    # parent waiting uninterruptibly for a child that is stopped (a CI failure: "did not stop").
    # About 1 stop in 20 lands there on this machine; 60 stops in a row must all settle.
    proc = subprocess.Popen([sys.executable, "-c", spawner], start_new_session=True)
    g = ProcessGroup(proc.pid)
    try:
        time.sleep(0.3)
        for _ in range(60):
            pids = g.stop(timeout_s=3.0)
            assert all(not os.path.exists(f"/proc/{p}") or _state(p) in "TtZ" for p in pids)
            g.cont()
            time.sleep(0.01)
    finally:
        g.kill()
        proc.wait()


def test_catcher_keeps_the_engine_stopped_only_when_its_allocations_stay(group):
    g, _ = group
    state = {"calls": 0}

    def stats_held():
        return {"open_saves": 1, "writing_blocks": 4, "aborted_blocks": 0}

    catch = SaveCatcher(stats_held, g).attempt(lambda: time.sleep(5))
    assert catch.caught and catch.frozen["writing_blocks_min"] == 4
    assert all(_state(p) in "Tt" for p in g.pids())
    g.cont()

    def stats_transient():  # another engine's save: gone within the frozen window
        state["calls"] += 1
        busy = state["calls"] % 5 == 1
        return {"open_saves": int(busy), "writing_blocks": 3 * busy, "aborted_blocks": 0}

    catch = SaveCatcher(stats_transient, g).attempt(lambda: time.sleep(1.0))
    assert not catch.caught and catch.false_freezes >= 1
    assert all(_state(p) not in "Tt" for p in g.pids())


def test_frozen_unsealed_takes_the_minimum_over_the_window():
    values = iter([5, 5, 0, 5] + [5] * 100)
    out = frozen_unsealed(
        lambda: {"writing_blocks": next(values), "open_saves": 1}, window_s=0.05, interval_s=0.01
    )
    assert out["writing_blocks_min"] == 0 and out["samples"] >= 4


def test_proc_status_counts_this_process_fds_and_threads(tmp_path):
    before = proc_sampler.proc_status(os.getpid())
    with open(tmp_path / "f", "w"):
        during = proc_sampler.proc_status(os.getpid())
    assert during["fds"] == before["fds"] + 1 and before["threads"] >= 1 and before["rss_bytes"] > 1 << 20
    assert proc_sampler.parse_status("VmRSS:\t  10 kB\nThreads:\t3\n") == {"rss_bytes": 10240, "threads": 3}
    with pytest.raises(ProcessLookupError):
        proc_sampler.proc_status(2**22 + 12345)


def test_periodic_sampler_keeps_samples_and_errors():
    calls = iter([{"x": 1}, RuntimeError("boom")] + [{"x": 2}] * 100)

    def sample():
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    s = proc_sampler.PeriodicSampler(sample, interval_s=0.02).start()
    time.sleep(0.1)
    out = s.stop()
    assert out[0]["x"] == 1 and "boom" in out[1]["error"] and len(out) >= 4
    assert all("t" in row for row in out)


def test_lease_hog_pins_at_most_its_quota_and_is_refused_beyond(tmp_path):
    block = 1 << 20
    capacity = models.pool_capacity_blocks(16 << 20, block)
    with ServerProcess(tmp_path / "srv", pool_size="16mb") as srv:
        hog = LeaseHog(srv.addr, block, blocks=capacity, renew_s=0.1).start()
        time.sleep(0.5)
        counts = hog.stop()
        stats = PegaClient(srv.addr, map_pool=False)
        with stats:
            refusals = stats.stats().quota_refusals
    assert counts["sealed"] == capacity and counts["leases"] >= 2
    assert counts["pinned_blocks_max"] == capacity // 2  # the session's lease quota: half the pool
    assert counts["lease_cut"] == counts["leases"] and refusals >= counts["leases"]
    assert counts["extra_leases_refused"] == counts["leases"] and counts["extra_leases_granted"] == 0
    assert counts["errors"] == 0, hog.last_error
