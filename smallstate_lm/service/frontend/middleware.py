"""The service's middleware, pure ASGI so that it sees every request, errors raised below it
included: request metrics, the count of requests on their way in (which the batcher waits for),
the API key, and the body's size and arrival limits."""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from ..metrics import Metrics
from .errors import error_body
from .state import ARRIVAL, T0, Service

PROTECTED = frozenset({"/rescore", "/score", "/v1/models", "/metrics", "/v1/sessions"})
ROUTES = frozenset({"/rescore", "/score", "/healthz", "/readyz", "/metrics", "/v1/models", "/docs", "/redoc",
                    "/openapi.json", "/docs/oauth2-redirect", "/v1/sessions"})
SESSIONS = "/v1/sessions/"  # a session's own path: protected, and one label in the metrics


def route_of(path: str) -> str:
    """The route a path counts under (its session's path under /v1/sessions)."""
    return "/v1/sessions" if path.startswith(SESSIONS) else path


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class MetricsMiddleware:
    """Counts and times every HTTP request (pure ASGI, so errors raised below it count as 500)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_of(scope["path"])
        route = route if route in ROUTES else "other"  # unknown paths would blow up the label set
        status = 500
        t0 = time.perf_counter()

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        gauge = self.metrics.in_progress.labels(route)
        gauge.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            gauge.dec()
            self.metrics.observe_request(route, scope["method"], status, time.perf_counter() - t0)


class ArrivalMiddleware:
    """Counts scoring requests from their first byte until they are queued, so that the
    batcher waits for requests already on their way in and never for ones that may not come."""

    def __init__(self, app, svc: Service):
        self.app, self.svc = app, svc

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ("/rescore", "/score"):
            return await self.app(scope, receive, send)
        scope[ARRIVAL] = True
        scope[T0] = time.perf_counter()
        self.svc.receive()
        try:
            await self.app(scope, receive, send)
        finally:
            if ARRIVAL in scope:  # refused before it was queued (validation, limits)
                self.svc.arrived(scope)


class BodyLimitMiddleware:
    """Reads the whole body before any parsing: 413 for bodies over the limit (by Content-Length, or
    counting a chunked body), 408 for one that does not arrive within body_timeout_s (a stalled or
    trickled upload), 503 when the service starts shutting down meanwhile."""

    def __init__(self, app, svc: Service):
        self.app, self.svc = app, svc
        self.limit, self.timeout_s = svc.settings.max_body_bytes, svc.settings.body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length":
                if not v.isdigit():
                    return await _send_json(send, 400, error_body("bad Content-Length header", "bad_request"))
                if int(v) > self.limit:
                    return await _send_json(send, 413, self._too_big(), [(b"connection", b"close")])
        read = await self._read(receive)
        if read is None:  # the client left
            return
        if isinstance(read, tuple):
            return await _send_json(send, *read, [(b"connection", b"close")])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(read), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_big(self) -> dict:
        return error_body(f"request body is over the limit of {self.limit} bytes (max_body_bytes)",
                          "limit_exceeded", "body", self.limit)

    async def _read(self, receive) -> list[bytes] | tuple[int, dict] | None:
        """The body's chunks; (status, error body) when it is too big or too slow; None when the client left."""
        deadline = time.perf_counter() + self.timeout_s
        chunks, size = [], 0
        while True:
            pending = asyncio.ensure_future(receive())
            if not await self.svc.wait_any({pending}, deadline):
                pending.cancel()
                if time.perf_counter() < deadline:
                    return 503, error_body("the service is shutting down; retry on another replica", "unavailable")
                return 408, error_body(f"the request body did not arrive within {self.timeout_s:g} s "
                                       f"(body_timeout_s)", "request_timeout", "body", self.timeout_s)
            message = pending.result()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return 413, self._too_big()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on the protected routes, compared in constant time."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and route_of(scope["path"]) in PROTECTED:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body("missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  "unauthorized")
                return await _send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)
