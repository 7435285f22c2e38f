"""The rescoring service's HTTP side (FastAPI): `create_app(settings)` and `serve(settings)`.

The one module of the service that knows HTTP: routes, middleware, error handlers and their
status codes, uvicorn. A route parses and validates its body (pydantic; in a thread when large),
turns it into work (inputs.py: limits, cost estimates, lattice parsing, token counts), awaits the
batcher, which runs compute.py on the worker thread, and builds its response from the schemas'
models. Each request has a deadline; a deadline passed, a client gone or a shutdown stops its
work. Heads and bodies that do not arrive in time get 408. The model is loaded (and self-checked)
in the lifespan; the event loop never runs model code.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import hmac
import json
import logging
import math
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
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from uvicorn.lifespan.on import LifespanOn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from smallstate_lm.errors import ConfigError, SmallstateError

from .batcher import Batcher, Job
from .compute import Compute, LMTotal, RankedHypothesis, Result, Work
from .errors import ClientGone, CostLimitError, DeadlineExceeded, ServiceError, Unavailable
from .inputs import rescore_work, score_work
from .metrics import Metrics
from .schemas import (
    NO_SPACE,
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
T0 = "smallstate.t0"  # scope key: when the request arrived (time.perf_counter); its deadline counts from it
TIMEOUT_HEADER = "x-request-timeout"
INLINE_BYTES = 32 * 1024  # bodies parsed on the event loop (~1 ms); larger ones in a thread
INLINE_WORDS = 1000  # words (roughly) a request may have to be prepared on the event loop
INLINE_HYPOTHESES = 100  # and hypotheses its answer may have to be built there too (~0.5 ms)
# Freed memory is handed back to the OS after a request body this large, and when the worker goes idle with the
# process this much larger than after warm-up: the allocator keeps what a burst freed otherwise.
LARGE_BYTES = 2**20
# A request is admitted when its predicted seconds times this fit in what is left of its deadline: the worker
# turns to newer requests between its steps, so a long request gets less than all of it.
HEADROOM = 1.5
# A long request waits for the long work ahead of it and its own work times this: its class gets every other slice
# while small requests flow (2), and the predictions of lattices are rough (2).
LONG_WAIT = 4.0
RELEASE_GROWTH = 64 * 2**20
ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "Malformed JSON."), (401, "Missing or wrong API key."),
    (408, "The body did not arrive within body_timeout_s."),
    (413, "Body over max_body_bytes; estimated cost over max_trie_nodes / max_lattice_cost; predicted seconds or "
          "bytes over max_request_seconds / max_request_bytes, or hypothesis lists that cannot meet the deadline."),
    (415, "Body not sent as application/json."),
    (422, "Invalid request, or over a limit: `field` names the part, `limit` the limit."),
    (503, "Overloaded (queue full, or more work queued ahead than the deadline allows), out of memory for this "
          "request, not ready, or shutting down; see Retry-After."),
    (504, "No answer within the deadline (X-Request-Timeout, at most request_timeout_s); the work was stopped."))}


class Service:
    """What the routes share: settings, metrics, the compute module and its batcher, the
    readiness flags (ready after load + warm-up; draining after SIGTERM; failed when the model
    did not load or failed its self-check) and, once shutting down, the time by which every
    request must be answered."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.compute = Compute(settings, self.metrics)
        self.arriving = 0  # scoring requests received, not yet queued (see ArrivalMiddleware)
        self.batcher = Batcher(self.compute.run_batch, batching=settings.batching,
                               max_batch_cost=settings.max_batch_tokens, max_wait_s=settings.max_wait_ms / 1000,
                               max_queue=settings.max_queue, slice_s=settings.slice_ms / 1000, metrics=self.metrics,
                               arriving=(lambda: self.arriving) if settings.wait_for_arrivals else None,
                               on_idle=self._idle)
        self.ready = False
        self.draining = False
        self.failed: str | None = None  # why the model may not serve, once known
        self.stop_at = math.inf  # once shutting down: when every request gets its answer (perf_counter seconds)
        self.stopping = asyncio.Event()
        self.rss_base = 0  # the process's size after warm-up
        self._releasing = False

    async def start(self) -> None:
        t0 = time.perf_counter()
        try:
            # The worker thread loads the model: it is the thread that will use it (and the GPU).
            await self.batcher.call(self.compute.load)
        except SmallstateError as e:  # a bad checkpoint, or finite weights whose scores are not (self-check)
            self.failed = str(e)
            log.error("refusing to become ready: the model failed to load or its self-check: %s", e)
            return
        jobs = [Job(w.cost, w) for w in await run_in_threadpool(self.compute.warmup)]

        def answered(job, result) -> None:
            if isinstance(result, BaseException):  # e.g. an n-gram-only server without the warm-up words
                log.info("warm-up request answered: %s", result)

        await self.batcher.run_now(jobs, answered)  # straight to the worker: no batching wait
        await run_in_threadpool(_release_memory)
        # What is alive now (model, vocabulary, n-gram, the app) lives as long as the process: out of the cyclic
        # collector's generations, a full collection scans requests' objects only, not a 100+ ms walk of the
        # whole heap in whichever thread (the event loop's too) happens to trigger it.
        gc.freeze()
        self.rss_base = _rss_bytes()
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

    def begin_shutdown(self, stop_at: float) -> None:
        """Every request in flight gets its answer by `stop_at` (perf_counter seconds): its result,
        or 503; new ones get 503 at once."""
        self.stop_at = stop_at
        self.stopping.set()
        self.batcher.begin_shutdown(stop_at)

    def _idle(self, cost: int) -> None:
        """The worker has nothing to do: when the work since it was last idle left the process well above its
        size after warm-up (a large lattice's states, a long list's activations), the memory goes back."""
        if _rss_bytes() > self.rss_base + RELEASE_GROWTH:
            self.release_memory()

    def release_memory(self) -> None:
        """Hand freed memory back to the OS (one at a time), on the worker's thread: it exists already, where
        a new thread may not be had when memory is short, which is when this matters most."""
        if self._releasing:
            return
        self._releasing = True

        def done(_) -> None:
            self._releasing = False

        self.batcher.aside(_release_memory).add_done_callback(done)

    def arrived(self, scope) -> None:
        """The request of `scope` stops counting as on its way in (once)."""
        if scope.pop(ARRIVAL, False):
            self.arriving -= 1

    def timeout(self, request: Request) -> float:
        """The request's time budget in seconds: X-Request-Timeout, at most request_timeout_s."""
        limit = self.settings.request_timeout_s
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return limit
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise ServiceError(f"X-Request-Timeout must be a positive number of seconds, got {raw[:40]!r}",
                               f"headers.{TIMEOUT_HEADER}")
        return min(value, limit)

    async def wait_any(self, waiters: set, deadline: float) -> set:
        """The done ones of `waiters`; empty when `deadline` (perf_counter seconds) or, once
        shutting down, the stop time passes first."""
        while True:
            done = {w for w in waiters if w.done()}
            remaining = min(deadline, self.stop_at) - time.perf_counter()
            if done or remaining <= 0:
                return done
            # a shutdown that begins meanwhile brings the deadline forward
            stopping = set() if self.stopping.is_set() else {asyncio.ensure_future(self.stopping.wait())}
            try:
                await asyncio.wait(waiters | stopping, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in stopping:
                    task.cancel()

    async def submit(self, work: Work, request: Request, timeout: float) -> Result:
        """Queue the request's work and wait for its result until its deadline (its arrival +
        `timeout`) or the shutdown's; a deadline passed, a client gone or a shutdown stops its work."""
        if not self.ready:
            raise Unavailable("the model failed its start-up check" if self.failed else "the model is still loading",
                              retry_after=2)
        deadline = request.scope.get(T0, time.perf_counter()) + timeout
        # its class by what it may take (a lattice's upper bound), its place in the backlog by what it should take
        job = Job(work.cost, work, deadline=min(deadline, self.stop_at), seconds=self.compute.expected_seconds(work),
                  long=work.seconds > self.batcher.slice_s)
        self._admit(job, work, deadline - time.perf_counter(), timeout)
        self.arrived(request.scope)  # no await between this and queueing: the collector sees one or the other
        future = self.batcher.submit(job)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done = await self.wait_any({future, gone}, deadline)
        except asyncio.CancelledError:
            self.batcher.cancel(job)
            raise
        finally:
            gone.cancel()
        if future in done:
            return future.result()
        self.batcher.cancel(job)
        reason = "disconnect" if gone in done else "deadline" if time.perf_counter() >= deadline else "shutdown"
        self.metrics.cancelled.labels(reason).inc()
        if reason == "disconnect":
            raise ClientGone("the client closed the connection; its work was stopped")
        if reason == "shutdown":
            raise Unavailable("the service is shutting down; retry on another replica", retry_after=1)
        raise DeadlineExceeded(f"no answer within the request's deadline of {timeout:g} s (X-Request-Timeout, at "
                               f"most request_timeout_s); its work was stopped", limit=timeout)


    def _admit(self, job: Job, work: Work, remaining: float, timeout: float) -> None:
        """Refuse at once, before any work, a request whose answer cannot come in time: alone (413) or
        behind the work already queued (503 with Retry-After). Hypothesis lists are predicted closely and
        must fit in their deadline with room for the other requests that share the worker (HEADROOM);
        lattices only have an upper bound, and count as the share of it that this server's lattices
        took so far. A request of one slice is always let in (small requests never wait for long ones),
        and so is a long one on an idle worker: its own estimate is checked above, as far as it is
        reliable."""
        field = "sentences" if work.kind == "score" else "utterances"
        lists = work.seconds - work.lattice_seconds
        if lists * HEADROOM > remaining:
            raise CostLimitError(f"the request's hypothesis lists would take about {lists:.1f} s on this server "
                                 f"(predicted by its cost model), more than its deadline allows ({remaining:.1f} s "
                                 f"left of {timeout:g} s, of which the worker shares a part with other requests)",
                                 field, timeout)
        own = job.seconds
        if not job.long:
            return
        backlog = self.batcher.backlog(long=True)
        busy = backlog > self.batcher.slice_s or self.batcher.backlog(long=False) > self.batcher.slice_s
        if busy and (backlog + own) * LONG_WAIT > remaining:
            raise Unavailable(f"overloaded: the work queued ahead needs about {backlog:.1f} s and this request "
                              f"about {own:.1f} s, more than its deadline allows ({remaining:.1f} s left); retry "
                              "later", retry_after=max(1, math.ceil(backlog)))


async def _disconnected(receive) -> None:
    """Returns once the client has closed the connection (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a stray message: never spin


async def _off_loop(inline: bool, fn: Callable, *args) -> Any:
    """`fn(*args)` in a thread-pool thread, or in place when `inline`: a small hypothesis list costs
    less to prepare or answer (~0.1 ms) than a thread hand-off does."""
    return fn(*args) if inline else await run_in_threadpool(fn, *args)


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


TOO_DEEP = [{"type": "json_invalid", "loc": ("body",),
             "msg": "nested too deeply (expected the request's own few levels)"}]


def _body_errors(e: ValidationError) -> list[dict]:
    return [_readable({**err, "loc": ("body", *err["loc"])}) for err in e.errors(include_url=False)]


def _readable(err: dict) -> dict:
    """A word's whitespace check says so, not which character class it failed."""
    if err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NO_SPACE:
        return {**{k: v for k, v in err.items() if k != "ctx"}, "msg": "a word may not contain whitespace"}
    return err


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _rss_bytes() -> int:
    """The process's resident size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _release_memory() -> None:
    """Hand the memory a large request freed back to the OS (after its response, in a thread):
    the allocator keeps freed pages for reuse, and the process would stay at its peak size."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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
        scope[T0] = time.perf_counter()
        self.svc.arriving += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if ARRIVAL in scope:  # refused before it was queued (validation, limits)
                self.svc.arrived(scope)
                self.svc.batcher.poke()


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
                    return await _send_json(send, 400, _error_body("bad Content-Length header", "bad_request"))
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
        return _error_body(f"request body is over the limit of {self.limit} bytes (max_body_bytes)",
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
                    return 503, _error_body("the service is shutting down; retry on another replica", "unavailable")
                return 408, _error_body(f"the request body did not arrive within {self.timeout_s:g} s "
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


# Status codes of the service's own errors (the first class that matches); any other ServiceError is 422.
# 499 (nginx's "client closed request") only shows in the metrics: nobody is left to read it.
STATUS = ((Unavailable, 503), (CostLimitError, 413), (DeadlineExceeded, 504), (ClientGone, 499))


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    status = next((code for cls, code in STATUS if isinstance(exc, cls)), 422)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return _error(status, _error_body(exc.message, exc.kind, exc.field, exc.limit), headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404, 405, a body that cannot be decoded) in the service's error shape."""
    kind = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
            415: "unsupported_media_type"}.get(exc.status_code, "http_error")
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
        await svc.start()  # a model that fails to load or its self-check sets svc.failed: never ready
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
    app.add_middleware(BodyLimitMiddleware, svc=svc)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key)
    app.add_middleware(ArrivalMiddleware, svc=svc)
    app.add_middleware(MetricsMiddleware, metrics=svc.metrics)
    _add_routes(app, svc)
    app.openapi = functools.partial(_openapi, app)
    return app


# The routes parse their own bodies (off the event loop when large), so FastAPI does not see these models:
# the OpenAPI document gets them here.
REQUEST_MODELS = {"/rescore": RescoreRequest, "/score": ScoreRequest}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_MODELS.items():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _read(request: Request, model: type[BaseModel]) -> tuple[BaseModel, int]:
    """The request's body as `model` (parsed in a thread unless small) and its size in bytes.
    Only JSON is read: a browser sends text/plain and form bodies to any origin without asking
    first, so accepting them would let any web page make a local service do work."""
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):
        raise HTTPException(415, f"Content-Type {content_type or '(none)'!r}: expected application/json")
    raw = await request.body()
    return await _off_loop(len(raw) <= INLINE_BYTES, _parse, model, raw), len(raw)


