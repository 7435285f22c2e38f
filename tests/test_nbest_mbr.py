"""n-best MBR decoding of rescored lattices (`decode="nbest-mbr"`): the path of the lattice's best few with the
fewest expected word errors against them, checked against exhaustive search over every path of small lattices."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from test_posteriors import enumerate_paths

from smallstate_lm.errors import ConfigError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.lattice import SymbolTable
from smallstate_lm.rescoring.lattice_decode import MBR_PATHS, decode_lattice
from smallstate_lm.rescoring.lattice_expand import LatticeRescorer
from smallstate_lm.rescoring.lattice_io import read_fst, read_fst_text, read_slf
from smallstate_lm.rescoring.tune_decode import choose_decode, parse_decodes
from smallstate_lm.rescoring.wer import align_counts, pairwise_errors
from smallstate_lm.scoring import Weights

LAT_DIR = Path(__file__).resolve().parents[1] / "lattices"
WORDS = ["the", "lord", "said", "unto", "him", "and", "he"]


def random_lattice_text(seed: int, sym: SymbolTable) -> str:
    """A small acyclic OpenFST text lattice: states 0..n-1, a chain through all of them plus random forward arcs
    (some epsilon), random (graph, acoustic) weights, the last state final."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 7))
    arcs = [(i, i + 1) for i in range(n - 1)]
    for _ in range(int(rng.integers(1, 2 * n))):
        s = int(rng.integers(0, n - 1))
        arcs.append((s, int(rng.integers(s + 1, n))))
    lines = []
    for s, d in arcs:
        label = 0 if rng.random() < 0.15 else sym.id(WORDS[int(rng.integers(0, len(WORDS)))])
        lines.append(f"{s} {d} {label} {label} {rng.uniform(0, 3):.3f},{rng.uniform(5, 40):.3f}")
    lines.append(f"{n - 1} 0,0")
    return "\n".join(lines) + "\n"


def exhaustive_choice(x, w: Weights, scale: float) -> list[str]:
    """By brute force: every path of the rescored lattice, each word sequence at its best path's total (as the
    k-best search gives them), the posterior softmax(scale * total) over the sequences, and the sequence with the
    fewest expected word errors against them (ties: the higher total)."""
    dag = x.dag(w)
    best: dict[tuple[str, ...], float] = {}
    for arcs, _, cost in enumerate_paths(dag):
        words = tuple(x.symbols.word(int(dag.word_key[e])) for e in arcs if dag.word_key[e] >= 0)
        best[words] = max(best.get(words, -math.inf), -cost)
    seqs = sorted(best, key=lambda s: -best[s])
    tot = np.array([best[s] for s in seqs])
    p = np.exp(scale * (tot - tot.max()))
    p /= p.sum()
    risk = pairwise_errors(seqs) @ p
    return list(seqs[int(np.argmin(np.round(risk, 9)))])


@pytest.mark.parametrize("seed", range(25))
def test_nbest_mbr_equals_exhaustive_search_over_every_path(seed, kenlm_model):
    sym = SymbolTable.from_words(WORDS)
    w = Weights(am_scale=0.1, graph_scale=1.0, lm_weight=0.0, ngram_weight=0.5)
    x = LatticeRescorer(w, ngram=NgramLM(kenlm_model)).expand(read_fst_text(random_lattice_text(seed, sym), sym,
                                                                             name=f"r{seed}"))
    assert len(enumerate_paths(x.dag(w))) <= MBR_PATHS  # every sequence is a candidate: the search is exhaustive
    for scale in (0.3, 1.0, 3.0):
        d = decode_lattice(x, dataclasses.replace(w, decode="nbest-mbr", mbr_scale=scale))
        assert d.words == exhaustive_choice(x, w, scale)
        assert d.path_words == x.best_words(w) and d.risk >= 0.0
        assert len(d.confidences) == len(d.words) and all(0.0 <= c <= 1.0 for c in d.confidences)


