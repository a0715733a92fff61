"""Client liveness: one session per client process.

A session lives while its client heartbeats within the TTL *and* (once it has
attached to the fd broker) keeps that Unix connection open. Either signal
failing ends it; the engine then reclaims everything the session held except
the blocks it sealed. Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

import secrets


class Session:
    __slots__ = (
        "id",
        "client_name",
        "pid",
        "hostname",
        "last_seen",
        "expires",
        "trusted",
        "attachments",
        "instances",
        "leases",
        "saves",
        "leased_bytes",
        "unsealed_bytes",
        "read_only",
        "tenant",
    )

    def __init__(
        self, client_name: str, pid: int, hostname: str, now: float, expires: bool, trusted: bool = False
    ):
        self.id = "s-" + secrets.token_hex(12)
        self.client_name = client_name
        self.pid = pid
        self.hostname = hostname
        self.last_seen = now
        self.expires = expires  # False for in-process (embedded) sessions: no heartbeat needed
        # The server's own in-process parts (the GPU data path) act on other sessions' instances.
        self.trusted = trusted
        self.attachments = 0  # open fd-broker connections
        self.instances: set[str] = set()
        self.leases: set[str] = set()
        self.saves: set[str] = set()
        # What the session holds right now, against its quotas (review finding F8).
        self.leased_bytes = 0  # bytes of blocks its leases pin
        self.unsealed_bytes = 0  # bytes granted to its saves and not sealed yet
        self.read_only = False  # a reader: a read-only pool fd, no saves
        self.tenant = None  # clients/tenants.py Tenant it acts for; None: the unnamed tenant ""


class SessionTable:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}

    def open(
        self,
        client_name: str,
        pid: int,
        hostname: str,
        now: float,
        expires: bool = True,
        trusted: bool = False,
    ) -> Session:
        session = Session(client_name, pid, hostname, now, expires, trusted)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def remove(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def expired(self, now: float) -> list[Session]:
        deadline = now - self.ttl_s
        return [s for s in self._sessions.values() if s.expires and s.last_seen < deadline]

    def __iter__(self):
        """The live sessions (a snapshot: the caller may end some while iterating)."""
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)
