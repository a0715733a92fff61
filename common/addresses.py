"""Listen addresses as HOST:PORT text.

Parsing stays with each daemon's config (the server and the metaserver accept
different spellings); formatting the address actually bound is the same for both.
"""

from __future__ import annotations


def format_host_port(host: str, port: int) -> str:
    """``host``, ``port`` -> ``host:port``, an IPv6 host in brackets (``[::1]:50055``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
