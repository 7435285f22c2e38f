"""The HTTP side of errors: the one error body (`ErrorResponse`'s shape) and the status code of
every error, from the service's own (`service/errors.py`), the library's, FastAPI's validation and
Starlette's; and the error responses the OpenAPI document lists."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from smallstate_lm.errors import SmallstateError

from ..errors import ClientGone, CostLimitError, DeadlineExceeded, ServiceError, Unavailable
from ..schemas import ErrorResponse
from ..sessions import SessionExists, SessionNotFound, TooManySessions

log = logging.getLogger("smallstate_lm.service")
ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "Malformed JSON."), (401, "Missing or wrong API key."),
    (408, "The body did not arrive within body_timeout_s."),
    (413, "Body over max_body_bytes; estimated cost over max_trie_nodes / max_lattice_cost; predicted seconds or "
          "bytes over max_request_seconds / max_request_bytes, or hypothesis lists that cannot meet the deadline."),
    (404, "Unknown or expired session."), (409, "A session of that id exists already."),
    (415, "Body not sent as application/json."),
    (422, "Invalid request, or over a limit: `field` names the part, `limit` the limit."),
    (429, "max_sessions sessions are open."),
    (503, "Overloaded (queue full, or more work queued ahead than the deadline allows), out of memory for this "
          "request, not ready, or shutting down; see Retry-After."),
    (504, "No answer within the deadline (X-Request-Timeout, at most request_timeout_s); the work was stopped."))}
# Status codes of the service's own errors (the first class that matches); any other ServiceError is 422.
# 499 (nginx's "client closed request") only shows in the metrics: nobody is left to read it.
STATUS = ((Unavailable, 503), (CostLimitError, 413), (DeadlineExceeded, 504), (ClientGone, 499),
          (SessionNotFound, 404), (SessionExists, 409), (TooManySessions, 429))


def error_body(detail: str, kind: str, field: str | None = None, limit: int | float | None = None,
               errors: list[dict] | None = None) -> dict:
    """The ErrorResponse shape. A dict rather than the model: the model's float `limit` would turn
    an integer limit into 5.0."""
    body: dict[str, Any] = {"detail": detail, "type": kind}
    for key, value in (("field", field), ("limit", limit), ("errors", errors)):
        if value is not None:
            body[key] = value
    return body


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(SmallstateError, _user_error)
    app.add_exception_handler(Exception, _internal_error)


def _field(loc) -> str:
    """('body', 'utterances', 0, 'hypotheses') -> 'utterances[0].hypotheses'. A union's member tags in the path
    ('list[...]', 'function-after[...]': no field has brackets in its name) are left out."""
    out = ""
    for part in loc:
        if (part == "body" and not out) or (isinstance(part, str) and "[" in part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


class _AsciiJSON(JSONResponse):
    """Error bodies may quote client text; ASCII escapes make any of it encodable."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return _AsciiJSON(body, status_code=status, headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"field": _field(e.get("loc", ())), "message": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in exc.errors()]
    if any(e["type"] == "json_invalid" for e in errors):
        first = next(e for e in errors if e["type"] == "json_invalid")
        return _error(400, error_body(f"body: malformed JSON ({first['message']})", "bad_request", "body",
                                      errors=errors))
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    return _error(422, error_body(f"{first['field']}: {first['message']}", "invalid_request", first["field"],
                                  errors=errors))


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    status = next((code for cls, code in STATUS if isinstance(exc, cls)), 422)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return _error(status, error_body(exc.message, exc.kind, exc.field, exc.limit), headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404, 405, a body that cannot be decoded) in the service's error shape."""
    kind = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
            415: "unsupported_media_type"}.get(exc.status_code, "http_error")
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return _error(exc.status_code, error_body(detail, kind), getattr(exc, "headers", None))


async def _user_error(request: Request, exc: SmallstateError) -> JSONResponse:
    return _error(422, error_body(str(exc), "invalid_request"))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, error_body(f"internal error ({type(exc).__name__}); this is a bug, it has been logged",
                                  "internal_error"))
