"""Responses from results: the schemas' models built from the worker's `Result`, encoded as compact
JSON (off the event loop unless small), with the memory a large request freed handed back once the
response is sent."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from fastapi.responses import Response
from pydantic import BaseModel
from starlette.background import BackgroundTask

from ..errors import ServiceError
from ..results import LMTotal, RankedHypothesis, Result
from ..schemas import (
    LMScore,
    RescoreRequest,
    RescoreResponse,
    ScoredHypothesis,
    ScoreRequest,
    ScoreResponse,
    SentenceScore,
    TokenLogprobs,
    Transcript,
    Usage,
    UtteranceResult,
    WeightsOut,
)
from .bodies import off_loop
from .state import Service

# After a request body this large, freed memory goes back to the OS: the allocator keeps what it freed otherwise.
LARGE_BYTES = 2**20


async def answer(svc: Service, inline: bool, build: Callable[[], Response], size: int) -> Response:
    """The response, built and encoded off the loop unless small; after a large request (`size` bytes),
    once it is sent, the memory the request freed goes back to the OS."""
    response = await off_loop(inline, build)
    if size > LARGE_BYTES:
        async def release() -> None:  # async: a BackgroundTask runs plain functions on a thread, without the loop
            svc.release_memory()

        response.background = BackgroundTask(release)
    return response


def rescore_response(result: Result, body: RescoreRequest) -> Response:
    utterances = []
    for u in result.items:
        token_logprobs = body.return_token_logprobs and u.source == "hypotheses"  # lattices have none
        hyps = [_hypothesis(h, token_logprobs) for h in u.hypotheses]
        optional = {}  # left unset, the transcript stays out of a list's JSON
        if u.transcript is not None:
            optional["transcript"] = Transcript(decode=result.weights.decode, words=u.transcript.words,
                                                confidences=u.transcript.confidences)
        utterances.append(UtteranceResult(id=u.utt, source=u.source, best=hyps[0], hypotheses=hyps, **optional))
    return _json(RescoreResponse(utterances=utterances, weights=WeightsOut(**dataclasses.asdict(result.weights)),
                                 usage=Usage(**dataclasses.asdict(result.counts))))


def score_response(result: Result, body: ScoreRequest) -> Response:
    def lm(t: LMTotal | None) -> LMScore | None:
        if t is None:
            return None
        optional = {"token_logprobs": t.token_logprobs} if body.return_token_logprobs else {}
        return LMScore(logprob=t.logprob, perplexity=t.perplexity, **optional)

    sentences = [SentenceScore(words=s.words, tokens=s.tokens, n_oov=s.n_oov, neural=lm(s.neural), ngram=lm(s.ngram))
                 for s in result.items]
    return _json(ScoreResponse(sentences=sentences, usage=Usage(**dataclasses.asdict(result.counts))))


def _hypothesis(h: RankedHypothesis, token_logprobs: bool) -> ScoredHypothesis:
    optional: dict[str, Any] = {}  # left unset, these fields stay out of the JSON
    if h.expected_errors is not None:
        optional["expected_errors"] = h.expected_errors
    if h.confidences is not None:
        optional["confidences"] = h.confidences
    if token_logprobs:
        optional["token_logprobs"] = TokenLogprobs(neural=h.neural_tok, ngram=h.ngram_tok)
    return ScoredHypothesis(id=h.id, words=h.words, rank=h.rank, total=h.total, am=h.am, graph=h.graph,
                            neural=h.neural, ngram=h.ngram, penalty=h.penalty, n_words=h.n_words, n_oov=h.n_oov,
                            **optional)


def _json(model: BaseModel) -> Response:
    """The model's fields that were given (optional parts left out), as compact UTF-8 JSON."""
    try:
        data = json.dumps(model.model_dump(exclude_unset=True), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")
    except ValueError:  # an overflow to inf/NaN from extreme (but finite) lattice costs
        raise ServiceError("a score is not finite: the input's scores or costs are too large", "utterances") from None
    return Response(data, media_type="application/json")
