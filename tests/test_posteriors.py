"""Forward-backward posteriors: brute-force path enumeration on small random DAGs, every cut summing to 1
on larger ones, stability on a long lattice, and the posteriors of a real rescored lattice."""

import math
from pathlib import Path

import numpy as np
import pytest

from smallstate_lm.errors import SmallstateError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.decode.posteriors import first_pass_dag, forward_backward, source_arc_posteriors
from smallstate_lm.rescoring.expand.rescorer import LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.lattices.graph import state_levels
from smallstate_lm.rescoring.lattices.kbest import Dag
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.weights import Weights

LAT_DIR = Path(__file__).resolve().parent / "data" / "lattices"


def random_dag(seed: int, n_max: int = 9) -> Dag:
    """Nodes 0..n-1 in topological order, each reachable from 0; random extra arcs (some to dead ends),
    epsilons (-1) among the words, finals among the last nodes (one node may be listed twice)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, n_max + 1))
    src = [int(rng.integers(0, v)) for v in range(1, n)]
    dst = list(range(1, n))
    for _ in range(int(rng.integers(0, 2 * n))):
        s = int(rng.integers(0, n - 1))
        src.append(s)
        dst.append(int(rng.integers(s + 1, n)))
    word = np.where(rng.random(len(src)) < 0.3, -1, rng.integers(0, 4, len(src)))
    final = n - 1 - rng.choice(min(3, n), int(rng.integers(1, min(3, n) + 1)), replace=False)
    final = np.append(final, final[0])
    return Dag(n, np.array(src), np.array(dst), rng.normal(2.0, 1.5, len(src)), final,
               rng.normal(0.5, 1.0, len(final)), word)


def enumerate_paths(dag: Dag):
    """Every complete path: (arcs, final entry, cost)."""
    out = [[e for e in range(len(dag.src)) if dag.src[e] == v] for v in range(dag.n_nodes)]
    paths, stack = [], [(0, [], 0.0)]
    while stack:
        v, arcs, c = stack.pop()
        for f in np.flatnonzero(np.asarray(dag.final_node) == v):
            paths.append((arcs, int(f), c + dag.final_cost[f]))
        for e in out[v]:
            stack.append((int(dag.dst[e]), arcs + [e], c + dag.cost[e]))
    return paths


@pytest.mark.parametrize("seed", range(40))
def test_posteriors_equal_brute_force_enumeration(seed):
    dag = random_dag(seed)
    scale = [0.3, 1.0, 2.5][seed % 3]
    paths = enumerate_paths(dag)
    weight = np.array([math.exp(-scale * c) for _, _, c in paths])
    arc, final, node = np.zeros(len(dag.src)), np.zeros(len(dag.final_node)), np.zeros(dag.n_nodes)
    for (arcs, f, _), p in zip(paths, weight / weight.sum()):
        arc[arcs] += p
        final[f] += p
        node[list({0, *(int(dag.dst[e]) for e in arcs)})] += p
    post = forward_backward(dag, scale)
    assert np.allclose(post.arc, arc, atol=1e-12)
    assert np.allclose(post.final, final, atol=1e-12)
    assert np.allclose(post.node, node, atol=1e-12)
    assert math.isclose(post.log_total, math.log(weight.sum()), abs_tol=1e-9)
    assert math.isclose(post.beta[0], post.log_total, abs_tol=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_every_cut_carries_probability_one(seed):
    """A complete path crosses each cut between nodes < k and nodes >= k once, or ends before it: the
    posteriors of the crossing arcs and of the finals before the cut sum to 1; likewise per topological level."""
    dag = random_dag(1000 + seed, n_max=60)
    post = forward_backward(dag, 0.7)
    src, dst, fin = np.asarray(dag.src), np.asarray(dag.dst), np.asarray(dag.final_node)
    for k in range(1, dag.n_nodes):
        total = post.arc[(src < k) & (dst >= k)].sum() + post.final[fin < k].sum()
        assert math.isclose(total, 1.0, abs_tol=1e-9)
    level = state_levels(dag.n_nodes, src, dst)
    for lv in range(int(level.max())):
        total = post.arc[(level[src] <= lv) & (level[dst] > lv)].sum() + post.final[level[fin] <= lv].sum()
        assert math.isclose(total, 1.0, abs_tol=1e-9)


def test_long_lattice_stays_exact_in_log_space():
    """3,000 steps of two parallel arcs, costs in the thousands of nats: linear-space sums would underflow."""
    steps = 3000
    src = np.repeat(np.arange(steps), 2)
    dst = src + 1
    cost = np.tile([1000.0, 1000.0 + math.log(3.0)], steps)
    post = forward_backward(Dag(steps + 1, src, dst, cost, np.array([steps]), np.array([5.0]), np.zeros(2 * steps)))
    assert np.allclose(post.arc[0::2], 0.75) and np.allclose(post.arc[1::2], 0.25)
    assert np.allclose(post.node, 1.0) and math.isfinite(post.log_total)


def test_dead_ends_get_nothing_and_no_path_is_an_error():
    # 0 -> 1 -> 3 (final), 0 -> 2 (a dead end)
    dag = Dag(4, np.array([0, 1, 0]), np.array([1, 3, 2]), np.array([1.0, 1.0, 0.5]), np.array([3]), np.array([0.0]),
              np.array([1, 2, 3]))
    post = forward_backward(dag)
    assert post.arc.tolist() == [1.0, 1.0, 0.0] and post.node[2] == 0.0
    with pytest.raises(SmallstateError, match="no complete path"):
        forward_backward(dag._replace(final_node=np.array([2]), src=np.array([0, 1, 3]), dst=np.array([1, 3, 3])))
    with pytest.raises(SmallstateError, match="posterior scale"):
        forward_backward(dag, 0.0)


@pytest.fixture(scope="module")
def expanded(kenlm_model):
    sym = SymbolTable.read(LAT_DIR / "words.txt")
    w = Weights(am_scale=1 / 9.5, graph_scale=0.5, lm_weight=0.0, ngram_weight=0.6, word_penalty=-0.2)
    rescorer = LatticeRescorer(w, ngram=NgramLM(kenlm_model))
    return w, [rescorer.expand(read_fst(p, sym)) for p in sorted(LAT_DIR.glob("*.lat.fst"))]


def test_word_posteriors_of_a_rescored_lattice_sum_over_its_source_arcs(expanded):
    """An input arc expanded into several LM histories gets the sum of their posteriors; the input lattice's
    cuts (source states < k) then carry probability 1 too, as its states are topologically numbered."""
    w, lats = expanded
    for x in lats:
        post = forward_backward(x.dag(w), w.posterior_scale)
        per_source = source_arc_posteriors(x, w)
        assert math.isclose(per_source.sum(), post.arc.sum(), rel_tol=1e-12)
        src = x.source
        final_at = x.node_lat[x.final_node]
        for k in range(1, src.num_states, max(1, src.num_states // 25)):
            cut = per_source[(src.src < k) & (src.dst >= k)].sum() + post.final[final_at < k].sum()
            assert math.isclose(cut, 1.0, abs_tol=1e-9)


def test_first_pass_posteriors_peak_on_the_decoders_best_path(expanded):
    w, lats = expanded
    for x in lats:
        dag = first_pass_dag(x.source, w.am_scale)
        post = forward_backward(dag, 1e3)  # a sharp posterior: the best path's arcs carry almost everything
        best_cost = x.source.best_path(w.am_scale, 1.0)[1]
        assert math.isclose(-post.log_total / 1e3, best_cost, rel_tol=1e-6, abs_tol=1e-3)
