"""Minimum-Bayes-risk selection over n-best lists: ranking, vectorised tuning, CLI."""

import dataclasses
import json
import math

import numpy as np
import pytest
from conftest import TEST_DATA, run_cli

from smallstate_lm.errors import ConfigError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.decode.wer import align_counts, pairwise_errors
from smallstate_lm.rescoring.nbest.components import (
    Components,
    apply_weights,
    compute_components,
    mbr_distances,
    ranking,
    totals,
)
from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance, read_nbest, read_text
from smallstate_lm.rescoring.runs.tune import MBR_GRID, _Stack, hypothesis_errors, tune
from smallstate_lm.weights import Weights, weight_vector

# One outlier with the best score, three hypotheses that agree with each other.
WORDS = [["x", "y", "z"], ["a", "b", "c"], ["a", "b", "d"], ["a", "e", "c"]]
AM = [0.0, -1.0, -1.2, -1.4]


def consensus_utterance() -> tuple[Utterance, Components]:
    u = Utterance("u1", [Hypothesis(words=w, am=a, graph=0.0, id=str(i)) for i, (w, a) in enumerate(zip(WORDS, AM))])
    c = Components(am=np.array(AM), graph=np.zeros(4), n_words=np.full(4, 3.0), n_oov=np.zeros(4))
    return u, c


def risk_by_definition(words, tot, scale):
    post = [math.exp(scale * t) for t in tot]
    z = sum(post)
    return [sum(p / z * align_counts(other, w).errors for other, p in zip(words, post)) for w in words]


def test_pairwise_errors_are_word_edit_distances():
    d = pairwise_errors(WORDS)
    assert d.shape == (4, 4) and np.array_equal(d, d.T) and not d.diagonal().any()
    for i in range(4):
        for j in range(4):
            assert d[i, j] == align_counts(WORDS[i], WORDS[j]).errors
    assert d[1, 2] == 1 and d[0, 1] == 3


def test_mbr_prefers_the_consensus_and_large_scales_fall_back_to_the_best_total():
    u, c = consensus_utterance()
    w = Weights(am_scale=1.0, graph_scale=0.0, lm_weight=0.0, ngram_weight=0.0)
    assert ranking(u, c, w)[0][0] == 0  # highest total
    order, tot, risk = ranking(u, c, dataclasses.replace(w, mbr_scale=0.5))
    assert np.allclose(risk, risk_by_definition(WORDS, tot, 0.5))
    assert order[0] == 1  # agrees best with the others
    assert list(order) == sorted(range(4), key=lambda j: (risk[j], -tot[j]))
    assert ranking(u, c, dataclasses.replace(w, mbr_scale=50.0))[0][0] == 0  # posterior ~ a point mass


def test_apply_weights_reports_expected_errors_in_rank_order():
    u, c = consensus_utterance()
    ranked = apply_weights([u], [c], Weights(am_scale=1.0, lm_weight=0.0, ngram_weight=0.0, mbr_scale=0.5))[0]
    risks = [h.scores["expected_errors"] for h in ranked.hyps]
    assert risks == sorted(risks) and [h.scores["rank"] for h in ranked.hyps] == [0, 1, 2, 3]
    assert ranked.hyps[0].words == ["a", "b", "c"]
    plain = apply_weights([u], [c], Weights(am_scale=1.0, lm_weight=0.0, ngram_weight=0.0))[0]
    assert "expected_errors" not in plain.hyps[0].scores


def test_weights_carry_the_mbr_scale(tmp_path):
    w = Weights(mbr_scale=0.7)
    w.save(tmp_path / "w.json")
    assert Weights.load(tmp_path / "w.json") == w
    with pytest.raises(ConfigError, match="mbr_scale"):
        Weights(mbr_scale=-1.0)


@pytest.fixture(scope="module")
def dev_lists(kenlm_model):
    utts = read_nbest(TEST_DATA / "nbest.tsv")
    comps, _ = compute_components(utts, None, NgramLM(kenlm_model), progress=False)
    return utts, comps, read_text(TEST_DATA / "ref.txt")


def test_vectorised_mbr_errors_match_ranking_each_list(dev_lists):
    utts, comps, refs = dev_lists
    errs, _ = hypothesis_errors(utts, refs)
    stack = _Stack(comps, errs, [mbr_distances(u, c) for u, c in zip(utts, comps)])
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = Weights(am_scale=0.105, graph_scale=float(rng.uniform(0, 1)), lm_weight=0.0,
                    ngram_weight=float(rng.uniform(0, 1.5)), word_penalty=float(rng.uniform(-2, 2)))
        for scale in (0.0, 0.3, 2.0):
            ws = dataclasses.replace(w, mbr_scale=scale)
            expected = sum(int(e[ranking(u, c, ws)[0][0]]) for u, c, e in zip(utts, comps, errs))
            assert stack.errors(weight_vector(ws)[None], scale)[0] == expected
            if scale == 0.0:
                assert expected == sum(int(e[np.argmax(totals(c, ws))]) for c, e in zip(comps, errs))


