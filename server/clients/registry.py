"""Who is connected and what each of them holds: sessions, instances, leases, saves, tombstones.

The registry is the engine's bookkeeping of clients. It knows nothing of
bytes or tiers: a lease lists block entries, and the engine asks the block
store to pin and unpin them. Every id is bound to the session that created it:
an instance, lease or save named by another session is NOT_FOUND, exactly as
an id that never existed (review finding F9: bearer ids reached too far).

Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

from pegaflow.server.clients.expiring import ExpiringTable
from pegaflow.server.clients.leases import Lease
from pegaflow.server.clients.saves import Save
from pegaflow.server.clients.sessions import Session, SessionTable
from pegaflow.server.clients.tombstones import Tombstones
from pegaflow.server.errors import DeadlineExceeded, FailedPrecondition, NotFound, ResourceExhausted
from pegaflow.server.store.namespace import Namespace


class Instance:
    __slots__ = ("id", "session_id", "namespace", "name")

    def __init__(self, session_id: str, namespace: Namespace, name: str):
        self.id = "i-" + secrets.token_hex(12)
        self.session_id = session_id
        self.namespace = namespace
        self.name = name


class ClientRegistry:
    def __init__(
        self,
        session_ttl_s: float,
        tombstone_ttl_s: float,
        max_instances_per_session: int,
        max_leases_per_session: int,
    ):
        self.sessions = SessionTable(session_ttl_s)
        self.instances: dict[str, Instance] = {}
        self.leases: ExpiringTable[Lease] = ExpiringTable()
        self.saves: ExpiringTable[Save] = ExpiringTable()
        # Ids released / aborted before they existed: a late call with one is refused (see tombstones.py).
        self.tombstones = Tombstones(tombstone_ttl_s)
        self.max_instances_per_session = max_instances_per_session
        self.max_leases_per_session = max_leases_per_session

    # -------------------------------------------------------------- sessions

    def open_session(
        self, client_name: str, pid: int, hostname: str, now: float, expires: bool, trusted: bool = False
    ) -> Session:
        return self.sessions.open(client_name, pid, hostname, now, expires, trusted)

    def live_session(self, session_id: str, now: float) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound("session", session_id)
        session.last_seen = now  # any request is as good as a heartbeat
        return session

    def end_session(self, session: Session) -> tuple[list[Lease], list[Save], int]:
        """Forgets the session; returns its leases and saves (for the engine to unpin and abort) and
        how many instances it dropped."""
        self.sessions.remove(session.id)
        leases = [lease for lease in map(self.leases.get, list(session.leases)) if lease is not None]
        for lease in leases:
            self.leases.remove(lease.id)
        saves = [save for save in map(self.saves.get, list(session.saves)) if save is not None]
        for save in saves:
            self.saves.remove(save.id)
        for instance_id in session.instances:
            self.instances.pop(instance_id, None)
        return leases, saves, len(session.instances)

    # ------------------------------------------------------------- instances

    def add_instance(self, session: Session, namespace: Namespace, name: str) -> Instance:
        if len(session.instances) >= self.max_instances_per_session:
            raise ResourceExhausted(
                f"session {session.id} already has {len(session.instances)} instances (the limit)"
            )
        instance = Instance(session.id, namespace, name)
        self.instances[instance.id] = instance
        session.instances.add(instance.id)
        return instance

    def instance(self, session: Session, instance_id: str) -> Instance:
        instance = self.instances.get(instance_id)
        if instance is None or (instance.session_id != session.id and not session.trusted):
            raise NotFound("instance", instance_id)
        return instance

    def remove_instance(self, session: Session, instance_id: str) -> Instance:
        instance = self.instance(session, instance_id)
        del self.instances[instance.id]
        session.instances.discard(instance.id)
        return instance

    def instances_per_namespace(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for instance in self.instances.values():
            counts[instance.namespace.index] = counts.get(instance.namespace.index, 0) + 1
        return counts

    # ---------------------------------------------------------------- leases

    def check_new_id(self, ident: str, kind: str) -> None:
        """A client-chosen lease / save id must be fresh and not given up already."""
        if ident in self.tombstones:
            raise DeadlineExceeded(f"{kind} {ident} was already given up by its caller")
        table = self.leases if kind == "lease" else self.saves
        if table.get(ident) is not None:
            raise FailedPrecondition(f"{kind} id {ident} is already in use")

    def check_lease_room(self, session: Session) -> None:
        if len(session.leases) >= self.max_leases_per_session:
            raise ResourceExhausted(f"session {session.id} holds {len(session.leases)} leases (the limit)")

    def add_lease(self, session: Session, lease: Lease) -> None:
        self.leases.add(lease)
        session.leases.add(lease.id)
        session.leased_bytes += lease.nbytes

    def lease(self, session: Session, lease_id: str, now: float) -> Lease:
        """The session's lease ``lease_id``; an unknown one is tombstoned (a late query naming it is
        refused)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.session_id != session.id:
            if lease is None:
                self.tombstones.add(lease_id, now)
            raise NotFound("lease", lease_id)
        return lease

    def remove_lease(self, lease: Lease) -> None:
        self.leases.remove(lease.id)
        owner = self.sessions.get(lease.session_id)
        if owner is not None:
            owner.leases.discard(lease.id)
            owner.leased_bytes -= lease.nbytes

    # ----------------------------------------------------------------- saves

    def add_save(self, session: Session, save: Save) -> None:
        self.saves.add(save)
        session.saves.add(save.id)

    def save(self, session: Session, save_id: str, now: float, tombstone: bool = False) -> Save:
        save = self.saves.get(save_id)
        if save is None or save.session_id != session.id:
            if save is None and tombstone:
                self.tombstones.add(save_id, now)
            raise NotFound("save", save_id)
        return save

    def remove_save(self, save: Save) -> None:
        self.saves.remove(save.id)
        owner = self.sessions.get(save.session_id)
        if owner is not None:
            owner.saves.discard(save.id)

    # ---------------------------------------------------------------- reaping

    def expired(self, now: float) -> tuple[list[Session], list[Lease], list[Save]]:
        """What timed out by ``now``: silent sessions, leases past their TTL, saves past the write timeout."""
        self.tombstones.prune(now)
        return self.sessions.expired(now), self.leases.expired(now), self.saves.expired(now)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self.sessions))
