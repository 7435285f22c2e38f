"""The n best distinct word sequences of an expanded lattice, by lazy k-best derivations.

Huang & Chiang (2005), "Better k-best parsing", algorithm 3, on a DAG (a hypergraph whose
edges have one tail): a forward Viterbi pass gives every node its best cost from the start;
then each node keeps a sorted list of its derivations (paths from the start), extended only
on demand from a heap of candidates (cost, in-arc, rank of the derivation at the arc's
source). The final weights are in-arcs of one virtual sink node, so the sink's list is the
answer.

Distinctness is enforced at every node, not only at the sink: a node lists only the best
derivation of each word prefix (epsilon arcs add no word), because a worse path with the same
prefix extends to the same word sequences, always at a higher cost. This keeps PocketSphinx-style
lattices, where one word sequence has thousands of time alignments, from flooding the search:
each node lists at most n + 1 derivations, so the work is bounded by (arcs + finals) * (n + 1)
candidate pops, and in practice only the nodes near the best paths are visited at all.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from .graph import viterbi

# Candidate pops allowed over all nodes before the search gives up (a safety net: the natural
# bound above only exceeds it for very large lattices with a large n).
DEFAULT_MAX_PATHS = 2_000_000


class KbestTruncated(UserWarning):
    """The k-best search hit its cap on examined paths and returned fewer than n sequences."""


def _graph(n_nodes, src, dst, cost, final_node, final_cost, word_key):
    """The DAG with the finals as arcs into a virtual sink (node n_nodes, arcs E..), checked, and its
    in-arcs by node: (src, dst, cost, word, in_start, in_arcs)."""
    if (len(src) and int(np.max(dst)) >= n_nodes) or (len(final_node) and int(np.max(final_node)) >= n_nodes):
        raise ValueError(f"a node number is not below n_nodes={n_nodes}")
    src = np.concatenate([np.asarray(src, dtype=np.int64), np.asarray(final_node, dtype=np.int64)])
    dst = np.concatenate([np.asarray(dst, dtype=np.int64), np.full(len(final_node), n_nodes, dtype=np.int64)])
    cost = np.concatenate([np.asarray(cost, dtype=np.float64), np.asarray(final_cost, dtype=np.float64)])
    word = np.concatenate([np.asarray(word_key, dtype=np.int64), np.full(len(final_node), -1, dtype=np.int64)])
    if len(src) and (src.min() < 0 or bool((src >= dst).any())):
        raise ValueError("arcs must go from a lower to a higher node number (topological order, start 0)")
    in_arcs = np.argsort(dst, kind="stable")
    in_start = np.searchsorted(dst[in_arcs], np.arange(n_nodes + 2))
    return src, dst, cost, word, in_start, in_arcs


class _LazyKbest:
    """Derivation lists of one DAG; node `n_nodes` is the virtual sink, arcs E.. are the finals."""

    def __init__(self, n_nodes, src, dst, cost, word, in_start, in_arcs, best_in=None):
        self.n_arcs, self.sink = len(src) - int(in_start[-1] - in_start[-2]), n_nodes  # finals come last
        self.in_start, self.in_arcs = in_start.tolist(), in_arcs.tolist()
        self.src, self.cost, self.word = src.tolist(), cost.tolist(), word.tolist()
        alpha = self._forward(n_nodes + 1) if best_in is None else best_in
        # cost of each arc's best derivation: the key of its rank-0 candidate at the arc's target
        self.arc_best = (np.asarray(alpha)[src] + cost).tolist()
        # (cost, arc, rank at source, prefix) per node, made when first asked for: most nodes never are
        self.derivs: defaultdict[int, list[tuple]] = defaultdict(list)
        self.derivs[0].append((0.0, -1, -1, 0))
        self.heaps: list[list | None] = [None] * (n_nodes + 1)
        self.pending: list[tuple | None] = [None] * (n_nodes + 1)  # last pop, whose successor is not pushed yet
        self.prefixes_at: list[set | None] = [None] * (n_nodes + 1)
        self.exhausted = [False] * (n_nodes + 1)
        self.exhausted[0] = True  # the start has no in-arc: its empty path is its only derivation
        self.trie: dict[tuple[int, int], int] = {}  # (prefix id, word) -> prefix id; 0 is the empty prefix
        self.pops = 0

    def _forward(self, n: int) -> list[float]:
        """Viterbi: the best cost from the start to each node (inf where none reaches it)."""
        alpha = [math.inf] * n
        alpha[0] = 0.0
        src, cost, arcs, start = self.src, self.cost, self.in_arcs, self.in_start
        for v in range(1, n):
            best = math.inf
            for e in arcs[start[v]:start[v + 1]]:
                d = alpha[src[e]] + cost[e]
                if d < best:
                    best = d
            alpha[v] = best
        return alpha

    def ensure(self, v: int, k: int, max_pops: int) -> bool:
        """Extend node v's list to rank k (or until v has no more); False when the pop cap stopped it.

        An explicit stack replaces the paper's recursion: a path can be thousands of arcs long."""
        derivs, heaps, pending, exhausted = self.derivs, self.heaps, self.pending, self.exhausted
        src, cost, word, trie = self.src, self.cost, self.word, self.trie
        stack = [(v, k)]
        while stack:
            v, k = stack[-1]
            if len(derivs[v]) > k or exhausted[v]:
                stack.pop()
                continue
            heap = heaps[v]
            if heap is None:
                heap = heaps[v] = self._first_candidates(v)
                self.prefixes_at[v] = set()
            last = pending[v]
            if last is not None:  # the popped candidate's successor may be the next best: push it first
                e, j = last
                du = derivs[src[e]]
                if len(du) <= j + 1 and not exhausted[src[e]]:
                    stack.append((src[e], j + 1))
                    continue
                pending[v] = None
                if len(du) > j + 1:
                    heapq.heappush(heap, (du[j + 1][0] + cost[e], e, j + 1))
            if not heap:
                exhausted[v] = True
                stack.pop()
                continue
            c, e, j = heap[0]
            du = derivs[src[e]]
            if len(du) <= j:  # a rank-0 candidate whose source has not been listed yet
                stack.append((src[e], j))
                continue
            if self.pops >= max_pops:
                return False
            self.pops += 1
            heapq.heappop(heap)
            prefix = du[j][3]
            if word[e] >= 0:
                prefix = trie.setdefault((prefix, word[e]), len(trie) + 1)
            seen = self.prefixes_at[v]
            if prefix not in seen:
                seen.add(prefix)
                derivs[v].append((c, e, j, prefix))
            pending[v] = (e, j)
        return True

    def _first_candidates(self, v: int) -> list[tuple]:
        best = self.arc_best
        heap = [(best[e], e, 0) for e in self.in_arcs[self.in_start[v]:self.in_start[v + 1]] if best[e] < math.inf]
        heapq.heapify(heap)
        return heap

    def arcs_of(self, v: int, k: int) -> list[int]:
        """The arcs of node v's rank-k derivation, from the start."""
        arcs = []
        while v != 0:
            _, e, j, _ = self.derivs[v][k]
            arcs.append(e)
            v, k = self.src[e], j
        return arcs[::-1]


