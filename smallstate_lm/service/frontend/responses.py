"""Responses from results: JSON built directly from the worker's `Result` in the shape of the schemas'
response models (which stay the routes' documented contract) and encoded by msgspec, off the event
loop unless small, with the memory a large request freed handed back once the response is sent."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import msgspec
import numpy as np
from fastapi.responses import Response
from starlette.background import BackgroundTask

from ..errors import ServiceError
from ..memory import release_memory
from ..schemas import WeightsOut
from .bodies import off_loop
from .results import Counts, LMTotal, RankedHypothesis, Result

# After a request body this large, freed memory goes back to the OS: the allocator keeps what it freed otherwise.
LARGE_BYTES = 2**20
WEIGHT_FIELDS = tuple(WeightsOut.model_fields)
USAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Counts))


def _plain(obj):
    """numpy scalars as the Python values they hold (msgspec encodes only the builtin types; a numpy value that
    reaches a response must not turn it into a 500)."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"{type(obj).__name__} cannot be written as JSON")


_ENCODER = msgspec.json.Encoder(enc_hook=_plain)


async def answer(inline: bool, build: Callable[[], Response], size: int) -> Response:
    """The response, built and encoded off the loop unless small; after a large request (`size` bytes),
    once it is sent, the memory the request freed goes back to the OS."""
    response = await off_loop(inline, build)
    if size > LARGE_BYTES:
        response.background = BackgroundTask(release_memory)  # a plain function: run on a thread, off the loop
    return response


def rescore_response(result: Result, body) -> Response:
    """The response's JSON built directly from the result, field for field what RescoreResponse's
    `model_dump(exclude_unset=True)` gives (its schema stays the route's contract): the pydantic
    models and their dump cost more than the scoring of a small request."""
    utterances = []
    for u in result.items:
        token_logprobs = body.return_token_logprobs and u.source == "hypotheses"  # lattices have none
        hyps = [_hypothesis(h, token_logprobs) for h in u.hypotheses]
        out = {"id": u.utt, "source": u.source, "best": hyps[0], "hypotheses": hyps}
        if u.transcript is not None:  # left out, the transcript stays out of a list's JSON
            out["transcript"] = {"decode": result.weights.decode, "words": u.transcript.words,
                                 "confidences": _finite(u.transcript.confidences)}
        utterances.append(out)
    return _json({"utterances": utterances, "weights": _weights(result.weights), "usage": _usage(result.counts)})


def score_response(result: Result, body) -> Response:
    def lm(t: LMTotal | None) -> dict | None:
        if t is None:
            return None
        out = {"logprob": t.logprob, "perplexity": t.perplexity}
        _finite((t.logprob, t.perplexity))
        if body.return_token_logprobs:
            out["token_logprobs"] = _finite(t.token_logprobs)
        return out

    sentences = [{"words": s.words, "tokens": s.tokens, "n_oov": s.n_oov, "neural": lm(s.neural), "ngram": lm(s.ngram)}
                 for s in result.items]
    return _json({"sentences": sentences, "usage": _usage(result.counts)})


def _hypothesis(h: RankedHypothesis, token_logprobs: bool) -> dict:
    _finite((h.total, h.am, h.graph, h.penalty, h.neural or 0.0, h.ngram or 0.0, h.expected_errors or 0.0))
    out = {"id": h.id, "words": h.words, "rank": h.rank, "total": h.total, "am": h.am, "graph": h.graph,
           "neural": h.neural, "ngram": h.ngram, "penalty": h.penalty, "n_words": h.n_words, "n_oov": h.n_oov}
    # left out when unset, as the schema's optional fields are
    if h.expected_errors is not None:
        out["expected_errors"] = h.expected_errors
    if h.confidences is not None:
        out["confidences"] = _finite(h.confidences)
    if token_logprobs:
        out["token_logprobs"] = {"neural": _finite(h.neural_tok), "ngram": _finite(h.ngram_tok)}
    return out


# Field by field: dataclasses.asdict deep-copies every value, which costs a small request more than its ranking.
def _weights(w) -> dict:
    return {k: getattr(w, k) for k in WEIGHT_FIELDS}


def _usage(c: Counts) -> dict:
    return {k: getattr(c, k) for k in USAGE_FIELDS}


def _finite(values):
    """`values` (None passes), when every one is finite; else the request's scores overflowed (extreme but
    finite lattice costs): JSON has no inf or NaN, and msgspec would write them as null."""
    if values is not None and not math.isfinite(sum(values)) and not all(map(math.isfinite, values)):
        raise ServiceError("a score is not finite: the input's scores or costs are too large", "utterances")
    return values


def _json(data: dict) -> Response:
    return Response(_ENCODER.encode(data), media_type="application/json")
