"""Everything that crosses a process boundary, defined once for both ends.

`types.py` holds the value types with proto numbers (AllocStatus, Tier, QueryPurpose,
Location). Byte formats (frames, records) live beside it, one module each, each with
its magic, version and checksum. Imports nothing from the server, the client or the
connector, so any of them may import it.
"""