def test_tune_with_mbr_never_does_worse_on_its_own_data(dev_lists):
    utts, comps, refs = dev_lists
    base = Weights(am_scale=0.105, lm_weight=0.0)
    grid = {"graph_scale": [0.0, 0.5, 1.0], "ngram_weight": [0.0, 0.5, 1.0], "word_penalty": [-1.0, 0.0, 1.0]}
    plain = tune(utts, comps, refs, base, grid)
    with_mbr = tune(utts, comps, refs, base, grid, mbr=True)
    assert with_mbr.errors <= plain.errors
    assert with_mbr.weights.mbr_scale in MBR_GRID
    assert [m for m, _ in with_mbr.mbr_errors] == MBR_GRID
    assert dict(with_mbr.mbr_errors)[0.0] == plain.errors  # scale 0 is the plain choice
    errs, _ = hypothesis_errors(utts, refs)
    chosen = sum(int(e[ranking(u, c, with_mbr.weights)[0][0]]) for u, c, e in zip(utts, comps, errs))
    assert chosen == with_mbr.errors


def test_cli_tune_mbr_then_rescore(tmp_path, kenlm_model):
    weights = tmp_path / "weights.json"
    proc = run_cli("tune", "--nbest", TEST_DATA / "nbest.tsv", "--refs", TEST_DATA / "ref.txt", "--ngram",
                   kenlm_model, "-o", weights, "--set", "am_scale=0.105", "--mbr", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "WER% vs mbr_scale" in proc.stdout
    tuned = json.loads(weights.read_text())
    assert tuned["mbr_scale"] in MBR_GRID
    out = tmp_path / "out"
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--ngram", kenlm_model, "--weights", weights,
                   "--set", "mbr_scale=0.5", "--refs", TEST_DATA / "ref.txt", "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    for line in (out / "nbest.jsonl").read_text().splitlines():
        hyps = json.loads(line)["hyps"]
        risks = [h["expected_errors"] for h in hyps if "expected_errors" in h]
        assert risks and risks == sorted(risks)
    proc = run_cli("tune", TEST_DATA / "lattices" / "slt-dev0000.lat.fst", "--refs", TEST_DATA / "ref.txt", "--ngram",
                   kenlm_model, "-o", weights, "--mbr", "--quiet")
    assert proc.returncode == 2 and "--mbr" in proc.stderr and "Traceback" not in proc.stderr


W_TIE = Weights(am_scale=1.0, graph_scale=0.0, lm_weight=0.0, ngram_weight=0.0, mbr_scale=0.5)


def make_list(words, am):
    u = Utterance("u", [Hypothesis(words=w.split(), am=a, graph=0.0, id=str(i)) for i, (w, a) in
                        enumerate(zip(words, am))])
    c = Components(am=np.array(am, dtype=float), graph=np.zeros(len(am)),
                   n_words=np.array([len(w.split()) for w in words], dtype=float), n_oov=np.zeros(len(am)))
    return u, c


def test_tied_risks_go_to_the_first_hypothesis_in_ranking_and_tuning():
    # equal totals: a uniform posterior; "b a" and "a a" both have expected errors 1.4
    u, c = make_list(["b a", "b b", "c", "a a", "a c c"], [0.0] * 5)
    order, tot, risk = ranking(u, c, W_TIE)
    assert risk[0] == risk[3]
    assert order[0] == 0
    errs = [np.arange(5, dtype=float)]  # the error count names the chosen hypothesis
    stack = _Stack([c], errs, [mbr_distances(u, c)])
    assert stack.errors(weight_vector(W_TIE)[None], W_TIE.mbr_scale)[0] == order[0]
    risks = [h.scores["expected_errors"] for h in apply_weights([u], [c], W_TIE)[0].hyps]
    assert risks == sorted(risks)


def test_vectorised_mbr_matches_ranking_on_random_lists():
    rng = np.random.default_rng(5)
    vocab = list("abc")
    for _ in range(300):
        us, cs, errs = [], [], []
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.choice([1, 2, 4, 6, 103]))
            u, c = make_list([" ".join(rng.choice(vocab, rng.integers(1, 4))) for _ in range(n)],
                         rng.integers(-2, 1, n).astype(float).tolist())
            us.append(u), cs.append(c), errs.append(rng.integers(0, 4, n).astype(float))
        stack = _Stack(cs, errs, [mbr_distances(u, c) for u, c in zip(us, cs)])
        for scale in (0.5, 1.0):
            w = Weights(am_scale=1.0, graph_scale=0.0, lm_weight=0.0, ngram_weight=0.0, mbr_scale=scale)
            want = sum(e[ranking(u, c, w)[0][0]] for u, c, e in zip(us, cs, errs))
            assert stack.errors(weight_vector(w)[None], scale)[0] == want
