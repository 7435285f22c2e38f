"""The array expansion (issue 16) builds the same expanded graph as the per-state expansion
it replaced (tests/reference_expansion.py): same states in the same order, same arcs, same
scores, same merged-state counts, on the bundled and test lattices, with the n-gram alone
(bit for bit, exact and merged, and when pruning tightens) and with a neural LM (scores within 1e-5)."""

import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_DATA
from reference_expansion import LatticeRescorer as ReferenceRescorer
from test_kaldi_archive import random_lattice

from smallstate_lm.checkpoint import load_model
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_lattice
from smallstate_lm.rescoring.lattices.lattice import LatticeFormatError, LatticeWarning, SymbolTable
from smallstate_lm.weights import Weights

ROOT = Path(__file__).resolve().parent.parent
W = Weights(am_scale=0.1, graph_scale=0.6, lm_weight=0.8, ngram_weight=0.4, word_penalty=-0.5, oov_penalty=-1.0)
ARRAYS = ("node_lat", "src", "dst", "word", "acoustic", "graph", "is_word", "oov", "final_node", "final_acoustic",
          "final_graph")


def lattices() -> list:
    out = []
    for d in (ROOT / "lattices", TEST_DATA / "lattices"):
        sym = SymbolTable.read(d / "words.txt")
        out += [read_lattice(p, sym) for p in sorted(d.iterdir()) if p.name.endswith((".fst", ".slf", ".lat"))
                and "broken" not in p.name and "bad" not in p.name]
    return out


@pytest.fixture(scope="module")
def lats():
    return lattices()


def assert_same(a, b, lm_tol: float) -> None:
    assert a.stats.expanded_states == b.stats.expanded_states
    assert a.stats.expanded_arcs == b.stats.expanded_arcs
    assert a.stats.pruned_harder == b.stats.pruned_harder
    for k in ARRAYS:
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)
    for k in ("nn", "ng", "final_nn", "final_ng"):
        np.testing.assert_allclose(getattr(a, k), getattr(b, k), rtol=0, atol=lm_tol, err_msg=k)
    assert a.best_words(W) == b.best_words(W)
    np.testing.assert_allclose(a.arc_costs(W), b.arc_costs(W), rtol=0, atol=max(lm_tol, 1e-12))


@pytest.mark.parametrize("order", [4, 2, None], ids=["order4", "order2", "exact"])
def test_ngram_only_expansion_is_unchanged_bit_for_bit(lats, kenlm_model, order):
    ngram = NgramLM(kenlm_model)
    cfg = ExpandConfig(max_ngram_order=order, batch_lattices=5)
    new = dict(LatticeRescorer(W, ngram=ngram, config=cfg).expand_many(lats))
    old = dict(ReferenceRescorer(W, ngram=ngram, config=cfg).expand_many(lats))
    assert sorted(new) == sorted(old) == list(range(len(lats)))
    for i in new:
        assert_same(new[i], old[i], lm_tol=0.0)


def small_lattices(n: int = 16) -> list:
    """Random lattices of 8 states and 16 arcs (at most a few hundred paths) in the bundled lattices' words."""
    rng = np.random.default_rng(7)
    symbols = SymbolTable.read(ROOT / "lattices" / "words.txt")
    out = []
    while len(out) < n:
        lat = random_lattice(rng, f"small{len(out)}", symbols, 0, S=8, A=16)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LatticeWarning)  # states off every path dropped
                out.append(lat.prepare())
        except LatticeFormatError:  # no path from start to end: draw another
            continue
    return out


def test_neural_expansion_is_unchanged(kenlm_model, tiny_lm_dir):
    """Full histories and no pruning, on lattices small enough for that: the two expansions batch their LM
    calls differently, so float rounding differs in the last bits, and a merge or a beam could flip on a
    near-tie; without either, the graph is the lattice's own and only the scores are compared (the n-gram
    tests above cover merging and pruning on the real lattices)."""
    small = small_lattices()
    lm, ngram = load_model(tiny_lm_dir), NgramLM(kenlm_model)
    cfg = ExpandConfig(max_ngram_order=None, beam=float("inf"), max_per_state=10_000, batch_lattices=4)
    new = dict(LatticeRescorer(W, lm.model, lm.vocab, ngram, cfg).expand_many(small))
    old = dict(ReferenceRescorer(W, lm.model, lm.vocab, ngram, cfg).expand_many(small))
    for i in new:
        assert_same(new[i], old[i], lm_tol=1e-5)
        assert new[i].stats.lm_rows == old[i].stats.lm_rows


