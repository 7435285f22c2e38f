"""Word confidences of many lattices aligned in the same passes (`Aligner.many`, `decode_lattices`): each lattice
gets the confidences it gets alone, whatever lies beside it, however the batch is cut into groups; one lattice
without a finite path fails alone."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_posteriors import random_dag

from smallstate_lm.errors import SmallstateError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.decode.consensus import Aligner, aligned_confidences
from smallstate_lm.rescoring.decode.transcript import Decoded, decode_lattice, decode_lattices
from smallstate_lm.rescoring.expand.rescorer import LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst, read_slf
from smallstate_lm.rescoring.lattices.kbest import Dag
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.weights import Weights

LAT_DIR = Path(__file__).resolve().parent / "data" / "lattices"


@pytest.fixture(scope="module")
def rescored(kenlm_model):
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    w = Weights(am_scale=1 / 9.5, graph_scale=0.5, lm_weight=0.0, ngram_weight=0.6, word_penalty=-0.2)
    rescorer = LatticeRescorer(w, ngram=NgramLM(kenlm_model))
    paths = sorted(LAT_DIR.glob("*.lat.fst"))
    lats = [rescorer.expand(read_fst(p, sym)) for p in paths]
    lats += [rescorer.expand(read_slf(p, sym)) for p in sorted(LAT_DIR.glob("*.lm.slf.gz"))]
    return w, lats


def test_random_lattices_aligned_together_get_their_own_confidences():
    dags = [random_dag(seed) for seed in range(40)]  # dead ends, epsilons, repeated finals, words said twice
    rng = np.random.default_rng(5)
    keys = [rng.integers(-1, 4, int(rng.integers(0, 7))).tolist() for _ in dags]  # lengths 0..6, unknown words
    together = Aligner.many(dags, 0.8, [f"dag {i}" for i in range(len(dags))]).confidences_many(keys)
    for dag, k, got in zip(dags, keys, together):
        alone = aligned_confidences(dag, 0.8, k)
        assert len(got) == len(k) and np.allclose(got, alone, rtol=0, atol=1e-12)


def test_rescored_lattices_decoded_together_as_one_at_a_time(rescored):
    w, lats = rescored
    alone = [decode_lattice(x, w) for x in lats]
    for cells in (None, 1, 2000):  # one group; every lattice its own group; groups cut by size
        kw = {} if cells is None else {"max_cells": cells}
        together = decode_lattices(lats, w, [None] * len(lats), **kw)
        for a, t in zip(alone, together):
            assert isinstance(t, Decoded) and t.words == a.words == t.path_words
            assert np.allclose(t.confidences, a.confidences, rtol=0, atol=1e-12)
            assert t.path_confidences == t.confidences


def test_levels_from_the_lattice_states_align_as_the_graphs_own(rescored):
    w, lats = rescored
    dags = [x.dag(w) for x in lats]
    keys = [[x.symbols.id(wd) for wd in x.best_words(w)] for x in lats]
    names = [x.name for x in lats]
    assert all(x.node_level is not None for x in lats)
    own = Aligner.many(dags, w.posterior_scale, names).confidences_many(keys)
    given = Aligner.many(dags, w.posterior_scale, names, [x.node_level for x in lats]).confidences_many(keys)
    for a, b in zip(own, given):
        assert np.allclose(a, b, rtol=0, atol=1e-12)


def test_a_lattice_without_a_finite_path_fails_alone(rescored):
    w, lats = rescored
    broken = dataclasses.replace(lats[1], name="broken", final_acoustic=np.full(len(lats[1].final_node), np.inf))
    batch = [lats[0], broken, lats[2]]
    with pytest.raises(SmallstateError, match="broken: no complete path"):
        Aligner.many([x.dag(w) for x in batch], w.posterior_scale, [x.name for x in batch])
    out = decode_lattices(batch, w, [x.best_words(w) for x in (lats[0], lats[0], lats[2])])
    assert isinstance(out[1], SmallstateError) and "broken" in str(out[1])
    for k in (0, 2):
        assert np.allclose(out[k].confidences, decode_lattice(batch[k], w).confidences, rtol=0, atol=1e-12)


def test_consensus_and_word_times_still_go_one_lattice_at_a_time(rescored):
    w, lats = rescored
    mbr = dataclasses.replace(w, decode="mbr")
    slfs = [x for x in lats if x.source is not None and x.source.state_time is not None]
    assert slfs
    for got, x in zip(decode_lattices(lats, mbr, [None] * len(lats)), lats):
        assert got == decode_lattice(x, mbr)
    for got, x in zip(decode_lattices(slfs, w, [None] * len(slfs), frame_shift=0.01), slfs):
        assert got == decode_lattice(x, w, frame_shift=0.01) and got.timed


def test_several_lattices_aligned_together_give_each_its_own_sausage():
    dags = [random_dag(seed) for seed in range(12)]
    rng = np.random.default_rng(9)
    keys = [rng.integers(0, 5, int(rng.integers(0, 6))).tolist() for _ in dags]  # 4: a word no arc has
    alone = [Aligner(d, 0.8) for d in dags]
    together = Aligner.many(dags, 0.8, [f"dag {i}" for i in range(len(dags))])
    got_all = together.align_many([together.keys_to_index(kk, k) for k, kk in enumerate(keys)])
    for a, kk, got in zip(alone, keys, got_all):
        one = a.align(a.keys_to_index(kk))
        assert np.array_equal(got.hyp, one.hyp) and np.allclose(got.gamma, one.gamma, rtol=0, atol=1e-12)
        assert got.risk == pytest.approx(one.risk, abs=1e-12)


def test_empty_hypotheses_and_a_node_no_finite_path_reaches():
    """Empty hypotheses have no confidences; an arc of infinite cost into a node leaves that node out of
    every posterior, as if the arc were not there (not a NaN that spreads to the nodes after it)."""
    dags = [random_dag(seed) for seed in range(3)]
    assert Aligner.many(dags, 1.0, ["a", "b", "c"]).confidences_many([[], [], []]) == [[], [], []]
    inf = Dag(3, np.array([0, 1, 0]), np.array([1, 2, 2]), np.array([np.inf, 1.0, 1.0]), np.array([2]),
              np.array([0.0]), np.array([7, 7, 7]))
    without = Dag(3, np.array([0]), np.array([2]), np.array([1.0]), np.array([2]), np.array([0.0]), np.array([7]))
    assert aligned_confidences(inf, 1.0, [7]) == aligned_confidences(without, 1.0, [7]) == [1.0]
    assert Aligner(inf, 1.0).align(np.array([1])).risk == 0.0
    with pytest.raises(ValueError, match="2 hypotheses for 3 lattices"):
        Aligner.many(dags, 1.0, ["a", "b", "c"]).confidences_many([[], []])
    with pytest.raises(ValueError, match="every arc must go up a level"):
        Aligner.many([dags[0]], 1.0, ["a"], [np.zeros(dags[0].n_nodes, dtype=np.int64)])


def test_a_result_that_fails_is_that_lattices_error_not_the_runs(rescored):
    """A lattice's error while its result is made (here: a rescored lattice cannot be written without an
    acoustic scale) fails that lattice, with its path, and the run goes on."""
    from smallstate_lm.rescoring.runs.lattice_files import LatticeResult

    w, lats = rescored
    done = [(f"in/{x.name}", x) for x in lats[:3]]
    results = LatticeResult.many(done, dataclasses.replace(w, am_scale=0.0), nbest=5)
    assert [r.path for r in results] == [p for p, _ in done]
    assert all(r.error and r.error.startswith(r.path) and "am_scale" in r.error for r in results)
    fine = LatticeResult.many(done, w, nbest=5)
    assert all(r.error is None and r.nbest and len(r.confidences) == len(r.best) for r in fine)
