"""Errors the service answers with a status code of their own (never 500)."""

from __future__ import annotations

from smallstate_lm.errors import SmallstateError


class ServiceError(SmallstateError):
    """An error for the client: HTTP `status`, the request `field` it is about (a path
    like `utterances[0].hypotheses[3].words`) and, for limits, the `limit`."""

    status = 422
    kind = "invalid_request"

    def __init__(self, message: str, field: str | None = None, limit: int | float | None = None,
                 status: int | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.limit = limit
        self.retry_after = retry_after
        if status is not None:
            self.status = status

    def body(self) -> dict:
        out: dict = {"detail": self.message, "type": self.kind}
        if self.field is not None:
            out["field"] = self.field
        if self.limit is not None:
            out["limit"] = self.limit
        return out


class LimitError(ServiceError):
    """A request is over one of the configured limits."""

    kind = "limit_exceeded"


class Unavailable(ServiceError):
    """Overloaded, loading or shutting down: try again later (503 + Retry-After)."""

    status = 503
    kind = "unavailable"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, retry_after=retry_after)
