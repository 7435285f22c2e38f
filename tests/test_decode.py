"""The fast request decoder beside the pydantic schemas it stands in for: whatever it accepts,
pydantic accepts with the same content (so the contract, errors included, stays pydantic's), and
the requests clients send every day do take the fast way."""

from __future__ import annotations

import copy
import json
import random
import re

import msgspec
import pytest
from pydantic import ValidationError

from smallstate_lm.service import schemas
from smallstate_lm.service.frontend import decode
from smallstate_lm.service.schemas import SPACES

HYP = {"id": "h0", "words": ["in", "the", "beginning"], "am_score": -12.5, "graph_score": -3.25}
FST = "0 1 in in 1.0,2.0\n1 2 the the 0.5,0.5\n2 0.0,0.0\n"
RESCORE = {"utterances": [{"id": "u1", "hypotheses": [HYP, {"text": "in a beginning", "am_score": -13}],
                           "context": "and god said"},
                          {"id": "u2", "lattice": {"format": "openfst-text", "data": FST,
                                                   "words": {"<eps>": 0, "in": 1, "the": 2}}}],
           "weights": {"lm_weight": 0.5, "interpolation": "linear", "lam": 0.25, "mbr_scale": 0, "decode": "mbr",
                       "posterior_scale": 0.7},
           "nbest": 3, "return_token_logprobs": True}
SCORE = {"sentences": ["in the beginning", "god created the heaven"], "return_token_logprobs": False}

# Values that stand in for a field's value: each is valid for some fields and invalid for others.
ODD_VALUES = [None, True, False, 0, 1, -1, 2.0, 0.5, 1e9, 1e9 + 1, -1e10, 2**31, 2**63, "", "x", "1", "a b", [],
              ["a"], ["a b"], [""], {}, {"a": 1}, "x" * 1001, ["x" * 1001], "w " + "x" * 1001, ["a\u3000b"],
              ["a\x1cb"], ["a\x85b"], ["a\u200bb"], ["a\x00b"], ["a\tb"], "openfst-text", "htk-slf", "linear",
              {"<eps>": 0, "a b": 1}, {"a": -1}, {"a": 2**31}, {"": 1}, "mbr", "viterbi"]


def _pydantic(model, raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        return None


def _same(fast, slow) -> bool:
    return msgspec.to_builtins(fast) == slow.model_dump()


def _check(model, raw: bytes) -> bool:
    """Whether `raw` takes the fast way; fails the test when the fast way accepts what pydantic does not,
    or decodes it differently."""
    fast = decode.decode(model.__name__, raw)
    if fast is None:
        return False
    slow = _pydantic(model, raw)
    assert slow is not None, f"the fast decoder accepted a body pydantic refuses: {raw[:300]!r}"
    assert _same(fast, slow), raw[:300]
    return True


def _paths(obj, path=()):
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _drop(obj, path):
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]


def test_the_requests_clients_send_take_the_fast_way():
    assert _check(schemas.RescoreRequest, json.dumps(RESCORE).encode())
    assert _check(schemas.ScoreRequest, json.dumps(SCORE).encode())
    slf_text = "N=2 L=1\nI=0\nI=1\nJ=0 S=0 E=1 W=a\n"
    slf = {"utterances": [{"id": "s", "lattice": {"format": "htk-slf", "data": slf_text}}]}
    assert _check(schemas.RescoreRequest, json.dumps(slf).encode())
    unicode = {"utterances": [{"id": "ü", "hypotheses": [{"words": ["日本", "naïve", "a\x00b"], "am_score": 0}]}]}
    assert _check(schemas.RescoreRequest, json.dumps(unicode, ensure_ascii=False).encode())


@pytest.mark.parametrize("model,base", [(schemas.RescoreRequest, RESCORE), (schemas.ScoreRequest, SCORE)],
                         ids=["rescore", "score"])
def test_every_field_replaced_or_dropped_is_never_accepted_where_pydantic_refuses(model, base):
    fast = 0
    cases = 0
    for path in list(_paths(base))[1:]:
        variants = [copy.deepcopy(base) for _ in ODD_VALUES]
        for body, value in zip(variants, ODD_VALUES):
            _set(body, path, value)
        dropped = copy.deepcopy(base)
        _drop(dropped, path)
        extra = copy.deepcopy(base)
        parent = path[:-1]
        target = extra
        for k in parent:
            target = target[k]
        if isinstance(target, dict):
            target["unexpected"] = 1
        for body in [*variants, dropped, extra]:
            cases += 1
            fast += _check(model, json.dumps(body).encode())
    assert cases > 100 and 0 < fast < cases


def test_every_whitespace_character_in_a_word_goes_to_pydantic_which_refuses_it():
    for ch in sorted({c for c in map(chr, range(0x3001)) if c.isspace()} | set("\u3000\u2028\u2029\u205f")):
        body = {"utterances": [{"id": "u", "hypotheses": [{"words": ["a", f"b{ch}c"], "am_score": 0}]}]}
        raw = json.dumps(body).encode()
        assert decode.decode("RescoreRequest", raw) is None, repr(ch)
        assert _pydantic(schemas.RescoreRequest, raw) is None, repr(ch)
    # the fast way finds whitespace with str.split: its whitespace must be the schema's, character for character
    schema_spaces = re.compile(f"[{SPACES}]")
    assert {c for c in map(chr, range(0x110000)) if c.isspace()} == {
        c for c in map(chr, range(0x110000)) if schema_spaces.match(c)}
    assert len(SPACES) > 10


@pytest.mark.parametrize("raw", [b'{"sentences": ["a"], "return_token_logprobs": 1}', b'{"sentences": ["a\\ud800"]}',
                                 b'{"sentences": [NaN]}', b'{"sentences": ["a"]', b'[' * 3000 + b']' * 3000,
                                 b'{"sentences": ["a"], "sentences": []}', b'{"sentences": "a"}', b'',
                                 b'\xff\xfe', b'{"sentences": ["a"]} x'])
def test_malformed_or_doubtful_bodies_go_to_pydantic(raw):
    assert decode.decode("ScoreRequest", raw) is None or _pydantic(schemas.ScoreRequest, raw) is not None


def test_random_bodies_agree_with_pydantic():
    rng = random.Random(7)
    for _ in range(400):
        body = copy.deepcopy(RESCORE)
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(list(_paths(body))[1:])
            try:
                if rng.random() < 0.2:
                    _drop(body, path)
                else:
                    # a copy: a later change inside it must not reach ODD_VALUES (or make a body contain itself)
                    _set(body, path, copy.deepcopy(rng.choice(ODD_VALUES)))
            except (KeyError, IndexError, TypeError):
                pass  # an earlier change removed the path
        _check(schemas.RescoreRequest, json.dumps(body).encode())
