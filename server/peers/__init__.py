"""Moving sealed blocks' bytes from another node's DRAM into this node's pool (the remote tier's
transports). The seam and its contracts are in base.py; README.md shows how the parts fit."""
