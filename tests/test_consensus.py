"""Consensus (MBR) decoding and word confidences: exact where the method provably is (one path; sausage
lattices with disjoint positions), hand-computed confidences, the bins' mass, and the decode of real rescored
lattices."""

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from test_posteriors import random_dag

from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.decode.consensus import aligned_confidences, consensus
from smallstate_lm.rescoring.decode.posteriors import forward_backward
from smallstate_lm.rescoring.decode.transcript import decode_lattice, first_pass_decode, word_confidences
from smallstate_lm.rescoring.decode.wer import align_counts
from smallstate_lm.rescoring.expand.rescorer import LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst, read_fst_text, read_slf
from smallstate_lm.rescoring.lattices.kbest import Dag
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.weights import Weights

LAT_DIR = Path(__file__).resolve().parent / "data" / "lattices"


def edit_distance(a, b) -> int:
    return align_counts(list(a), list(b)).errors


def test_one_path_lattice_gives_its_path_with_confidence_one():
    # 0 -a-> 1 -eps-> 2 -b-> 3 -eps-> 4 (final): one word sequence, the best path by construction
    dag = Dag(5, np.arange(4), np.arange(1, 5), np.array([1.0, 0.2, 3.0, 0.1]), np.array([4]), np.array([0.5]),
              np.array([7, -1, 9, -1]))
    c = consensus(dag, 1.0, [7, 9])
    assert c.keys == [7, 9] and c.confidences == [1.0, 1.0] and c.risk == 0.0
    assert consensus(dag, 1.0, [9, 9, 3]).keys == [7, 9]  # from any start it finds the only path
    assert aligned_confidences(dag, 1.0, [7, 5]) == [1.0, 0.0]  # 5 is never said


def test_confidences_of_two_paths_worked_out_by_hand():
    # "a b" with probability p, "a c" with 1 - p: a is certain, b has p, c has 1 - p
    cost_b, cost_c = 1.0, 2.0
    p = math.exp(-cost_b) / (math.exp(-cost_b) + math.exp(-cost_c))
    dag = Dag(3, np.array([0, 1, 1]), np.array([1, 2, 2]), np.array([0.0, cost_b, cost_c]), np.array([2]),
              np.array([0.0]), np.array([1, 2, 3]))
    assert np.allclose(aligned_confidences(dag, 1.0, [1, 2]), [1.0, p])
    assert np.allclose(aligned_confidences(dag, 1.0, [1, 3]), [1.0, 1 - p])
    c = consensus(dag, 1.0, [1, 3])
    assert c.keys == [1, 2] and np.allclose(c.confidences, [1.0, p]) and math.isclose(c.risk, 1 - p)
    assert np.allclose(c.start_confidences, [1.0, 1 - p])  # the first pass was aligned to its start


def sausage(seed: int) -> tuple[Dag, list[list[int]]]:
    """K positions, each a choice among 2-3 words of its own (disjoint vocabularies), every word by one or
    two parallel arcs (alignments), some positions followed by a silence (epsilon) arc every path takes."""
    rng = np.random.default_rng(seed)
    src, dst, cost, word, positions = [], [], [], [], []
    node = vocab = 0
    for _ in range(int(rng.integers(1, 4))):
        words = list(range(vocab, vocab + int(rng.integers(2, 4))))
        vocab += len(words)
        positions.append(words)
        for w in words:
            for _ in range(int(rng.integers(1, 3))):
                src.append(node), dst.append(node + 1), cost.append(rng.uniform(0, 3)), word.append(w)
        node += 1
        if rng.random() < 0.5:
            src.append(node), dst.append(node + 1), cost.append(rng.uniform(0, 1)), word.append(-1)
            node += 1
    return Dag(node + 1, np.array(src), np.array(dst), np.array(cost), np.array([node]), np.array([0.3]),
               np.array(word)), positions


@pytest.mark.parametrize("seed", range(12))
def test_on_sausage_lattices_consensus_equals_exhaustive_bayes_risk_minimisation(seed):
    """Where the method is provably exact (decode/consensus.py's docstring: disjoint positions, no epsilon
    alternative), it finds the word string of least expected edit distance among all strings of the
    lattice's words up to one word longer than its paths, from any start, and its risk is that exact one."""
    dag, positions = sausage(seed)
    post = forward_backward(dag, 1.0)
    word = np.asarray(dag.word_key)
    marginal = [{w: post.arc[word == w].sum() for w in ws} for ws in positions]
    dist = {combo: np.prod([marginal[k][w] for k, w in enumerate(combo)]) for combo in itertools.product(*positions)}

    def risk(h):
        return sum(p * edit_distance(h, s) for s, p in dist.items())

    vocab = sorted(w for ws in positions for w in ws)
    strings = [s for n in range(len(positions) + 2) for s in itertools.product(vocab, repeat=n)]
    risks = np.array([risk(s) for s in strings])
    start = [ws[seed % len(ws)] for ws in positions]
    c = consensus(dag, 1.0, start)
    assert math.isclose(risk(c.keys), risks.min(), abs_tol=1e-9)
    assert math.isclose(c.risk, risks.min(), abs_tol=1e-9)
    assert np.allclose(c.confidences, [marginal[k][w] for k, w in enumerate(c.keys)])


