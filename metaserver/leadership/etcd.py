"""Replicas elected through etcd: one holds a lease-backed leadership key and serves, the others stand by.

The election (the recipe of etcd's own concurrency package, reduced to one key):

1. A standby polls the key ``<prefix>/leader`` every ``poll_interval_s``. While it
   exists, its value names the leader's address and its *create revision* is
   the leader's term (etcd revisions only grow, so a later election always has
   a larger term). The standby answers every RPC with that address.
2. When the key is absent, the standby grants itself a lease of ``ttl_s`` and
   runs one transaction: ``if create_revision(key) == 0 then put(key, me,
   lease)``. Exactly one replica's transaction succeeds; a loser revokes its
   lease and goes on polling.
3. The leader keeps the lease alive every ``ttl_s / 6`` and re-reads the key
   (it must still exist, with its term and lease). ``writable_until`` is set to
   the instant the keep-alive was *sent* plus the TTL etcd granted, minus a
   margin: etcd counts the TTL from when it received the keep-alive, so the
   lease cannot expire, and no other replica can win, before this replica's
   own fence closed. ``LeaderView.serving()`` checks that instant on every RPC;
   a leader cut off from etcd (or whose thread stalls) stops serving by itself,
   and the election thread then deposes it explicitly.
4. Leaving (``stop``): the key is deleted (if still ours) and the lease revoked,
   so a standby takes over within one poll instead of one TTL.

Failover after a SIGKILLed leader therefore takes at most ``ttl_s`` (etcd
expires the lease; etcd's lessor checks every 500 ms) plus one poll: about 2.1
to 2.6 s with the defaults (measured: bench/metaserver_bench.py, README).

The client is PyPI ``aetcd`` 1.0.0 (gRPC stubs of etcd's own protos, asyncio),
chosen by measurement against a real etcd 3.4.23 on this machine
(``bench/metaserver_bench.py --etcd-clients``; README, "etcd client"): lease
keep-alive / put p50 1.17 / 0.94 ms, against 2.76 / 2.56 ms for ``etcd3gw`` (the
HTTP gateway, plus pbr / futurist / requests); PyPI ``etcd3`` 0.12.0 does not
even import beside protobuf 7 ("Descriptors cannot be created directly"). aetcd
talks to one endpoint at a time, so this module rotates through ``endpoints``
itself on any failure. It runs in a thread of its
own with its own event loop; nothing else in the metaserver is asyncio.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import aetcd

from pegaflow.metaserver.leadership.base import NOT_LEADER, Deposed, Elected, Leadership, LeaderView

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/pegaflow/metaserver"
# etcd leases are whole seconds, and etcd 3.4 raises any TTL below 1.5 x its election
# timeout (1.5 s with the defaults) to that minimum: 2 s is the shortest it honours as asked.
MIN_TTL_S = 2


def parse_endpoints(text: str) -> list[str]:
    """``host:port,host:port`` (an ``http://`` prefix is allowed) -> ["host:port", ...]."""
    endpoints = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        host, sep, port = part.rpartition(":")
        if not part or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected host:port[,host:port...] for the etcd endpoints, got {text!r}")
        endpoints.append(part)
    return endpoints


class EtcdLeadership(Leadership):
    def __init__(
        self,
        endpoints: list[str],
        advertise_address: str = "",
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: int = MIN_TTL_S,
        poll_interval_s: float = 0.1,
        rpc_timeout_s: float | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if int(ttl_s) != ttl_s or ttl_s < MIN_TTL_S:
            raise ValueError(f"the leader TTL must be a whole number of seconds >= {MIN_TTL_S}, got {ttl_s}")
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"the etcd prefix must start with / and not end with it, got {prefix!r}")
        self.endpoints = list(endpoints)
        self.advertise_address = advertise_address
        self.key = f"{prefix}/leader".encode()
        self.ttl_s = int(ttl_s)
        self.poll_interval_s = poll_interval_s
        self.keepalive_interval_s = self.ttl_s / 6
        # Several keep-alive attempts (on rotating endpoints) fit in one TTL.
        self.rpc_timeout_s = rpc_timeout_s or self.ttl_s / 5
        self.margin_s = max(0.1, 0.1 * self.ttl_s)
        self._view: LeaderView = NOT_LEADER
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_elected: Elected | None = None
        self._on_deposed: Deposed | None = None
        self._endpoint = 0
        self._lease_id: int | None = None
        self._term: int | None = None
        self._stale_leases: list[int] = []
        self.elections_won = 0
        self.times_deposed = 0
        self.etcd_errors = 0
        self.endpoint_switches = 0

    # ------------------------------------------------------------ the seam

    def start(self, on_elected: Elected, on_deposed: Deposed) -> None:
        self._on_elected, self._on_deposed = on_elected, on_deposed
        self._thread = threading.Thread(target=self._run, name="metaserver-election", daemon=True)
        self._thread.start()

    def view(self) -> LeaderView:
        return self._view

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s + 2 * self.rpc_timeout_s + 1)

    def stats(self) -> dict[str, float]:
        return {
            "elections_won": self.elections_won,
            "times_deposed": self.times_deposed,
            "etcd_errors": self.etcd_errors,
            "endpoint_switches": self.endpoint_switches,
        }

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("metaserver: the election thread failed; this replica no longer serves")
            self._depose("election thread failed")

    def _client(self) -> aetcd.Client:
        host, _, port = self.endpoints[self._endpoint].rpartition(":")
        return aetcd.Client(
            host=host.strip("[]"),
            port=int(port),
            timeout=self.rpc_timeout_s,
            options={"grpc.initial_reconnect_backoff_ms": 100, "grpc.max_reconnect_backoff_ms": 1000},
        )

    async def _main(self) -> None:
        client = self._client()
        try:
            while not self._stop.is_set():
                self._check_fence()
                try:
                    if self._lease_id is not None:
                        await self._keep(client)
                        pause = self.keepalive_interval_s
                    else:
                        await self._revoke_stale(client)
                        await self._campaign(client)
                        pause = self.poll_interval_s
                except Exception as exc:  # any failure of this endpoint: try the next one soon
                    self.etcd_errors += 1
                    log.warning(
                        "metaserver: etcd %s failed (%s: %s)",
                        self.endpoints[self._endpoint],
                        type(exc).__name__,
                        exc,
                    )
                    await self._close(client)
                    if len(self.endpoints) > 1:
                        self._endpoint = (self._endpoint + 1) % len(self.endpoints)
                        self.endpoint_switches += 1
                    client = self._client()
                    pause = min(self.poll_interval_s, self.keepalive_interval_s / 4)
                await self._sleep(pause)
            await self._resign(client)
        finally:
            await self._close(client)

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop.is_set():
            self._check_fence()
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.05))

    @staticmethod
    async def _close(client: aetcd.Client) -> None:
        try:
            await asyncio.wait_for(client.close(), timeout=1.0)
        except Exception as exc:
            log.debug("metaserver: closing an etcd client failed: %s", exc)

    def _check_fence(self) -> None:
        view = self._view
        if view.is_leader and time.monotonic() >= view.writable_until:
            self._depose(f"lease not renewed within its TTL ({self.ttl_s}s)")

    # ---------------------------------------------------------- the steps

    def _value(self) -> bytes:
        return json.dumps({"address": self.advertise_address, "pid": os.getpid()}).encode()

    async def _campaign(self, client: aetcd.Client) -> None:
        current = await client.get(self.key)
        if current is not None:
            self._set_standby(current)
            return
        started = time.monotonic()
        lease = await client.lease(self.ttl_s)
        try:
            won, _ = await client.transaction(
                compare=[client.transactions.create(self.key) == 0],
                success=[client.transactions.put(self.key, self._value(), lease=lease.id)],
                failure=[],
            )
        except BaseException:
            self._stale_leases.append(lease.id)
            raise
        if not won:
            self._stale_leases.append(lease.id)
            await self._revoke_stale(client)
            current = await client.get(self.key)
            if current is not None:
                self._set_standby(current)
            return
        self._lease_id = lease.id
        self._term = None
        await self._confirm(client, started, lease.ttl)

    async def _confirm(self, client: aetcd.Client, renewed_at: float, ttl: int) -> None:
        """Reads the key back: it must be ours; its create revision is the term. Then serves."""
        kv = await client.get(self.key)
        if kv is None or kv.lease != self._lease_id:
            self._depose("the leadership key is gone or another replica's")
            return
        if self._term is None:
            self._term = kv.create_revision
            self.elections_won += 1
            try:
                self._on_elected(self._term)
            except Exception:
                log.exception("metaserver: on_elected failed; stepping down")
                self._depose("on_elected failed")
                return
            log.info("metaserver: elected leader, term %d (%s)", self._term, self.advertise_address)
        elif kv.create_revision != self._term:
            self._depose("the leadership key was re-created")
            return
        self._view = LeaderView(
            is_leader=True,
            term=self._term,
            leader_address=self.advertise_address,
            writable_until=renewed_at + ttl - self.margin_s,
        )

    async def _keep(self, client: aetcd.Client) -> None:
        sent = time.monotonic()
        reply = await client.refresh_lease(self._lease_id)
        if reply is None or reply.TTL <= 0:
            self._depose("etcd says the lease expired")
            return
        await self._confirm(client, sent, reply.TTL)

    def _set_standby(self, kv) -> None:
        try:
            address = json.loads(kv.value).get("address", "")
        except (ValueError, AttributeError):
            address = ""
        self._view = LeaderView(is_leader=False, term=kv.create_revision, leader_address=str(address))

    def _depose(self, reason: str) -> None:
        term = self._term
        was_leader = self._view.is_leader
        # The fence first: from here on every RPC is refused.
        self._view = LeaderView(is_leader=False, term=self._view.term, leader_address="")
        if self._lease_id is not None:
            self._stale_leases.append(self._lease_id)
        self._lease_id = None
        self._term = None
        if term is not None and was_leader:
            self.times_deposed += 1
            log.warning("metaserver: no longer the leader of term %d: %s", term, reason)
            try:
                self._on_deposed(term)
            except Exception:
                log.exception("metaserver: on_deposed failed")

    async def _revoke_stale(self, client: aetcd.Client) -> None:
        """Revokes leases this replica gave up (a lost election, a deposition): their keys go at once."""
        while self._stale_leases:
            lease_id = self._stale_leases[-1]
            try:
                await client.revoke_lease(lease_id)
            except aetcd.exceptions.ClientError as exc:
                if "not found" not in str(exc):
                    raise
            self._stale_leases.pop()

    async def _resign(self, client: aetcd.Client) -> None:
        term, lease_id = self._term, self._lease_id
        self._depose("stopping")
        if lease_id is None:
            return
        try:
            if term is not None:
                await client.transaction(
                    compare=[client.transactions.create(self.key) == term],
                    success=[client.transactions.delete(self.key)],
                    failure=[],
                )
            await self._revoke_stale(client)
        except Exception as exc:
            log.warning("metaserver: resigning failed (%s); the key expires with its lease", exc)
