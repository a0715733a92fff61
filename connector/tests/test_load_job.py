"""The work protocol of one step's loads (worker._LoadJob): the lease work is taken once, copy
units are claimed in layer order by two threads (vLLM's step thread and the load thread), each
exactly once; a layer is done when its units landed; once a job is closed no copy is in
progress and none starts, and a lease that comes back after the step ended is handed back."""

from __future__ import annotations

import threading

from pegaflow.connector.metadata import PegaConnectorMetadata
from pegaflow.connector.worker import _LoadJob


def units(per_layer: list[int]) -> list:
    """Fake copy units: (layer, pieces, bytes); `per_layer[i]` units of 10 bytes for layer i."""
    return [(layer, [], 10) for layer, n in enumerate(per_layer) for _ in range(n)]


def new_job(layers: int) -> _LoadJob:
    return _LoadJob(PegaConnectorMetadata(), layers, deadline=float("inf"))


def test_two_threads_claim_every_unit_once_in_layer_order():
    job = new_job(4)
    assert job.publish(units([3, 1, 5, 2]))
    got: list[tuple[str, int]] = []
    lock = threading.Lock()
    start = threading.Barrier(2)

    def copier(name: str):
        start.wait()
        while (unit := job.claim()) is not None:
            with lock:
                got.append((name, unit[0]))
            job.landed(unit[0], unit[2], ok=True)

    threads = [threading.Thread(target=copier, args=(n,)) for n in ("step", "load")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(layer for _, layer in got) == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3]
    assert job.done.is_set() and job.layers_landed == 4 and job.landed_bytes == 110
    assert job.t_landed > 0


def test_a_layer_is_done_only_when_all_its_units_landed():
    job = new_job(2)
    job.publish(units([2, 1]))
    a, b = job.claim(), job.claim()
    assert (a[0], b[0]) == (0, 0)
    job.landed(0, 10, ok=True)
    assert not job.layer_done[0].is_set()  # one unit of layer 0 still in flight
    job.landed(0, 10, ok=True)
    assert job.layer_done[0].is_set() and not job.done.is_set()


def test_layers_without_units_are_done_at_once():
    job = new_job(3)
    job.publish([])  # every lease missed: nothing to copy
    assert all(ev.is_set() for ev in job.layer_done) and job.done.is_set()
    assert job.claim() is None


def test_the_lease_work_is_taken_once_and_never_after_close():
    job = new_job(1)
    assert job.claim_planning() and not job.claim_planning()
    other = new_job(1)
    other.close()
    assert not other.claim_planning()
    assert not other.publish(units([1]))  # closed while leasing: the caller releases its leases


def test_close_waits_for_a_copy_in_progress_and_stops_new_claims():
    job = new_job(3)
    job.publish(units([1, 1, 1]))
    unit = job.claim()  # a copier is inside its memcpy
    closed = threading.Event()
    landed_when_closed: list[int] = []

    def close():
        landed_when_closed.append(job.close())
        closed.set()

    t = threading.Thread(target=close)
    t.start()
    assert not closed.wait(0.2)  # close() cannot return while the copy runs
    job.landed(unit[0], 10, ok=True)
    assert closed.wait(10)
    t.join()
    assert landed_when_closed == [1]
    assert job.claim() is None  # closed: nothing more may land
    assert not job.done.is_set()
    job.finish()
    assert job.done.is_set()


def test_a_failed_copy_lands_nothing_for_its_layer():
    job = new_job(2)
    job.publish(units([1, 1]))
    unit = job.claim()
    job.landed(unit[0], 10, ok=False)
    assert job.layers_landed == 0 and not job.layer_done[0].is_set() and job.landed_bytes == 0


def test_a_lease_granted_after_the_step_released_its_leases_is_handed_back():
    job = new_job(1)
    assert job.add_lease("l-1")
    assert job.take_leases() == ["l-1"]
    assert job.take_leases() == []  # released once
    assert not job.add_lease("l-late")  # the caller must release this one itself
