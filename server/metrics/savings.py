"""What the cache saved, per namespace: prefill tokens served from it and prefill seconds avoided.

* **Tokens served**: every block a LOOKUP found (its leading prefix hits) is ``block_tokens``
  tokens the engine does not have to prefill. Counted from the lookups the metrics feeder drains
  (not on the request path), with the namespace's ``block_tokens`` from its KvLayout; a layout
  that does not state it (0) serves blocks but no countable tokens.
* **Seconds avoided**: tokens served x the engine's *own measured* prefill cost per token. The
  server never sees the engine compute, so the engine reports it: the connector's scheduler side
  periodically sends, per instance, how many prompt tokens it computed (not loaded) since its last
  report and how many seconds of prefill they took (vLLM's per-request prefill time, the
  scheduled-to-first-token span, over the tokens it computed; ``report_prefill``). The server
  keeps a rolling ratio per namespace (seconds / tokens over the reports of the last
  ``RATE_WINDOW_S``; the last known ratio when no report is that recent) and prices each hit
  with the ratio known at the time. Hits served before any report are counted as *unpriced*
  tokens, never priced after the fact with a rate measured later.

  The linear price is an approximation: attention makes a token's prefill cost grow with its
  position, and cached tokens are the leading ones, so a per-token mean over the computed tokens
  (which sit later in the prompt) slightly over-prices them. It is the engine's measurement,
  not a guess, and it moves with the engine's real speed (load, batch sizes, hardware).

Cardinality is bounded: namespaces are the label (as in pegaflow_namespace_resident_blocks);
past MAX_NAMESPACES distinct ones, further namespaces are accounted under ``OVERFLOW``.
Thread-safe: one lock, held for a few dict operations.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable

RATE_WINDOW_S = 600.0
RATE_BUCKETS = 10
MAX_NAMESPACES = 256
OVERFLOW = "_other"
# A report above this is a broken measurement (a prefill of one token taking 10 s), not a slow engine.
MAX_SECONDS_PER_TOKEN = 10.0


@dataclasses.dataclass(frozen=True)
class NamespaceSavings:
    namespace_id: str
    model_id: str
    hit_blocks: int
    tokens_served: int
    seconds_avoided: float
    unpriced_tokens: int  # served while no prefill rate of the namespace was known
    seconds_per_token: float | None  # the current price; None until the engine reported one


class _Account:
    __slots__ = ("model_id", "hit_blocks", "tokens", "seconds", "unpriced", "stamps", "rep_tokens",
                 "rep_seconds", "last_rate")  # fmt: skip

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.hit_blocks = 0
        self.tokens = 0
        self.seconds = 0.0
        self.unpriced = 0
        self.stamps = [-1] * RATE_BUCKETS
        self.rep_tokens = [0] * RATE_BUCKETS
        self.rep_seconds = [0.0] * RATE_BUCKETS
        self.last_rate: float | None = None

    def rate(self, bucket: int) -> float | None:
        tokens = seconds = 0
        for slot in range(RATE_BUCKETS):
            if bucket - RATE_BUCKETS < self.stamps[slot] <= bucket:
                tokens += self.rep_tokens[slot]
                seconds += self.rep_seconds[slot]
        if tokens:
            return seconds / tokens
        return self.last_rate


class PrefillSavings:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._bucket_s = RATE_WINDOW_S / RATE_BUCKETS
        self._accounts: dict[str, _Account] = {}
        self._lock = threading.Lock()

    def _account(self, namespace_id: str, model_id: str) -> _Account:
        account = self._accounts.get(namespace_id)
        if account is None:
            if len(self._accounts) >= MAX_NAMESPACES:
                namespace_id, model_id = OVERFLOW, OVERFLOW
                account = self._accounts.get(OVERFLOW)
            if account is None:
                account = self._accounts[namespace_id] = _Account(model_id)
        return account

    def add_hits(self, namespace_id: str, model_id: str, block_tokens: int, hit_blocks: int) -> None:
        """``hit_blocks`` blocks of the namespace were found by one lookup."""
        if hit_blocks <= 0:
            return
        tokens = hit_blocks * max(0, block_tokens)
        bucket = int(self._clock() // self._bucket_s)
        with self._lock:
            account = self._account(namespace_id, model_id)
            account.hit_blocks += hit_blocks
            account.tokens += tokens
            rate = account.rate(bucket)
            if rate is None:
                account.unpriced += tokens
            else:
                account.seconds += tokens * rate

    def report_prefill(
        self, namespace_id: str, model_id: str, computed_tokens: int, prefill_seconds: float
    ) -> None:
        """The engine of the namespace computed ``computed_tokens`` prompt tokens in
        ``prefill_seconds`` of prefill since its previous report. ValueError for a report that
        cannot be a measurement (negative, not finite, over MAX_SECONDS_PER_TOKEN per token);
        nothing is recorded then."""
        if isinstance(computed_tokens, bool) or not isinstance(computed_tokens, int) or computed_tokens < 0:
            raise ValueError(f"computed_tokens must be an int >= 0, got {computed_tokens!r}")
        if (
            not isinstance(prefill_seconds, (int, float))
            or not math.isfinite(prefill_seconds)
            or prefill_seconds < 0
        ):
            raise ValueError(f"prefill_seconds must be a finite number >= 0, got {prefill_seconds!r}")
        if computed_tokens == 0:
            if prefill_seconds > 0:
                raise ValueError("prefill_seconds > 0 with computed_tokens == 0")
            return
        if prefill_seconds / computed_tokens > MAX_SECONDS_PER_TOKEN:
            raise ValueError(
                f"{prefill_seconds} s for {computed_tokens} tokens: over {MAX_SECONDS_PER_TOKEN} s per token"
            )
        bucket = int(self._clock() // self._bucket_s)
        slot = bucket % RATE_BUCKETS
        with self._lock:
            account = self._account(namespace_id, model_id)
            if account.stamps[slot] != bucket:
                account.stamps[slot] = bucket
                account.rep_tokens[slot] = 0
                account.rep_seconds[slot] = 0.0
            account.rep_tokens[slot] += computed_tokens
            account.rep_seconds[slot] += float(prefill_seconds)
            account.last_rate = account.rate(bucket)

    def snapshot(self) -> list[NamespaceSavings]:
        bucket = int(self._clock() // self._bucket_s)
        with self._lock:
            return [
                NamespaceSavings(
                    ns, a.model_id, a.hit_blocks, a.tokens, a.seconds, a.unpriced, a.rate(bucket)
                )
                for ns, a in self._accounts.items()
            ]
