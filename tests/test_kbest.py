
"""Lazy k-best distinct word sequences: random DAGs against brute-force enumeration, the real
expanded lattices against ExpandedLattice.nbest, and the cap on examined paths."""

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
from reference_expansion import reference_nbest

from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.expand.rescorer import LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.lattices.kbest import Dag, KbestTruncated, kbest_paths, nbest_paths
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.weights import Weights

LATTICES = Path(__file__).resolve().parent.parent / "lattices"
ALL = 10_000


def random_dag(seed: int, int_costs: bool = False):
    """A small DAG with words from {0, 1, 2} and epsilons (-1), several finals, some dead ends."""
    rng = np.random.default_rng(seed)
    n_nodes = int(rng.integers(2, 10))
    # every node reachable (an in-arc from one of the two nodes before it), then random short hops
    back = [int(rng.integers(max(0, v - 2), v)) for v in range(1, n_nodes)]
    extra = rng.integers(0, n_nodes - 1, int(rng.integers(0, 2 * n_nodes)))
    src = np.r_[back, extra].astype(np.int64)
    dst = np.r_[np.arange(1, n_nodes), [rng.integers(s + 1, min(s + 3, n_nodes - 1) + 1) for s in extra]]
    dst = dst.astype(np.int64)
    n_arcs = len(src)
    word = np.where(rng.random(n_arcs) < 0.3, -1, rng.integers(0, 3, n_arcs))
    cost = rng.integers(-1, 3, n_arcs).astype(float) if int_costs else rng.normal(1.0, 1.5, n_arcs)
    n_final = int(rng.integers(1, min(4, n_nodes) + 1))  # among the last nodes
    final_node = n_nodes - 1 - rng.choice(min(4, n_nodes), n_final, replace=False)
    final_cost = rng.integers(0, 2, n_final).astype(float) if int_costs else rng.normal(0.5, 1.0, n_final)
    return n_nodes, src, dst, cost, final_node, final_cost, word


def brute_force(n_nodes, src, dst, cost, final_node, final_cost, word) -> dict[tuple, float]:
    """Every start->final path, grouped by word sequence: the cheapest total of each."""
    out = [[e for e in range(len(src)) if src[e] == v] for v in range(n_nodes)]
    best: dict[tuple, float] = {}
    stack = [(0, 0.0, ())]
    while stack:
        v, c, words = stack.pop()
        for i in np.flatnonzero(final_node == v):
            t = c + final_cost[i]
            if words not in best or t < best[words]:
                best[words] = t
        for e in out[v]:
            stack.append((int(dst[e]), c + cost[e], words + ((int(word[e]),) if word[e] >= 0 else ())))
    return best


def check_path(dag, total, arcs, fi) -> tuple:
    """The returned arcs form a start->final path whose cost is the total; its words."""
    n_nodes, src, dst, cost, final_node, final_cost, word = dag
    node, c = 0, 0.0
    for e in arcs:
        assert src[e] == node
        node, c = int(dst[e]), c + cost[e]
    assert node == final_node[fi]
    assert c + final_cost[fi] == pytest.approx(total, abs=1e-9)
    return tuple(int(word[e]) for e in arcs if word[e] >= 0)