class Dag(NamedTuple):
    """A DAG for the k-best search, as flat arrays (arc i goes src[i] -> dst[i] at `cost`, -ln)."""

    n_nodes: int
    src: Sequence
    dst: Sequence
    cost: Sequence
    final_node: Sequence
    final_cost: Sequence
    word_key: Sequence


class Laid(NamedTuple):
    """Several Dags laid end to end as one (`dag`: node ids offset, arrays concatenated), and where each one's
    nodes, arcs and finals start (`node_start`, `arc_start`, `final_start`: (L + 1,) each): passes over them
    then go a level at a time over all of them at once (the n-best's forward pass, the confidences'
    alignment), which is what makes many small lattices cheap (a level's array operations cost about the same
    for one lattice or 60)."""

    dag: Dag
    node_start: np.ndarray
    arc_start: np.ndarray
    final_start: np.ndarray

    @property
    def n_lattices(self) -> int:
        return len(self.node_start) - 1

    def with_sinks(self) -> tuple[np.ndarray, ...]:
        """(src, dst, cost, word_key, lattice) of every arc and of each final as an arc into its lattice's sink
        (node `dag.n_nodes` + l, no word), each lattice's arcs then its finals, in the order given."""
        d, L = self.dag, self.n_lattices
        lat_fin = np.repeat(np.arange(L), np.diff(self.final_start))
        lat = np.concatenate([np.repeat(np.arange(L), np.diff(self.arc_start)), lat_fin])
        order = np.argsort(lat, kind="stable")
        return (np.concatenate([d.src, d.final_node])[order],
                np.concatenate([d.dst, d.n_nodes + lat_fin])[order],
                np.concatenate([d.cost, d.final_cost])[order],
                np.concatenate([d.word_key, np.full(len(lat_fin), -1)])[order], lat[order])


_TYPES = (np.int64, np.int64, np.float64, np.int64, np.float64, np.int64)  # Dag's arrays, after n_nodes


def lay_out(dags: Sequence[Dag]) -> Laid:
    """`dags` end to end (see `Laid`)."""
    sizes = np.array([(int(d.n_nodes), len(d.src), len(d.final_node)) for d in dags], dtype=np.int64).reshape(-1, 3)
    node_start, arc_start, final_start = (np.concatenate([[0], np.cumsum(c)]) for c in sizes.T)
    offsets = node_start[:-1].tolist()

    def cat(i: int, ids: bool) -> np.ndarray:
        parts = [np.asarray(d[i], dtype=_TYPES[i - 1]) + (o if ids else 0) for d, o in zip(dags, offsets)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=_TYPES[i - 1])
    dag = Dag(int(node_start[-1]), *(cat(i, ids) for i, ids in zip(range(1, 7), (1, 1, 0, 1, 0, 0))))
    return Laid(dag, node_start, arc_start, final_start)


