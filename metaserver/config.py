"""Settings of one metaserver (what the CLI flags fill in)."""

from __future__ import annotations

import dataclasses

from pegaflow.common.auth import ServerAuth


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; ``:port`` = every interface) -> (host, port); port 0 = a free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclasses.dataclass(frozen=True)
class MetaServerConfig:
    addr: str = "0.0.0.0:50056"
    # None: no HTTP endpoint (in-process tests); the CLI always sets one.
    http_addr: str | None = "127.0.0.1:9092"
    # Slots of the index table (52 bytes each with up to 64 nodes, +8 per further 64; index.py).
    max_entries: int = 1_000_000
    max_nodes: int = 1024
    # Lease granted when a node asks for none, and the bounds of what it may ask.
    lease_ttl_s: float = 10.0
    min_lease_ttl_s: float = 1.0
    max_lease_ttl_s: float = 300.0
    # A call that arrives without a deadline gets this one.
    default_rpc_deadline_s: float = 10.0
    grpc_workers: int = 8
    # Calls in flight or queued beyond this are refused (RESOURCE_EXHAUSTED) rather than queued without bound.
    max_concurrent_rpcs: int = 256
    # Lease expiry checks and index sweeps run this often.
    maintenance_interval_s: float = 0.25
    # Replicas: empty = the one embedded metaserver (no etcd), always the leader.
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = "/pegaflow/metaserver"
    # The leader's etcd lease (whole seconds, >= 2): how long a dead leader blocks failover.
    leader_ttl_s: int = 2
    # What standbys and etcd name as this replica's address; "" = the address bound (a
    # wildcard host is replaced by this host's name).
    advertise_addr: str = ""
    # Who may call (common/auth.py); all None: plaintext, no check, as before. Health stays open.
    auth_token_file: str | None = None  # tokens accepted (one per line), re-read when it changes
    tls_cert_file: str | None = None  # TLS, with tls_key_file
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # mutual TLS: callers need a certificate this CA signed

    def auth(self) -> ServerAuth:
        return ServerAuth(
            self.auth_token_file, self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
        )

    def validate(self) -> None:
        parse_host_port(self.addr)
        if self.http_addr is not None:
            parse_host_port(self.http_addr)
        if self.max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        if self.max_nodes < 1:
            raise ValueError("max_nodes must be at least 1")
        if not 0 < self.min_lease_ttl_s <= self.lease_ttl_s <= self.max_lease_ttl_s:
            raise ValueError(
                "lease TTLs must satisfy 0 < min <= default <= max, got "
                f"{self.min_lease_ttl_s}, {self.lease_ttl_s}, {self.max_lease_ttl_s}"
            )
        if self.default_rpc_deadline_s <= 0 or self.maintenance_interval_s <= 0:
            raise ValueError("deadlines and intervals must be positive")
        if self.etcd_endpoints and (int(self.leader_ttl_s) != self.leader_ttl_s or self.leader_ttl_s < 2):
            raise ValueError(f"leader_ttl_s must be a whole number of seconds >= 2, got {self.leader_ttl_s}")
        if self.advertise_addr:
            parse_host_port(self.advertise_addr)
        if self.grpc_workers < 1 or self.max_concurrent_rpcs < 1:
            raise ValueError("grpc_workers and max_concurrent_rpcs must be at least 1")
        self.auth().check()
