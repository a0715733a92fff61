"""KV layout -> namespace: which engines' KV bytes are interchangeable.

A namespace id is a digest of every field of the layout that changes the bytes
of a block: model identity, dtype, layout tag, tokens and bytes per block,
layer count, TP size and TP rank. With ``mla`` the latent KV is identical on
every rank, so the rank is left out and all ranks of a TP group share one copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from pegaflow.common import kv_layout as common_kv_layout
from pegaflow.server.errors import InvalidArgument, ResourceExhausted

MAX_TEXT_FIELD = 512


class KvLayout(common_kv_layout.KvLayout):
    """The server's view of a KvLayout message: the shared fields, plus conversion and validation."""

    @classmethod
    def from_fields(cls, src) -> KvLayout:
        """From any object with the layout's attributes (a protobuf message, the client's dataclass)."""
        return cls(**{f.name: getattr(src, f.name) for f in dataclasses.fields(cls)})

    def validate(self, max_block_bytes: int) -> None:
        if not self.model_id:
            raise InvalidArgument("layout.model_id must not be empty")
        for name in ("model_id", "model_fingerprint", "dtype", "layout", "extra"):
            if len(getattr(self, name)) > MAX_TEXT_FIELD:
                raise InvalidArgument(f"layout.{name} is longer than {MAX_TEXT_FIELD} characters")
        if self.block_bytes <= 0:
            raise InvalidArgument("layout.block_bytes must be greater than zero")
        if self.block_bytes > max_block_bytes:
            raise InvalidArgument(
                f"layout.block_bytes {self.block_bytes} exceeds the largest block this server's pool serves "
                f"({max_block_bytes} bytes, its slab size); start the server with a larger pool"
            )
        if self.tp_size < 1:
            raise InvalidArgument("layout.tp_size must be at least 1")
        if self.tp_rank >= self.tp_size:
            raise InvalidArgument(f"layout.tp_rank {self.tp_rank} must be below tp_size {self.tp_size}")


@dataclasses.dataclass(frozen=True)
class Namespace:
    id: str
    index: int  # small dense number, used in block keys (cheaper to hash than the id string)
    layout: KvLayout
    tenant: str = ""  # clients/tenants.py: whose blocks these are ("": no tenant)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def model_id(self) -> str:
        return self.layout.model_id


def namespace_id(layout: KvLayout, tenant: str = "") -> str:
    """The layout's digest; a tenant's name is part of it, so tenants never share a namespace (the
    unnamed tenant "" keeps the ids namespaces had before tenants existed)."""
    fields = dataclasses.asdict(layout)
    if layout.mla:
        del fields["tp_rank"]
    if tenant:
        fields["tenant"] = tenant
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return f"ns-{digest[:20]}"


class NamespaceTable:
    """Interns namespaces: the same layout always yields the same Namespace object.

    The id is a digest of the layout, so it is the same on every node and after every restart:
    a persistent tier's records name their namespace by id, and ``restore`` seeds the table
    from the layouts saved beside them before any engine registers again.

    A namespace no instance uses and no block belongs to is released (``release``) after it has
    been idle a while (the engine's reaper decides), so clients cycling through fresh layouts
    cannot grow memory or metric series without bound (review finding F7). Indices are never
    reused: a block key (index, hash) can only ever mean one namespace.
    """

    def __init__(self, max_namespaces: int = 4096) -> None:
        self.max_namespaces = max_namespaces
        self._by_id: dict[str, Namespace] = {}
        self._by_index: dict[int, Namespace] = {}
        self._next_index = 0

    def intern(self, layout: KvLayout, tenant: str = "") -> tuple[Namespace, bool]:
        """(the namespace of ``layout`` for ``tenant``, whether it is new). ResourceExhausted past
        max_namespaces."""
        ns_id = namespace_id(layout, tenant)
        ns = self._by_id.get(ns_id)
        if ns is not None:
            return ns, False
        if len(self._by_id) >= self.max_namespaces:
            raise ResourceExhausted(
                f"the server holds {len(self._by_id)} namespaces (the limit); unused ones are released "
                "after they have been idle a while"
            )
        ns = Namespace(ns_id, self._next_index, layout, tenant)
        self._next_index += 1
        self._by_id[ns_id] = ns
        self._by_index[ns.index] = ns
        return ns, True

    def restore(self, ns_id: str, layout: KvLayout, tenant: str = "") -> Namespace:
        """A namespace known from persisted state; refused if the layout does not digest to ``ns_id``."""
        if namespace_id(layout, tenant) != ns_id:
            raise ValueError(f"persisted layout does not match namespace id {ns_id}")
        return self.intern(layout, tenant)[0]

    def release(self, ns: Namespace) -> None:
        """Forgets an unused namespace (no instance, no block: the caller checked)."""
        self._by_id.pop(ns.id, None)
        self._by_index.pop(ns.index, None)

    def by_id(self, ns_id: str) -> Namespace | None:
        return self._by_id.get(ns_id)

    def at(self, index: int) -> Namespace:
        return self._by_index[index]

    def by_index(self, index: int) -> Namespace | None:
        return self._by_index.get(index)

    def layouts(self) -> dict[str, dict]:
        """Every namespace's layout as plain fields, by id (what is persisted beside a tier's records),
        with its tenant under "tenant" when it has one."""
        out = {}
        for ns in self._by_index.values():
            fields = dataclasses.asdict(ns.layout)
            if ns.tenant:
                fields["tenant"] = ns.tenant
            out[ns.id] = fields
        return out

    def __iter__(self):
        return iter(list(self._by_index.values()))

    def __len__(self) -> int:
        return len(self._by_index)


def block_tag(namespace_id_: str, block_hash: bytes) -> bytes:
    """The identity a persistent tier stores beside a block's bytes: its namespace id and hash."""
    return namespace_id_.encode() + b"\0" + block_hash


def parse_block_tag(tag: bytes) -> tuple[str, bytes]:
    """(namespace id, block hash) of a tag made by ``block_tag``; ValueError for anything else."""
    ns, sep, block_hash = tag.partition(b"\0")
    if not sep or not ns.startswith(b"ns-") or not block_hash:
        raise ValueError(f"not a block tag: {tag[:40]!r}")
    return ns.decode("ascii"), block_hash
