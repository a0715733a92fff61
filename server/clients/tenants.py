"""Tenants: who a session acts for, named by the token it opened with (``--tenant-file``).

Without a tenant file every session belongs to the one unnamed tenant "" (as before: every token
holder is the same principal). With one, each line names a tenant, its secret token and its limits:

    # name    token (>= 16 printable characters)      limits (optional)
    team-a    3f0c8e1d2b4a59687766554433221100         leased=8gb unsealed=2gb pool=40gb
    team-b    9a8b7c6d5e4f30211203948576abcdef

What a tenant gets (ARCHITECTURE.md, "Trust model"):

* **Its own namespaces.** A namespace's id digests the tenant's name with the layout
  (store/namespace.py), so two tenants running the same model never share a block: no hit, no
  dedup (EXISTS), no probing which prompts another tenant has sent, no seal over another
  tenant's hashes. Every engine of one tenant still shares, as before.
* **Ids bound to it.** Sessions are opened over gRPC with the tenant's token; every later call
  names a session, and every instance, lease and save id is bound to its session already
  (clients/registry.py), hence to its tenant.
* **Limits over all its sessions together**: ``leased`` (bytes its leases pin at once) and
  ``unsealed`` (bytes granted to its saves and not sealed yet), on top of each session's own
  quotas; past them a lease is cut short and a save's extra blocks are REJECTED, counted in
  ``quota_refusals`` and per tenant.
* **A cap on its DRAM** (``pool``): the most bytes of its blocks the pool holds at once. At its
  cap a tenant makes room by evicting its own least recently used blocks, never another tenant's
  (policy/tenant_caps.py), so a tenant that saves without end churns its own share and the others
  keep the rest of the pool. Caps may add up to more than the pool: a cap bounds, it reserves nothing.
* **Or memory of its own** (``region``): a region of that size beside the pool, a memfd of its own
  (tiers/dram/region.py). The tenant's blocks live only there, it evicts only its own, and its
  sessions are handed only that memfd: they cannot map, read or write the pool or another
  tenant's region, and nothing of theirs is in its. ``region`` and ``pool`` exclude each other.

Without ``region`` a tenant's sessions map the shared pool, so a tenant that runs code on this host
and can open the local sockets can read or overwrite the blocks of every tenant without a region
there (detected with block checksums, not prevented); tenants that must not trust each other with
that get a region each.

Tokens are compared in constant time. The file is read once at start (a change needs a restart:
a session's tenant and its namespaces must not move under it).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import re
import stat
from collections.abc import Sequence

from pegaflow.common.auth import MAX_TOKEN_FILE_BYTES, AuthConfigError, bearer_tokens, check_token
from pegaflow.common.units import parse_size

DEFAULT_TENANT = ""  # sessions opened without a tenant token (no tenant file, or an operator token)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_LIMITS = ("leased", "unsealed", "pool", "region")


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    token: str = dataclasses.field(repr=False)
    leased_bytes: int | None = None  # None: no tenant-wide limit (the session quotas still apply)
    unsealed_bytes: int | None = None
    pool_bytes: int | None = None  # None: no DRAM cap (the tenant competes for the whole pool)
    region_bytes: int | None = None  # memory of its own (a memfd beside the pool); None: the pool


class TenantTable:
    def __init__(self, tenants: Sequence[Tenant] = ()):
        self._tenants = tuple(tenants)
        self.by_name = {t.name: t for t in self._tenants}

    @classmethod
    def from_text(cls, text: str, where: str) -> TenantTable:
        tenants: list[Tenant] = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            here = f"{where}, line {number}"
            name, token, *options = line.split()
            if not _NAME.fullmatch(name):
                raise AuthConfigError(
                    f"{here}: a tenant name is 1-64 letters, digits, '_', '.' or '-': {name!r}"
                )
            limits: dict[str, int] = {}
            for option in options:
                key, sep, value = option.partition("=")
                if not sep or key not in _LIMITS or key in limits:
                    raise AuthConfigError(
                        f"{here}: {option!r} is not a limit "
                        "(leased=SIZE, unsealed=SIZE, pool=SIZE, region=SIZE, each once)"
                    )
                try:
                    limits[key] = parse_size(value)
                except ValueError as exc:
                    raise AuthConfigError(f"{here}: {key}: {exc}") from None
            tenant = Tenant(
                name,
                check_token(token, here),
                limits.get("leased"),
                limits.get("unsealed"),
                limits.get("pool"),
                limits.get("region"),
            )
            if tenant.pool_bytes is not None and tenant.region_bytes is not None:
                raise AuthConfigError(
                    f"{here}: pool= caps a share of the pool, region= gives memory of its own: one of them"
                )
            tenants.append(tenant)
        if not tenants:
            raise AuthConfigError(
                f"{where} names no tenant "
                "(one per line: NAME TOKEN [leased=SIZE] [unsealed=SIZE] [pool=SIZE | region=SIZE])"
            )
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise AuthConfigError(f"{where}: a tenant is named twice")
        tokens = [t.token for t in tenants]
        if len(set(tokens)) != len(tokens):
            raise AuthConfigError(f"{where}: two tenants share a token (a token names one tenant)")
        return cls(tenants)

    @classmethod
    def load(cls, path: str) -> TenantTable:
        what = "--tenant-file"
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_TOKEN_FILE_BYTES + 1)
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise AuthConfigError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise AuthConfigError(f"{what} {path}: larger than {MAX_TOKEN_FILE_BYTES} bytes")
        if mode & stat.S_IROTH:
            raise AuthConfigError(
                f"{what} {path} is readable by every local user (chmod o-r): it holds secrets"
            )
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise AuthConfigError(f"{what} {path}: a tenant file is ASCII text") from None
        return cls.from_text(text, f"{what} {path}")

    def pool_caps(self) -> dict[str, int]:
        """Tenant name -> its DRAM cap in bytes, for the tenants that have one."""
        return {t.name: t.pool_bytes for t in self._tenants if t.pool_bytes is not None}

    def regions(self) -> dict[str, int]:
        """Tenant name -> the size of its own region, for the tenants that have one (file order)."""
        return {t.name: t.region_bytes for t in self._tenants if t.region_bytes is not None}

    def tokens(self) -> tuple[str, ...]:
        return tuple(t.token for t in self._tenants)

    def identify(self, metadata) -> Tenant | None:
        """The tenant whose token the call's metadata carries, or None. Every comparison runs (in
        constant time), whichever matches."""
        found = None
        for sent in bearer_tokens(metadata):
            for tenant in self._tenants:
                if hmac.compare_digest(sent, tenant.token.encode()):
                    found = tenant
        return found

    def __len__(self) -> int:
        return len(self._tenants)
