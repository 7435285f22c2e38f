"""No request holds the service hostage (issue 25), end to end on real uvicorn processes with the tiny
test model: a deep hypothesis list is scored in pieces between which other requests are served and
after which a hang-up stops it; a request predicted not to fit its deadline or the limits is refused at
once (413), one that would wait behind too much queued work gets 503 with Retry-After; a wide lattice
level stays within max_level_bytes; running out of memory answers 503 and the worker goes on; memory
goes back after a large lattice; SIGTERM stops a deep list within the grace time.

A "deep" list is 1,000 hypotheses of 200 words drawn from 14 words: about 200,000 trie nodes, ~15 s in
one scoring call on the tiny model (the call the worker could not leave before). Nothing here times a
request: what is checked is who is answered first, what is refused before any work, and the metrics."""

from __future__ import annotations

import collections
import json
import random
import resource
import sys

import pytest
from conftest import DATA
from test_server import Server, _check, _metric, post, utt
from test_service_abuse import (
    _rss_mib,
    answered,
    assert_sigterm_answers_and_exits,
    batches_settled,
    metrics,
    on_worker,
    raw_request,
    wait_until,
)

# The most frequent words of the training text: in the tiny LM's vocabulary and the n-gram's.
WORDS = [w for w, _ in collections.Counter((DATA / "train.txt").read_text().split()).most_common(2100)]
DEEP = ("max_trie_nodes=400000", "max_request_seconds=600", "request_timeout_s=600", "drain_seconds=0")


def deep_list(n: int = 1000, length: int = 200, seed: int = 0) -> dict:
    rng = random.Random(seed)
    words = WORDS[:14]
    return {"utterances": [{"id": "deep", "hypotheses": [
        {"words": [rng.choice(words) for _ in range(length)], "am_score": -1.0} for _ in range(n)]}]}


def fan_lattice(first: int = 64, second: int = 300) -> dict:
    """0 -> 1 over `first` words, 1 -> 2 over `second` others: every history meets every second word."""
    a, b = WORDS[:first], WORDS[first : first + second]
    lines = [f"0 1 {w} {w} 1.0,1.0" for w in a] + [f"1 2 {w} {w} 1.0,1.0" for w in b] + ["2 0,0"]
    return {"utterances": [{"id": "fan", "lattice": {"format": "openfst-text", "data": "\n".join(lines) + "\n"}}]}


def running_stops(server: Server) -> float:
    return _metric(metrics(server), "smallstate_work_cancelled_total", stage="running")


