"""The L3 SSD tier: log-structured segments over preallocated O_DIRECT files (one or more paths,
striped), checksummed block records, io_uring or a thread pool, recovery after kill -9.

    from pegaflow.server.tiers.ssd import SsdTier, SsdTierOptions, SsdConfigError

README.md here has the design, the formats and the measured numbers.
"""

from pegaflow.server.tiers.ssd.config import SsdConfigError, SsdTierOptions
from pegaflow.server.tiers.ssd.tier import HEADER_BYTES, SsdTier

__all__ = ["HEADER_BYTES", "SsdConfigError", "SsdTier", "SsdTierOptions"]
