"""Request bodies: JSON only, parsed and validated against the request models, on the event loop
when small and in a thread-pool thread otherwise. A valid body takes the fast way (`decode`); any
other goes through pydantic, whose errors FastAPI answers (400 malformed JSON, 422 invalid), made
readable here."""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..schemas import NO_SPACE
from . import decode

INLINE_BYTES = 32 * 1024  # bodies parsed on the event loop (~1 ms); larger ones in a thread
TOO_DEEP = [{"type": "json_invalid", "loc": ("body",),
             "msg": "nested too deeply (expected the request's own few levels)"}]


async def off_loop(inline: bool, fn: Callable, *args) -> Any:
    """`fn(*args)` in a thread-pool thread, or in place when `inline`: a small hypothesis list costs
    less to prepare or answer (~0.1 ms) than a thread hand-off does."""
    return fn(*args) if inline else await run_in_threadpool(fn, *args)


async def read_raw(request: Request) -> bytes:
    """The request's body, unparsed.
    Only JSON is read: a browser sends text/plain and form bodies to any origin without asking
    first, so accepting them would let any web page make a local service do work."""
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):
        raise HTTPException(415, f"Content-Type {content_type or '(none)'!r}: expected application/json")
    return await request.body()


async def parse_body(raw: bytes, model: type[BaseModel], inline: bool = False) -> BaseModel | decode.Request:
    """The body as `model`, or as its `decode` twin when valid (parsed in a thread unless small, or `inline`: a
    valid body decoded in place; one that needs pydantic, which may take a second for 10 MiB, always in a thread)."""
    small = len(raw) <= INLINE_BYTES
    if not (small or inline):
        return await run_in_threadpool(_decode, model, raw)
    body = decode.decode(model.__name__, raw)
    return body if body is not None else await off_loop(small, _parse, model, raw)


def _decode(model: type[BaseModel], raw: bytes) -> BaseModel | decode.Request:
    body = decode.decode(model.__name__, raw)
    return body if body is not None else _parse(model, raw)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    """A request body as `model`, with FastAPI's errors (400 malformed JSON, 422 invalid). On a
    thread for large bodies: parsing and validating 10 MiB holds the interpreter for a second.

    pydantic's own JSON parser shares one str object among the repeats of a word: a large body
    makes a few thousand strings instead of millions, and fragments the heap far less. What it
    refuses (NaN, lone surrogates) goes through the standard parser, for FastAPI's answers."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        if not any(err["type"] == "json_invalid" for err in e.errors()):
            raise RequestValidationError(_body_errors(e)) from None
    try:
        data = json.loads(raw)
    except ValueError as e:  # not JSON, or bytes in no JSON encoding
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": str(e)}]) from None
    except RecursionError:  # arrays or objects nested thousands deep: no request of ours is
        raise RequestValidationError(TOO_DEEP) from None
    try:
        bad = _lone_surrogate(data, ("body",))
        if bad is not None:
            raise RequestValidationError([{"type": "value_error", "loc": bad, "input": None,
                                           "msg": "must be valid Unicode text (it holds a lone surrogate)"}])
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(_body_errors(e)) from None
    except RecursionError:
        raise RequestValidationError(TOO_DEEP) from None


def _lone_surrogate(data: Any, loc: tuple) -> tuple | None:
    """Where in `data` (parsed JSON) a string or key holds a lone surrogate, which nothing downstream (KenLM, the
    response) can encode; None when nowhere. pydantic's own parser refuses them, so only bodies it refused come
    here."""
    if isinstance(data, str):
        return None if data.isascii() or _encodable(data) else loc
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        if isinstance(key, str) and not _encodable(key):
            return loc  # the key itself could not be echoed back
        found = _lone_surrogate(value, (*loc, key))
        if found is not None:
            return found
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _body_errors(e: ValidationError) -> list[dict]:
    return [_readable({**err, "loc": ("body", *err["loc"])}) for err in e.errors(include_url=False)]


def _readable(err: dict) -> dict:
    """A word's whitespace check says so, not which character class it failed."""
    if err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NO_SPACE:
        return {**{k: v for k, v in err.items() if k != "ctx"}, "msg": "a word may not contain whitespace"}
    return err