@pytest.mark.parametrize("seed", range(30))
def test_bins_hold_the_posterior_mass_and_the_risk_never_exceeds_the_start(seed):
    dag = random_dag(seed, n_max=12)
    start = [int(k) for k in dag.word_key if k >= 0][:3]  # any start will do
    c = consensus(dag, 0.8, start)
    first = consensus(dag, 0.8, start, max_iter=1)
    assert c.risk <= first.risk + 1e-12
    assert len(c.bins) == 2 * len(c.keys) + 1
    for b in c.bins[1::2]:  # every path fills each word's slot once, with a word or epsilon
        assert math.isclose(sum(b.values()), 1.0, abs_tol=1e-9)
    for b in c.bins[0::2]:
        assert 0.0 <= b.get(-1, 0.0) <= 1.0
    assert all(0.0 <= x <= 1.0 for x in c.confidences)
    assert consensus(dag, 0.8, start) == c  # deterministic


@pytest.fixture(scope="module")
def rescored(kenlm_model):
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    w = Weights(am_scale=1 / 9.5, graph_scale=0.5, lm_weight=0.0, ngram_weight=0.6, word_penalty=-0.2)
    rescorer = LatticeRescorer(w, ngram=NgramLM(kenlm_model))
    fst = [rescorer.expand(read_fst(p, sym)) for p in sorted(LAT_DIR.glob("*.lat.fst"))]
    slf = [rescorer.expand(read_slf(p, sym)) for p in sorted(LAT_DIR.glob("*.lm.slf.gz"))]
    return w, fst, slf


def test_decoding_real_rescored_lattices(rescored):
    w, lats, _ = rescored
    mbr = dataclasses.replace(w, decode="mbr")
    for x in lats:
        v = decode_lattice(x, w)
        assert v.words == x.best_words(w) and v.path_confidences == v.confidences
        assert len(v.confidences) == len(v.words) and all(0.0 <= c <= 1.0 for c in v.confidences)
        m = decode_lattice(x, mbr)
        assert m.path_words == v.words and np.allclose(m.path_confidences, v.confidences)
        assert len(m.confidences) == len(m.words) and all(0.0 <= c <= 1.0 for c in m.confidences)
        conf = word_confidences(x, w)
        assert conf == v.confidences and all(type(c) is float for c in conf)
        assert word_confidences(x, w, ["no-such-word"] + v.words[1:])[0] == 0.0
        words, fp = first_pass_decode(x, w.am_scale, 1.0)
        assert words == x.first_pass_words(w.am_scale) and len(fp) == len(words)


def test_a_single_path_expanded_lattice_decodes_alike_both_ways(kenlm_model):
    sym = SymbolTable.from_words(["the", "lord", "said", "<sil>"])
    text = "\n".join([f"0 1 {sym.id('the')} {sym.id('the')} 1,10", f"1 2 {sym.id('<sil>')} {sym.id('<sil>')} 0,2",
                      f"2 3 {sym.id('lord')} {sym.id('lord')} 1,10", f"3 4 {sym.id('said')} {sym.id('said')} 1,9",
                      "4 0.3,0"]) + "\n"
    w = Weights(am_scale=0.1, ngram_weight=1.0, lm_weight=0.0)
    x = LatticeRescorer(w, ngram=NgramLM(kenlm_model)).expand(read_fst_text(text, sym, name="one"))
    v, m = decode_lattice(x, w), decode_lattice(x, dataclasses.replace(w, decode="mbr"))
    assert v.words == m.words == ["the", "lord", "said"] and m.confidences == [1.0, 1.0, 1.0] and m.risk == 0.0


def test_consensus_word_times_follow_one_another(rescored):
    w, _, slfs = rescored
    mbr = dataclasses.replace(w, decode="mbr")
    for x in slfs:
        d = decode_lattice(x, mbr, frame_shift=0.01)
        assert [t[0] for t in d.timed] == d.words
        for (_, s, dur, c), (_, s2, _, _) in zip(d.timed, d.timed[1:]):
            assert dur >= 0 and s + dur <= s2 + 1e-9 and 0.0 <= c <= 1.0
        v = decode_lattice(x, w, frame_shift=0.01)
        assert [t[:3] for t in v.timed] == x.best_timed_words(w, 0.01)
        assert [t[3] for t in v.timed] == v.confidences
