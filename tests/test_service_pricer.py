"""Large bodies priced in the pricing process (service/http/pricer.py), end to end on real uvicorn servers with
the tiny test model: a server with it answers large requests as one without it does (refusals by count limits
word for word, admitted requests with the same ranking, invalid bodies with the same 422), and counts what it
priced; when the pricing process dies the server prices in-process and says so once; the process goes when the
server goes. The limits are counts (trie nodes, lattice steps), so the answers do not depend on timing."""

from __future__ import annotations

import json
import os
import random
import signal
import sys

import pytest
from test_server import Server, _check, _metric, post, utt
from test_service_abuse import metrics, wait_until
from test_service_grains import WORDS, fan_lattice

from smallstate_lm.service.http.pricer import PRICE_BYTES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pricing process is Linux only")

LIMITS = ("max_trie_nodes=20000", "max_lattice_cost=10000", "drain_seconds=0")


def _lists(n_utts: int, n_hyps: int, length: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"utterances": [{"id": f"u{i}", "hypotheses": [
        {"words": [rng.choice(WORDS[:vocab]) for _ in range(length)], "am_score": -float(j)} for j in range(n_hyps)]}
        for i in range(n_utts)]}


def _requests() -> dict[str, dict]:
    fans = [{**fan_lattice()["utterances"][0], "id": f"fan{i}"} for i in range(8)]
    admitted = _lists(60, 20, 10, 6, seed=1)
    invalid = json.loads(json.dumps(admitted))
    invalid["utterances"][59]["hypotheses"][19]["words"][3] = "two words"
    reqs = {"over max_trie_nodes": _lists(1, 600, 40, 200, seed=2), "over max_lattice_cost": {"utterances": fans},
            "admitted": admitted, "invalid": invalid}
    for name, r in reqs.items():
        assert len(json.dumps(r)) >= PRICE_BYTES, f"{name}: too small to be priced"
    return reqs


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def servers(tiny_lm_dir, kenlm_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("pricer")
    priced = Server(tiny_lm_dir, kenlm_model, *LIMITS, log=d / "priced.log")
    plain = Server(tiny_lm_dir, kenlm_model, *LIMITS, "pricers=0", log=d / "plain.log")
    yield priced, plain
    for s in (priced, plain):
        assert s.stop() == 0, s.log.read_text()
        assert "Traceback" not in s.log.read_text(), s.log.read_text()


def _answers(server: Server) -> dict:
    return {name: post(server, "/rescore", body) for name, body in _requests().items()}


def _same_answers(got: dict, want: dict) -> None:
    for name in want:
        assert got[name].status_code == want[name].status_code, (name, got[name].text, want[name].text)
    for name in ("over max_trie_nodes", "over max_lattice_cost", "invalid"):
        assert got[name].json() == want[name].json(), name
    _check(got["over max_trie_nodes"], 413, field="utterances", limit=20000)
    _check(got["over max_lattice_cost"], 413, field="utterances[0].lattice", limit=10000)
    assert got["invalid"].status_code == 422
    for g, w in zip(got["admitted"].json()["utterances"], want["admitted"].json()["utterances"], strict=True):
        assert [h["id"] for h in g["hypotheses"]] == [h["id"] for h in w["hypotheses"]]
        assert [h["total"] for h in g["hypotheses"]] == pytest.approx([h["total"] for h in w["hypotheses"]],
                                                                      abs=1e-4)


def test_large_bodies_are_answered_as_without_the_pricing_process_and_counted(servers):
    priced, plain = servers
    assert len(_children(priced.proc.pid)) == 2 and not _children(plain.proc.pid)
    before = metrics(priced)
    got, want = _answers(priced), _answers(plain)
    _same_answers(got, want)
    after = metrics(priced)
    counted = {o: _metric(after, "smallstate_priced_total", outcome=o)
               - _metric(before, "smallstate_priced_total", outcome=o) for o in ("refused", "let_in", "unpriced")}
    assert counted == {"refused": 2, "let_in": 2, "unpriced": 0}, counted  # a bad word is the server's to find
    for stage in ("wait", "price"):  # each priced body's wait for a copy and the copy's answer, timed
        n = _metric(after, "smallstate_pricing_seconds_count", stage=stage) - _metric(
            before, "smallstate_pricing_seconds_count", stage=stage)
        assert n == 4, (stage, n)
    assert _metric(after, "smallstate_pricing_seconds_sum", stage="price") > 0
    assert _metric(metrics(plain), "smallstate_priced_total") == 0
    # a small request never goes there
    assert post(priced, "/rescore", {"utterances": [utt()]}).status_code == 200
    assert _metric(metrics(priced), "smallstate_priced_total") == sum(counted.values())


def test_a_dead_pricing_process_leaves_the_server_pricing_in_process(tiny_lm_dir, kenlm_model, tmp_path, servers):
    _, plain = servers
    s = Server(tiny_lm_dir, kenlm_model, *LIMITS, log=tmp_path / "server.log")
    try:
        children = _children(s.proc.pid)
        for child in children:
            os.kill(child, signal.SIGKILL)
        wait_until(lambda: not any(map(_alive, children)), what="the pricing processes to die")
        _same_answers(_answers(s), _answers(plain))
        _same_answers(_answers(s), _answers(plain))
        log = s.log.read_text()
        assert log.count("a pricing process failed") == 2 and "1 left" in log, log
        assert "requests are priced in the server from now on" in log, log
        assert _metric(metrics(s), "smallstate_priced_total", outcome="refused") == 0
    finally:
        assert s.stop() == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def test_the_pricing_process_goes_when_the_server_goes(tiny_lm_dir, kenlm_model, tmp_path):
    s = Server(tiny_lm_dir, kenlm_model, *LIMITS, log=tmp_path / "server.log")
    children = _children(s.proc.pid)
    assert len(children) == 2
    assert s.stop() == 0, s.log.read_text()
    # each sees its pipe close at once (none holds another's open): no wait, no kill
    wait_until(lambda: not any(map(_alive, children)), timeout=3, what="the pricing processes to exit with the server")
    s = Server(tiny_lm_dir, kenlm_model, *LIMITS, log=tmp_path / "killed.log")
    children = _children(s.proc.pid)
    s.proc.kill()  # no shutdown at all: the pipes' ends close with the server
    s.proc.wait()
    wait_until(lambda: not any(map(_alive, children)), timeout=10, what="the pricing processes to exit after a kill")


def test_a_held_worker_waits_between_steps_at_most_hold_s_each_time(monkeypatch):
    """While large bodies are priced on a CPU server the worker holds between two steps (service/batcher.py):
    it runs no step while held, goes on when let go, and a hold never lasts past HOLD_S a step."""
    import threading
    import time

    from smallstate_lm.service import batcher

    def steps(done: list):
        for i in range(3):
            done.append(i)
            yield

    monkeypatch.setattr(batcher, "HOLD_S", 60.0)
    run, done = threading.Event(), []
    worker = threading.Thread(target=batcher._advance, args=(steps(done), 600.0, lambda: False, run))
    worker.start()
    wait_until(lambda: done == [0], what="the first step")
    time.sleep(0.05)
    assert done == [0], "a step ran while the worker was held"
    run.set()
    worker.join(10)
    assert not worker.is_alive() and done == [0, 1, 2]
    monkeypatch.setattr(batcher, "HOLD_S", 0.01)
    done = []
    held = threading.Thread(target=batcher._advance, args=(steps(done), 600.0, lambda: False, threading.Event()))
    held.start()
    held.join(10)
    assert not held.is_alive() and done == [0, 1, 2], "a hold that is never let go still ends"