async def _answer(svc: Service, inline: bool, build: Callable[[], Response], size: int) -> Response:
    """The response, built and encoded off the loop unless small; after a large request, once it is
    sent, the memory the request freed goes back to the OS."""
    response = await _off_loop(inline, build)
    if size > LARGE_BYTES:
        async def release() -> None:  # async: a BackgroundTask runs plain functions on a thread, without the loop
            svc.release_memory()

        response.background = BackgroundTask(release)
    return response


def _add_routes(app: FastAPI, svc: Service) -> None:
    @app.post("/rescore", response_model=RescoreResponse, responses=ERRORS)
    async def rescore(request: Request) -> Response:
        """Rescore n-best lists and/or lattices; per utterance the hypotheses ranked by total (natural log).
        Header `X-Request-Timeout` (seconds) may shorten the server's deadline."""
        timeout = svc.timeout(request)
        body, size = await _read(request, RescoreRequest)
        lattice = any(u.lattice is not None for u in body.utterances)
        words = 0 if lattice else sum(_words(h.words, h.text) for u in body.utterances for h in u.hypotheses)
        inline = not lattice and words <= INLINE_WORDS
        work = await _off_loop(inline, rescore_work, body, svc.compute, svc.settings)
        result = await svc.submit(work, request, timeout)
        inline = inline and result.counts.hypotheses <= INLINE_HYPOTHESES
        return await _answer(svc, inline, lambda: _json(_rescore_response(result, body)), size)

    @app.post("/score", response_model=ScoreResponse, responses=ERRORS)
    async def score(request: Request) -> Response:
        """Natural-log probability, token count and perplexity of sentences under each loaded LM.
        Header `X-Request-Timeout` (seconds) may shorten the server's deadline."""
        timeout = svc.timeout(request)
        body, size = await _read(request, ScoreRequest)
        inline = sum(_words(None, t) for t in body.sentences) <= INLINE_WORDS
        work = await _off_loop(inline, score_work, body, svc.compute, svc.settings)
        result = await svc.submit(work, request, timeout)
        inline = inline and result.counts.hypotheses <= INLINE_HYPOTHESES
        return await _answer(svc, inline, lambda: _json(_score_response(result, body)), size)

    @app.get("/healthz")
    async def healthz() -> dict:
        """The process is up (says nothing about the model)."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "Loading, failed or draining."}})
    async def readyz() -> JSONResponse:
        """200 once the model is loaded and warmed up; 503 while loading, after SIGTERM, and for good
        when the model failed to load or its self-check (`detail` says why)."""
        if svc.failed is not None:
            return JSONResponse({"status": "failed", "detail": svc.failed}, status_code=503)
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
            raise Unavailable("the model failed its start-up check" if svc.failed else "the model is still loading",
                              retry_after=2)
        info = svc.compute.info
        return ModelsResponse.model_validate({**info, "cost_model": {**info.get("cost_model", {}),
                                                                     "lattice_ratio": svc.compute.lattice_ratio}})


# ---------------------------------------------------------------------------------------------
# Running it


def serve(settings: Settings) -> None:
    """Run the service in this process until SIGTERM/SIGINT. SIGTERM: /readyz turns 503 for
    `drain_seconds`, then the listener closes, in-flight requests finish or get 503 within
    `graceful_timeout_s`, the model is released and the process exits with status 0. A model
    that fails to load or its self-check: no port is opened, ConfigError."""
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
                            lifespan="on", timeout_graceful_shutdown=settings.graceful_timeout_s,
                            http=_timed_head_protocol(settings.header_timeout_s, svc.metrics))
    config.load()
    config.lifespan_class = _refusing_lifespan(svc)
    server = _Server(config, svc, settings.drain_seconds)
    # uvicorn re-raises the signal it handled once it is done; for SIGTERM that would kill the process
    # after a clean shutdown, so the handler it restores is a no-op.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit after a failed start-up
        if svc.failed is None:
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if svc.failed is not None:
        raise ConfigError(f"the service refused to become ready: {svc.failed}")
    if not server.started:
        raise ConfigError("the service did not start (see the log above)")


def _timed_head_protocol(timeout_s: float, metrics: Metrics) -> type:
    """uvicorn's HTTP protocol with a deadline on every request's head: a connection whose head has
    not arrived `timeout_s` after its first byte (or after it opened) gets 408 and is closed.
    uvicorn times out idle keep-alive connections, but not a head sent slowly or stalled half-way."""
    text = json.dumps(_error_body(f"the request head did not arrive within {timeout_s:g} s (header_timeout_s)",
                                  "request_timeout")).encode()
    reply = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n%s" % (len(text), text))

    class TimedHead(AutoHTTPProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._reading_head():
                if self._head_timer is None:  # the first bytes of the next request on this connection
                    self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _reading_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._reading_head() and not self.transport.is_closing():
                metrics.header_timeouts.inc()
                self.transport.write(reply)
                self.transport.close()

    return TimedHead


def _refusing_lifespan(svc: Service) -> type:
    """uvicorn's lifespan, failing the start-up when the service refused to become ready: uvicorn
    then opens no port and exits; the log holds our one line, not a traceback."""

    class RefusingLifespan(LifespanOn):
        async def send(self, message) -> None:
            if message["type"] == "lifespan.startup.complete" and svc.failed is not None:
                message = {"type": "lifespan.startup.failed", "message": ""}
            await super().send(message)

        async def startup(self) -> None:
            await super().startup()
            if self.startup_failed and svc.failed is not None:  # let the app's lifespan end: the worker stops
                await self.receive_queue.put({"type": "lifespan.shutdown"})
                await self.shutdown_event.wait()

    return RefusingLifespan


class _Server(uvicorn.Server):
    """uvicorn's server with a drain period and a bounded shutdown: the first SIGTERM marks the
    service as draining (readiness probes fail, requests are still served) and only after
    `drain_seconds` starts uvicorn's graceful shutdown, in which every request in flight is
    answered (its result or 503) a little before uvicorn's own timeout would cancel it (a 500)."""

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

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown or 0.0
        # The margin leaves time to send the answers before uvicorn's timeout.
        self.svc.begin_shutdown(time.perf_counter() + max(0.0, grace - min(0.5, grace / 4)))
        await super().shutdown(sockets)
