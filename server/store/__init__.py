"""The blocks: index over every tier, eviction, placement, promotion planning (block_store.py); stats."""
