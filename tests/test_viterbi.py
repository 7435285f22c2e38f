"""Array graph searches equal plain scans: level-at-a-time Viterbi and levels (ties included), reachability."""

import numpy as np

from smallstate_lm.rescoring.lattices.lattice import _reach, state_levels, viterbi


def _random_dag(rng, n):
    src, dst = [], []
    for t in range(1, n):
        for s in rng.choice(t, size=min(t, int(rng.integers(1, 4))), replace=False):
            src.append(int(s))
            dst.append(t)
    for _ in range(n):  # parallel arcs too
        t = int(rng.integers(1, n))
        src.append(int(rng.integers(0, t)))
        dst.append(t)
    return np.array(src), np.array(dst)


def _scan(n, src, dst, cost):
    dist = np.full(n, np.inf)
    back = np.full(n, -1)
    dist[0] = 0.0
    for t in range(1, n):  # incoming arcs in index order, the first minimum wins
        for a in np.flatnonzero(dst == t):
            if back[t] < 0 or dist[src[a]] + cost[a] < dist[t]:
                dist[t], back[t] = dist[src[a]] + cost[a], a
    return dist, back


def test_viterbi_equals_a_node_by_node_scan_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 30))
        src, dst = _random_dag(rng, n)
        cost = rng.integers(-2, 3, size=src.size).astype(float)  # small integers: many ties
        level = state_levels(n, src, dst)
        assert np.all(level[dst] > level[src])
        dist, back = viterbi(n, src, dst, cost, level)
        ref_dist, ref_back = _scan(n, src, dst, cost)
        np.testing.assert_array_equal(dist, ref_dist)
        np.testing.assert_array_equal(back, ref_back)


def test_reachability_equals_a_depth_first_search():
    rng = np.random.default_rng(1)
    for _ in range(500):
        S, A = int(rng.integers(2, 40)), int(rng.integers(0, 80))
        a, b = rng.integers(0, S, A), rng.integers(0, S, A)
        src, dst = (a, b) if rng.random() < 0.3 else (np.minimum(a, b), np.maximum(a, b))  # cyclic, or numbered
        keep = src != dst
        src, dst = src[keep], dst[keep]
        if rng.random() < 0.5:
            src, dst = dst, src
        seeds = rng.choice(S, size=int(rng.integers(1, 3)), replace=False).tolist()
        seen = np.zeros(S, dtype=bool)
        seen[seeds] = True
        todo = list(seeds)
        while todo:
            for v in dst[src == todo.pop()]:
                if not seen[v]:
                    seen[v] = True
                    todo.append(int(v))
        np.testing.assert_array_equal(_reach(S, src, dst, seeds), seen)


def _longest_depth(n, src, dst):
    depth = np.zeros(n, dtype=np.int64)
    for t in range(n):  # nodes are numbered topologically by _random_dag
        for a in np.flatnonzero(dst == t):
            depth[t] = max(depth[t], depth[src[a]] + 1)
    return depth


def _end_to_end(rng, sizes):
    """Random DAGs laid end to end (ids offset), arcs shuffled: (n, src, dst, first node of each)."""
    srcs, dsts, firsts, off = [], [], [], 0
    for n in sizes:
        s, d = _random_dag(rng, n)
        srcs.append(s + off)
        dsts.append(d + off)
        firsts.append(off)
        off += n
    src, dst = np.concatenate(srcs), np.concatenate(dsts)
    perm = rng.permutation(src.size)
    return off, src[perm], dst[perm], np.array(firsts)


def test_levels_are_longest_path_depths_also_for_graphs_laid_end_to_end():
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(2, 40))
        src, dst = _random_dag(rng, n)
        perm = rng.permutation(src.size)  # levels must not depend on the arcs' order
        np.testing.assert_array_equal(state_levels(n, src[perm], dst[perm]), _longest_depth(n, src, dst))
        total, src2, dst2, firsts = _end_to_end(rng, rng.integers(2, 25, size=4))
        level = state_levels(total, src2, dst2)
        for k, first in enumerate(firsts):
            end = firsts[k + 1] if k + 1 < len(firsts) else total
            mine = (src2 >= first) & (src2 < end)
            np.testing.assert_array_equal(level[first:end], _longest_depth(end - first, src2[mine] - first,
                                                                           dst2[mine] - first))


def test_viterbi_from_several_sources_equals_each_graph_alone():
    rng = np.random.default_rng(2)
    for _ in range(30):
        total, src, dst, firsts = _end_to_end(rng, rng.integers(2, 25, size=5))
        cost = rng.integers(-2, 3, size=src.size).astype(float)
        dist, back = viterbi(total, src, dst, cost, state_levels(total, src, dst), sources=firsts)
        for k, first in enumerate(firsts):
            end = firsts[k + 1] if k + 1 < len(firsts) else total
            arcs = np.flatnonzero((src >= first) & (src < end))  # in index order, as the ties go
            ref_dist, ref_back = _scan(end - first, src[arcs] - first, dst[arcs] - first, cost[arcs])
            np.testing.assert_array_equal(dist[first:end], ref_dist)
            np.testing.assert_array_equal(back[first:end], np.where(ref_back >= 0, arcs[ref_back], -1))
