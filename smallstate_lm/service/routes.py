"""The rescoring service's HTTP side (FastAPI): `create_app(settings)` and `serve(settings)`.

The one module of the service that knows HTTP: routes, middleware, error handlers and their
status codes, uvicorn. A route validates its body (pydantic), turns it into work (inputs.py:
limits, lattice parsing, token counts), awaits the batcher, which runs compute.py on the worker
thread, and builds its response from the schemas' models. The model is loaded in the lifespan;
the event loop never runs model code.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from smallstate_lm.errors import ConfigError, SmallstateError

from .batcher import Batcher, Job
from .compute import Compute, LMTotal, RankedHypothesis, Result, Work
from .errors import ServiceError, Unavailable
from .inputs import rescore_work, score_work
from .metrics import Metrics
from .schemas import (
    ErrorResponse,
    LMScore,
    ModelsResponse,
    RescoreRequest,
    RescoreResponse,
    ScoredHypothesis,
    ScoreRequest,
    ScoreResponse,
    SentenceScore,
    TokenLogprobs,
    Usage,
    UtteranceResult,
    WeightsOut,
)
from .settings import Settings

log = logging.getLogger("smallstate_lm.service")
PROTECTED = frozenset({"/rescore", "/score", "/v1/models", "/metrics"})
ROUTES = frozenset({"/rescore", "/score", "/healthz", "/readyz", "/metrics", "/v1/models", "/docs", "/redoc",
                    "/openapi.json", "/docs/oauth2-redirect"})
ARRIVAL = "smallstate.arriving"  # scope key: the request is counted in Service.arriving
INLINE_WORDS = 1000  # words (roughly) a request may have to be prepared on the event loop
INLINE_HYPOTHESES = 100  # and hypotheses its answer may have to be built there too (~0.5 ms)
ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "Malformed JSON."), (401, "Missing or wrong API key."), (413, "Body over max_body_bytes."),
    (422, "Invalid request, or over a limit: `field` names the part, `limit` the limit."),
    (503, "Overloaded (queue full) or shutting down; see Retry-After."))}


class Service:
    """What the routes share: settings, metrics, the compute module and its batcher, and the
    readiness flags (ready after load + warm-up; draining after SIGTERM)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.compute = Compute(settings, self.metrics)
        self.arriving = 0  # scoring requests received, not yet queued (see ArrivalMiddleware)
        self.batcher = Batcher(self.compute.run_batch, batching=settings.batching,
                               max_batch_cost=settings.max_batch_tokens, max_wait_s=settings.max_wait_ms / 1000,
                               max_queue=settings.max_queue, metrics=self.metrics,
                               arriving=(lambda: self.arriving) if settings.wait_for_arrivals else None)
        self.ready = False
        self.draining = False

    async def start(self) -> None:
        t0 = time.perf_counter()
        # The worker thread loads the model: it is the thread that will use it (and the GPU).
        await self.batcher.call(self.compute.load)
        jobs = [Job(w.cost, w) for w in await run_in_threadpool(self.compute.warmup)]

        def answered(job, result) -> None:
            if isinstance(result, BaseException):  # e.g. an n-gram-only server without the warm-up words
                log.info("warm-up request answered: %s", result)

        await self.batcher.call(self.compute.run_batch, jobs, answered)  # straight to the worker: no batching wait
        self.batcher.start()
        self.ready = True
        self.metrics.ready.set(1)
        log.info("model loaded and warmed up in %.1f s on %s", time.perf_counter() - t0, self.compute.device)

    async def stop(self) -> None:
        self.ready = False
        self.metrics.ready.set(0)
        await self.batcher.close()

    def set_draining(self) -> None:
        self.draining = True
        self.metrics.ready.set(0)

    def arrived(self, scope) -> None:
        """The request of `scope` stops counting as on its way in (once)."""
        if scope.pop(ARRIVAL, False):
            self.arriving -= 1

    async def submit(self, work: Work, scope) -> Result:
        if not self.ready:
            raise Unavailable("the model is still loading", retry_after=2)
        self.arrived(scope)  # no await between this and queueing: the collector sees one or the other
        return await self.batcher.submit(Job(work.cost, work))


async def _off_loop(inline: bool, fn: Callable, *args) -> Any:
    """`fn(*args)` in a thread-pool thread, or in place when `inline`: a small hypothesis list costs
    less to prepare or answer (~0.1 ms) than a thread hand-off does."""
    return fn(*args) if inline else await run_in_threadpool(fn, *args)


def _words(words: list | None, text: str | None) -> int:
    """About how many words a hypothesis has, without splitting its text."""
    return len(words) if words is not None else text.count(" ") + 1


# ---------------------------------------------------------------------------------------------
# Responses, from the schemas' models


