"""Lattice rescoring by expansion: hand-made lattices whose best path under a known LM
is worked out in the test, consistency with n-best scoring, and real dev lattices."""

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_DATA, run_cli

from smallstate_lm.checkpoint import load_model
from smallstate_lm.ngram import NgramLM, build_ngram
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst, read_fst_text
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.rescoring.nbest.components import compute_components, totals
from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.weights import Weights

LAT_DIR = TEST_DATA / "lattices"


@pytest.fixture(scope="module")
def bigram(tmp_path_factory) -> NgramLM:
    d = tmp_path_factory.mktemp("bigram")
    (d / "text.txt").write_text("the lord said\n" * 5 + "the lord spoke\n" + "the man said\n" * 2)
    build_ngram(d / "text.txt", 2, d / "lm.arpa")
    return NgramLM(d / "lm.arpa")


SYMS = ["the", "lord", "man", "said", "spoke", "<sil>"]


def sausage_text(sym: SymbolTable) -> str:
    """the (lord | man) (said | spoke), with an epsilon/silence chain in the middle."""
    i = sym.id
    return "\n".join([
        f"0 1 {i('the')} {i('the')} 1,10",
        f"1 2 {i('lord')} {i('lord')} 1,10",
        f"1 2 {i('man')} {i('man')} 0.5,9",
        "2 3 0 0 0,1",
        f"3 4 {i('<sil>')} {i('<sil>')} 0,2",
        f"4 5 {i('said')} {i('said')} 1,10",
        f"4 5 {i('spoke')} {i('spoke')} 0.2,10",
        "5 0.3,0",
    ]) + "\n"


def direct_total(words, w: Weights, lat_costs: dict, ngram: NgramLM | None = None, scorer=None) -> float:
    """The total of one word sequence computed without the lattice machinery."""
    am, graph = lat_costs[tuple(words)]
    h = Hypothesis(list(words), am=-am, graph=-graph)
    comps, _ = compute_components([Utterance("u", [h])], scorer, ngram, progress=False)
    return float(totals(comps[0], w)[0])


SAUSAGE_COSTS = {  # (acoustic, graph) summed along each path, final weight included
    ("the", b, c): (10 + (10 if b == "lord" else 9) + 1 + 2 + 10,
                    1 + (1 if b == "lord" else 0.5) + (1 if c == "said" else 0.2) + 0.3)
    for b, c in itertools.product(["lord", "man"], ["said", "spoke"])
}


def kaldifst_best_words(path, sym: SymbolTable, am_scale: float) -> list[str]:
    """Words on kaldifst's own shortest path of the lattice (acoustics scaled), fillers dropped."""
    import kaldifst

    k = kaldifst.Lattice.read(str(path))
    kaldifst.scale_lattice([[1.0, 0.0], [0.0, am_scale]], k)
    best = kaldifst.shortest_path(k)
    olabels = kaldifst.get_linear_symbol_sequence(best)[2]
    return [sym.word(i) for i in olabels if sym.is_word(i)]


def test_ngram_picks_the_best_path_worked_out_directly(bigram):
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, graph_scale=1.0, lm_weight=0.0, ngram_weight=1.0, word_penalty=0.3)
    exp = LatticeRescorer(w, ngram=bigram, config=ExpandConfig(max_ngram_order=None)).expand(lat)
    got = exp.nbest(w, 4)
    expected = sorted(SAUSAGE_COSTS, key=lambda p: -direct_total(p, w, SAUSAGE_COSTS, bigram))
    assert [tuple(h.words) for h in got] == expected  # all four paths, in the directly computed order
    for h in got:
        assert math.isclose(h.total, direct_total(h.words, w, SAUSAGE_COSTS, bigram), abs_tol=1e-6)
    # the first pass alone prefers the cheaper graph path; the LM changes the answer
    first, _ = lat.prepare().best_path(0.1, 1.0)
    assert first == ["the", "man", "spoke"] and got[0].words == ["the", "lord", "said"]


def test_neural_exact_expansion_equals_nbest_scoring_of_each_path(tiny_lm_dir, bigram):
    lm = load_model(tiny_lm_dir)
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, graph_scale=0.5, lm_weight=0.7, ngram_weight=0.4, word_penalty=-0.1)
    exp = LatticeRescorer(w, lm.model, lm.vocab, bigram, ExpandConfig(max_ngram_order=None)).expand(lat)
    scorer = NeuralScorer(lm.model, lm.vocab)
    for h in exp.nbest(w, 4):
        assert math.isclose(h.total, direct_total(h.words, w, SAUSAGE_COSTS, bigram, scorer), abs_tol=1e-4)


