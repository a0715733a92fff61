"""Placement: when a DRAM block is also written to the SSD tier.

Three rules, by name (``--ssd-write-policy``):

``on-seal``   write-through: every sealed block is written at once (PegaFlow's rule). Every
              block computed once costs a disk write, one-off blocks included.
``on-reuse``  second sighting: a block is written the first time a lookup hits it in DRAM.
              A one-off block (a request's unique tail) is never hit, so it never wears the
              disk; a reused block (a shared system prompt, a multi-turn history) is written
              after its first reuse, while it is still in DRAM. Eviction never waits for a disk:
              a DRAM victim without an SSD copy is simply dropped.
``off``       the SSD tier only serves what it recovered; nothing new is written.

Writes are planned by the block store under its lock and run by the tier mover off it; a
full write queue or no SSD space means the block is not written (counted), never a wait.
Which rule is the default is decided by measurement (bench/ssd_experiment.py).
"""

from __future__ import annotations

RULES = ("on-seal", "on-reuse", "off")


class SsdPlacement:
    def __init__(self, rule: str):
        if rule not in RULES:
            raise ValueError(f"unknown SSD write policy {rule!r}: expected one of {', '.join(RULES)}")
        self.rule = rule

    @property
    def on_seal(self) -> bool:
        return self.rule == "on-seal"

    @property
    def on_reuse(self) -> bool:
        return self.rule == "on-reuse"

    def __repr__(self) -> str:
        return f"SsdPlacement({self.rule!r})"
