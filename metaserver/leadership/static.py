"""The embedded default: a metaserver without etcd is the only replica, leader of term 0, forever."""

from __future__ import annotations

from pegaflow.metaserver.leadership.base import Deposed, Elected, Leadership, LeaderView


class SoleLeader(Leadership):
    def __init__(self, advertise_address: str = "") -> None:
        self.advertise_address = advertise_address
        self._view = LeaderView(is_leader=False, term=0, leader_address=advertise_address)

    def start(self, on_elected: Elected, on_deposed: Deposed) -> None:
        on_elected(0)
        self._view = LeaderView(
            is_leader=True, term=0, leader_address=self.advertise_address, writable_until=float("inf")
        )

    def view(self) -> LeaderView:
        return self._view

    def stop(self) -> None:
        self._view = LeaderView(is_leader=False, term=0, leader_address="")