@pytest.fixture(scope="module")
def deep(tiny_lm_dir, kenlm_model, tmp_path_factory):
    s = Server(tiny_lm_dir, kenlm_model, *DEEP, log=tmp_path_factory.mktemp("deep") / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def test_small_requests_are_served_while_a_deep_list_is_scored_and_a_hang_up_stops_it(deep):
    stops0 = running_stops(deep)
    s = raw_request(deep, json.dumps(deep_list()).encode())
    try:
        on_worker(deep)
        for text in ("the lord said", "and he said unto them", "in the beginning"):
            r = post(deep, "/rescore", {"utterances": [utt({"text": text, "am_score": -1.0})]})
            assert r.status_code == 200, r.text
            assert not answered(s), "the deep list finished first: the small request waited behind it"
        r = post(deep, "/score", {"sentences": ["the lord"]})
        assert r.status_code == 200 and not answered(s)
    finally:
        s.close()
    # the list's remaining pieces are dropped, counted as work stopped part-way
    wait_until(lambda: running_stops(deep) > stops0, what="the worker to stop the abandoned list")
    assert _metric(metrics(deep), "smallstate_requests_cancelled_total", reason="disconnect") >= 1
    assert post(deep, "/rescore", {"utterances": [utt()]}).status_code == 200


def test_a_list_that_cannot_meet_its_deadline_is_refused_before_any_work(deep):
    batches0 = batches_settled(deep)
    r = post(deep, "/rescore", deep_list(), {"X-Request-Timeout": "1"})
    body = _check(r, 413, field="utterances", limit=1)
    assert "predicted" in body["detail"] and "deadline" in body["detail"], body
    assert _metric(metrics(deep), "smallstate_batch_requests_count") == batches0, "no work was done for it"
    # a list that fits its deadline is scored in pieces and gives what one pass gives
    small = deep_list(n=40, length=30, seed=1)
    r = post(deep, "/rescore", small, {"X-Request-Timeout": "300"})
    assert r.status_code == 200, r.text
    ranked = r.json()["utterances"][0]["hypotheses"]
    assert len(ranked) == 40 and [h["rank"] for h in ranked] == list(range(40))


def test_a_request_behind_too_much_queued_work_gets_503_with_retry_after(deep):
    s = raw_request(deep, json.dumps(deep_list(seed=2)).encode())
    try:
        on_worker(deep)
        # alone it fits its deadline (about a tenth of the deep list's work); behind the deep list it cannot
        r = post(deep, "/rescore", deep_list(n=100, length=200, seed=3), {"X-Request-Timeout": "6"})
        body = _check(r, 503)
        assert "queued ahead" in body["detail"] and int(r.headers["retry-after"]) >= 1, body
        # a request of one slice is always let in: the worker turns to it between two pieces
        assert post(deep, "/rescore", {"utterances": [utt()]}, {"X-Request-Timeout": "20"}).status_code == 200
        assert not answered(s)
    finally:
        s.close()


def test_behind_too_much_queued_work_a_large_request_is_refused_before_the_rest_of_it_is_read(deep):
    """Three wide lattices and a bad one: behind the deep list the first lattice already passes one slice, so
    the request is refused there (the bad lattice never read); on an idle worker it is read to its end."""
    fans = [{**fan_lattice()["utterances"][0], "id": f"fan{i}"} for i in range(3)]
    request = {"utterances": [*fans, {"id": "bad", "lattice": {"format": "openfst-text", "data": "0 1 x\n"}}]}
    stops0 = running_stops(deep)
    s = raw_request(deep, json.dumps(deep_list(seed=4)).encode())
    try:
        on_worker(deep)
        r = post(deep, "/rescore", request, {"X-Request-Timeout": "6"})
        body = _check(r, 503)
        assert "queued ahead" in body["detail"] and "at least" in body["detail"], body
        assert int(r.headers["retry-after"]) >= 1
    finally:
        s.close()
    wait_until(lambda: running_stops(deep) > stops0, what="the worker to stop the abandoned list")
    _check(post(deep, "/rescore", request, {"X-Request-Timeout": "6"}), 422, field="utterances[3].lattice.data")


def test_predicted_seconds_and_bytes_over_the_limits_are_413_naming_them(tiny_lm_dir, kenlm_model, tmp_path):
    srv = Server(tiny_lm_dir, kenlm_model, "max_trie_nodes=400000", "max_request_seconds=2",
                 "max_request_bytes=20000000", "max_level_bytes=100000000", "drain_seconds=0",
                 log=tmp_path / "server.log")
    try:
        body = _check(post(srv, "/rescore", deep_list()), 413, field="utterances", limit=2)
        assert "max_request_seconds" in body["detail"], body
        body = _check(post(srv, "/rescore", fan_lattice()), 413, field="utterances[0].lattice", limit=20000000)
        assert "max_request_bytes" in body["detail"] and "MiB" in body["detail"], body
        assert post(srv, "/rescore", {"utterances": [utt()]}).status_code == 200
    finally:
        assert srv.stop() == 0


def _dev_lattices_request(n: int) -> dict:
    """`n` of the test lattices as a client sends them: OpenFST text, words as labels."""
    from conftest import TEST_DATA

    from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable

    symbols = SymbolTable.read(TEST_DATA / "lattices" / "words.txt")
    utts = []
    for path in sorted((TEST_DATA / "lattices").glob("*.lat.fst"))[:n]:
        rows = [line.split("\t") for line in lattice_to_text(read_fst(path, symbols)).splitlines()]
        text = "\n".join("\t".join(r[:2] + [symbols.word(int(r[2]))] * 2 + r[4:]) if len(r) == 5 else "\t".join(r)
                         for r in rows) + "\n"
        utts.append({"id": path.stem, "lattice": {"format": "openfst-text", "data": text}})
    return {"utterances": utts}


def test_lattices_that_would_not_fit_in_memory_together_are_served_fewer_at_a_time(tiny_lm_dir, kenlm_model,
                                                                                    tmp_path):
    """A request whose lattices' predicted peaks exceed max_request_bytes together, each fitting alone, is let in
    and expanded a few at a time: the same answers as a server whose limit holds them all together."""
    from smallstate_lm.service.frontend.inputs import rescore_work
    from smallstate_lm.service.model import Models
    from smallstate_lm.service.schemas import RescoreRequest
    from smallstate_lm.service.settings import Settings

    request = _dev_lattices_request(4)
    m = Models(Settings(lm=str(tiny_lm_dir), ngram=str(kenlm_model), device="cpu", threads=1))
    m.load()
    peaks = [it.nbytes for it in rescore_work(RescoreRequest.model_validate(request), m, m.s).items]
    assert min(peaks) > 0
    limit = max(peaks) + min(peaks) // 2  # any one fits, no two of the largest do
    tight = Server(tiny_lm_dir, kenlm_model, f"max_request_bytes={limit}", "drain_seconds=0",
                   log=tmp_path / "tight.log")
    roomy = Server(tiny_lm_dir, kenlm_model, f"max_request_bytes={sum(peaks)}", "drain_seconds=0",
                   log=tmp_path / "roomy.log")
    try:
        answers = [post(srv, "/rescore", request) for srv in (tight, roomy)]
    finally:
        assert tight.stop() == 0 and roomy.stop() == 0
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    a, b = (r.json() for r in answers)
    for x, y in zip(a["utterances"], b["utterances"], strict=True):
        assert [h["words"] for h in x["hypotheses"]] == [h["words"] for h in y["hypotheses"]]
        assert [h["total"] for h in x["hypotheses"]] == pytest.approx([h["total"] for h in y["hypotheses"]],
                                                                      abs=1e-4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sets another process's address-space limit")
def test_running_out_of_memory_answers_503_and_the_worker_goes_on(tiny_lm_dir, tmp_path, monkeypatch):
    """Under an address-space cap a lattice level that needs more than the cap fails to allocate: 503 (not
    500), no traceback, memory handed back, and the next request is served. (One malloc arena: glibc
    reserves 64 MiB of address space for each thread's own, which would make where the cap bites depend
    on which threads ran first.)"""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    srv = Server(tiny_lm_dir, None, "max_level_bytes=8000000000", "drain_seconds=0", log=tmp_path / "server.log")
    try:
        assert post(srv, "/rescore", {"utterances": [utt()]}).status_code == 200
        engine = srv.engine_pid()  # the process that holds the model and expands the lattice
        size = next(int(ln.split()[1]) * 1024 for ln in open(f"/proc/{engine}/status")
                    if ln.startswith("VmSize:"))
        resource.prlimit(engine, resource.RLIMIT_AS, (size + 150 * 2**20,) * 2)
        r = post(srv, "/rescore", fan_lattice(64, 2000))
        body = _check(r, 503)
        assert "memory" in body["detail"], body
        assert post(srv, "/rescore", {"utterances": [utt()]}).status_code == 200
    finally:
        assert srv.stop() == 0
    log = srv.log.read_text()
    assert "Traceback" not in log and "ran out of memory" in log, log


def test_a_wide_lattice_level_stays_within_max_level_bytes_and_memory_goes_back(tiny_lm_dir, tmp_path):
    srv = Server(tiny_lm_dir, None, "max_level_bytes=4000000", "drain_seconds=0", log=tmp_path / "server.log")
    try:
        assert post(srv, "/rescore", {"utterances": [utt()]}).status_code == 200
        engine = srv.engine_pid()
        baseline = _rss_mib(engine)
        r = post(srv, "/rescore", fan_lattice(64, 2000))
        assert r.status_code == 200, r.text
        assert r.json()["utterances"][0]["best"]["words"]
        # 128,000 histories x words would hold ~400 MiB of LM state; the level keeps what fits in 4 MB
        wait_until(lambda: _rss_mib(engine) <= baseline + 100, what=f"RSS near {baseline:.0f} MiB")
    finally:
        assert srv.stop() == 0


def test_sigterm_stops_a_deep_list_within_the_grace_time(tiny_lm_dir, kenlm_model, tmp_path):
    grace = 2.0
    srv = Server(tiny_lm_dir, kenlm_model, *DEEP, f"graceful_timeout_s={grace}", log=tmp_path / "server.log")
    # before: the list's whole ~15 s scoring call
    assert_sigterm_answers_and_exits(srv, deep_list(), grace, smalls=2)
