"""Sessions: a stream of utterances rescored by the service one request at a time, each after the transcripts
chosen for the ones before (kept in the engine). The store's rules (turns in arrival order, leases, idle
expiry, the bound) on a clock of the test's own; a real server's answers against `rescore --utt2doc`."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import TEST_DATA, run_cli
from test_server import LAT_DIR, Server, fst_utterance, post

from smallstate_lm.service.sessions import SessionExists, SessionNotFound, SessionStore, TooManySessions

TTL_S = 5.0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _store(**kw):
    clock = Clock()
    return SessionStore(kw.get("max_sessions", 4), kw.get("ttl_s", 10.0), 8, clock), clock


def test_turns_in_arrival_order_each_after_the_previous_transcripts():
    store, clock = _store()
    store.create("k", "s", 2)
    got = []
    for lease in ("a", "b", "c"):
        store.acquire("k", "s", lease, 30.0, lambda ctx, err, lease=lease: got.append((lease, ctx, err)))
    assert got == [("a", [], None)]  # b and c wait for their turns
    store.release("k", "s", "a", ["one"])
    assert got[-1] == ("b", [["one"]], None)
    store.release("k", "s", "b", None)  # b failed: nothing kept
    assert got[-1] == ("c", [["one"]], None)
    store.release("k", "s", "c", ["two"])
    store.acquire("k", "s", "d", 30.0, lambda ctx, err: got.append(("d", ctx, err)))
    store.release("k", "s", "d", ["three"])
    assert got[-1] == ("d", [["one"], ["two"]], None)
    assert store.describe("k", "s")["transcripts"] == ["two", "three"]  # at most context_utts kept


def test_a_lost_turn_is_taken_back_at_its_deadline():
    store, clock = _store()
    store.create("k", "s", 1)
    got = []
    store.acquire("k", "s", "a", 5.0, lambda ctx, err: got.append("a"))
    store.acquire("k", "s", "b", 5.0, lambda ctx, err: got.append("b"))
    clock.now += 4.0
    store.sweep()
    assert got == ["a"]
    clock.now += 2.0  # a's front-end never came back
    store.sweep()
    assert got == ["a", "b"]
    store.release("k", "s", "a", ["late"])  # too late: ignored
    store.release("k", "s", "b", ["b's"])
    assert store.describe("k", "s")["transcripts"] == ["b's"]


def test_sessions_expire_are_bounded_and_scoped_to_the_key():
    store, clock = _store(max_sessions=2, ttl_s=10.0)
    store.create("k", "s", 1)
    store.create("other key", "s", 1)  # the same name under another key is another session
    with pytest.raises(TooManySessions):
        store.create("k", "t", 1)
    with pytest.raises(SessionExists):
        store.create("k", "s", 1)
    with pytest.raises(SessionNotFound):
        store.describe("k", "t")
    clock.now += 11.0
    with pytest.raises(SessionNotFound, match="unknown or expired"):
        store.acquire("k", "s", "a", 5.0, lambda ctx, err: None)
    store.create("k", "t", 1)  # the expired ones made room
    assert len(store.sessions) == 1


def test_deleting_a_session_answers_its_waiting_requests():
    store, clock = _store()
    store.create("k", "s", 1)
    got = []
    store.acquire("k", "s", "a", 5.0, lambda ctx, err: got.append(err))
    store.acquire("k", "s", "b", 5.0, lambda ctx, err: got.append(err))
    store.delete("k", "s")
    assert got[0] is None and isinstance(got[1], SessionNotFound)
    store.release("k", "s", "a", ["x"])  # the holder's release after the delete is ignored
    with pytest.raises(SessionNotFound):
        store.describe("k", "s")


# ---------------------------------------------------------------------------------------------
# A real server


@pytest.fixture(scope="module")
def server(tiny_lm_dir, kenlm_model, tmp_path_factory):
    s = Server(tiny_lm_dir, kenlm_model, "drain_seconds=0", "max_sessions=3", f"session_ttl_s={TTL_S}",
               log=tmp_path_factory.mktemp("sessions") / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def _session(server, name: str, **kw) -> httpx.Response:
    return post(server, "/v1/sessions", {"id": name, **kw})


def test_two_lattice_requests_of_a_session_match_the_cli(server, tmp_path, tiny_lm_dir, kenlm_model):
    fsts = [LAT_DIR / "slt-dev0000.lat.fst", LAT_DIR / "slt-dev0004.lat.fst", LAT_DIR / "kal-dev0001.lat.fst"]
    names = [p.name.split(".")[0] for p in fsts]
    r = _session(server, "talk", context_utts=1)
    assert r.status_code == 201, r.text
    assert r.json()["context_utts"] == 1 and r.json()["transcripts"] == []
    served = []
    for path, name in zip(fsts, names):
        r = post(server, "/rescore", {"session": "talk", "utterances": [fst_utterance(path, name)]})
        assert r.status_code == 200, r.text
        served.append(r.json()["utterances"][0]["transcript"]["words"])
    kept = httpx.get(server.url + "/v1/sessions/talk").json()["transcripts"]
    assert kept == [" ".join(served[-1])]  # the last one only: context_utts 1
    assert httpx.delete(server.url + "/v1/sessions/talk").status_code == 204

    utt2doc = tmp_path / "utt2doc"
    utt2doc.write_text("".join(f"{n} talk\n" for n in names))
    proc = run_cli("rescore", *fsts, "--words", LAT_DIR / "words.txt", "--lm", tiny_lm_dir, "--ngram", kenlm_model,
                   "--utt2doc", utt2doc, "--context-utts", "1", "-o", tmp_path / "out", "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    best = dict(line.split(" ", 1) if " " in line else (line, "")
                for line in (tmp_path / "out" / "best.txt").read_text().splitlines())
    assert [best[n].split() for n in names] == served

    # the same lattice without the session: its first utterance alone is read from <s> alike, the later ones
    # after their context (the neural LM's scores differ)
    alone = post(server, "/rescore", {"utterances": [fst_utterance(fsts[1], names[1])], "nbest": 1}).json()
    after = post(server, "/rescore", {"utterances": [{**fst_utterance(fsts[1], names[1]),
                                                      "context": " ".join(served[0])}], "nbest": 1}).json()
    assert alone["utterances"][0]["best"]["neural"] != pytest.approx(after["utterances"][0]["best"]["neural"])


def test_session_errors_are_clear(server):
    lat = fst_utterance(LAT_DIR / "slt-dev0000.lat.fst", "slt-dev0000")
    r = post(server, "/rescore", {"session": "nobody", "utterances": [lat]})
    assert r.status_code == 404 and r.json()["type"] == "session_not_found" and r.json()["field"] == "session"
    assert "unknown or expired" in r.json()["detail"]
    assert _session(server, "e1").status_code == 201
    assert _session(server, "e1").status_code == 409
    r = post(server, "/rescore", {"session": "e1", "utterances": [lat, {**lat, "id": "x"}]})
    assert r.status_code == 422 and r.json()["field"] == "utterances"
    r = post(server, "/rescore", {"session": "e1", "utterances": [{**lat, "context": "and he said"}]})
    assert r.status_code == 422 and r.json()["field"] == "utterances[0].context"
    assert _session(server, "bad id!").status_code == 422
    assert _session(server, "e2", context_utts=99).status_code == 422
    assert httpx.delete(server.url + "/v1/sessions/e1").status_code == 204
    assert httpx.delete(server.url + "/v1/sessions/e1").status_code == 404
    r = post(server, "/rescore", {"session": "e1", "utterances": [lat]})
    assert r.status_code == 404


def test_sessions_are_bounded_and_expire(server):
    for k in range(3):
        assert _session(server, f"b{k}").status_code == 201
    r = _session(server, "b3")
    assert r.status_code == 429 and r.json()["limit"] == 3
    time.sleep(TTL_S + 1.0)  # the engine sweeps idle sessions every half second
    assert httpx.get(server.url + "/v1/sessions/b0").status_code == 404
    assert _session(server, "b3").status_code == 201
    assert httpx.delete(server.url + "/v1/sessions/b3").status_code == 204


def test_nbest_requests_of_a_session_read_the_previous_best(server):
    from smallstate_lm.rescoring.nbest.lists import read_nbest

    utts = read_nbest(TEST_DATA / "nbest.tsv")[:2]
    assert _session(server, "lists", context_utts=1).status_code == 201
    bests = []
    for u in utts:
        body = {"session": "lists", "return_token_logprobs": True, "utterances": [{"id": u.utt, "hypotheses": [
            {"words": h.words, "am_score": h.am, "graph_score": h.graph} for h in u.hyps]}]}
        r = post(server, "/rescore", body)
        assert r.status_code == 200, r.text
        bests.append(r.json()["utterances"][0]["best"])
    # the second list was read after the first one's best: as a request with that context
    body = {"return_token_logprobs": True, "utterances": [{"id": utts[1].utt, "context": " ".join(bests[0]["words"]),
                                                           "hypotheses": [{"words": h.words, "am_score": h.am,
                                                                           "graph_score": h.graph}
                                                                          for h in utts[1].hyps]}]}
    want = post(server, "/rescore", body).json()["utterances"][0]["best"]
    assert want["words"] == bests[1]["words"]
    assert want["token_logprobs"]["neural"] == pytest.approx(bests[1]["token_logprobs"]["neural"], rel=1e-5,
                                                             abs=1e-4)
    assert httpx.delete(server.url + "/v1/sessions/lists").status_code == 204