def _hypothesis(h: RankedHypothesis, token_logprobs: bool) -> ScoredHypothesis:
    optional: dict[str, Any] = {}  # left unset, these fields stay out of the JSON
    if h.expected_errors is not None:
        optional["expected_errors"] = h.expected_errors
    if token_logprobs:
        optional["token_logprobs"] = TokenLogprobs(neural=h.neural_tok, ngram=h.ngram_tok)
    return ScoredHypothesis(id=h.id, words=h.words, rank=h.rank, total=h.total, am=h.am, graph=h.graph,
                            neural=h.neural, ngram=h.ngram, penalty=h.penalty, n_words=h.n_words, n_oov=h.n_oov,
                            **optional)


def _rescore_response(result: Result, body: RescoreRequest) -> RescoreResponse:
    utterances = []
    for u in result.items:
        token_logprobs = body.return_token_logprobs and u.source == "hypotheses"  # lattices have none
        hyps = [_hypothesis(h, token_logprobs) for h in u.hypotheses]
        utterances.append(UtteranceResult(id=u.utt, source=u.source, best=hyps[0], hypotheses=hyps))
    return RescoreResponse(utterances=utterances, weights=WeightsOut(**dataclasses.asdict(result.weights)),
                           usage=Usage(**dataclasses.asdict(result.counts)))


def _score_response(result: Result, body: ScoreRequest) -> ScoreResponse:
    def lm(t: LMTotal | None) -> LMScore | None:
        if t is None:
            return None
        optional = {"token_logprobs": t.token_logprobs} if body.return_token_logprobs else {}
        return LMScore(logprob=t.logprob, perplexity=t.perplexity, **optional)

    sentences = [SentenceScore(words=s.words, tokens=s.tokens, n_oov=s.n_oov, neural=lm(s.neural), ngram=lm(s.ngram))
                 for s in result.items]
    return ScoreResponse(sentences=sentences, usage=Usage(**dataclasses.asdict(result.counts)))


def _json(model: BaseModel) -> Response:
    """The model's fields that were given (optional parts left out), as compact UTF-8 JSON."""
    try:
        data = json.dumps(model.model_dump(exclude_unset=True), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")
    except ValueError:  # an overflow to inf/NaN from extreme (but finite) lattice costs
        raise ServiceError("a score is not finite: the input's scores or costs are too large", "utterances") from None
    return Response(data, media_type="application/json")


# ---------------------------------------------------------------------------------------------
# Middleware (pure ASGI)


def _error_body(detail: str, kind: str, field: str | None = None, limit: int | float | None = None,
                errors: list[dict] | None = None) -> dict:
    """The ErrorResponse shape. A dict rather than the model: the model's float `limit` would turn
    an integer limit into 5.0."""
    body: dict[str, Any] = {"detail": detail, "type": kind}
    for key, value in (("field", field), ("limit", limit), ("errors", errors)):
        if value is not None:
            body[key] = value
    return body


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
        route = scope["path"] if scope["path"] in ROUTES else "other"  # unknown paths would blow up the label set
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
        self.svc.arriving += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if ARRIVAL in scope:  # refused before it was queued (validation, limits)
                self.svc.arrived(scope)
                self.svc.batcher.poke()


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or by counting a chunked body, before any parsing."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = _error_body(f"request body is over the limit of {self.limit} bytes (max_body_bytes)",
                              "limit_exceeded", "body", self.limit)
        for k, v in scope["headers"]:
            if k == b"content-length":
                if not v.isdigit():
                    return await _send_json(send, 400, _error_body("bad Content-Length header", "bad_request"))
                if int(v) > self.limit:
                    return await _send_json(send, 413, too_big, [(b"connection", b"close")])
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_json(send, 413, too_big, [(b"connection", b"close")])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on the protected routes, compared in constant time."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] in PROTECTED:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = _error_body("missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                   "unauthorized")
                return await _send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# Error handlers


def _field(loc) -> str:
    """('body', 'utterances', 0, 'hypotheses') -> 'utterances[0].hypotheses'."""
    out = ""
    for part in loc:
        if part == "body" and not out:
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
        return _error(400, _error_body(f"body: malformed JSON ({first['message']})", "bad_request", "body",
                                       errors=errors))
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    return _error(422, _error_body(f"{first['field']}: {first['message']}", "invalid_request", first["field"],
                                   errors=errors))


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    status = 503 if isinstance(exc, Unavailable) else 422
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return _error(status, _error_body(exc.message, exc.kind, exc.field, exc.limit), headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404, 405, a body that cannot be decoded) in the service's error shape."""
    kind = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return _error(exc.status_code, _error_body(detail, kind), getattr(exc, "headers", None))


async def _user_error(request: Request, exc: SmallstateError) -> JSONResponse:
    return _error(422, _error_body(str(exc), "invalid_request"))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, _error_body(f"internal error ({type(exc).__name__}); this is a bug, it has been logged",
                                   "internal_error"))


