"""The fast way in for request bodies: the request schemas as msgspec Structs, decoded and checked in
about a sixth of pydantic's time (a 2 MB list of 256 n-best lists: 11 + 6 ms against 66 ms), which a
server on two cores spends on every large body before it can even refuse it.

The pydantic models of `schemas` stay the contract (the OpenAPI document, every error's wording):
a body is taken here only when it is certainly valid, and anything these Structs or the checks
below do not accept goes to pydantic, which then accepts it or words the error. So this module may
be stricter than the schemas, never more lenient; tests/test_decode.py holds the two side by side.

The Structs are untracked by the cycle collector (`gc=False`: they hold strings, numbers and lists
only), so that decoding a large body does not set off full collections.

A hypothesis's words have their length checked by msgspec as it decodes them (in C); whitespace is looked for
in all the request's words joined into one string: one C scan, where a pattern per word costs more than the
whole decode."""

from __future__ import annotations

import itertools
from typing import Annotated, Literal, Optional, Union

import msgspec

from ..schemas import MAX_ABS_SCORE, MAX_ABS_WEIGHT, MAX_WORD_CHARS

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Score = Annotated[float, msgspec.Meta(ge=-MAX_ABS_SCORE, le=MAX_ABS_SCORE)]
Weight = Annotated[float, msgspec.Meta(ge=-MAX_ABS_WEIGHT, le=MAX_ABS_WEIGHT)]
SymbolId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Word = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_WORD_CHARS)]  # whitespace: `_no_space`


class HypothesisIn(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    am_score: Score
    id: Optional[Id] = None
    text: Optional[str] = None
    words: Optional[list[Word]] = None
    graph_score: Score = 0.0


class LatticeIn(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    format: Literal["openfst-text", "htk-slf"]
    data: Annotated[str, msgspec.Meta(min_length=1)]
    words: Optional[dict[str, SymbolId]] = None


class UtteranceIn(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: Id
    hypotheses: Optional[Annotated[list[HypothesisIn], msgspec.Meta(min_length=1)]] = None
    lattice: Optional[LatticeIn] = None
    context: Optional[Union[str, list[str]]] = None


class WeightsIn(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    am_scale: Optional[Weight] = None
    graph_scale: Optional[Weight] = None
    lm_weight: Optional[Weight] = None
    ngram_weight: Optional[Weight] = None
    word_penalty: Optional[Weight] = None
    oov_penalty: Optional[Weight] = None
    interpolation: Optional[Literal["loglinear", "linear"]] = None
    lam: Optional[Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]] = None
    mbr_scale: Optional[Annotated[float, msgspec.Meta(ge=0.0, le=MAX_ABS_WEIGHT)]] = None
    posterior_scale: Optional[Annotated[float, msgspec.Meta(gt=0.0, le=MAX_ABS_WEIGHT)]] = None
    decode: Optional[Literal["viterbi", "mbr"]] = None

    def model_dump(self, exclude_none: bool = False) -> dict:
        """The overrides given, as pydantic's model would list them."""
        d = msgspec.structs.asdict(self)
        return {k: v for k, v in d.items() if v is not None} if exclude_none else d


class RescoreRequest(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    utterances: Annotated[list[UtteranceIn], msgspec.Meta(min_length=1)]
    weights: Optional[WeightsIn] = None
    nbest: Optional[Annotated[int, msgspec.Meta(ge=1)]] = None
    return_token_logprobs: bool = False
    session: Optional[Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]] = None


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    sentences: Annotated[list[str], msgspec.Meta(min_length=1)]
    return_token_logprobs: bool = False


Request = Union[RescoreRequest, ScoreRequest]
_DECODERS = {name: msgspec.json.Decoder(t) for name, t in (("RescoreRequest", RescoreRequest),
                                                           ("ScoreRequest", ScoreRequest))}


def decode(kind: str, raw: bytes, words: bool = True) -> Request | None:
    """`raw` as the request of `kind` ("RescoreRequest" or "ScoreRequest", the schema's name) when it is
    certainly valid; None when pydantic must decide (and word the error). `words=False` leaves the words'
    own checks (non-empty, no whitespace, at most MAX_WORD_CHARS) out: the structure and types are checked
    (each utterance a list or a lattice, each hypothesis words or text)."""
    if kind not in _DECODERS:  # small bodies (a session's): pydantic's way only
        return None
    try:
        body = _DECODERS[kind].decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    if isinstance(body, RescoreRequest):
        return body if _rescore_ok(body, words) else None
    return body if not words or all(_text_ok(s) for s in body.sentences) else None


def _rescore_ok(body: RescoreRequest, words: bool = True) -> bool:
    """Each utterance a list or a lattice, each hypothesis words or text; and, with `words`, the words' own checks
    (a hypothesis's words' lengths were checked as they were decoded)."""
    lists = []  # every hypothesis's `words`, checked together
    symbols = []  # and every lattice's symbol table's
    for u in body.utterances:
        if (u.hypotheses is None) == (u.lattice is None):
            return False
        if words and u.context is not None and not all(map(_text_ok, [u.context] if isinstance(u.context, str)
                                                               else u.context)):
            return False
        if u.lattice is not None:
            if words and u.lattice.words is not None:
                symbols.append(list(u.lattice.words))
            continue
        for h in u.hypotheses:
            if h.words is None:
                if h.text is None or (words and not _text_ok(h.text)):
                    return False
            elif h.text is not None:
                return False
            elif words:
                lists.append(h.words)
    if not words:
        return True
    return _words_ok(list(itertools.chain.from_iterable(symbols))) and _no_space(itertools.chain.from_iterable(lists))


def _words_ok(words: list[str]) -> bool:
    """Every word non-empty, at most MAX_WORD_CHARS characters, without whitespace (`schemas.Word`)."""
    if not words:
        return True
    if "" in words or max(map(len, words)) > MAX_WORD_CHARS:
        return False
    return _no_space(words)


def _no_space(words) -> bool:
    """No word holds whitespace: str.split's whitespace is the schema's (SPACES, str.isspace), found in one
    C scan several times faster than a search by pattern."""
    joined = "".join(words)
    return not joined or joined.split(maxsplit=1) == [joined]


def _text_ok(text: str) -> bool:
    """Whitespace-separated words of at most MAX_WORD_CHARS characters each (`schemas.Words`)."""
    return len(text) <= MAX_WORD_CHARS or max(map(len, text.split()), default=0) <= MAX_WORD_CHARS
