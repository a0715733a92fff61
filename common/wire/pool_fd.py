"""The fd broker's handshake: how a local client proves its session and receives the pool's fd.

Server end ``pegaflow.server.endpoints.fd_broker``, client end ``pegaflow.client.pool_map``.
One connection per client session, kept open for the session's life (its close is the
session's end)::

    client -> server   b"PEGAFLOW-POOL 1 <session_id>\\n"       (at most MAX_HELLO_BYTES, within the
                                                              server's handshake timeout)
    server -> client   b'{"epoch": ..., "size_bytes": ..., "hugepages": ...}\\n' + the fd (SCM_RIGHTS)
                   or  b'{"error": "..."}\\n' and the connection is closed

No checksum: the bytes never leave the host's kernel (a Unix socket).
"""

from __future__ import annotations

import json

MAGIC = b"PEGAFLOW-POOL 1 "
MAX_HELLO_BYTES = 256


def encode_hello(session_id: str) -> bytes:
    return MAGIC + session_id.encode("ascii") + b"\n"


def parse_hello(line: bytes) -> str:
    """The session id of a handshake line (without its newline); ValueError if it is not one."""
    if len(line) > MAX_HELLO_BYTES or not line.startswith(MAGIC):
        raise ValueError("bad handshake: expected 'PEGAFLOW-POOL 1 <session_id>'")
    try:
        return line[len(MAGIC) :].decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError("bad handshake: session id is not ASCII") from None


def encode_header(fields: dict) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def encode_error(reason: str) -> bytes:
    return json.dumps({"error": reason}).encode() + b"\n"