# ---------------------------------------------------------------------------------------------
# The app


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    svc = Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="smallstate-lm", version="0.1.0", lifespan=lifespan,
                  description="N-best and lattice rescoring with a small-state neural LM and a KenLM n-gram. "
                  "All scores are natural logarithms (higher is better).")
    app.state.service = svc
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(SmallstateError, _user_error)
    app.add_exception_handler(Exception, _internal_error)
    # Added innermost first: metrics see everything, the key is checked before a body is read.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key)
    app.add_middleware(ArrivalMiddleware, svc=svc)
    app.add_middleware(MetricsMiddleware, metrics=svc.metrics)
    _add_routes(app, svc)
    return app


def _add_routes(app: FastAPI, svc: Service) -> None:
    @app.post("/rescore", response_model=RescoreResponse, responses=ERRORS)
    async def rescore(body: RescoreRequest, request: Request) -> Response:
        """Rescore n-best lists and/or lattices; per utterance the hypotheses ranked by total (natural log)."""
        lattice = any(u.lattice is not None for u in body.utterances)
        words = 0 if lattice else sum(_words(h.words, h.text) for u in body.utterances for h in u.hypotheses)
        inline = not lattice and words <= INLINE_WORDS
        work = await _off_loop(inline, rescore_work, body, svc.compute, svc.settings)
        result = await svc.submit(work, request.scope)
        inline = inline and result.counts.hypotheses <= INLINE_HYPOTHESES
        return await _off_loop(inline, lambda: _json(_rescore_response(result, body)))

    @app.post("/score", response_model=ScoreResponse, responses=ERRORS)
    async def score(body: ScoreRequest, request: Request) -> Response:
        """Natural-log probability, token count and perplexity of sentences under each loaded LM."""
        inline = sum(_words(None, t) for t in body.sentences) <= INLINE_WORDS
        work = await _off_loop(inline, score_work, body, svc.compute, svc.settings)
        result = await svc.submit(work, request.scope)
        inline = inline and result.counts.hypotheses <= INLINE_HYPOTHESES
        return await _off_loop(inline, lambda: _json(_score_response(result, body)))

    @app.get("/healthz")
    async def healthz() -> dict:
        """The process is up (says nothing about the model)."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "Loading or draining."}})
    async def readyz() -> JSONResponse:
        """200 once the model is loaded and warmed up; 503 while loading and after SIGTERM."""
        if svc.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not svc.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(svc.metrics.exposition(), media_type=svc.metrics.content_type)

    @app.get("/v1/models", response_model=ModelsResponse, responses={503: {"model": ErrorResponse}})
    async def models() -> ModelsResponse:
        """The loaded neural LM and n-gram, device, default weights, lattice and batching settings."""
        if not svc.ready:
            raise Unavailable("the model is still loading", retry_after=2)
        return ModelsResponse.model_validate(svc.compute.info)


# ---------------------------------------------------------------------------------------------
# Running it


def serve(settings: Settings) -> None:
    """Run the service in this process until SIGTERM/SIGINT. SIGTERM: /readyz turns 503 for
    `drain_seconds`, then the listener closes, in-flight requests finish (up to
    `graceful_timeout_s`), the model is released and the process exits with status 0."""
    for key in ("lm", "ngram", "weights"):
        path = getattr(settings, key)
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"--{key} {path}: no such file or directory")
    logger = logging.getLogger("smallstate_lm")
    if not logger.handlers:  # uvicorn configures its own loggers only
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if settings.log_level == "trace" else settings.log_level.upper())
    app = create_app(settings)
    svc: Service = app.state.service
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            lifespan="on", timeout_graceful_shutdown=settings.graceful_timeout_s)
    server = _Server(config, svc, settings.drain_seconds)
    # uvicorn re-raises the signal it handled once it is done; for SIGTERM that would kill the process
    # after a clean shutdown, so the handler it restores is a no-op.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise ConfigError("the service did not start (see the log above)")


class _Server(uvicorn.Server):
    """uvicorn's server with a drain period: the first SIGTERM marks the service as
    draining (readiness probes fail, requests are still served) and only after
    `drain_seconds` starts uvicorn's graceful shutdown."""

    def __init__(self, config, svc: Service, drain_seconds: float):
        super().__init__(config)
        self.svc, self.drain_seconds = svc, drain_seconds

    def handle_exit(self, sig, frame) -> None:
        first = not self.svc.draining
        self.svc.set_draining()
        if first and sig == signal.SIGTERM and self.drain_seconds > 0:
            log.info("SIGTERM: draining for %.1f s, then shutting down", self.drain_seconds)
            timer = threading.Timer(self.drain_seconds, super().handle_exit, (sig, None))
            timer.daemon = True
            timer.start()
            return
        super().handle_exit(sig, frame)
