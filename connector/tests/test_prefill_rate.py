"""The engine's prefill cost, fitted online from the steps' forward times (connector/prefill_rate.py)."""

import numpy as np

from pegaflow.connector.prefill_rate import PrefillRate


def test_the_fit_recovers_the_per_token_prefill_cost_from_mixed_steps():
    clock = [0.0]
    rate = PrefillRate(report_interval_s=10.0, clock=lambda: clock[0])
    rng = np.random.default_rng(0)
    a, b, c = 3e-4, 2e-3, 5e-3  # seconds per prefill token, per decode token, per step
    total = 0
    for _ in range(200):
        p = int(rng.integers(0, 2000)) if rng.random() < 0.5 else 0
        d = int(rng.integers(1, 8))
        total += p
        rate.observe(p, d, a * p + b * d + c + rng.normal(0, 1e-4))
    assert not rate.due()
    clock[0] = 11.0
    assert rate.due()
    tokens, seconds = rate.take_report()
    assert tokens == total
    assert abs(seconds / tokens - a) / a < 0.02
    assert rate.take_report() is None  # a fresh window, nothing in it


def test_without_enough_prefill_steps_nothing_is_reported():
    rate = PrefillRate()
    for _ in range(50):
        rate.observe(0, 4, 0.01)  # decode only
    rate.observe(100, 0, 0.05)
    assert rate.take_report() is None
