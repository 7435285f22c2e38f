"""The rescoring service's answers to bad input and to its limits, end to end on a real uvicorn process: every
malformed, invalid or oversize request gets its documented status and names its field; the API key and a full
queue are enforced."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import LAT_DIR, Server, _check, fst_utterance, hyp, post, served, utt


@pytest.fixture(scope="module")
def server(tiny_lm_dir, kenlm_model, tmp_path_factory):
    """The service at its default limits, for the malformed and invalid requests."""
    yield from served(tiny_lm_dir, kenlm_model, tmp_path_factory, "errors")


# Limits small enough to reach with tiny requests, an API key, and a queue that fills.
TIGHT = ("max_utterances=2", "max_hypotheses=3", "max_words=5", "max_lattice_arcs=200", "max_nbest=5",
         "lattice_nbest=3", "max_body_bytes=20000", "max_queue=2", "max_wait_ms=1500", "wait_for_arrivals=false",
         "api_key=sekrit", "drain_seconds=0")
AUTH = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def tight(tiny_lm_dir, kenlm_model, tmp_path_factory):
    s = Server(tiny_lm_dir, kenlm_model, *TIGHT, log=tmp_path_factory.mktemp("tight") / "server.log")
    yield s
    s.stop()


BAD_REQUESTS = [  # (body, status, field)
    ({"utterances": [{"id": "u", "hypotheses": []}]}, 422, "utterances[0].hypotheses"),
    ({"utterances": []}, 422, "utterances"),
    ({}, 422, "utterances"),
    ({"utterances": [utt(hyp(words=["a"]))]}, 422, "utterances[0].hypotheses[0]"),
    ({"utterances": [utt({"words": ["a b"], "am_score": 0})]}, 422, "utterances[0].hypotheses[0].words[0]"),
    ({"utterances": [utt({"text": "a", "am_score": "x"})]}, 422, "utterances[0].hypotheses[0].am_score"),
    ({"utterances": [utt({"text": "a"})]}, 422, "utterances[0].hypotheses[0].am_score"),
    ({"utterances": [utt(hyp(am=1e300))]}, 422, "utterances[0].hypotheses[0].am_score"),
    ({"utterances": [utt(hyp(), lattice={"format": "openfst-text", "data": "0 0"})]}, 422, "utterances[0]"),
    ({"utterances": [{"id": "u", "lattice": {"format": "kaldi", "data": "0"}}]}, 422, "utterances[0].lattice.format"),
    ({"utterances": [{"id": "u", "lattice": {"format": "openfst-text", "data": "0 1 the the x\n1\n"}}]}, 422,
     "utterances[0].lattice.data"),
    ({"utterances": [{"id": "u", "lattice": {"format": "openfst-text", "data": "0 1 5 5 1,1\n1\n"}}]}, 422,
     "utterances[0].lattice.words"),
    ({"utterances": [{"id": "u", "lattice": {"format": "openfst-text", "data": "0 1 a a\n1 0 b b\n"}}]}, 422,
     "utterances[0].lattice.data"),  # a cycle, no final state
    ({"utterances": [{"id": "u", "lattice": {"format": "htk-slf", "data": "VERSION=1.0\nN=2 L=1\nJ=0 S=0 E=5\n"}}]},
     422, "utterances[0].lattice.data"),
    ({"utterances": [{"id": "u", "lattice": {"format": "openfst-text", "data": "0 1 a a\n1\n", "words": {"a": 1},
                                              }, "context": ["x"] * 9}]}, 422, "utterances[0].context"),  # > 8
    ({"utterances": [utt(context=["x", "y " * 201])]}, 422, "utterances[0].context[1]"),  # > max_words
    ({"utterances": [utt()], "session": "no such session"}, 422, "session"),  # not an id's characters
    ({"utterances": [utt()], "weights": {"lam": 2}}, 422, "weights.lam"),
    ({"utterances": [utt()], "weights": {"lm_wieght": 1}}, 422, "weights.lm_wieght"),
    ({"utterances": [utt()], "weights": {"mbr_scale": -1}}, 422, "weights.mbr_scale"),
    ({"utterances": [utt()], "nbest": 0}, 422, "nbest"),
    ({"utterances": [utt(hyp("zzxq qqzx xxqz"))]}, 422, "utterances"),  # vocabulary mismatch
    ({"utterances": [utt(hyp("the \ud800 lord"))]}, 422, "utterances[0].hypotheses[0].text"),
    ({"utterances": [utt({"words": ["the", "lo\ud800rd"], "am_score": 0})]}, 422,
     "utterances[0].hypotheses[0].words[1]"),
    ({"utterances": [{"id": "u\udfff", "hypotheses": [hyp()]}]}, 422, "utterances[0].id"),
    # every character str.split() splits on, the rarer ones included
    *[({"utterances": [utt({"words": [f"a{c}b"], "am_score": 0})]}, 422, "utterances[0].hypotheses[0].words[0]")
      for c in "\x1c\x85\u2028\u3000"],
    ({"sentences": []}, 422, "sentences"),
    # words in text, context and sentences have the same length cap as words in `words`
    ({"utterances": [utt(hyp("the lord " + "x" * 1001))]}, 422, "utterances[0].hypotheses[0].text"),
    ({"utterances": [utt(hyp(), context="the " + "y" * 1001)]}, 422, "utterances[0].context"),
    ({"sentences": ["the " + "z" * 1001]}, 422, "sentences[0]"),
    # a lattice in the wrong vocabulary is refused like an n-best list in it
    ({"utterances": [{"id": "u", "lattice": {"format": "openfst-text",
                                             "data": "0 1 zzxq zzxq 1,1\n1 2 qqzx qqzx 1,1\n2 0,0\n"}}]},
     422, "utterances[0].lattice"),
]


@pytest.mark.parametrize("body,status,field", BAD_REQUESTS)
def test_bad_requests(server, body, status, field):
    route = "/score" if "sentences" in body else "/rescore"
    # ensure_ascii escapes the lone surrogate, as a client in any language may send it
    r = httpx.post(server.url + route, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=30)
    _check(r, status, field)


@pytest.mark.parametrize("route, body", [
    ("/rescore", b"[" * 2000 + b"]" * 2000),
    ("/score", b'{"sentences":' + b"[" * 3000 + b"]" * 3000 + b"}"),
])
def test_deeply_nested_json_is_a_400_and_the_connection_lives(server, route, body):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post(route, content=body, headers={"content-type": "application/json"})
        _check(r, 400, "body", text="nested too deeply")
        assert client.get("/healthz").status_code == 200  # the same keep-alive connection still answers


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"},
                                     {"content-type": "application/x-www-form-urlencoded"}, {}])
def test_bodies_not_sent_as_json_are_a_415(server, headers):
    body = json.dumps({"sentences": ["the lord said"]}).encode()
    r = httpx.post(server.url + "/score", content=body, headers=headers, timeout=30)
    assert _check(r, 415, text="expected application/json")["type"] == "unsupported_media_type"
    ok = httpx.post(server.url + "/score", content=json.dumps({"sentences": ["the lord said"]}),
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=30)
    assert ok.status_code == 200


def test_malformed_bodies(server):
    h = {"content-type": "application/json"}
    _check(httpx.post(server.url + "/rescore", content=b'{"utterances": [', headers=h), 400, "body", text="JSON")
    _check(httpx.post(server.url + "/rescore", content=b"\xff\xfe", headers=h), 400, "body")
    r = httpx.post(server.url + "/rescore", content=b'{"utterances": [{"id": "u", "hypotheses": [{"text": "a", '
                   b'"am_score": NaN}]}]}', headers=h)
    _check(r, 422, "utterances[0].hypotheses[0].am_score")  # JSON's NaN parses; a score must be finite
    _check(httpx.post(server.url + "/rescore", content=b"[]", headers=h), 422)
    assert httpx.get(server.url + "/rescore").status_code == 405
    assert httpx.get(server.url + "/nothing").status_code == 404
    # a lattice whose costs overflow when combined is refused, not answered with inf
    big = {"utterances": [{"id": "u", "lattice": {"format": "openfst-text",
                                                  "data": "0 1 the the 1e308,1e308\n1 1e308,1e308\n"}}]}
    _check(post(server, "/rescore", big), 422)


def test_limits(tight):
    ok = {"utterances": [utt()]}
    assert post(tight, "/rescore", ok, AUTH).status_code == 200
    _check(post(tight, "/rescore", {"utterances": [utt()] * 3}, AUTH), 422, "utterances", 2)
    _check(post(tight, "/rescore", {"utterances": [utt(*[hyp()] * 4)]}, AUTH), 422, "utterances[0].hypotheses", 3)
    _check(post(tight, "/rescore", {"utterances": [utt(hyp(), hyp("a b c d e f"))]}, AUTH), 422,
           "utterances[0].hypotheses[1].text", 5)
    _check(post(tight, "/rescore", {"utterances": [utt(hyp(), context="a b c d e f")]}, AUTH), 422,
           "utterances[0].context", 5)
    _check(post(tight, "/score", {"sentences": ["the", "a b c d e f"]}, AUTH), 422, "sentences[1]", 5)
    _check(post(tight, "/score", {"sentences": ["the"] * 3}, AUTH), 422, "sentences", 2)
    _check(post(tight, "/rescore", {**ok, "nbest": 6}, AUTH), 422, "nbest", 5)
    lat = fst_utterance(LAT_DIR / "slt-dev0004.lat.fst", "big")  # 285 arcs
    _check(post(tight, "/rescore", {"utterances": [lat]}, AUTH), 422, "utterances[0].lattice.data", 200)
    sparse = {"id": "s", "lattice": {"format": "openfst-text", "data": "0 123456789012 a a\n123456789012\n"}}
    _check(post(tight, "/rescore", {"utterances": [sparse]}, AUTH), 422, "utterances[0].lattice.data", 200)
    slf = {"id": "s", "lattice": {"format": "htk-slf", "data": "N=99999999999 L=1\nJ=0 S=0 E=1\n"}}
    _check(post(tight, "/rescore", {"utterances": [slf]}, AUTH), 422, "utterances[0].lattice.data", 201)
    # body size: by Content-Length and when streamed without one
    big = {"utterances": [utt(hyp("the " * 5000))]}
    _check(post(tight, "/rescore", big, AUTH), 413, "body", 20000)

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    r = httpx.post(tight.url + "/rescore", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    _check(r, 413, "body", 20000)
    # API key
    _check(post(tight, "/rescore", ok), 401)
    _check(post(tight, "/rescore", ok, {"Authorization": "Bearer sekrit2"}), 401)
    assert httpx.get(tight.url + "/metrics").status_code == 401
    assert httpx.get(tight.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(tight.url + "/healthz").status_code == 200 and httpx.get(tight.url + "/readyz").status_code == 200


def test_queue_full_answers_503(tight):
    # max_wait_ms=1500 holds the first requests in the queue; beyond max_queue=2 the rest are refused.
    def call(_):
        return post(tight, "/rescore", {"utterances": [utt()]}, AUTH)

    with ThreadPoolExecutor(6) as ex:
        rs = list(ex.map(call, range(6)))
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    busy = next(r for r in rs if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "overloaded" in busy.json()["detail"]