def kbest_paths(dag: Dag, n: int, max_paths: int = DEFAULT_MAX_PATHS,
                best_in: np.ndarray | None = None) -> list[tuple[float, np.ndarray, int]]:
    """The n cheapest distinct word sequences of a DAG, cheapest first: (total cost, the arcs of
    the sequence's cheapest path from node 0 in order, the index into final_node it ends with).

    Nodes are numbered topologically (every arc goes to a higher number) and node 0 is the start;
    an arc's word_key is its word as an int, negative for an arc that carries none (epsilon).
    Totals add costs along the path from 0.0 in path order, then the final cost. Ties between
    sequences go to the lower last arc (a final counts as arc len(src) + its index), then
    recursively the same at the arc's source, so the answer is deterministic.

    `max_paths` caps the candidate derivations examined over all nodes. When the cap is hit the
    sequences found so far are returned (they are the true best ones, in order, just fewer than
    n) and a KbestTruncated warning says so; it never returns a wrong sequence or total. `best_in`: the best
    cost from the start to every node and the sink, when known (`best_costs`)."""
    final_node = np.asarray(dag.final_node, dtype=np.int64)
    if n < 1 or len(final_node) == 0:
        return []
    graph = _graph(dag.n_nodes, dag.src, dag.dst, dag.cost, final_node, dag.final_cost, dag.word_key)
    kb = _LazyKbest(dag.n_nodes, *graph, best_in=best_in)
    sink = kb.sink
    for k in range(n):
        if not kb.ensure(sink, k, max_paths):
            _truncated(kb.pops, max_paths, len(kb.derivs[sink]), n)
            break
        if len(kb.derivs[sink]) <= k:
            break  # fewer than n distinct sequences exist
    out = []
    for k, (total, e, _, _) in enumerate(kb.derivs[sink][:n]):
        arcs = kb.arcs_of(sink, k)
        out.append((total, np.array(arcs[:-1], dtype=np.int64), e - kb.n_arcs))
    return out


def _truncated(pops: int, max_paths: int, found: int, n: int) -> None:
    warnings.warn(f"k-best search stopped after examining {pops} paths (max_paths={max_paths}): "
                  f"{found} of {n} word sequences returned", KbestTruncated, stacklevel=3)


@dataclass(frozen=True)
class ScoredPath:
    """One of a lattice's n best word sequences under some weights: its words, the natural-log components
    of its best path, and its total (higher is better)."""

    words: list[str]
    am: float
    graph: float
    neural: float
    ngram: float
    n_words: int
    n_oov: int
    total: float

    def scores(self) -> dict:
        """The components and the total, as an n-best record holds them (nbest.jsonl)."""
        return {"am": self.am, "graph": self.graph, "neural": self.neural, "ngram": self.ngram,
                "n_words": self.n_words, "n_oov": self.n_oov, "total": self.total}


def best_costs(dags: Sequence[Dag], levels: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each DAG's best cost from its start to every node and, last, to its virtual sink (what the k-best search
    starts from): the DAGs laid end to end, a level of all of them relaxed at a time (`graph.viterbi`), the same
    sums and minima as one at a time. `levels`: each one's node levels (every arc going up a level)."""
    laid = lay_out(dags)
    n, L = laid.dag.n_nodes, laid.n_lattices
    src, dst, cost, _, _ = laid.with_sinks()
    level = np.concatenate([*(np.asarray(lv, dtype=np.int64) for lv in levels), np.zeros(L, dtype=np.int64)])
    level[n:] = level[:n].max(initial=0) + 1  # the sinks after every node
    starts = laid.node_start[:-1][np.diff(laid.node_start) > 0]
    dist, _ = viterbi(n + L, src, dst, cost, level, sources=starts)
    return [np.append(dist[a:b], dist[n + k]) for k, (a, b) in enumerate(zip(laid.node_start[:-1].tolist(),
                                                                                 laid.node_start[1:].tolist()))]


def nbest_paths(expanded, w, n: int, dag: Dag | None = None, best_in: np.ndarray | None = None) -> list[ScoredPath]:
    """`ExpandedLattice.nbest(w, n)`: the n best distinct word sequences of an expanded lattice
    under weights `w`, best first; `dag` (its `dag(w)`) and `best_in` (`best_costs`) when already made."""
    x = expanded
    paths = kbest_paths(x.dag(w) if dag is None else dag, n, best_in=best_in)
    per_arc = np.stack([x.acoustic, x.graph, x.nn, x.ng, x.is_word, x.oov])  # one gather per path, not six
    per_final = np.stack([x.final_acoustic, x.final_graph, x.final_nn, x.final_ng])
    out = []
    for tot, a, fi in paths:
        am, graph, nn, ng, n_words, n_oov = per_arc[:, a].sum(axis=1).tolist()
        f_am, f_graph, f_nn, f_ng = per_final[:, fi].tolist()
        words = x.word[a][x.is_word[a] > 0]
        out.append(ScoredPath(words=[x.symbols.word(i) for i in words.tolist()], am=-am - f_am,
                              graph=-graph - f_graph, neural=nn + f_nn, ngram=ng + f_ng, n_words=int(n_words),
                              n_oov=int(n_oov), total=float(-tot)))
    return out
