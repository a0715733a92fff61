"""The foreground-priority policy on a fake clock: a DRAM-served query holds tier I/O back for the
hold time, keeps the depth low for the calm time, and a steady stream of them can hold it back at
most max_hold_share of the time (a waiting promotion is slowed, never stopped)."""

from __future__ import annotations

import math

import pytest

from pegaflow.server.movers.foreground_priority import UNLIMITED, ForegroundPriority


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(**kw) -> tuple[ForegroundPriority, Clock]:
    clock = Clock()
    return ForegroundPriority(clock=clock, **kw), clock


def test_unlimited_until_a_ready_hit():
    p, _ = policy()
    assert p.allowed() == (UNLIMITED, math.inf)


def test_a_ready_hit_holds_then_calms_then_frees():
    p, clock = policy(hold_s=0.03, busy_depth=2, calm_s=1.0)
    p.ready_hit()
    depth, recheck = p.allowed()
    assert depth == 0 and recheck == pytest.approx(0.03)
    clock.now += 0.02
    assert p.allowed()[0] == 0
    clock.now += 0.011
    depth, recheck = p.allowed()
    assert depth == 2 and recheck == pytest.approx(1.0 - 0.031)
    clock.now += 1.0
    assert p.allowed() == (UNLIMITED, math.inf)
    assert p.held_s == pytest.approx(0.03) and p.ready_hits == 1


def test_hits_close_together_extend_the_hold_without_counting_it_twice():
    p, clock = policy(hold_s=0.03, max_hold_share=0.9)
    p.ready_hit()
    clock.now += 0.01
    p.ready_hit()  # the lookup's load, 10 ms later: held until 40 ms
    clock.now += 0.025
    assert p.allowed()[0] == 0
    clock.now += 0.006
    assert p.allowed()[0] > 0
    assert p.held_s == pytest.approx(0.04)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_a_steady_stream_of_hits_holds_at_most_the_share(share):
    p, clock = policy(hold_s=0.03, max_hold_share=share)
    step, held, span = 0.001, 0, 0
    for _ in range(20_000):  # a DRAM hit every millisecond for 20 s
        p.ready_hit()
        clock.now += step
        span += 1
        held += p.allowed()[0] == 0
    assert held / span <= share + 0.01
    assert held / span >= share - 0.05  # and it does hold, up to the share
    assert p.held_s <= 20 * share + 0.06 + 1e-9


def test_with_zero_share_only_the_first_burst_holds_then_it_only_calms():
    p, clock = policy(max_hold_share=0.0, hold_s=0.01, busy_depth=3)
    for _ in range(10):
        p.ready_hit()
        clock.now += 0.02
    assert p.held_s == pytest.approx(0.02)  # the bucket's two holds, never refilled
    p.ready_hit()
    assert p.allowed()[0] == 3


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ForegroundPriority(busy_depth=0)
    with pytest.raises(ValueError):
        ForegroundPriority(max_hold_share=1.0)
    with pytest.raises(ValueError):
        ForegroundPriority(hold_s=-1)
