"""The endpoints. A scoring route reads its body, turns it into work (`inputs`: limits, cost
estimates, lattice parsing), waits for the worker's result through the service's batcher and
answers with the response built from it; the status routes answer from the service's state."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..schemas import ErrorResponse, ModelsResponse, RescoreRequest, RescoreResponse, ScoreRequest, ScoreResponse
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
        Header `X-Request-Timeout` (seconds) may shorten the server's deadline."""
        timeout = svc.timeout(request)
        raw = await read_raw(request)
        size, in_place = len(raw), len(raw) <= PREPARE_IN_PLACE_BYTES
        body = await parse_body(raw, RescoreRequest, in_place)
        lattice = any(u.lattice is not None for u in body.utterances)
        words = 0 if lattice else sum(_words(h.words, h.text) for u in body.utterances for h in u.hypotheses)
        inline = not lattice and words <= INLINE_WORDS
        # a large request's lists are checked against its deadline before they are built; a small one's cost
        # less to build than to check twice
        early = None if inline else svc.early_checks(request, timeout, "utterances")
        work = await off_loop(inline or in_place, rescore_work, body, svc.models, svc.settings, early)
        scored = await svc.submit(work, request, timeout)
        inline = inline and work.hypotheses <= INLINE_HYPOTHESES
        return await answer(inline, lambda: rescore_response(result(svc.models, work, scored), body), size)

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


async def _read(request: Request, model: type) -> tuple:
    """The request's body parsed, and its size in bytes."""
    raw = await read_raw(request)
    return await parse_body(raw, model), len(raw)


def _words(words: list | None, text: str | None) -> int:
    """About how many words a hypothesis has, without splitting its text."""
    return len(words) if words is not None else text.count(" ") + 1
