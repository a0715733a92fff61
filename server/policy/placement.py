"""Placement: when a DRAM block is also written to the SSD tier.

Three rules, by name (``--ssd-write-policy``):

``on-seal``   write-through: every sealed block is written at once (PegaFlow's rule). Every
              block computed once costs a disk write, one-off blocks included.
``on-reuse``  second sighting: a block is written the first time it is asked for again, which
              happens one of two ways. A lookup hits it in DRAM: it is written then. Or DRAM
              had evicted it first, the lookup missed, and the engine computed and saved it
              again: it is written at that seal (policy/sightings.py remembers which missed
              blocks were asked for twice). A one-off block (a request's unique tail) is asked
              for once, so it never wears the disk. Eviction never waits for a disk: a DRAM
              victim without an SSD copy is simply dropped.
``off``       the SSD tier only serves what it recovered; nothing new is written.

Writes are planned by the block store under its lock and run by the tier mover off it; a
full write queue or no SSD space means the block is not written (counted), never a wait.
The default, on-reuse, was chosen by measurement: bench/experiments/ssd_tier.py, bench/README.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from pegaflow.server.policy.sightings import LookupSightings

RULES = ("on-seal", "on-reuse", "off")


# Aging period of the lookup sightings when the caller does not size it (about 1 MiB of filters).
DEFAULT_SIGHTING_KEYS = 1 << 19
# Sized by the SSD tier: remember about as many missed blocks as it holds 256 KiB blocks (a 16-token
# block of an 8B model per TP rank is 2 MiB, so this errs long), within 1 and 64 MiB of filters.
SIGHTING_BLOCK_BYTES = 256 << 10
MAX_SIGHTING_KEYS = 1 << 25


def sighting_keys(ssd_capacity_bytes: int) -> int:
    return min(max(ssd_capacity_bytes // SIGHTING_BLOCK_BYTES, DEFAULT_SIGHTING_KEYS), MAX_SIGHTING_KEYS)


class SsdPlacement:
    def __init__(self, rule: str, sighting_keys: int = DEFAULT_SIGHTING_KEYS):
        if rule not in RULES:
            raise ValueError(f"unknown SSD write policy {rule!r}: expected one of {', '.join(RULES)}")
        self.rule = rule
        self.sightings = LookupSightings(sighting_keys) if rule == "on-reuse" else None

    def missed(self, keys: Sequence[Hashable]) -> None:
        """A lookup found none of these blocks in any tier (on-reuse remembers them)."""
        if self.sightings is not None:
            self.sightings.missed(keys)

    def write_at_seal(self, keys: Sequence[Hashable]) -> np.ndarray:
        """Per block being sealed: whether the rule writes it to SSD now."""
        if self.rule == "on-seal":
            return np.ones(len(keys), dtype=bool)
        if self.sightings is None:
            return np.zeros(len(keys), dtype=bool)
        return self.sightings.seen_again(keys)

    @property
    def on_reuse(self) -> bool:
        return self.rule == "on-reuse"

    def __repr__(self) -> str:
        return f"SsdPlacement({self.rule!r})"
