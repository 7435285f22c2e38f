"""Searches over acyclic graphs held as flat arrays (arc i goes src[i] -> dst[i], costs are -ln, lower is
better), on one graph or on several laid end to end with their node ids offset: levels, Viterbi, best
completion costs and backtracking; and the grouping of rows by key that the expansion's merges use.
"""

from __future__ import annotations

import numpy as np


def state_levels(num_states: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(S,) int64 longest-path depth of each state of a DAG: states of one level have no arc between
    them. States are peeled a level at a time (those whose predecessors are all done), so each arc is
    looked at once; several lattices laid end to end are done together. States on a cycle keep 0."""
    level = np.zeros(num_states, dtype=np.int64)
    if len(src) == 0:
        return level
    waiting = np.bincount(dst, minlength=num_states)  # unfinished predecessors, by arc
    order = np.argsort(src, kind="stable")
    first = np.searchsorted(src[order], np.arange(num_states + 1))
    ready = np.flatnonzero(waiting == 0)
    depth = 0
    while ready.size:
        level[ready] = depth
        out = dst[order[concat_ranges(first[ready], first[ready + 1] - first[ready])]]
        if out.size == 0:
            break
        to, n = np.unique(out, return_counts=True)
        waiting[to] -= n
        ready = to[waiting[to] == 0]
        depth += 1
    return level


def viterbi(num_nodes: int, src: np.ndarray, dst: np.ndarray, cost: np.ndarray,
            level: np.ndarray, sources: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Best (lowest) cost from node 0 (or from the nearest of `sources`: several graphs laid end to
    end) to every node of a DAG, and the best incoming arc (-1: none; `backtrack` follows them).

    `level` (N,) is a longest-path depth (`state_levels`): arcs into one level are relaxed together.
    Ties go to the lowest arc index, as a scan of each node's incoming arcs in index order would."""
    dist = np.full(num_nodes, np.inf)
    back = np.full(num_nodes, -1, dtype=np.int64)
    if num_nodes:
        dist[0 if sources is None else sources] = 0.0
    arc_level = level[dst]
    order = np.argsort(arc_level, kind="stable")
    bounds = np.searchsorted(arc_level[order], np.arange(int(level.max(initial=0)) + 2))
    first = np.full(num_nodes, len(src), dtype=np.int64)  # lowest best in-arc of each node
    for lo, hi in zip(bounds[1:-1].tolist(), bounds[2:].tolist()):
        if lo == hi:
            continue
        a = order[lo:hi]  # arcs into this level: their targets have no other in-arcs
        d = dst[a]
        cand = dist[src[a]] + cost[a]
        np.minimum.at(dist, d, cand)
        win = cand == dist[d]
        np.minimum.at(first, d[win], a[win])
    reached = first < len(src)
    back[reached] = first[reached]
    return dist, back


def backtrack(back: np.ndarray, src: np.ndarray, end: int) -> np.ndarray:
    """The arcs of the best path into node `end`, from its first arc: `back` (each node's best in-arc, -1 where
    it has none, as `viterbi` gives) followed from `end` to a node without one. A path is a few dozen arcs,
    so Python ints are cheaper here than numpy calls."""
    arcs = []
    a = int(back[end])
    while a >= 0:
        arcs.append(a)
        a = int(back[src[a]])
    return np.array(arcs[::-1], dtype=np.int64)


def completion_costs(src: np.ndarray, dst: np.ndarray, cost: np.ndarray, final: np.ndarray,
                     level: np.ndarray) -> np.ndarray:
    """Best cost from each state to the end of the graph (`final` holds the final costs, inf elsewhere),
    relaxed a level at a time from the last (`level`: `state_levels`); works on many graphs laid end to end."""
    beta = np.where(np.isfinite(final), final, np.inf)
    src_level = level[src]
    order = np.argsort(src_level, kind="stable")
    bounds = np.searchsorted(src_level[order], np.arange(int(level.max(initial=0)) + 2))
    for lo, hi in zip(bounds[-2::-1].tolist(), bounds[:0:-1].tolist()):  # the last level first
        if lo < hi:
            a = order[lo:hi]
            np.minimum.at(beta, src[a], cost[a] + beta[dst[a]])
    return beta


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges starts[i] .. starts[i] + counts[i] (the arcs of several states at once)."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - offsets + np.repeat(starts, counts)


def sort_groups(groups: tuple[np.ndarray, ...], keys: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Order rows by (*groups, *keys, position) and return (that order, the index in it where
    each group starts): the first row of a group is its minimum by the keys, ties to the
    earliest row, like a dict updated only on a strictly better value."""
    n = len(groups[0])
    order = np.lexsort((*reversed(keys), *reversed(groups)))  # a stable sort: equal rows keep their order
    if n == 0:
        return order, np.zeros(0, dtype=np.int64)
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for g in groups:
        v = g[order]
        change[1:] |= v[1:] != v[:-1]
    return order, np.flatnonzero(change)


def segments(starts: np.ndarray, n: int) -> np.ndarray:
    """Group number of each of n sorted rows, given where groups start."""
    return np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))


def run_index(run: np.ndarray) -> dict[int, slice]:
    """Each value -> its rows, of rows sorted by value (the rows of each lattice of a run, by its number)."""
    if len(run) == 0:
        return {}
    cut = np.flatnonzero(run[1:] != run[:-1]) + 1
    starts, ends = np.append(0, cut), np.append(cut, len(run))
    return {r: slice(a, e) for r, a, e in zip(run[starts].tolist(), starts.tolist(), ends.tolist())}
