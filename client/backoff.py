"""Exponential backoff with full jitter, for reconnect loops."""

from __future__ import annotations

import random


class Backoff:
    """``next()`` returns the delay before the next attempt: base * 2**n capped at ``cap``, jittered."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0, rng: random.Random | None = None):
        if base_s <= 0 or cap_s < base_s:
            raise ValueError("need 0 < base_s <= cap_s")
        self.base_s = base_s
        self.cap_s = cap_s
        self.attempts = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        ceiling = min(self.cap_s, self.base_s * (2 ** min(self.attempts, 30)))
        self.attempts += 1
        # Half fixed, half random: never zero (no hot loop), and clients do not retry in lockstep.
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.attempts = 0
