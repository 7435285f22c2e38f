"""The endpoints. A scoring route reads its body, turns it into work (`inputs`: limits, cost
estimates, lattice parsing), waits for the worker's result through the service's batcher and
answers with the response built from it; the status routes answer from the service's state."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..errors import ServiceError
from ..schemas import (
    ErrorResponse,
    ModelsResponse,
    RescoreRequest,
    RescoreResponse,
    ScoreRequest,
    ScoreResponse,
    SessionId,
    SessionIn,
    SessionOut,
)
from .bodies import off_loop, parse_body, read_raw
from .errors import ERRORS
from .inputs import rescore_work, score_work
from .responses import answer, rescore_response, score_response
from .results import result
from .state import Service

INLINE_WORDS = 1000  # words (roughly) a request may have to be prepared on the event loop
# A valid body up to this size is decoded and prepared on the event loop (~50 ms for 2 MB of lists or lattices):
# in a thread it shares the interpreter with the loop turn by turn, and a near-limit request refused anyway took
# twice as long or more under load (docs/service.md, "Processes"). Larger ones, and any pydantic must word, in a
# thread.
PREPARE_IN_PLACE_BYTES = 4 * 2**20
INLINE_HYPOTHESES = 100  # and hypotheses its answer may have to be built there too (~0.5 ms)


def add_routes(app: FastAPI, svc: Service) -> None:
    _add_scoring_routes(app, svc)
    _add_status_routes(app, svc)


def _add_scoring_routes(app: FastAPI, svc: Service) -> None:
    @app.post("/rescore", response_model=RescoreResponse, responses=ERRORS)
    async def rescore(request: Request) -> Response:
        """Rescore n-best lists and/or lattices; per utterance the hypotheses ranked by total (natural log).
        Header `X-Request-Timeout` (seconds) may shorten the server's deadline. With `session`, the one utterance
        is rescored after the session's last transcripts, and its own is kept for the next request."""
        timeout = svc.timeout(request)
        raw = await read_raw(request)
        size, in_place = len(raw), len(raw) <= PREPARE_IN_PLACE_BYTES
        body = await parse_body(raw, RescoreRequest, in_place)
        if body.session is None:
            return await _rescore(request, body, timeout, size, in_place)
        _check_session_request(body)
        lease, context = await svc.acquire(request, body.session, timeout)
        said = None
        try:
            body.utterances[0].context = [" ".join(words) for words in context] or None
            response, said = await _rescore(request, body, timeout, size, in_place, transcript=True)
            return response
        finally:
            svc.release(request, body.session, lease, said)

    async def _rescore(request: Request, body: RescoreRequest, timeout: float, size: int, in_place: bool,
                       transcript: bool = False):
        lattice = any(u.lattice is not None for u in body.utterances)
        words = 0 if lattice else sum(_words(h.words, h.text) for u in body.utterances for h in u.hypotheses)
        inline = not lattice and words <= INLINE_WORDS
        # a large request's lists are checked against its deadline before they are built; a small one's cost
        # less to build than to check twice
        early = None if inline else svc.early_checks(request, timeout, "utterances")
        work = await off_loop(inline or in_place, rescore_work, body, svc.models, svc.settings, early)
        scored = await svc.submit(work, request, timeout)
        inline = inline and work.hypotheses <= INLINE_HYPOTHESES
        if not transcript:
            return await answer(inline, lambda: rescore_response(result(svc.models, work, scored), body), size)
        done = result(svc.models, work, scored)
        return await answer(inline, lambda: rescore_response(done, body), size), _transcript(done.items[0])

    @app.post("/v1/sessions", response_model=SessionOut, status_code=201, responses=ERRORS)
    async def create_session(request: Request) -> JSONResponse:
        """A session: a stream of utterances (one per /rescore request naming it) each rescored after the last
        `context_utts` transcripts chosen for the ones before. It is the API key's, and ends when deleted or
        after session_ttl_s without a request."""
        body, _ = await _read(request, SessionIn)
        k = svc.settings.session_context_utts if body.context_utts is None else body.context_utts
        return JSONResponse(await svc.session("create", request, body.id, k=k), status_code=201)

    @app.get("/v1/sessions/{session}", response_model=SessionOut, responses=ERRORS)
    async def describe_session(session: SessionId, request: Request) -> JSONResponse:
        """The session's transcripts kept, and how long it has left."""
        return JSONResponse(await svc.session("describe", request, session))

    @app.delete("/v1/sessions/{session}", status_code=204, responses=ERRORS)
    async def delete_session(session: SessionId, request: Request) -> Response:
        """End the session now (its waiting requests are answered 404)."""
        await svc.session("delete", request, session)
        return Response(status_code=204)

    @app.post("/score", response_model=ScoreResponse, responses=ERRORS)
    async def score(request: Request) -> Response:
        """Natural-log probability, token count and perplexity of sentences under each loaded LM.
        Header `X-Request-Timeout` (seconds) may shorten the server's deadline."""
        timeout = svc.timeout(request)
        body, size = await _read(request, ScoreRequest)
        inline = sum(_words(None, t) for t in body.sentences) <= INLINE_WORDS
        work = await off_loop(inline, score_work, body, svc.models, svc.settings)
        scored = await svc.submit(work, request, timeout)
        inline = inline and work.hypotheses <= INLINE_HYPOTHESES
        return await answer(inline, lambda: score_response(result(svc.models, work, scored), body), size)


def _add_status_routes(app: FastAPI, svc: Service) -> None:
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
        if not svc.serving():
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
            raise svc.unavailable()
        info = svc.models.info
        return ModelsResponse.model_validate({**info, "cost_model": {**info.get("cost_model", {}),
                                                                     "lattice_ratio": svc.lattice_ratio}})


def _check_session_request(body: RescoreRequest) -> None:
    if len(body.utterances) != 1:
        raise ServiceError(f"a request of a session holds one utterance, the next one said (got "
                           f"{len(body.utterances)}); send the others as the session's next requests", "utterances")
    if body.utterances[0].context is not None:
        raise ServiceError("give either 'session' (whose last transcripts are the context) or 'context', not both",
                           "utterances[0].context")


def _transcript(item) -> list[str]:
    """What a session keeps of a rescored utterance: a lattice's transcript, a list's best hypothesis."""
    if item.transcript is not None:
        return list(item.transcript.words)
    return list(item.hypotheses[0].words) if item.hypotheses else []


async def _read(request: Request, model: type) -> tuple:
    """The request's body parsed, and its size in bytes."""
    raw = await read_raw(request)
    return await parse_body(raw, model), len(raw)


def _words(words: list | None, text: str | None) -> int:
    """About how many words a hypothesis has, without splitting its text."""
    return len(words) if words is not None else text.count(" ") + 1
