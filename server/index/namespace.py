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
from pegaflow.server.errors import InvalidArgument

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

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def model_id(self) -> str:
        return self.layout.model_id


def namespace_id(layout: KvLayout) -> str:
    fields = dataclasses.asdict(layout)
    if layout.mla:
        del fields["tp_rank"]
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return f"ns-{digest[:20]}"


class NamespaceTable:
    """Interns namespaces: the same layout always yields the same Namespace object."""

    def __init__(self) -> None:
        self._by_id: dict[str, Namespace] = {}
        self._by_index: list[Namespace] = []

    def intern(self, layout: KvLayout) -> Namespace:
        ns_id = namespace_id(layout)
        ns = self._by_id.get(ns_id)
        if ns is None:
            ns = Namespace(ns_id, len(self._by_index), layout)
            self._by_id[ns_id] = ns
            self._by_index.append(ns)
        return ns

    def __iter__(self):
        return iter(self._by_index)

    def __len__(self) -> int:
        return len(self._by_index)
