"""The rescoring service end to end: real uvicorn processes on 127.0.0.1 (random ports) with
a tiny random-weight Transformer and a real KenLM 3-gram. Scores equal the CLI's, concurrent
clients are batched and answered correctly, SIGTERM loses no accepted request, and schemathesis
finds no 5xx (bad input and the limits: test_server_errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import REPO, TEST_DATA, run_cli

from smallstate_lm.rescoring.decode.wer import align_counts
from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.rescoring.nbest.lists import read_nbest

LAT_DIR = TEST_DATA / "lattices"
TOL = dict(rel=1e-5, abs=1e-4)  # float32 forward passes in different batch compositions


# ---------------------------------------------------------------------------------------------
# A server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`smallstate-lm serve` in a subprocess on a free loopback port, one torch thread."""

    def __init__(self, lm: Path | None, ngram: Path | None, *settings: str, log: Path, device: str = "cpu"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, SMALLSTATE_THREADS="1", SMALLSTATE_LOG_LEVEL="warning")
        args = [sys.executable, "-m", "smallstate_lm.cli", "serve", "--port", str(self.port),
                "--device", device] + (["--lm", str(lm)] if lm else []) + (["--ngram", str(ngram)] if ngram else [])
        for s in settings:
            args += ["--set", s]
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become ready:\n{log.read_text()}")
            time.sleep(0.1)

    def children(self) -> dict[int, str]:
        """The service's processes under the supervisor: pid -> role ("engine" or "frontend")."""
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        roles = {}
        for pid in map(int, kids):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            role = next((c.decode().rsplit(".", 1)[1] for c in cmd if c.startswith(b"smallstate_lm.service.")), None)
            if role is not None:
                roles[pid] = role
        return roles

    def engine_pid(self) -> int:
        return next(pid for pid, role in self.children().items() if role == "engine")

    def frontend_pids(self) -> list[int]:
        return sorted(pid for pid, role in self.children().items() if role == "frontend")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def engine_process(settings, log: Path):
    """A real engine process in a run directory of its own, for a front-end app run in the test's own process
    (where the test can watch it): yields the run directory, the board and the process."""
    from smallstate_lm.service.board import Board
    from smallstate_lm.service.supervisor import BOARD, write_run

    rundir = Path(tempfile.mkdtemp(prefix="smallstate-test-"))
    write_run(rundir, settings, 1)
    board = Board(rundir / BOARD, 1, create=True)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.Popen([sys.executable, "-m", "smallstate_lm.service.engine", str(rundir)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        yield rundir, board, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(rundir, ignore_errors=True)


def served(tiny_lm_dir, kenlm_model, tmp_path_factory, name: str = "srv"):
    """A module's server at the default limits; on teardown it must exit 0 and have logged no traceback."""
    s = Server(tiny_lm_dir, kenlm_model, "drain_seconds=0", log=tmp_path_factory.mktemp(name) / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def server(tiny_lm_dir, kenlm_model, tmp_path_factory):
    yield from served(tiny_lm_dir, kenlm_model, tmp_path_factory)


def post(server: Server, route: str, body, headers=None) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=headers, timeout=60)


# ---------------------------------------------------------------------------------------------
# Requests from the test data


def nbest_request(utts) -> dict:
    return {"utterances": [{"id": u.utt, "hypotheses": [
        {"id": h.id, "words": h.words, "am_score": h.am, "graph_score": h.graph} for h in u.hyps]} for u in utts]}


def words_map() -> dict[str, int]:
    pairs = [line.split() for line in (LAT_DIR / "words.txt").read_text().splitlines() if line.strip()]
    return {w: int(i) for w, i in pairs}


def fst_utterance(path: Path, name: str) -> dict:
    lat = read_fst(path, SymbolTable.read(LAT_DIR / "words.txt"))
    return {"id": name, "lattice": {"format": "openfst-text", "data": lattice_to_text(lat), "words": words_map()}}


def cli_nbest(out: Path) -> dict[str, list[dict]]:
    recs = [json.loads(line) for line in (out / "nbest.jsonl").read_text().splitlines()]
    return {r["utt"]: r["hyps"] for r in recs}


def assert_same_hyps(cli_hyps: list[dict], served: dict, by_id: bool) -> None:
    got = served["hypotheses"]
    assert len(got) == len(cli_hyps)
    assert served["best"] == got[0]
    for rank, (want, have) in enumerate(zip(cli_hyps, got)):
        assert have["rank"] == rank
        assert have["words"] == want["words"]
        if by_id:
            assert have["id"] == want["id"]
        for key in ("total", "am", "graph", "neural", "ngram"):
            assert have[key] == pytest.approx(want[key], **TOL), (rank, key)
        assert (have["n_words"], have["n_oov"]) == (want["n_words"], want["n_oov"])


# ---------------------------------------------------------------------------------------------
# Same numbers as the CLI


def test_nbest_matches_cli(server, tmp_path, tiny_lm_dir, kenlm_model):
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--ngram", kenlm_model, "-o",
                   tmp_path / "out", "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    want = cli_nbest(tmp_path / "out")
    utts = read_nbest(TEST_DATA / "nbest.tsv")
    r = post(server, "/rescore", nbest_request(utts))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [u["id"] for u in body["utterances"]] == [u.utt for u in utts]
    for u in body["utterances"]:
        assert u["source"] == "hypotheses"
        assert_same_hyps(want[u["id"]], u, by_id=True)
    usage = body["usage"]
    n_tokens = sum(len(h.words) + 1 for u in utts for h in u.hyps)
    assert usage["tokens_total"] == n_tokens and 0 < usage["tokens_computed"] < n_tokens
    assert usage["hypotheses"] == sum(len(u.hyps) for u in utts)
    # text instead of words, per-request weights and nbest: the same components, re-weighted
    req = nbest_request(utts[:1])
    for h in req["utterances"][0]["hypotheses"]:
        h["text"] = "  " + " ".join(h.pop("words")) + " "
    req.update(weights={"lm_weight": 1.0, "word_penalty": -0.5}, nbest=2, return_token_logprobs=True)
    hyps = post(server, "/rescore", req).json()["utterances"][0]["hypotheses"]
    assert len(hyps) == 2
    by_id = {h["id"]: h for h in want[utts[0].utt]}
    for h in hyps:
        c = by_id[h["id"]]
        assert h["total"] == pytest.approx(0.1 * c["am"] + c["graph"] + c["neural"] + 0.5 * c["ngram"]
                                           - 0.5 * c["n_words"], **TOL)
        assert h["penalty"] == -0.5 * c["n_words"]
        assert len(h["token_logprobs"]["neural"]) == c["n_words"] + 1
        assert sum(h["token_logprobs"]["ngram"]) == pytest.approx(c["ngram"], **TOL)
    # minimum Bayes risk: ranked by the expected errors the library computes from the same totals
    req = nbest_request(utts[:1])
    req["weights"] = {"mbr_scale": 0.5}
    body = post(server, "/rescore", req).json()
    assert body["weights"]["mbr_scale"] == 0.5
    hyps = body["utterances"][0]["hypotheses"]
    words = [h["words"] for h in want[utts[0].utt]]
    tot = {h["id"]: h["total"] for h in want[utts[0].utt]}
    post_ = np.exp(0.5 * (np.array(list(tot.values())) - max(tot.values())))
    post_ /= post_.sum()
    for h in hyps:
        risk = sum(p * align_counts(other, h["words"]).errors for other, p in zip(words, post_))
        assert h["expected_errors"] == pytest.approx(risk, rel=1e-6, abs=1e-9)
    assert [h["expected_errors"] for h in hyps] == sorted(h["expected_errors"] for h in hyps)


def test_lattices_match_cli(server, tmp_path, tiny_lm_dir, kenlm_model):
    fsts = sorted(LAT_DIR.glob("*.lat.fst"))
    proc = run_cli("rescore", *fsts, "--words", LAT_DIR / "words.txt", "--lm", tiny_lm_dir, "--ngram", kenlm_model,
                   "-o", tmp_path / "fst", "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    slfs = sorted(LAT_DIR.glob("*.lm.slf.gz"))
    proc = run_cli("rescore", *slfs, "--lm", tiny_lm_dir, "--ngram", kenlm_model, "-o", tmp_path / "slf",
                   "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    names = [p.name.split(".")[0] for p in fsts]
    r = post(server, "/rescore", {"utterances": [fst_utterance(p, n) for p, n in zip(fsts, names)], "nbest": 10})
    assert r.status_code == 200, r.text
    want = cli_nbest(tmp_path / "fst")
    for u in r.json()["utterances"]:
        assert u["source"] == "lattice"
        assert_same_hyps(want[u["id"]], u, by_id=False)
    # without `nbest`: the best path only (lattice_nbest defaults to 1), the CLI's first
    r = post(server, "/rescore", {"utterances": [fst_utterance(p, n) for p, n in zip(fsts, names)]})
    for u in r.json()["utterances"]:
        assert len(u["hypotheses"]) == 1
        assert u["hypotheses"][0]["words"] == want[u["id"]][0]["words"]
    slf_req = {"utterances": [{"id": p.name.split(".")[0], "lattice": {
        "format": "htk-slf", "data": gzip.decompress(p.read_bytes()).decode()}} for p in slfs], "nbest": 10}
    r = post(server, "/rescore", slf_req)
    assert r.status_code == 200, r.text
    want = cli_nbest(tmp_path / "slf")
    for u in r.json()["utterances"]:
        assert_same_hyps(want[u["id"]], u, by_id=False)
    # a mixed request: a lattice next to an n-best list, three best paths
    mixed = {"utterances": [fst_utterance(fsts[0], "lat"), nbest_request(read_nbest(TEST_DATA / "nbest.tsv")[:1])
                            ["utterances"][0]], "nbest": 3}
    body = post(server, "/rescore", mixed).json()
    assert [len(u["hypotheses"]) for u in body["utterances"]] == [3, 3]
    assert body["usage"]["lattice_arcs"] > 0


def test_score_and_context(server):
    r = post(server, "/score", {"sentences": ["the lord said", "", "and he said unto them"],
                                "return_token_logprobs": True})
    assert r.status_code == 200, r.text
    s = r.json()["sentences"]
    assert [x["tokens"] for x in s] == [4, 1, 6]
    for x in s:
        for lm in ("neural", "ngram"):
            assert x[lm]["logprob"] == pytest.approx(sum(x[lm]["token_logprobs"]), **TOL)
            assert x[lm]["perplexity"] == pytest.approx(2.718281828 ** (-x[lm]["logprob"] / x["tokens"]), rel=1e-6)
    # context, the previous transcript: the neural LM reads it and its </s>, then the hypothesis (the tail of the
    # two sentences read as one text); the n-gram starts at <s>
    req = {"utterances": [{"id": "c", "context": "and he said", "hypotheses": [
        {"text": "unto them", "am_score": -10.0}]}], "return_token_logprobs": True}
    h = post(server, "/rescore", req).json()["utterances"][0]["best"]
    both = post(server, "/score", {"sentences": ["and he said </s> unto them", "unto them"],
                                   "return_token_logprobs": True}).json()["sentences"]
    assert h["n_words"] == 2
    assert h["token_logprobs"]["neural"] == pytest.approx(both[0]["neural"]["token_logprobs"][4:], **TOL)
    assert h["token_logprobs"]["ngram"] == pytest.approx(both[1]["ngram"]["token_logprobs"], **TOL)
    assert h["token_logprobs"]["neural"] != pytest.approx(both[1]["neural"]["token_logprobs"], **TOL)


# ---------------------------------------------------------------------------------------------
# Malformed input and limits


def _check(r: httpx.Response, status: int, field: str | None = None, limit=None, text: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert isinstance(body["detail"], str) and body["detail"]
    if field is not None:
        assert body["field"] == field, body
    if limit is not None:
        assert body["limit"] == limit, body
    if text is not None:
        assert text in body["detail"], body
    return body


def hyp(text="the lord said", am=-10.0, **kw) -> dict:
    return {"text": text, "am_score": am, **kw}


def utt(*hyps, **kw) -> dict:
    return {"id": "u", "hypotheses": list(hyps) or [hyp()], **kw}


# ---------------------------------------------------------------------------------------------
# Concurrency, metrics


def _metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`, from a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        metric, _, lab = key.partition("{")
        if metric == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
    return total


def test_64_concurrent_clients(server, tiny_lm_dir, kenlm_model):
    from smallstate_lm.checkpoint import load_model
    from smallstate_lm.ngram import NgramLM
    from smallstate_lm.rescoring.nbest.components import apply_weights, compute_components
    from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance
    from smallstate_lm.scoring.scorer import NeuralScorer
    from smallstate_lm.weights import Weights

    base = read_nbest(TEST_DATA / "nbest.tsv")
    # 64 different small requests: 3..7 hypotheses of one utterance, some with their own weights
    reqs, utts, weights = [], [], []
    for k in range(64):
        u = base[k % len(base)]
        hyps = u.hyps[k % 5: k % 5 + 3 + k % 5]
        utts.append(Utterance(f"{u.utt}-{k}", [Hypothesis(h.words, h.am, h.graph, str(j)) for j, h in enumerate(hyps)]))
        w = {"lm_weight": 0.25 * (k % 4)} if k % 3 == 0 else {}
        weights.append(Weights(**w))
        reqs.append({**nbest_request(utts[-1:]), **({"weights": w} if w else {})})
    lm = load_model(tiny_lm_dir)
    comps, _ = compute_components(utts, NeuralScorer(lm.model, lm.vocab), NgramLM(kenlm_model), progress=False)
    want = [apply_weights([u], [c], w)[0] for u, c, w in zip(utts, comps, weights)]
    before = httpx.get(server.url + "/metrics").text

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*[client.post("/rescore", json=r) for r in reqs])

    rs = asyncio.run(run())
    batched = 0
    for r, ref in zip(rs, want):
        assert r.status_code == 200, r.text
        u = r.json()["utterances"][0]
        assert [h["id"] for h in u["hypotheses"]] == [h.id for h in ref.hyps]
        assert [h["total"] for h in u["hypotheses"]] == pytest.approx([h.scores["total"] for h in ref.hyps], **TOL)
        batched += r.json()["usage"]["batch_requests"] > 1
    assert batched > 0  # concurrent requests shared forward passes
    after = httpx.get(server.url + "/metrics").text
    count = lambda t: _metric(t, "smallstate_requests_total", route="/rescore", status="200")  # noqa: E731
    assert count(after) - count(before) == 64
    batches = _metric(after, "smallstate_batch_requests_count") - _metric(before, "smallstate_batch_requests_count")
    assert 0 < batches < 64
    assert _metric(after, "smallstate_request_duration_seconds_count", route="/rescore", status="200") >= 64
    assert _metric(after, "smallstate_tokens_total", kind="scored") > 0
    assert 'smallstate_model_info{' in after and 'device="cpu"' in after
    assert _metric(after, "smallstate_ready") == 1.0
    assert httpx.post(server.url + "/rescore", json={"utterances": []}).status_code == 422
    refused = _metric(httpx.get(server.url + "/metrics").text, "smallstate_requests_total", route="/rescore",
                      status="422")
    assert refused >= 1  # 4xx answers are counted by status too
    models = httpx.get(server.url + "/v1/models").json()
    assert models["neural"]["vocab_size"] == len(lm.vocab) and models["ngram"]["order"] == 3
    assert models["neural"]["tokenizer"] == "word"
    assert models["neural"]["state_numel_per_position"] == lm.model.state_numel_per_position()
    cost = models["cost_model"]  # calibrated on this machine at warm-up
    assert cost["calibrated"] and cost["node_s"] > 0 and cost["row_s"] > 0 and 0 < cost["lattice_ratio"] <= 1
    assert cost["state_bytes_per_position"] == lm.model.state_numel_per_position() * 4


def test_models_and_metrics_name_models_without_their_paths(server, tiny_lm_dir, kenlm_model):
    models = httpx.get(server.url + "/v1/models").text
    text = httpx.get(server.url + "/metrics").text
    for shown in (models, text):
        assert str(tiny_lm_dir.parent) not in shown and str(kenlm_model.parent) not in shown
    m = json.loads(models)
    assert m["neural"]["name"] == tiny_lm_dir.name and m["ngram"]["name"] == kenlm_model.name
    assert f'lm="{tiny_lm_dir.name}"' in text and f'ngram="{kenlm_model.name}"' in text


def test_openapi_says_words_have_no_whitespace(server):
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    assert {"RescoreRequest", "ScoreRequest", "RescoreResponse"} <= schemas.keys()
    words = schemas["HypothesisIn"]["properties"]["words"]
    item = next(a["items"] for a in words["anyOf"] if a.get("type") == "array")
    assert item["pattern"] == r"^\S+$" and item["maxLength"] == 1000
    assert "1000" in schemas["HypothesisIn"]["properties"]["text"]["description"]


def test_arrivals_are_counted_across_front_ends(tiny_lm_dir, kenlm_model, tmp_path):
    """Two front-ends, one engine that waits up to 2 s for company while requests are on their way in to any
    front-end: mixed good and bad requests share batches, and afterwards none is counted as on its way in (a lone
    request would wait the 2 s for it otherwise)."""
    srv = Server(tiny_lm_dir, kenlm_model, "max_wait_ms=2000", "frontends=2", "drain_seconds=0",
                 log=tmp_path / "server.log")
    good = {"utterances": [utt()]}
    bodies = [good, {"utterances": []}, good, {"sentences": ["the lord"]}, {"utterances": [utt(hyp("a " * 300))]}]
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                rs = await asyncio.gather(*[client.post("/score" if "sentences" in b else "/rescore", json=b)
                                            for b in bodies * 4])
                await client.post("/rescore", content=b"{", headers={"content-type": "application/json"})
                return rs

        rs = asyncio.run(run())
        assert [r.status_code for r in rs] == [200, 422, 200, 200, 422] * 4
        assert max(r.json()["usage"]["batch_requests"] for r in rs if r.status_code == 200) > 1
        lone = post(srv, "/rescore", good).json()["usage"]
        assert lone["batch_requests"] == 1 and lone["queue_ms"] < 1000
    finally:
        assert srv.stop() == 0, srv.log.read_text()


# ---------------------------------------------------------------------------------------------
# Graceful shutdown


def test_sigterm_finishes_accepted_requests(tiny_lm_dir, kenlm_model, tmp_path):
    # a fixed 2 s batching wait keeps requests in flight long enough to signal the server under them
    srv = Server(tiny_lm_dir, kenlm_model, "max_wait_ms=2000", "wait_for_arrivals=false", "drain_seconds=1.0",
                 log=tmp_path / "server.log")
    utts = read_nbest(TEST_DATA / "nbest.tsv")
    reference = post(srv, "/rescore", nbest_request(utts[:1])).json()["utterances"][0]["hypotheses"]
    results: list = []
    stop = threading.Event()

    def one(_=None):
        try:
            with httpx.Client(timeout=30) as c:  # a connection of its own: no keep-alive races
                r = c.post(srv.url + "/rescore", json=nbest_request(utts[:1]))
            results.append(r)
            return r
        except httpx.TransportError as e:  # refused or reset before the server took the request
            results.append(e)
            return e

    def background():
        while not stop.is_set() and not isinstance(one(), httpx.TransportError):
            pass

    with ThreadPoolExecutor(12) as ex:
        for _ in range(4):
            ex.submit(background)
        inflight = [ex.submit(one) for _ in range(8)]
        deadline = time.monotonic() + 10
        while _metric(httpx.get(srv.url + "/metrics").text, "smallstate_requests_in_progress",
                      route="/rescore") < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        assert httpx.get(srv.url + "/readyz").status_code == 503  # draining, still serving
        assert httpx.get(srv.url + "/healthz").status_code == 200
        in_flight = [f.result() for f in inflight]
        stop.set()
    assert srv.proc.wait(30) == 0, (tmp_path / "server.log").read_text()
    for r in in_flight:
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
    answered = [r for r in results if isinstance(r, httpx.Response)]
    for r in answered:
        assert r.status_code == 200, r.text
        assert [h["total"] for h in r.json()["utterances"][0]["hypotheses"]] == pytest.approx(
            [h["total"] for h in reference], **TOL)
    assert len(answered) >= 8
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url + "/healthz", timeout=2)
    assert "Traceback" not in (tmp_path / "server.log").read_text()


# ---------------------------------------------------------------------------------------------
# Property-based: schemathesis against the running server's OpenAPI schema


@pytest.mark.skipif(shutil.which("st", path=str(Path(sys.executable).parent)) is None,
                    reason="schemathesis is not installed")
def test_schemathesis_finds_no_server_error(server, tmp_path):
    st = str(Path(sys.executable).parent / "st")
    n = os.environ.get("SMALLSTATE_SCHEMATHESIS_EXAMPLES", "15")
    proc = subprocess.run([st, "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
                           "--max-examples", n, "--seed", "1", "--no-shrink", "--request-timeout", "30",
                           "--phases", "examples,coverage,fuzzing", "--workers", "2",
                           "--suppress-health-check", "all"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"Test cases:\s*(\d+) generated", out)
    assert m and int(m.group(1)) > 50, out[-3000:]
    print(out[-1500:])


def test_lattice_transcripts_with_confidences_match_the_cli(server, tmp_path, tiny_lm_dir, kenlm_model):
    fsts = sorted(LAT_DIR.glob("*.lat.fst"))
    names = [p.name.split(".")[0] for p in fsts]
    proc = run_cli("rescore", *fsts, "--words", LAT_DIR / "words.txt", "--lm", tiny_lm_dir, "--ngram", kenlm_model,
                   "-o", tmp_path / "mbr", "--quiet", "--device", "cpu", "--decode", "mbr")
    assert proc.returncode == 0, proc.stderr
    cli = {r["utt"]: r for r in map(json.loads, (tmp_path / "mbr" / "nbest.jsonl").read_text().splitlines())}
    lattices = [fst_utterance(p, n) for p, n in zip(fsts, names)]
    for decode in ("viterbi", "mbr"):
        body = {"utterances": lattices + nbest_request(read_nbest(TEST_DATA / "nbest.tsv")[:1])["utterances"],
                "weights": {"decode": decode}}
        r = post(server, "/rescore", body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["weights"]["decode"] == decode and out["weights"]["posterior_scale"] > 0
        *lats, listed = out["utterances"]
        assert "transcript" not in listed  # hypothesis lists have none: their best has its words' confidences
        conf = listed["best"]["confidences"]
        assert len(conf) == len(listed["best"]["words"]) and all(0.0 <= c <= 1.0 for c in conf)
        assert conf == listed["hypotheses"][0]["confidences"]
        assert all("confidences" not in h for h in listed["hypotheses"][1:])
        for u in lats:
            t = u["transcript"]
            assert t["decode"] == decode and len(t["confidences"]) == len(t["words"])
            assert all(0.0 <= c <= 1.0 for c in t["confidences"])
            want = cli[u["id"]]
            if decode == "viterbi":
                assert t["words"] == u["best"]["words"] == want["hyps"][0]["words"]
                assert t["confidences"] == pytest.approx(want["hyps"][0]["confidences"], abs=1e-6)
            else:
                assert t["words"] == want["consensus"]["words"]
                assert t["confidences"] == pytest.approx(want["consensus"]["confidences"], abs=1e-6)
    r = post(server, "/rescore", {"utterances": lattices[:1], "weights": {"decode": "consensus"}})
    assert r.status_code == 422 and "decode" in r.text
    r = post(server, "/rescore", {"utterances": lattices[:1], "weights": {"posterior_scale": 0}})
    assert r.status_code == 422 and "posterior_scale" in r.text


def test_responses_are_the_schemas_response_models(server):
    """Responses are built without the pydantic models, so each must still be exactly what its documented
    model holds: it validates, and dumping the validated model (set fields only) gives the same JSON, for
    lists with every option, lattices under both decodings and /score with and without token log-probs."""
    from smallstate_lm.service.schemas import RescoreResponse, ScoreResponse

    lists = nbest_request(read_nbest(TEST_DATA / "nbest.tsv")[:3])
    fst = sorted(LAT_DIR.glob("*.lat.fst"))[0]
    requests = [("/rescore", RescoreResponse, {**lists, "return_token_logprobs": True}),
                ("/rescore", RescoreResponse, {**lists, "weights": {"mbr_scale": 1.0}, "nbest": 2}),
                ("/score", ScoreResponse, {"sentences": ["the lord said", "and god"], "return_token_logprobs": True}),
                ("/score", ScoreResponse, {"sentences": ["the lord said"]})]
    requests += [("/rescore", RescoreResponse, {"utterances": [fst_utterance(fst, "lat")], "weights": {"decode": d}})
                 for d in ("viterbi", "mbr")]
    for route, model, body in requests:
        r = post(server, route, body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert model.model_validate(got).model_dump(mode="json", exclude_unset=True) == got, (route, body)
        for u in got.get("utterances", []):
            assert ("transcript" in u) == (u["source"] == "lattice")  # a lattice's confidences are its transcript's
            assert ("confidences" in u["best"]) == (u["source"] == "hypotheses")
            assert all("confidences" not in h for h in u["hypotheses"][1:])
            assert ("expected_errors" in u["best"]) == ("mbr_scale" in body.get("weights", {}))