def test_tightened_pruning_is_unchanged(lats, kenlm_model):
    ngram = NgramLM(kenlm_model)
    cfg = ExpandConfig(max_ngram_order=None, max_states=40, max_per_state=8, beam=6.0)
    new = dict(LatticeRescorer(W, ngram=ngram, config=cfg).expand_many(lats))
    old = dict(ReferenceRescorer(W, ngram=ngram, config=cfg).expand_many(lats))
    assert any(x.stats.pruned_harder for x in new.values())
    for i in new:
        assert_same(new[i], old[i], lm_tol=0.0)


def test_short_histories_merge_only_on_their_whole_history(tmp_path):
    """With order 4 (3-word keys), two 2-word histories ending in the same word stay apart:
    the key of a history shorter than 3 words is all of it (the per-state expansion cut
    such histories to a wrapped-around suffix, (a, x) and (b, x) both to (x,))."""
    from smallstate_lm.ngram import build_ngram
    from smallstate_lm.rescoring.formats.lattice_io import read_fst_text

    (tmp_path / "t.txt").write_text("a x y\nb x y\n" * 3)
    build_ngram(tmp_path / "t.txt", 2, tmp_path / "lm.arpa")
    ngram = NgramLM(tmp_path / "lm.arpa")

    sym = SymbolTable.from_words(["a", "b", "x", "y"])
    i = sym.id
    text = f"0 1 {i('a')} {i('a')} 1,1\n0 1 {i('b')} {i('b')} 1,1\n1 2 {i('x')} {i('x')} 1,1\n" \
           f"2 3 {i('y')} {i('y')} 1,1\n3 0,0\n"
    lat = read_fst_text(text, sym, name="join")
    counts = {}
    for order in (2, 3, 4):
        exp = LatticeRescorer(W, ngram=ngram, config=ExpandConfig(max_ngram_order=order)).expand(lat)
        counts[order] = np.bincount(exp.node_lat, minlength=4).tolist()
    assert counts[2] == [1, 2, 1, 1]  # keys (a,) (b,) | (x,) | (y,)
    assert counts[3] == [1, 2, 2, 1]  # (a, x) and (b, x) apart; (x, y) after both
    assert counts[4] == [1, 2, 2, 2]



def test_nbest_zero_writes_best_txt_without_an_nbest_list(tmp_path, kenlm_model):
    """`--nbest 0`: no k-best search and no nbest.jsonl; best.txt is the Viterbi path, the same
    as the first entry of the n-best list of a default run."""
    from conftest import run_cli

    lat = ROOT / "lattices"
    fsts = sorted(lat.glob("*.fst"))[:4]
    common = ["--words", lat / "words.txt", "--ngram", kenlm_model, "--refs", lat / "ref.txt", "--quiet"]
    full = run_cli("rescore", *fsts, *common, "-o", tmp_path / "full")
    lean = run_cli("rescore", *fsts, *common, "-o", tmp_path / "lean", "--nbest", "0")
    assert full.returncode == 0 and lean.returncode == 0, full.stderr + lean.stderr
    assert (tmp_path / "full" / "nbest.jsonl").exists() and not (tmp_path / "lean" / "nbest.jsonl").exists()
    assert (tmp_path / "lean" / "best.txt").read_text() == (tmp_path / "full" / "best.txt").read_text()
    assert (tmp_path / "lean" / "wer.txt").read_text() == (tmp_path / "full" / "wer.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "lean" / "lattices").iterdir()) == [f.name for f in fsts]


def test_a_lattice_without_arcs_expands_alone_and_beside_others(lats, kenlm_model):
    """A one-state lattice (start = final, no arcs) gives its </s> path, alone and in a batch."""
    from smallstate_lm.rescoring.lattices.lattice import Lattice

    sym = lats[0].symbols
    empty = Lattice(name="empty", num_states=1, start=0, src=np.zeros(0, dtype=np.int64),
                    dst=np.zeros(0, dtype=np.int64), word=np.zeros(0, dtype=np.int64), graph=np.zeros(0),
                    acoustic=np.zeros(0), final_graph=np.array([0.5]), final_acoustic=np.array([1.0]), symbols=sym)
    ngram = NgramLM(kenlm_model)
    for batch in ([empty], [empty, empty], [lats[0], empty, lats[1]]):
        got = dict(LatticeRescorer(W, ngram=ngram).expand_many(batch))
        assert len(got) == len(batch)
        for i, lat in enumerate(batch):
            if lat is empty:
                assert got[i].best_words(W) == [] and len(got[i].final_node) == 1