def test_a_one_path_lattice_gives_its_path(kenlm_model):
    sym = SymbolTable.from_words(WORDS)
    text = f"0 1 {sym.id('the')} {sym.id('the')} 1,10\n1 2 {sym.id('lord')} {sym.id('lord')} 1,10\n2 0,0\n"
    w = Weights(am_scale=0.1, ngram_weight=1.0, lm_weight=0.0)
    x = LatticeRescorer(w, ngram=NgramLM(kenlm_model)).expand(read_fst_text(text, sym, name="one"))
    d = decode_lattice(x, dataclasses.replace(w, decode="nbest-mbr"))
    assert d.words == d.path_words == ["the", "lord"] and d.risk == 0.0 and d.confidences == [1.0, 1.0]


@pytest.fixture(scope="module")
def rescored(kenlm_model):
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    w = Weights(am_scale=1 / 9.5, graph_scale=0.5, lm_weight=0.0, ngram_weight=0.6, word_penalty=-0.2)
    rescorer = LatticeRescorer(w, ngram=NgramLM(kenlm_model))
    fst = [rescorer.expand(read_fst(p, sym)) for p in sorted(LAT_DIR.glob("*.lat.fst"))]
    slf = [rescorer.expand(read_slf(p, sym)) for p in sorted(LAT_DIR.glob("*.lm.slf.gz"))]
    return w, fst, slf


def test_on_real_lattices_the_choice_is_a_near_best_path_and_a_sharp_posterior_gives_the_best(rescored):
    w, lats, _ = rescored
    for x in lats:
        top = [p.words for p in x.nbest(w, MBR_PATHS)]
        d = decode_lattice(x, dataclasses.replace(w, decode="nbest-mbr", mbr_scale=1.0))
        assert d.words in top and d.path_words == top[0]
        v = decode_lattice(x, w)
        assert np.allclose(d.path_confidences, v.confidences)
        sharp = decode_lattice(x, dataclasses.replace(w, decode="nbest-mbr", mbr_scale=1000.0))
        assert sharp.words == top[0] and np.allclose(sharp.confidences, v.confidences)


def test_word_times_follow_the_chosen_path(rescored):
    w, _, slfs = rescored
    nb = dataclasses.replace(w, decode="nbest-mbr", mbr_scale=0.5)
    for x in slfs:
        d = decode_lattice(x, nb, frame_shift=0.01)
        assert [t[0] for t in d.timed] == d.words and [t[3] for t in d.timed] == d.confidences
        for (_, s, dur, _), (_, s2, _, _) in zip(d.timed, d.timed[1:]):
            assert dur >= 0 and s + dur <= s2 + 1e-9
        if d.words == d.path_words:
            assert [t[:3] for t in d.timed] == x.best_timed_words(w, 0.01)


def test_tuning_keeps_it_only_where_it_makes_fewer_errors(rescored):
    w, lats, _ = rescored
    refs = {ln.split()[0]: ln.split()[1:] for ln in (LAT_DIR / "ref.txt").read_text().splitlines() if ln.strip()}
    lats = [x for x in lats if x.name in refs]
    vit = sum(align_counts(refs[x.name], x.best_words(w)).errors for x in lats)
    grid = {"word_penalty": [-0.5, 0.0]}
    only = choose_decode(lats, refs, w, vit, ("nbest-mbr",), grid)
    assert only.weights.decode == "nbest-mbr"
    both = choose_decode(lats, refs, w, vit, ("viterbi", "nbest-mbr"), grid)
    assert both.errors == min(vit, only.errors)
    assert both.weights.decode == ("nbest-mbr" if only.errors < vit else "viterbi")
    decoded = sum(align_counts(refs[x.name], decode_lattice(x, both.weights).words).errors for x in lats)
    assert decoded == both.errors
    assert any(p.decode == "nbest-mbr" and p.weight == "mbr_scale" for p in both.points)


def test_the_decodes_are_parsed_and_bad_ones_named():
    assert parse_decodes("viterbi, nbest-mbr,mbr") == ("viterbi", "nbest-mbr", "mbr")
    with pytest.raises(ConfigError, match="nbest-mbr.*'viterbi,best'"):
        parse_decodes("viterbi,best")
    assert Weights(decode="nbest-mbr").decode == "nbest-mbr"
