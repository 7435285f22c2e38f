"""Every model family through every rescoring path: n-best (prefix-shared and padded),
lattices, the CLI and the service, with small random-weight models on the test data."""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DATA, run_cli
from test_server import LAT_DIR, Server, assert_same_hyps, cli_nbest, fst_utterance, nbest_request, post
from test_state_contract import shrunk

from smallstate_lm.checkpoint import load_model, save_checkpoint
from smallstate_lm.models import PRESETS, build_model
from smallstate_lm.rescoring.nbest.lists import read_nbest
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.vocab import EOS_ID, Vocabulary

OTHER = [name for name, cfg in PRESETS.items() if cfg.arch != "transformer"]
# one preset per architecture family goes through the CLI and a live server
PER_ARCH = list({PRESETS[name].arch: name for name in reversed(OTHER)}.values())


def small_run(name: str, vocab: Vocabulary, out) -> torch.nn.Module:
    cfg = shrunk(name, False, vocab_size=len(vocab), n_layers=min(PRESETS[name].n_layers, 2))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "model.pt", model, vocab)
    return model


@pytest.fixture(scope="module")
def vocab(tiny_lm_dir) -> Vocabulary:
    return load_model(tiny_lm_dir).vocab


@pytest.mark.parametrize("name", OTHER)
@torch.no_grad()
def test_nbest_scores_equal_each_sentence_alone(name, vocab, tmp_path):
    model = small_run(name, vocab, tmp_path / name)
    utts = read_nbest(TEST_DATA / "nbest.tsv")[:3]
    groups = [[h.words for h in u.hyps] for u in utts]
    shared = NeuralScorer(model, vocab, share_prefixes=True).token_logprobs(groups)
    padded = NeuralScorer(model, vocab, share_prefixes=False).token_logprobs(groups)
    for g, hyps in enumerate(groups):
        for j, words in enumerate(hyps[:10]):
            ids = torch.tensor([vocab.encode(words) + [EOS_ID]])
            alone, _ = model.score(ids, model.initial_state(1))
            assert abs(shared[g][j].sum() - float(alone.sum())) <= 1e-4
            assert abs(padded[g][j].sum() - float(alone.sum())) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", PER_ARCH)
def test_cli_and_service_rescore_with_each_family(name, vocab, kenlm_model, tmp_path):
    run = tmp_path / "run"
    small_run(name, vocab, run)
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", run, "--ngram", kenlm_model, "-o", tmp_path / "nb",
                   "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    fsts = sorted(LAT_DIR.glob("*.lat.fst"))[:2]
    proc = run_cli("rescore", *fsts, "--words", LAT_DIR / "words.txt", "--lm", run, "--ngram", kenlm_model,
                   "-o", tmp_path / "lat", "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "lat" / "best.txt").read_text().splitlines()) == 2
    server = Server(run, kenlm_model, "drain_seconds=0", log=tmp_path / "server.log")
    try:
        utts = read_nbest(TEST_DATA / "nbest.tsv")[:2]
        r = post(server, "/rescore", nbest_request(utts))
        assert r.status_code == 200, r.text
        want = cli_nbest(tmp_path / "nb")
        for u in r.json()["utterances"]:
            assert_same_hyps(want[u["id"]], u, by_id=True)
        names = [p.name.split(".")[0] for p in fsts]
        r = post(server, "/rescore", {"utterances": [fst_utterance(p, n) for p, n in zip(fsts, names)], "nbest": 10})
        assert r.status_code == 200, r.text
        want = cli_nbest(tmp_path / "lat")
        for u in r.json()["utterances"]:
            assert_same_hyps(want[u["id"]], u, by_id=False)
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log.read_text()
