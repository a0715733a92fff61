"""Exceptions of the metaserver client. Catch ``MetaServerError`` for all of them.

``MetaServerUnavailable`` (and ``DeadlineExceeded``) mean "no answer now": the
index is only a hint, so a caller treats them as "no remote holder known".
"""

from __future__ import annotations


class MetaServerError(Exception):
    """Base of every error the metaserver client raises."""


class MetaServerUnavailable(MetaServerError):
    """The metaserver cannot be reached."""


class DeadlineExceeded(MetaServerUnavailable):
    """The call did not complete within its deadline."""


class InvalidArgument(MetaServerError):
    """The request was malformed (the metaserver or the client's own check said so)."""


class LeaseLost(MetaServerError):
    """The metaserver does not know this node lease (expired or replaced): register again and republish."""


class ResourceExhausted(MetaServerError):
    """The metaserver refused the request for lack of room (e.g. too many nodes registered)."""


class ServerError(MetaServerError):
    """The metaserver failed internally."""


class NotLeader(MetaServerError):
    """The replica asked is not the serving leader; ``leader_address`` names the one it knows ("" if none)."""

    def __init__(self, message: str, leader_address: str = "", term: int = 0) -> None:
        super().__init__(message)
        self.leader_address = leader_address
        self.term = term


class StaleIncarnation(MetaServerError):
    """A newer incarnation of this node holds the registration (this process is a zombie of an old start)."""
