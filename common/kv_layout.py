"""The KV layout: everything that makes two engines' KV bytes interchangeable (proto KvLayout).

One definition for both ends: the client builds it, the server subclasses it to
add validation and namespaces it. A field added here reaches both.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """Same fields as the KvLayout message of proto/pegaflow.proto.

    ``block_bytes`` is the size of one block (all layers, this rank). With
    ``mla`` the TP rank is not part of the namespace: all ranks share one copy.
    """

    model_id: str
    block_bytes: int
    model_fingerprint: str = ""
    dtype: str = ""
    layout: str = ""
    block_tokens: int = 0
    num_layers: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    mla: bool = False
    extra: str = ""
