"""The pegaflow client: ``PegaClient`` (sync) and ``AsyncPegaClient`` (asyncio).

from pegaflow.client import PegaClient, KvLayout, QueryPurpose, errors

The client never imports server code (pegaflow.server): a vLLM process that only
talks to a server pays for no more than the client.
"""

from pegaflow.client import errors
from pegaflow.client.aio import AsyncPegaClient
from pegaflow.client.block_copy import block_checksums, read_blocks, verify_blocks, write_blocks
from pegaflow.client.sync import PegaClient
from pegaflow.client.types import (
    Allocation,
    AllocStatus,
    InstanceHandle,
    KvLayout,
    Location,
    PrefixHit,
    QueryPurpose,
    SaveBatch,
    ServerLimits,
    Tier,
)

__all__ = [
    "Allocation",
    "AllocStatus",
    "AsyncPegaClient",
    "InstanceHandle",
    "KvLayout",
    "Location",
    "PegaClient",
    "PrefixHit",
    "QueryPurpose",
    "SaveBatch",
    "ServerLimits",
    "Tier",
    "block_checksums",
    "errors",
    "read_blocks",
    "verify_blocks",
    "write_blocks",
]
