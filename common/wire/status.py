"""Status codes on pegaflow's local sockets: gRPC's own numbers, one table for every codec.

The local RPC socket and the GPU doorbell both carry a call's outcome as the number of its
``grpc.StatusCode`` (OK 0, INVALID_ARGUMENT 3, DEADLINE_EXCEEDED 4, NOT_FOUND 5, ...), and a
NOT_FOUND names what was unknown under ``NOT_FOUND_METADATA_KEY`` exactly as the gRPC trailing
metadata does. So a client maps an answer from any transport with the one function it uses for
gRPC (client/rpc_codec.translate), and a server answers with the status its engine error names
(server/errors.py ``EngineError.status``).
"""

from __future__ import annotations

import grpc

# The trailing-metadata key of a NOT_FOUND answer: "session", "instance", "lease", "save", ...
NOT_FOUND_METADATA_KEY = "pegaflow-not-found"

BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def number(code: grpc.StatusCode) -> int:
    return code.value[0]


def from_number(value: int) -> grpc.StatusCode:
    """The status a number names; UNKNOWN for a number gRPC does not define."""
    return BY_NUMBER.get(value, grpc.StatusCode.UNKNOWN)