@pytest.mark.parametrize("seed", range(60))
def test_random_dags_equal_brute_force(seed):
    dag = random_dag(seed)
    best = brute_force(*dag)
    ranked = sorted(best.items(), key=lambda kv: kv[1])
    for n in (1, 3, 10, ALL):
        got = kbest_paths(Dag(*dag), n=n)
        assert len(got) == min(n, len(ranked))
        words = [check_path(dag, *p) for p in got]
        assert words == [w for w, _ in ranked[:n]]
        assert [p[0] for p in got] == pytest.approx([c for _, c in ranked[:n]], abs=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_ties_are_exact_and_deterministic(seed):
    """Integer costs tie often: the totals are still the n best, each sequence at its own best."""
    dag = random_dag(1000 + seed, int_costs=True)
    best = brute_force(*dag)
    totals = sorted(best.values())
    for n in (1, 3, 10, ALL):
        got = kbest_paths(Dag(*dag), n=n)
        words = [check_path(dag, *p) for p in got]
        assert len(set(words)) == len(words)
        assert [p[0] for p in got] == pytest.approx(totals[:n], abs=1e-9)
        assert all(best[wd] == pytest.approx(p[0], abs=1e-9) for wd, p in zip(words, got))
        again = kbest_paths(Dag(*dag), n=n)
        assert [(p[0], p[1].tolist(), p[2]) for p in again] == [(p[0], p[1].tolist(), p[2]) for p in got]


def test_edge_cases():
    assert kbest_paths(Dag(1, [], [], [], [0], [0.5], []), n=3)[0][0] == 0.5  # the start is final: the empty path
    assert kbest_paths(Dag(2, [0], [1], [1.0], [1], [0.0], [5]), n=0) == []
    assert kbest_paths(Dag(3, [0], [1], [1.0], [2], [0.0], [5]), n=2) == []  # no path reaches the final
    assert len(kbest_paths(Dag(2, [0], [1], [1.0], [1], [np.inf], [5]), n=2)) == 0  # an infinite final weight
    with pytest.raises(ValueError):
        kbest_paths(Dag(3, [1], [0], [1.0], [2], [0.0], [5]), n=1)  # not topological


def diamonds(k: int):
    """k diamonds in a row, each with two parallel paths carrying the same word (2**k alignments
    of one sequence), and at the end either of two final words."""
    src, dst, word, cost = [], [], [], []
    for i in range(k):
        a, b, c = 2 * i, 2 * i + 1, 2 * i + 2
        for s, t, wd, co in ((a, b, -1, 0.1), (b, c, 0, 1.0), (a, c, 0, 1.05)):
            src.append(s), dst.append(t), word.append(wd), cost.append(co)
    end = 2 * k
    src += [end, end]
    dst += [end + 1, end + 2]
    word += [1, 2]
    cost += [0.0, 0.5]
    return end + 3, np.array(src), np.array(dst), np.array(cost), np.array([end + 1, end + 2]), np.zeros(2), \
        np.array(word)


def test_many_same_word_paths_stay_cheap():
    """2**40 paths hold 2 word sequences: the search lists each node's prefixes once, so it needs
    no more than (arcs + finals) * (n + 1) examined paths and ends with both."""
    dag = diamonds(40)
    n_arcs, n = len(dag[1]), 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", KbestTruncated)
        got = kbest_paths(Dag(*dag), n=n, max_paths=(n_arcs + 2) * (n + 1))
    assert [check_path(dag, *p) for p in got] == [(0,) * 40 + (1,), (0,) * 40 + (2,)]
    assert got[0][0] == pytest.approx(40 * 1.05)


def test_the_path_cap_returns_the_best_found_so_far_and_warns():
    """At the cap the search stops: what it returns is a true prefix of the answer, never a wrong entry."""
    checked = 0
    for seed in range(20):
        dag = random_dag(2000 + seed)
        full = kbest_paths(Dag(*dag), n=ALL)
        if len(full) < 3:
            continue
        checked += 1
        with pytest.warns(KbestTruncated, match="max_paths=4"):
            cut = kbest_paths(Dag(*dag), n=ALL, max_paths=4)
        assert len(cut) < len(full)
        assert [(p[0], p[1].tolist(), p[2]) for p in cut] == [(p[0], p[1].tolist(), p[2]) for p in full[:len(cut)]]
    assert checked >= 5


# ---- real expanded lattices against ExpandedLattice.nbest ---------------------------------

WEIGHTS = [
    Weights(am_scale=1 / 9.5, graph_scale=0.4, lm_weight=0.0, ngram_weight=0.6, word_penalty=-0.25),
    Weights(am_scale=1 / 9.5, graph_scale=1.0, lm_weight=0.0, ngram_weight=1.0, word_penalty=2.0, oov_penalty=1.0),
]


@pytest.fixture(scope="module")
def expanded(kenlm_model):
    sym = SymbolTable.read(LATTICES / "words.txt")
    paths = [LATTICES / f"{v}-dev{i:04d}.lat.fst" for v in ("slt", "kal") for i in (0, 2, 5)]
    rescorer = LatticeRescorer(WEIGHTS[0], ngram=NgramLM(kenlm_model))
    return [rescorer.expand(read_fst(p, sym)) for p in paths]


def same_dicts(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and x["words"] == y["words"] and x["n_words"] == y["n_words"]
                                    and x["n_oov"] == y["n_oov"] and all(abs(x[k] - y[k]) <= 1e-9 for k in
                                    ("am", "graph", "neural", "ngram", "total")) for x, y in zip(a, b))


@pytest.mark.parametrize("w", WEIGHTS)
def test_nbest_paths_equal_expanded_lattice_nbest(expanded, w):
    for x in expanded:
        for n in (1, 5, 20):
            new = [dataclasses.asdict(p) for p in nbest_paths(x, w, n)]
            assert same_dicts(new, reference_nbest(x, w, n)), (x.name, n)
            assert len({tuple(d["words"]) for d in new}) == len(new)
        assert nbest_paths(x, w, 1)[0].words == x.best_words(w)


def test_best_costs_of_many_dags_are_each_ones_own_forward_pass(expanded):
    """`best_costs` relaxes many DAGs a level at a time; the k-best search started from them finds what it
    finds from its own forward pass, exactly."""
    from smallstate_lm.rescoring.lattices.graph import state_levels
    from smallstate_lm.rescoring.lattices.kbest import _graph, _LazyKbest, best_costs

    dags = [Dag(*random_dag(seed)) for seed in range(30)]
    levels = [state_levels(d.n_nodes, d.src, d.dst) for d in dags]
    for d, got in zip(dags, best_costs(dags, levels)):
        own = _LazyKbest(d.n_nodes, *_graph(*d))._forward(d.n_nodes + 1)
        assert np.array_equal(got, np.asarray(own))
    w = WEIGHTS[0]
    lat_dags = [x.dag(w) for x in expanded]
    for x, d, b in zip(expanded, lat_dags, best_costs(lat_dags, [x.node_level for x in expanded])):
        assert nbest_paths(x, w, 10, d, b) == nbest_paths(x, w, 10)