def test_merging_with_a_long_enough_order_equals_exact(tiny_lm_dir, bigram):
    lm = load_model(tiny_lm_dir)
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, lm_weight=1.0, ngram_weight=0.5)
    exact = LatticeRescorer(w, lm.model, lm.vocab, bigram, ExpandConfig(max_ngram_order=None)).expand(lat)
    long = LatticeRescorer(w, lm.model, lm.vocab, bigram, ExpandConfig(max_ngram_order=5)).expand(lat)
    short = LatticeRescorer(w, lm.model, lm.vocab, bigram, ExpandConfig(max_ngram_order=2)).expand(lat)
    assert long.nbest(w, 1)[0].total == pytest.approx(exact.nbest(w, 1)[0].total, abs=1e-5)
    assert short.stats.expanded_states < exact.stats.expanded_states  # histories merged


def test_reweighting_an_exact_expansion_needs_no_lm(tiny_lm_dir, bigram):
    lm = load_model(tiny_lm_dir)
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w1 = Weights(am_scale=0.1, lm_weight=1.0, ngram_weight=0.0)
    w2 = Weights(am_scale=0.1, lm_weight=0.2, ngram_weight=1.5, word_penalty=1.0)
    cfg = ExpandConfig(max_ngram_order=None, beam=1e9)
    e1 = LatticeRescorer(w1, lm.model, lm.vocab, bigram, cfg).expand(lat)
    e2 = LatticeRescorer(w2, lm.model, lm.vocab, bigram, cfg).expand(lat)
    assert [h.words for h in e1.nbest(w2, 4)] == [h.words for h in e2.nbest(w2, 4)]
    assert np.allclose([h.total for h in e1.nbest(w2, 4)], [h.total for h in e2.nbest(w2, 4)])


def test_words_absent_from_the_lm_are_unk_and_counted(tiny_lm_dir):
    lm = load_model(tiny_lm_dir)
    sym = SymbolTable.from_words(["the", "qzxv"])
    lat = read_fst_text("0 1 1 1 0,1\n1 2 2 2 0,1\n2\n", sym, name="oov")
    w = Weights(am_scale=0.1, lm_weight=1.0, ngram_weight=0.0, oov_penalty=-2.0)
    h = LatticeRescorer(w, lm.model, lm.vocab).expand(lat).nbest(w, 1)[0]
    assert h.words == ["the", "qzxv"] and h.n_oov == 1
    alone = NeuralScorer(lm.model, lm.vocab).token_logprobs([[["the", "<unk>"]]])[0][0]
    assert math.isclose(h.neural, float(alone.sum()), abs_tol=1e-4)


def test_max_states_prunes_harder_and_says_so(bigram):
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, ngram_weight=1.0, lm_weight=0.0)
    exp = LatticeRescorer(w, ngram=bigram, config=ExpandConfig(max_ngram_order=None, max_states=2)).expand(lat)
    assert exp.stats.pruned_harder and exp.nbest(w, 1)


def _dev_lattices():
    return sorted(LAT_DIR.glob("*.lat.fst"))


@pytest.mark.parametrize("path", _dev_lattices(), ids=lambda p: p.name)
def test_lm_weight_zero_gives_the_first_pass_best_path(path, bigram):
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    lat = read_fst(path, sym)
    w = Weights(am_scale=1 / 9.5, graph_scale=1.0, lm_weight=0.0, ngram_weight=0.0)
    got = LatticeRescorer(w, ngram=bigram).expand(lat).nbest(w, 1)[0]
    assert got.words == kaldifst_best_words(path, sym, 1 / 9.5)


def test_a_run_without_references_skips_the_first_pass_and_nothing_else(bigram):
    """The decoder's own best path is found while preparing only for a first-pass WER; without it the
    expansion is the same, and asking for the first pass still answers (from the lattice itself)."""
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    lats = [read_fst(p, sym) for p in _dev_lattices()]
    w = Weights(am_scale=1 / 9.5, ngram_weight=0.6, lm_weight=0.0)
    both = [dict(LatticeRescorer(w, ngram=bigram, config=ExpandConfig(first_pass=fp)).expand_many(lats))
            for fp in (True, False)]
    for i, x in both[0].items():
        y = both[1][i]
        assert x.first_pass is not None and y.first_pass is None
        for f in dataclasses.fields(x):
            a, b = getattr(x, f.name), getattr(y, f.name)
            if isinstance(a, np.ndarray):
                assert np.array_equal(a, b), f.name
        assert x.nbest(w, 5) == y.nbest(w, 5) and x.stats.expanded_states == y.stats.expanded_states
        assert y.first_pass_words(w.am_scale) == x.first_pass_words(w.am_scale) == x.first_pass[1]


