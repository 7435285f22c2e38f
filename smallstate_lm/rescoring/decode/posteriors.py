"""Arc and word posteriors of a lattice by forward-backward in log space.

A path's probability is proportional to exp(-scale * cost), cost being the path's weighted cost (-ln, the
rescoring weights' total negated, final cost included) and `scale` the posterior scale (`--posterior-scale`;
Kaldi's acoustic scale plays this part in `lattice-to-post`). Forward and backward sums are kept as natural
logs and combined with logsumexp, a topological level at a time, so that a lattice whose best path costs
thousands of nats neither underflows nor loses the small posteriors that confidences are made of.

The graph is a `kbest.Dag` (nodes numbered topologically, start 0, finals as (node, cost) pairs), so the same
code serves an expanded, rescored lattice (`ExpandedLattice.dag(w)`) and a first-pass lattice
(`first_pass_dag`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import SmallstateError
from ..lattices.graph import state_levels
from ..lattices.kbest import Dag
from ..lattices.lattice import Lattice


@dataclass
class Posteriors:
    """Forward-backward on a Dag. `arc[e]` is the probability that a path drawn from the lattice uses arc e,
    `final[f]` that it ends at final entry f, `node[n]` that it passes node n; `alpha`/`beta` are the scaled
    log forward and backward sums (natural log, -inf where no path passes) and `log_total` the log of the sum
    over all complete paths. Nodes and arcs on no complete path (pruned dead ends) get posterior 0."""

    arc: np.ndarray  # (E,)
    final: np.ndarray  # (F,)
    node: np.ndarray  # (N,)
    alpha: np.ndarray  # (N,)
    beta: np.ndarray  # (N,)
    log_total: float
    scale: float


class _Segments:
    """Arcs ordered by (level, key node) once: per level, the arcs, the distinct key nodes and where each
    node's arcs start, so that every level's logsumexp is two reductions over contiguous runs."""

    def __init__(self, level_of_arc: np.ndarray, key: np.ndarray, descending: bool = False):
        order = np.lexsort((key, level_of_arc))
        lv, k = level_of_arc[order], key[order]
        cuts = np.flatnonzero(np.diff(lv)) + 1
        self.levels = []
        for a, lo in zip(np.split(order, cuts), np.append(0, cuts)) if len(order) else []:
            kk = k[lo : lo + len(a)]
            starts = np.flatnonzero(np.concatenate([[True], kk[1:] != kk[:-1]]))
            seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(a))))  # each arc's run
            self.levels.append((a, kk[starts], starts, seg))
        if descending:
            self.levels.reverse()


def logsumexp_runs(values: np.ndarray, starts: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """logsumexp of `values` over each run (runs begin at `starts`; `seg`: each value's run); an all -inf run
    gives -inf, without NaN."""
    peak = np.maximum.reduceat(values, starts)
    safe = np.where(np.isfinite(peak), peak, 0.0)
    sums = np.add.reduceat(np.exp(values - safe[seg]), starts)
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(peak), safe + np.log(sums), -np.inf)


def forward_backward(dag: Dag, scale: float = 1.0, name: str = "lattice",
                     level: np.ndarray | None = None) -> Posteriors:
    """Posteriors of every arc, final and node of `dag` under exp(-scale * cost) (see the module docstring).

    Arcs into one topological level are summed together (their sources are all done), and backward sums
    go a level at a time from the last; `level` (N,): the nodes' `state_levels` when the caller has them.
    Raises SmallstateError, naming `name`, when no complete path has a finite cost."""
    if not scale > 0:
        raise SmallstateError(f"{name}: posterior scale must be > 0, got {scale}")
    n = int(dag.n_nodes)
    src, dst = np.asarray(dag.src, dtype=np.int64), np.asarray(dag.dst, dtype=np.int64)
    cost = -scale * np.asarray(dag.cost, dtype=np.float64)  # log weights from here on
    final_node = np.asarray(dag.final_node, dtype=np.int64)
    final_w = -scale * np.asarray(dag.final_cost, dtype=np.float64)
    level = state_levels(n, src, dst) if level is None else level
    alpha = np.full(n, -np.inf)
    alpha[0] = 0.0
    for a, nodes, starts, seg in _Segments(level[dst], dst).levels:
        alpha[nodes] = logsumexp_runs(alpha[src[a]] + cost[a], starts, seg)
    beta = np.full(n, -np.inf)
    np.logaddexp.at(beta, final_node, final_w)  # a node listed twice as final has both final weights
    for a, nodes, starts, seg in _Segments(level[src], src, descending=True).levels:
        out = logsumexp_runs(beta[dst[a]] + cost[a], starts, seg)
        beta[nodes] = np.logaddexp(out, beta[nodes])  # a source's own final weight, if any
    ends = alpha[final_node] + final_w
    log_total = float(np.logaddexp.reduce(ends)) if len(ends) else -np.inf
    if not np.isfinite(log_total):
        raise SmallstateError(f"{name}: no complete path with a finite cost, so no posteriors")
    return Posteriors(arc=np.exp(alpha[src] + cost + beta[dst] - log_total), final=np.exp(ends - log_total),
                      node=np.exp(alpha + beta - log_total), alpha=alpha, beta=beta, log_total=log_total,
                      scale=scale)


def first_pass_dag(lat: Lattice, am_scale: float, graph_scale: float = 1.0) -> Dag:
    """The decoder's own lattice as a Dag: cost graph_scale * graph + am_scale * acoustic per arc and final,
    word keys from the symbol table (-1 for epsilon and non-words such as <sil>). `lat` must be prepared
    (`Lattice.prepare`: topological, start 0), as an `ExpandedLattice.source` is."""
    final = np.flatnonzero(lat.is_final())
    flags = lat.symbols.word_flags(lat.word)
    return Dag(lat.num_states, lat.src, lat.dst, graph_scale * lat.graph + am_scale * lat.acoustic, final,
               graph_scale * lat.final_graph[final] + am_scale * lat.final_acoustic[final],
               np.where(flags, lat.word, -1))


def source_arc_posteriors(expanded, w) -> np.ndarray:
    """(A,) posterior of each arc of the expanded lattice's source lattice under weights `w` (scale
    `w.posterior_scale`): a word hypothesis of the decoder's lattice (word, start and end state) split
    into many expanded arcs, one per LM history, gets the sum of theirs."""
    if expanded.source is None or expanded.arc is None:
        raise SmallstateError(f"lattice {expanded.name}: no source lattice kept, so no per-arc word posteriors")
    post = forward_backward(expanded.dag(w), w.posterior_scale, f"lattice {expanded.name}")
    return np.bincount(expanded.arc, weights=post.arc, minlength=expanded.source.num_arcs)
