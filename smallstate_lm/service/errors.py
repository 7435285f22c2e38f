"""Errors the service answers with an error body of their own (never a 500). They say what went
wrong and where (`field`, `limit`); http/errors.py alone decides the status code of each class."""

from __future__ import annotations

from smallstate_lm.errors import SmallstateError


class ServiceError(SmallstateError):
    """An error for the client: the request `field` it is about (a path like
    `utterances[0].hypotheses[3].words`) and, for limits, the `limit`. `kind` is the
    error body's `type`."""

    kind = "invalid_request"

    def __init__(self, message: str, field: str | None = None, limit: int | float | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.limit = limit
        self.retry_after = retry_after  # seconds after which a retry may succeed


class LimitError(ServiceError):
    """A request is over one of the configured limits."""

    kind = "limit_exceeded"


class Unavailable(ServiceError):
    """Overloaded, loading or shutting down: try again after `retry_after` seconds."""

    kind = "unavailable"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, retry_after=retry_after)


class CostLimitError(LimitError):
    """The estimated cost of a request (trie nodes, lattice steps) is over its limit: refused before any work."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before its answer was ready; its work was stopped."""

    kind = "deadline_exceeded"


class ClientGone(ServiceError):
    """The client closed the connection before its answer was ready; its work was stopped."""

    kind = "client_disconnected"
