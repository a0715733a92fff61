"""Errors the engine raises; each stands for one status code.

The engine knows nothing of gRPC: these are plain exceptions, so an embedded
user (the connector running the engine in-process) gets the same meaning. Each
kind names its status (``status``, a gRPC status code name) in one place, which
both wires read: the gRPC servicer and the GPU doorbell.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to a caller."""

    status = "UNKNOWN"


class InvalidArgument(EngineError):
    """Malformed input: wrong sizes, counts, empty or oversized fields."""

    status = "INVALID_ARGUMENT"


class NotFound(EngineError):
    """Unknown or expired session / instance / lease / save.

    ``kind`` says which, so a client can tell "my session is gone" (open a new
    one) from "this lease expired" (just a miss).
    """

    status = "NOT_FOUND"

    def __init__(self, kind: str, ident: str):
        super().__init__(f"unknown or expired {kind} {ident!r}")
        self.kind = kind
        self.ident = ident


class ResourceExhausted(EngineError):
    """The request can never be served (e.g. more blocks than the pool holds)."""

    status = "RESOURCE_EXHAUSTED"


class FailedPrecondition(EngineError):
    """The request contradicts server state."""

    status = "FAILED_PRECONDITION"


class DeadlineExceeded(EngineError):
    """The caller's deadline passed before the work could be done."""

    status = "DEADLINE_EXCEEDED"


class Closed(EngineError):
    """The engine has been closed."""

    status = "UNAVAILABLE"


class PoolCapacityError(Exception):
    """The machine cannot back the requested pool (raised at start, before anything is allocated)."""
