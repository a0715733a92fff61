"""Exceptions of the pegaflow client. Catch ``PegaflowError`` for all of them.

``ServerUnavailable`` (and its subclasses) means "treat as a cache miss and go
on": the client is already reconnecting in the background. The others mean the
request itself was wrong or refers to something that no longer exists.
"""

from __future__ import annotations


class PegaflowError(Exception):
    """Base of every error this client raises."""


class ServerUnavailable(PegaflowError):
    """The server cannot be reached (or our session with it is gone); a background reconnect is under way."""


class DeadlineExceeded(ServerUnavailable):
    """The call did not complete within its deadline."""


class SessionLost(ServerUnavailable):
    """The server no longer knows our session (it restarted, or we were silent past the TTL)."""


class InvalidArgument(PegaflowError):
    """The server (or the client's own check) rejected the request as malformed."""


class NotFound(PegaflowError):
    """An unknown or expired instance, lease or save. ``kind`` says which."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


class StaleEpoch(PegaflowError):
    """A location or view from an earlier pool mapping (the server restarted since)."""


class ResourceExhausted(PegaflowError):
    """The server cannot serve this request at all (e.g. message too large)."""


class ServerError(PegaflowError):
    """The server failed internally or refused the request for another reason."""
