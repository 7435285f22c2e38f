"""Consensus (minimum Bayes risk) decoding of a lattice, and the word confidences that come with it.

The method is Xu, Povey, Mangu & Zhu (2011), "Minimum Bayes risk decoding and system combination based on a
recursion for edit distance" (what Kaldi's `lattice-mbr-decode` and `lattice-to-ctm-conf` run), chosen over
Mangu et al.'s (2000) clustering into confusion networks because it needs no word times (the bundled OpenFST
lattices have none), and handles any acyclic lattice, epsilon arcs included, in passes over its arcs.

Given a hypothesis R = r_1..r_Q, a forward pass gives every node n and every q in 0..Q an approximation A(n, q)
of the expected Levenshtein distance between the paths' prefixes ending at n and r_1..r_q:

    arc e = (u -> n, word x):  A_e(0) = A(u, 0) + [x is a word]
                               A_e(q) = min( A(u, q-1) + [x != r_q],    x takes r_q's slot (match or substitution)
                                             A(u, q) + [x is a word],   x is inserted
                                             A_e(q-1) + 1 )             r_q is deleted
    A(n, q) = sum over the arcs e into n of P(e | n) A_e(q),   A(start, q) = q,

P(e | n) being e's share of the forward probability into n; the finals are arcs into one sink, and A(sink, Q)
is the (approximate) Bayes risk of R. The min is taken inside the expectation: that is the approximation (the
exact expected edit distance would take it per path). A backward pass then carries the posterior mass from
(sink, Q) to the start along the operations chosen, and fills a confusion network ("sausage") of 2Q + 1 bins:
mass that word x carries into r_q's slot goes to bin 2q - 1 under x, mass that deletes r_q (or an epsilon arc
in its slot) to bin 2q - 1 under epsilon, and words inserted between r_q and r_{q+1} to bin 2q (bin 0: before
r_1). Odd bins hold mass 1; an even bin's epsilon gets what its words leave of 1. The next hypothesis is each
bin's most probable entry, epsilons dropped. Starting from the Viterbi path, this repeats until the hypothesis
comes back (at most `max_iter` passes); the hypothesis of lowest risk met is kept, with its bins, and each of its
words' posterior in its own bin is that word's confidence. A Viterbi transcript's confidences come from one
pass aligned to it (as `lattice-to-ctm-conf --decode-mbr=false` gives them).

Where this provably equals exhaustive search (tests/test_consensus.py checks it): a one-path lattice (risk 0
there), and a "sausage" lattice (K positions, every choice of one word per position a path, the positions'
vocabularies disjoint, no epsilon). There, two paths' edit distance is their Hamming distance (a match can only
pair equal positions, so an alignment with m matches costs at least K - m), the expected loss of a path is
sum_k (1 - P(word_k)), least for each position's most probable word, and the recursion is exact: every path into
a node has the same length, so the same alignment (the diagonal) is best for all of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import SmallstateError
from ..lattices.graph import state_levels
from ..lattices.kbest import Dag, Laid, lay_out
from .posteriors import logsumexp_runs

SUB, INS, DEL = 0, 1, 2  # the operation an arc's mass takes at each hypothesis position
DEFAULT_MAX_ITER = 10


@dataclass
class Alignment:
    """One pass aligned to hypothesis `hyp` (compact word indices): its approximate Bayes risk (expected word
    errors), the bins' posteriors `gamma` (2Q+1, V+2: column 0 epsilon) and, when node times were given, the
    mass-weighted sums of the start and end times of each bin's words."""

    hyp: np.ndarray  # (Q,)
    risk: float
    gamma: np.ndarray
    t_start: np.ndarray | None = None
    t_end: np.ndarray | None = None

    def next_hypothesis(self) -> np.ndarray:
        best = self.gamma.argmax(axis=1)  # ties to the lower column: epsilon first, so no word is added on a tie
        return best[best > 0]

    def confidences(self) -> np.ndarray:
        """(Q,) each hypothesis word's posterior in its own bin, in [0, 1]."""
        q = np.arange(len(self.hyp))
        return np.clip(self.gamma[2 * q + 1, self.hyp], 0.0, 1.0)

    def times(self) -> np.ndarray | None:
        """(Q, 2) mass-weighted mean start and end time of each hypothesis word's arcs in its bin."""
        if self.t_start is None:
            return None
        q = np.arange(len(self.hyp))
        mass = np.maximum(self.gamma[2 * q + 1, self.hyp], 1e-300)
        return np.stack([self.t_start[2 * q + 1, self.hyp], self.t_end[2 * q + 1, self.hyp]], axis=1) / mass[:, None]


