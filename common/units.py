"""Human sizes, durations and listen addresses, parsed strictly: one definition for every part.

"512mb", "30gb", "1tb"; "250ms", "15m", "24h"; "127.0.0.1:50055", "[::1]:50055". A typo is an
error, never a silent default. The server's flags (server/config.py) and the connector's
``kv_connector_extra_config`` (connector/config.py) read the same spellings; the connector imports
this, not the server's config, so a vLLM process loads no server code.
"""

from __future__ import annotations

import re

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

_SIZE_UNITS = {
    "b": 1,
    "k": KIB,
    "kb": KIB,
    "kib": KIB,
    "m": MIB,
    "mb": MIB,
    "mib": MIB,
    "g": GIB,
    "gb": GIB,
    "gib": GIB,
    "t": TIB,
    "tb": TIB,
    "tib": TIB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def parse_size(text: str) -> int:
    """Bytes from a human size. Units are binary (1gb = 2**30 bytes) and required: a bare
    "30" is more likely a forgotten "gb" than thirty bytes.

    Raises ValueError for anything else (no unit, negative, zero, unknown unit, garbage).
    """
    if not isinstance(text, str):
        raise ValueError(f"size must be a string like '30gb', got {text!r}")
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: expected a number and a unit, e.g. 512mb, 30gb, 1tb")
    number, unit = m.group(1), m.group(2).lower()
    if not unit:
        raise ValueError(f"invalid size {text!r}: a unit is required (b, kb, mb, gb or tb), e.g. {text}gb")
    if unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: unknown unit {m.group(2)!r} (use b, kb, mb, gb or tb)")
    value = float(number) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be greater than zero")
    return int(value)


def format_size(nbytes: int) -> str:
    for unit, scale in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def parse_duration(text: str) -> float:
    """Seconds from '250ms', '30s', '15m', '1h', '24h', '7d'. A unit is required."""
    m = _DURATION_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"invalid duration {text!r}: expected a number and one of ms, s, m, h, d (e.g. 15m)")
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: must be greater than zero")
    return seconds


def parse_host_port(text: str) -> tuple[str, int]:
    """'127.0.0.1:50055' / '[::1]:50055' / '0.0.0.0:0' -> (host, port). Port 0 binds an ephemeral port."""
    m = re.match(r"^\[([0-9a-fA-F:.]+)\]:(\d+)$", text) or re.match(r"^([^:\s]+):(\d+)$", text)
    if not m:
        raise ValueError(f"invalid address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50055")
    port = int(m.group(2))
    if port > 65535:
        raise ValueError(f"invalid address {text!r}: port out of range")
    return m.group(1), port
