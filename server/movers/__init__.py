"""Movers run the transfers the block store plans, off the engine lock (tier_io.py)."""