class Aligner:
    """Lattices prepared once for repeated alignments (see the module docstring): finals as arcs into a sink per
    lattice, each arc's forward share P(e | dst) (0 from a node no path reaches; arcs into dead ends get no mass
    back), the arcs numbered by their target's level (forward) and each node's arcs in (backward, which follows
    only the cells that carry mass). One lattice (`Aligner(dag, ...)`) or several (`Aligner.many`): several are
    aligned in the same passes, a level of all of them at a time, each to its own hypothesis, with the choices
    each would get alone (a node's arcs are summed in the order its lattice gave them). The forward pass holds
    (positions, arcs) arrays: runs along the hypothesis are then operations on whole rows."""

    def __init__(self, dag: Dag, scale: float, node_times: np.ndarray | None = None, name: str = "lattice"):
        self._build(lay_out([dag]), scale, None if node_times is None else [node_times], [name])

    @classmethod
    def many(cls, dags: Sequence[Dag], scale: float, names: Sequence[str],
             levels: Sequence[np.ndarray] | None = None) -> "Aligner":
        """`dags` prepared together (no node times: what a consensus decode needs is prepared one at a time);
        `levels`, when known, a level per node of each (every arc going up a level, as `state_levels` gives
        them or the levels of the lattice states an expanded lattice's nodes stand for). Raises SmallstateError
        naming the first lattice without a complete path of finite cost."""
        al = cls.__new__(cls)
        al._build(lay_out(dags), scale, None, list(names), None if levels is None else np.concatenate(levels))
        return al

    def _build(self, laid: Laid, scale: float, node_times: list | None, names: list[str],
               level: np.ndarray | None = None) -> None:
        d, L = laid.dag, laid.n_lattices
        n = int(d.n_nodes)
        if level is None:
            level = state_levels(n, d.src, d.dst)
        else:
            level = np.asarray(level, dtype=np.int64)
            if len(level) != n or (len(d.src) and not bool((level[d.src] < level[d.dst]).all())):
                raise ValueError("levels must give every node one, and every arc must go up a level")
        if not scale > 0:
            raise SmallstateError(f"{names[0]}: posterior scale must be > 0, got {scale}")
        self.n_lattices, self.starts, self.sinks, self.n_rows = L, laid.node_start[:-1], n + np.arange(L), n + L
        self.sizes = np.diff(laid.node_start)
        src, dst, cost, key, lat = laid.with_sinks()
        level = np.concatenate([level, np.full(L, level.max(initial=0) + 1)])  # sinks come after every node
        # arcs numbered by their target's level, those alone into their target first, then by target: each level
        # of the forward pass is one slice, and a target with one arc in takes that arc's values as they are
        multi = (np.bincount(dst, minlength=n + L) > 1)[dst]
        order = np.argsort((level[dst] * 2 + multi) * (n + L) + dst, kind="stable")
        self.src, self.dst, self.lat, self.key = src[order], dst[order], lat[order], key[order]  # key -1: epsilon
        self._order, self._lat_given = order, lat
        log_w = -scale * cost[order]
        self.groups = _slices_by_level(self.dst, level, multi[order])
        alpha = self._forward_sums(log_w, names)
        # P(e | dst): sums to 1 into each node; 0 from or into a node no path of finite cost reaches (its arcs
        # then add nothing; -inf - -inf would be NaN, and NaN times 0 would reach every node after it)
        reached = np.isfinite(alpha[self.src]) & np.isfinite(alpha[self.dst])
        with np.errstate(invalid="ignore"):
            self.share = np.where(reached, np.exp(alpha[self.src] + log_w - alpha[self.dst]), 0.0)
        # the backward pass visits the nodes a level at a time, deepest first (a node's mass is complete once
        # every arc out of it, all into deeper levels, is done), and follows only the cells that carry mass
        self.levels = _nodes_by_level(level)
        runs = np.flatnonzero(np.concatenate([[True], self.dst[1:] != self.dst[:-1]])) if len(self.dst) \
            else np.zeros(0, dtype=np.int64)
        self.in_first = np.zeros(self.n_rows, dtype=np.int64)  # the arcs into node v: in_first[v] + range(in_count[v])
        self.in_count = np.zeros(self.n_rows, dtype=np.int64)
        self.in_first[self.dst[runs]] = runs
        self.in_count[self.dst[runs]] = np.diff(np.append(runs, len(self.dst)))
        self.times = None
        if node_times is not None:  # one lattice; a final's arc into the sink takes no time
            t = np.append(np.asarray(node_times[0], dtype=np.float64), 0.0)
            self.times = (t[self.src], np.where(self.dst >= n, t[self.src], t[self.dst]))

    def _forward_sums(self, log_w: np.ndarray, names: list[str]) -> np.ndarray:
        """(N + L,) the log forward sums of the nodes, the sinks' being the lattices' totals (a level at a time,
        each node's arcs summed in the order given, as `posteriors.forward_backward` does). Raises SmallstateError
        naming the first lattice with no complete path of finite cost."""
        alpha = np.full(self.n_rows, -np.inf)
        alpha[self.starts[self.sizes > 0]] = 0.0  # each lattice's start
        for a, m, b, alone, nodes, starts in self.groups:
            alpha[alone] = alpha[self.src[a:m]] + log_w[a:m]  # a sum of one term is that term
            if m == b:
                continue
            vals = alpha[self.src[m:b]] + log_w[m:b]
            if nodes[0] >= self.n_rows - self.n_lattices:  # the totals, summed as forward_backward sums them
                alpha[nodes] = np.logaddexp.reduceat(vals, starts)
            else:
                seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, b - m)))
                alpha[nodes] = logsumexp_runs(vals, starts, seg)
        bad = np.flatnonzero(~np.isfinite(alpha[self.sinks]))
        if len(bad):
            raise SmallstateError(f"{names[int(bad[0])] if len(names) > 1 else names[0]}: no complete path with a "
                                  "finite cost, so no posteriors")
        return alpha

    @functools.cached_property
    def _compact(self) -> tuple[list[np.ndarray], np.ndarray]:
        """(each lattice's word keys in order, each arc's compact word index: 0 epsilon, 1..V the lattice's
        words): the columns of its sausage."""
        words = self.key >= 0
        radix = int(self.key.max(initial=0)) + 1
        code = self.lat[words] * radix + self.key[words]  # (lattice, word) as one number
        uniq = np.unique(code)
        first = np.searchsorted(uniq // radix, np.arange(self.n_lattices + 1))
        word = np.zeros(len(self.key), dtype=np.int64)
        word[words] = np.searchsorted(uniq, code) - first[self.lat[words]] + 1
        return [uniq[first[k] : first[k + 1]] % radix for k in range(self.n_lattices)], word

    @property
    def vocab(self) -> np.ndarray:
        """The one lattice's word keys by compact index - 1."""
        return self._compact[0][0]

    def keys_to_index(self, keys: Sequence[int], k: int = 0) -> np.ndarray:
        """Word keys (decoder ids) -> lattice k's compact indices; a word it lacks gets V+1, which no arc has."""
        vocab = self._compact[0][k]
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(vocab, keys)
        found = (pos < len(vocab)) & (vocab[np.minimum(pos, len(vocab) - 1)] == keys) \
            if len(vocab) else np.zeros(len(keys), dtype=bool)
        return np.where(found, pos + 1, len(vocab) + 1)

    def confidences_of(self, keys: Sequence[int]) -> list[float]:
        """Each of `keys`' posterior in its own bin, the lattice aligned to them (`aligned_confidences`)."""
        return self.confidences_many([keys])[0]

    def confidences_many(self, keys: Sequence[Sequence[int]]) -> list[list[float]]:
        """`confidences_of` for every lattice, keys[k] (decoder ids, negative: a word no arc has) for lattice k,
        in one set of passes; only each word's own bin is summed (its mass in its slot), not whole sausages."""
        if len(keys) != self.n_lattices:
            raise ValueError(f"{len(keys)} hypotheses for {self.n_lattices} lattices")
        hyp, lens = _padded([np.where(np.asarray(k, dtype=np.int64) >= 0, k, -2) for k in keys], self.n_lattices)
        if hyp.shape[1] == 0:
            return [[] for _ in keys]
        _, choice, cells, _ = self._passes(hyp, lens)
        arc, q, m = cells
        Q = hyp.shape[1]
        said = (choice[q, arc] == SUB) & (self.key[arc] == hyp[self.lat[arc], np.maximum(q - 1, 0)])
        mass = np.bincount(self.lat[arc[said]] * Q + q[said] - 1, m[said], minlength=self.n_lattices * Q)
        mass = np.clip(mass.reshape(self.n_lattices, Q), 0.0, 1.0)
        return [mass[k, :n].tolist() for k, n in enumerate(lens.tolist())]

    def align(self, hyp: np.ndarray) -> Alignment:
        """One forward and one backward pass against `hyp` (compact indices)."""
        return self.align_many([hyp])[0]

    def align_many(self, hyps: Sequence[np.ndarray]) -> list[Alignment]:
        """One forward and one backward pass of every lattice, lattice k against hyps[k] (its compact indices),
        and each one's sausage."""
        vocabs, _ = self._compact
        keys = [np.append(v, -2)[np.asarray(h, dtype=np.int64) - 1] for v, h in zip(vocabs, hyps)]
        hyp, lens = _padded(keys, self.n_lattices)
        A, choice, (arc, q, m), B = self._passes(hyp, lens)
        flow = np.zeros(choice.shape)
        np.add.at(flow, (q, arc), m)
        out = []
        for k, h in enumerate(hyps):
            arcs, q = self._arcs_of(k), len(h)
            out.append(self._bins(k, arcs, np.asarray(h), float(A[q, self.sinks[k]]), choice[: q + 1, arcs].T,
                                  flow[: q + 1, arcs].T, B[: q + 1, self.starts[k]]))
        return out

    def _passes(self, hyp: np.ndarray, lens: np.ndarray):
        """(A, choice, the cells mass passes through, B) of the forward and backward passes against the hypotheses
        `hyp` (L, Q) of word keys, padded past each one's length `lens` with a key no arc has. Hypotheses of
        different lengths share one width: a lattice's positions past its own length only ever see its own
        (the deletion chain runs up, mass runs down), so they change nothing."""
        W = hyp.shape[1] + 1
        A = np.zeros((W, self.n_rows))
        A[:, self.starts] = np.arange(W)[:, None]
        choice = np.empty((W, len(self.src)), dtype=np.int8)
        other = self._other_words(hyp)
        for a, m, b, alone, nodes, starts in self.groups:
            choice[:, a:b], arc_a = self._forward_arcs(A[:, self.src[a:b]], self.key[a:b], other[:, a:b])
            arc_a *= self.share[a:b]
            A[:, alone] = arc_a[:, : m - a]
            if m < b:
                A[:, nodes] = np.add.reduceat(arc_a[:, m - a :], starts, axis=1)
        cells, B = self._backward(choice, lens)
        return A, choice, cells, B

    def _other_words(self, hyp: np.ndarray) -> np.ndarray:
        """(Q, E) whether each arc's word is not r_q of its lattice's hypothesis (`hyp`, (L, Q) word keys): a
        word stands at one or two places of a hypothesis, so the matches are found by sorting, not compared."""
        Q = hyp.shape[1]
        other = np.ones((Q, len(self.key)), dtype=bool)
        radix = int(max(self.key.max(initial=0), hyp.max(initial=0))) + 1
        k, q = np.nonzero(hyp >= 0)
        code = k * radix + hyp[k, q]  # (lattice, word) of each hypothesis position, as one number
        by = np.argsort(code, kind="stable")
        code, q = code[by], q[by]
        arcs = np.flatnonzero(self.key >= 0)
        mine = self.lat[arcs] * radix + self.key[arcs]
        lo, hi = np.searchsorted(code, mine), np.searchsorted(code, mine, side="right")
        count = hi - lo
        owner = np.repeat(np.arange(len(arcs)), count)
        at = lo[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)
        other[q[at], arcs[owner]] = False
        return other

    @staticmethod
    def _forward_arcs(Au: np.ndarray, x: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(choices, A_e), (Q+1, n) each, of arcs with word keys x (n,) from sources whose columns of A are Au
        (Q+1, n); `other` (Q, n): whether x is not r_q.

        The deletion chain A_e(q) = min(best(q), A_e(q-1) + 1) unrolls to q + min over j <= q of (best(j) - j):
        a running minimum along q, so no loop over the hypothesis is needed."""
        ins = (x >= 0).astype(np.float64)
        a1 = Au[:-1] + other  # (Q, n): x in r_q's slot
        a2 = Au[1:] + ins  # (Q, n): x inserted after r_q
        best = np.empty(Au.shape)  # (Q+1, n)
        best[0] = Au[0] + ins
        np.minimum(a1, a2, out=best[1:])
        c = np.empty(Au.shape, dtype=np.int8)
        c[0] = INS
        np.greater(a1, a2, out=c[1:].view(bool))  # SUB 0, INS 1; ties: substitution, then insertion, then deletion
        q = np.arange(Au.shape[0], dtype=np.float64)[:, None]
        best_q = best - q
        run = np.empty(Au.shape)
        run[0] = best_q[0]
        for i in range(1, len(run)):  # row by row: each row is one contiguous array operation
            np.minimum(run[i - 1], best_q[i], out=run[i])
        # a deletion only where it is better by more than rounding: ties stay with the operations above
        dele = np.zeros(Au.shape, dtype=bool)
        np.less(run[:-1], best_q[1:] - 1e-9, out=dele[1:])
        np.copyto(c, DEL, where=dele)
        run += q
        np.copyto(best, run, where=dele)
        return c, best

    def _backward(self, choice: np.ndarray, lens: np.ndarray) -> tuple[tuple, np.ndarray]:
        """((arcs, positions, masses) of every cell that mass passes through, a cell once for each time; the
        mass at each node at each position, (Q+1, rows), whose start columns are what reaches each lattice's
        start), from mass 1 at each sink at its hypothesis' length.

        Only cells that carry mass are followed (about one in twelve): a level's nodes' cells with mass go into
        their arcs (times each arc's share); a cell that deletes r_q hands its mass down to q-1 in the same arc,
        the others to the arc's source (at q after an insertion, q-1 after a substitution)."""
        width = choice.shape[0]
        B = np.zeros((self.n_rows, width))  # node by node: a level's nodes are read as whole rows
        B[self.sinks, lens] = 1.0
        flat_b = B.reshape(-1)
        seen: list[tuple] = []
        for nodes in self.levels[:0:-1]:  # level 0 has no arcs in
            at_level = B[nodes]
            js, qs = np.nonzero(at_level)
            mass = at_level[js, qs]
            v = nodes[js]
            count = self.in_count[v]
            owner = np.repeat(np.arange(len(v)), count)
            arc = self.in_first[v][owner] + np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)
            q = qs[owner]
            m = mass[owner] * self.share[arc]
            live = m > 0
            arc, q, m = arc[live], q[live], m[live]
            while len(arc):
                seen.append((arc, q, m))
                c = choice[q, arc]
                down = c == DEL
                out = ~down
                np.add.at(flat_b, self.src[arc[out]] * width + q[out] - (c[out] == SUB), m[out])
                arc, q, m = arc[down], q[down] - 1, m[down]
        cells = tuple(np.concatenate(x) if seen else np.zeros(0, dtype=t)
                      for x, t in zip(zip(*seen) if seen else ((), (), ()), (np.int64, np.int64, np.float64)))
        return cells, B.T

    def _arcs_of(self, k: int) -> np.ndarray:
        """Lattice k's arcs (its finals last) in the order it gave them: a sausage sums them in that order."""
        lo, hi = np.searchsorted(self._lat_given, [k, k + 1])
        return self._ours[lo:hi]

    @functools.cached_property
    def _ours(self) -> np.ndarray:
        """Our number of each arc, in the order the lattices gave them."""
        return np.argsort(self._order)

    def _bins(self, k: int, arcs: np.ndarray, hyp, risk, choice, flow, B0) -> Alignment:
        """Lattice k's sausage from its arcs' (`arcs`) choices and flows ((arcs, Q+1) each, its own width)."""
        vocabs, word_of = self._compact
        Q, V2 = len(hyp), len(vocabs[k]) + 2
        word_k = word_of[arcs]
        q = np.arange(Q + 1)[None, :]
        bins = np.where(choice == INS, 2 * q, 2 * q - 1)
        word = np.where(choice == DEL, 0, word_k[:, None])
        live = (flow > 0) & ~((choice == INS) & (word == 0))  # an epsilon arc inserts nothing
        flat = (bins * V2 + word)[live]
        size = (2 * Q + 1) * V2
        gamma = np.bincount(flat, flow[live], minlength=size).astype(np.float64).reshape(2 * Q + 1, V2)
        gamma[1::2, 0] += np.cumsum(B0[::-1])[::-1][1:]  # mass still owing r_1..r_q at the start deletes them
        gamma[0::2, 0] = np.maximum(0.0, 1.0 - gamma[0::2, 1:].sum(axis=1))
        ts = te = None
        if self.times is not None:
            timed = live & (word > 0)
            fl = (bins * V2 + word)[timed]
            w = flow[timed]
            rows = arcs[np.nonzero(timed)[0]]
            ts = np.bincount(fl, w * self.times[0][rows], minlength=size).astype(np.float64).reshape(2 * Q + 1, V2)
            te = np.bincount(fl, w * self.times[1][rows], minlength=size).astype(np.float64).reshape(2 * Q + 1, V2)
        return Alignment(np.asarray(hyp), risk, gamma, ts, te)


@dataclass
class Consensus:
    """A consensus decode: the word keys of the hypothesis, its words' confidences, its approximate Bayes risk
    (expected word errors), its sausage (2Q+1 bins of word key -> posterior, -1 for epsilon), (start, end) per
    word when node times were given, the passes made, and the first pass's confidences (those of the starting
    hypothesis, usually the Viterbi path)."""

    keys: list[int]
    confidences: list[float]
    risk: float
    bins: list[dict[int, float]]
    times: list[tuple[float, float]] | None
    iterations: int
    start_confidences: list[float]


def consensus(dag: Dag, scale: float, start: Sequence[int], max_iter: int = DEFAULT_MAX_ITER,
              node_times: np.ndarray | None = None, name: str = "lattice") -> Consensus:
    """The consensus hypothesis of `dag` under posterior scale `scale`, from `start` (word keys, usually the
    best path's): passes until the hypothesis comes back or `max_iter` (see the module docstring)."""
    return consensus_of(Aligner(dag, scale, node_times, name), start, max_iter)


def consensus_of(al: Aligner, start: Sequence[int], max_iter: int = DEFAULT_MAX_ITER) -> Consensus:
    """`consensus` on a lattice already prepared for alignments."""
    hyp = al.keys_to_index(start)
    seen: set[tuple[int, ...]] = set()
    best = first = None
    it = 0
    while it < max(1, max_iter):
        it += 1
        cur = al.align(hyp)
        if first is None:
            first = cur
        if best is None or cur.risk < best.risk - 1e-9:  # equal risks keep the earlier (closer to Viterbi)
            best = cur
        seen.add(tuple(hyp.tolist()))
        hyp = cur.next_hypothesis()
        if tuple(hyp.tolist()) in seen:
            break
    return _result(al, best, it, first)


def _result(al: Aligner, a: Alignment, iterations: int, first: Alignment) -> Consensus:
    keys = np.append(np.append(-1, al.vocab), -2)  # compact index -> word key (V+1: a word the lattice lacks)
    bins = [{int(keys[j]): float(p) for j, p in enumerate(row) if p > 0} for row in a.gamma]
    times = a.times()
    return Consensus(keys=keys[a.hyp].tolist(), confidences=a.confidences().tolist(), risk=a.risk, bins=bins,
                     times=None if times is None else [tuple(t) for t in times.tolist()], iterations=iterations,
                     start_confidences=first.confidences().tolist())


def aligned_confidences(dag: Dag, scale: float, keys: Sequence[int], name: str = "lattice") -> list[float]:
    """Each word's posterior in its own bin when the lattice is aligned to `keys` (one pass): the confidence of
    a given transcript, e.g. the Viterbi path's (0 for a word the lattice lacks)."""
    return Aligner(dag, scale, None, name).confidences_of(keys)


def _padded(hyps: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(hypotheses of word keys as (n, longest), padded with -3, a key no arc has; their lengths)."""
    lens = np.array([len(h) for h in hyps], dtype=np.int64)
    out = np.full((n, int(lens.max(initial=0))), -3, dtype=np.int64)
    for k, h in enumerate(hyps):
        out[k, : len(h)] = h
    return out, lens


def _slices_by_level(node: np.ndarray, level: np.ndarray, multi: np.ndarray) -> list:
    """For arcs already numbered by (level of `node`, `multi`: whether `node` has other arcs in, `node`): per
    level (its first arc, the first of its arcs into nodes with several, its end, the nodes with one arc in,
    the nodes with several, where each of those nodes' arcs starts among the latter)."""
    cuts = np.flatnonzero(np.diff(level[node])) + 1
    bounds = [0, *cuts.tolist(), len(node)] if len(node) else []
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        m = a + int(np.count_nonzero(~multi[a:b]))
        t = node[m:b]
        starts = np.flatnonzero(np.concatenate([[True], t[1:] != t[:-1]])) if len(t) else np.zeros(0, np.int64)
        out.append((a, m, b, node[a:m], t[starts], starts))
    return out


def _nodes_by_level(level: np.ndarray) -> list[np.ndarray]:
    """The nodes of each level, level 0 first."""
    order = np.argsort(level, kind="stable")
    cuts = np.flatnonzero(np.diff(level[order])) + 1
    return np.split(order, cuts) if len(order) else []
