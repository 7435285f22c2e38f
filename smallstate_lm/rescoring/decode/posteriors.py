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
from typing import NamedTuple, Sequence

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


class Laid(NamedTuple):
    """Several Dags laid end to end as one (`dag`: node ids offset, arrays concatenated), and where each one's
    nodes, arcs and finals start (`node_start`, `arc_start`, `final_start`: (L + 1,) each): the alignment's
    passes (`consensus.Aligner.many`) then go a level at a time over all of them at once, which is what makes
    many small lattices cheap (a level's array operations cost about the same for one lattice or 60)."""

    dag: Dag
    node_start: np.ndarray
    arc_start: np.ndarray
    final_start: np.ndarray

    @property
    def n_lattices(self) -> int:
        return len(self.node_start) - 1


def lay_out(dags: Sequence[Dag]) -> Laid:
    """`dags` end to end (see `Laid`); one Dag is laid out as itself."""
    sizes = [(int(d.n_nodes), len(d.src), len(d.final_node)) for d in dags]
    node_start, arc_start, final_start = (np.concatenate([[0], np.cumsum(c)]).astype(np.int64)
                                          for c in zip(*sizes)) if dags else (np.zeros(1, np.int64),) * 3
    if len(dags) == 1:
        d = dags[0]
        dag = Dag(int(d.n_nodes), *(np.asarray(a, dtype=t) for a, t in zip(d[1:], _TYPES)))
        return Laid(dag, node_start, arc_start, final_start)

    def cat(i: int, offset: bool):
        parts = [np.asarray(d[i], dtype=_TYPES[i - 1]) for d in dags]
        if offset:
            parts = [a + o for a, o in zip(parts, node_start[:-1].tolist())]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=_TYPES[i - 1])
    dag = Dag(int(node_start[-1]), cat(1, True), cat(2, True), cat(3, False), cat(4, True), cat(5, False),
              cat(6, False))
    return Laid(dag, node_start, arc_start, final_start)


_TYPES = (np.int64, np.int64, np.float64, np.int64, np.float64, np.int64)  # Dag's arrays, after n_nodes


def log_sums(laid: Laid, scale: float, level: np.ndarray,
             names: Sequence[str] = ("lattice",)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alpha (N,), beta (N,), log_total (L,)) of laid-out Dags under exp(-scale * cost) (the module docstring):
    arcs into one topological level (`level`, (N,): `state_levels` of the laid-out graph) are summed together,
    their sources all done, and backward sums go a level at a time from the last. A node's arcs are summed in
    the same order however many lattices are laid beside it. Raises SmallstateError naming the first lattice
    (`names[l]`, or the first name) with no complete path of finite cost, or for a scale that is not > 0."""
    dag = laid.dag
    if not scale > 0:
        raise SmallstateError(f"{names[0]}: posterior scale must be > 0, got {scale}")
    n, src, dst = int(dag.n_nodes), dag.src, dag.dst
    cost = -scale * dag.cost  # log weights from here on
    final_w = -scale * dag.final_cost
    alpha = np.full(n, -np.inf)
    alpha[laid.node_start[:-1][np.diff(laid.node_start) > 0]] = 0.0  # each lattice's start
    for a, nodes, starts, seg in _Segments(level[dst], dst).levels:
        alpha[nodes] = logsumexp_runs(alpha[src[a]] + cost[a], starts, seg)
    beta = np.full(n, -np.inf)
    np.logaddexp.at(beta, dag.final_node, final_w)  # a node listed twice as final has both final weights
    for a, nodes, starts, seg in _Segments(level[src], src, descending=True).levels:
        out = logsumexp_runs(beta[dst[a]] + cost[a], starts, seg)
        beta[nodes] = np.logaddexp(out, beta[nodes])  # a source's own final weight, if any
    ends = alpha[dag.final_node] + final_w
    log_total = np.full(laid.n_lattices, -np.inf)
    has = np.diff(laid.final_start) > 0
    if has.any():  # reduceat gives an empty run its next element: only lattices with finals are summed
        log_total[has] = np.logaddexp.reduceat(ends, laid.final_start[:-1][has])
    bad = np.flatnonzero(~np.isfinite(log_total))
    if len(bad):
        name = names[int(bad[0])] if len(names) > 1 else names[0]
        raise SmallstateError(f"{name}: no complete path with a finite cost, so no posteriors")
    return alpha, beta, log_total


def forward_backward(dag: Dag, scale: float = 1.0, name: str = "lattice",
                     level: np.ndarray | None = None) -> Posteriors:
    """Posteriors of every arc, final and node of `dag` under exp(-scale * cost) (see the module docstring);
    `level` (N,): the nodes' `state_levels` when the caller has them. Raises SmallstateError, naming `name`,
    when no complete path has a finite cost."""
    laid = lay_out([dag])
    d = laid.dag
    level = state_levels(d.n_nodes, d.src, d.dst) if level is None else level
    alpha, beta, totals = log_sums(laid, scale, level, [name])
    log_total = float(totals[0])
    ends = alpha[d.final_node] - scale * d.final_cost
    return Posteriors(arc=np.exp(alpha[d.src] - scale * d.cost + beta[d.dst] - log_total),
                      final=np.exp(ends - log_total), node=np.exp(alpha + beta - log_total), alpha=alpha,
                      beta=beta, log_total=log_total, scale=scale)


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
