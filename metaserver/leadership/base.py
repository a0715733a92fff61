"""The leadership seam: which metaserver replica serves, in which term, and until when.

The service asks ``view()`` on every RPC and serves only while it says so; the
runtime learns of changes through the two callbacks given to ``start``. Two
implementations: ``static.SoleLeader`` (no etcd: this process is the only
replica, term 0, forever) and ``etcd.EtcdLeadership`` (replicas elected through
an etcd lease-backed key).

Primitives, by role:

- ``start(on_elected, on_deposed)`` -- called once by the runtime before it
  serves. Returns at once; campaigning runs in the implementation's own thread.
  ``on_elected(term)`` is called in that thread *before* ``view()`` reports the
  replica as leader of ``term`` (the runtime installs a fresh, empty index
  there); ``on_deposed(term)`` is called *after* ``view()`` stopped reporting it
  (writes are already refused). Callbacks must not block for long; an exception
  in one is logged and the replica steps down.
- ``view() -> LeaderView`` -- called by every RPC handler. Never blocks, never
  raises, costs a lock-free attribute read. ``serving()`` on the view is the
  fence: True only while ``is_leader`` and ``time.monotonic()`` is before
  ``writable_until``, the instant by which the etcd lease could, at the
  earliest, expire without a keep-alive this replica saw answered. A leader
  whose election thread stalls therefore stops serving by itself, before etcd
  can let another replica win: no two replicas ever serve the same instant.
- ``stop()`` -- called once at shutdown; resigns (deletes the key and revokes the
  lease, so a standby takes over at once instead of after the TTL) and joins its
  thread within a bounded time. Failures are logged, never raised.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class LeaderView:
    """One consistent reading of the leadership state."""

    is_leader: bool
    # The current leader's term (etcd create revision of its key); 0 without etcd or when unknown.
    term: int
    # The current leader's advertised address ("" when no leader is known).
    leader_address: str
    # time.monotonic() instant after which this replica must not serve (0 when not leader).
    writable_until: float = 0.0

    def serving(self, now: float | None = None) -> bool:
        return self.is_leader and (time.monotonic() if now is None else now) < self.writable_until


NOT_LEADER = LeaderView(is_leader=False, term=0, leader_address="")

Elected = Callable[[int], None]
Deposed = Callable[[int], None]


class Leadership(abc.ABC):
    advertise_address: str

    @abc.abstractmethod
    def start(self, on_elected: Elected, on_deposed: Deposed) -> None: ...

    @abc.abstractmethod
    def view(self) -> LeaderView: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """Counters for metrics (elections won, times deposed, ...); empty by default."""
        return {}