def test_rescored_lattice_round_trips_and_keeps_the_best_path(tmp_path, tiny_lm_dir, bigram):
    from smallstate_lm.rescoring.formats.lattice_io import write_fst

    path = _dev_lattices()[0]
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    lm = load_model(tiny_lm_dir)
    w = Weights(am_scale=1 / 9.5, graph_scale=0.5, lm_weight=0.3, ngram_weight=0.3)
    exp = LatticeRescorer(w, lm.model, lm.vocab, bigram).expand(read_fst(path, sym))
    best = exp.nbest(w, 1)[0]
    write_fst(tmp_path / "r.lat.fst", exp.to_lattice(w))
    back = read_fst(tmp_path / "r.lat.fst", sym).prepare()
    words, cost = back.best_path(w.am_scale, 1.0)
    assert words == best.words and math.isclose(-cost, best.total, abs_tol=1e-3)


def test_cli_rescores_lattices_and_skips_a_broken_one(tmp_path, tiny_lm_dir, kenlm_model):
    lats = _dev_lattices()[:2]
    broken = tmp_path / "broken.lat.fst"
    broken.write_bytes(lats[0].read_bytes()[:100])
    out = tmp_path / "out"
    proc = run_cli("rescore", *lats, broken, "--words", LAT_DIR / "words.txt", "--lm", tiny_lm_dir, "--ngram",
                   kenlm_model, "-o", out, "--quiet", "--set", "am_scale=0.105")
    assert proc.returncode == 2, proc.stderr
    assert "broken.lat.fst" in proc.stderr and "Traceback" not in proc.stderr
    assert "2 lattices" in proc.stdout and "expanded states" in proc.stdout and "LM calls" in proc.stdout
    assert len((out / "best.txt").read_text().splitlines()) == 2
    assert len(list((out / "lattices").glob("*.lat.fst"))) == 2
    assert not (out / "lattices" / "broken.lat.fst").exists()


def test_slf_and_fst_versions_rescore_alike(tiny_lm_dir, bigram):
    from smallstate_lm.rescoring.formats.lattice_io import read_slf

    sym = SymbolTable.read(LAT_DIR / "words.txt")
    lm = load_model(tiny_lm_dir)
    w = Weights(am_scale=1 / 9.5, graph_scale=0.7, lm_weight=0.3, ngram_weight=0.3)
    for fst in _dev_lattices()[:2]:
        slf = Path(str(fst).replace(".lat.fst", ".lm.slf.gz"))
        a = LatticeRescorer(w, lm.model, lm.vocab, bigram).expand(read_fst(fst, sym)).nbest(w, 1)[0]
        b = LatticeRescorer(w, lm.model, lm.vocab, bigram).expand(read_slf(slf, sym)).nbest(w, 1)[0]
        assert a.words == b.words and math.isclose(a.total, b.total, abs_tol=1e-3)


def test_tune_on_lattices_then_rescore_reproduces_its_wer(tmp_path, kenlm_model):
    import json
    import re

    lats = _dev_lattices()
    refs = LAT_DIR / "ref.txt"
    weights = tmp_path / "w.json"
    proc = run_cli("tune", *lats, "--words", LAT_DIR / "words.txt", "--refs", refs, "--ngram",
                   kenlm_model, "--set", "am_scale=0.105", "--search", "ngram_weight,word_penalty", "-o", weights,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    tuned = json.loads(weights.read_text())
    assert tuned["dev_wer"] <= tuned["dev_first_pass_wer"]
    out = tmp_path / "out"
    proc = run_cli("rescore", *lats, "--words", LAT_DIR / "words.txt", "--ngram", kenlm_model, "--weights", weights,
                   "--refs", refs, "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    wer = float(re.search(r"%WER ([\d.]+)", (out / "wer.txt").read_text()).group(1))
    assert abs(wer - 100 * tuned["dev_wer"]) < 0.01


def test_tune_on_lattices_searches_the_linear_weight_with_the_neural_lm_in_the_expansion(
        tmp_path, kenlm_model, tiny_lm_dir):
    import json

    lats = _dev_lattices()[:2]
    weights = tmp_path / "w.json"
    proc = run_cli("tune", *lats, "--words", LAT_DIR / "words.txt", "--refs", LAT_DIR / "ref.txt", "--lm",
                   tiny_lm_dir, "--ngram", kenlm_model, "--set", "am_scale=0.105", "--set", "interpolation=linear",
                   "--search", "lam,lm_weight", "-o", weights, "--quiet")
    assert proc.returncode == 0, proc.stderr
    tuned = json.loads(weights.read_text())
    assert tuned["interpolation"] == "linear" and 0.0 <= tuned["lam"] <= 1.0
    assert "WER% vs lam" in proc.stdout  # lam leads the search: the components change with it
