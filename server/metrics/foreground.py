"""Latency-critical calls in flight, so that background Python work can wait for a quiet moment.

Every engine call (gRPC, the local RPC socket, the GPU doorbell) runs inside ``with activity:``
(server/endpoints/grpc_servicer.py, the handler frame). The metrics feeder (registry.py) feeds
its miss-ratio curve and HyperLogLog in short slices between calls: measured on the H200 host with
py-spy (server/gpu/README.md), the feeder held the GIL about as long as the doorbell's request
thread itself during a GPU benchmark, and a GPU save or load coming back from a CUDA wait or a
socket could wait up to the switch interval (0.2 ms) for it each time. The slices are short
because a quiet moment is often the gap right before the next call: with 256-key slices (2.5 ms
there) the calls were measured slower than with no yielding at all.

Only a count and a condition: two short lock holds per call.
"""

from __future__ import annotations

import threading


class ForegroundActivity:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls = 0

    def __enter__(self) -> ForegroundActivity:
        with self._cond:
            self._calls += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """True while any call is in flight (a read of one int: no lock)."""
        return self._calls > 0

    @property
    def calls(self) -> int:
        return self._calls

    def wait_quiet(self, timeout_s: float) -> bool:
        """Blocks until no call is in flight; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._calls, timeout_s)
