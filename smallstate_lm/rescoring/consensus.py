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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .graph import state_levels
from .kbest import Dag
from .posteriors import forward_backward

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
    """A lattice prepared once for repeated alignments (see the module docstring): the arcs on complete paths,
    finals as arcs into a sink, each arc's forward share P(e | dst), the arcs grouped by their target's level."""

    def __init__(self, dag: Dag, scale: float, node_times: np.ndarray | None = None, name: str = "lattice"):
        n = int(dag.n_nodes)
        src, dst = np.asarray(dag.src, dtype=np.int64), np.asarray(dag.dst, dtype=np.int64)
        level = state_levels(n, src, dst)
        post = forward_backward(dag, scale, name, level)
        cost = np.asarray(dag.cost, dtype=np.float64)
        keep = np.isfinite(post.alpha[src]) & np.isfinite(post.beta[dst])  # pruned dead ends carry no mass
        fnode = np.asarray(dag.final_node, dtype=np.int64)
        fkeep = np.isfinite(post.alpha[fnode])
        self.sink = n
        self.src = np.concatenate([src[keep], fnode[fkeep]])
        self.dst = np.concatenate([dst[keep], np.full(int(fkeep.sum()), n, dtype=np.int64)])
        alpha = np.append(post.alpha, post.log_total)
        log_w = -scale * np.concatenate([cost[keep], np.asarray(dag.final_cost, dtype=np.float64)[fkeep]])
        self.share = np.exp(alpha[self.src] + log_w - alpha[self.dst])  # P(e | dst): sums to 1 into each node
        keys = np.concatenate([np.asarray(dag.word_key, dtype=np.int64)[keep], np.full(int(fkeep.sum()), -1)])
        self.vocab = np.unique(keys[keys >= 0])  # compact word index: 0 epsilon, 1..V the lattice's words
        self.word = np.where(keys >= 0, np.searchsorted(self.vocab, keys) + 1, 0)
        level = np.append(level, level.max(initial=0) + 1)  # the sink comes after every node
        order = np.lexsort((self.dst, level[self.dst]))
        cuts = np.flatnonzero(np.diff(level[self.dst[order]])) + 1
        self.groups = np.split(order, cuts) if len(order) else []
        # per group, its target nodes and where each one's arcs start (arcs are sorted by target within a level)
        self.targets = []
        for g in self.groups:
            d = self.dst[g]
            starts = np.flatnonzero(np.concatenate([[True], d[1:] != d[:-1]]))
            self.targets.append((d[starts], starts))
        self.times = None
        if node_times is not None:  # a final's arc into the sink takes no time
            t = np.append(np.asarray(node_times, dtype=np.float64), 0.0)
            self.times = (t[self.src], np.where(self.dst == n, t[self.src], t[self.dst]))

    def keys_to_index(self, keys: Sequence[int]) -> np.ndarray:
        """Word keys (decoder ids) -> compact indices; a word the lattice lacks gets V+1, which no arc has."""
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(self.vocab, keys)
        found = (pos < len(self.vocab)) & (self.vocab[np.minimum(pos, len(self.vocab) - 1)] == keys) \
            if len(self.vocab) else np.zeros(len(keys), dtype=bool)
        return np.where(found, pos + 1, len(self.vocab) + 1)

    def confidences_of(self, keys: Sequence[int]) -> list[float]:
        """Each of `keys`' posterior in its own bin, the lattice aligned to them (`aligned_confidences`)."""
        return self.align(self.keys_to_index(keys)).confidences().tolist()

    def align(self, hyp: np.ndarray) -> Alignment:
        """One forward and one backward pass against `hyp` (compact indices)."""
        Q = len(hyp)
        A = np.zeros((self.sink + 1, Q + 1))
        A[0] = np.arange(Q + 1)
        choice = np.empty((len(self.src), Q + 1), dtype=np.int8)
        for g, (nodes, starts) in zip(self.groups, self.targets):
            choice[g], arc_a = self._forward_arcs(A[self.src[g]], self.word[g], hyp)
            A[nodes] = np.add.reduceat(self.share[g][:, None] * arc_a, starts, axis=0)
        flow, B0 = self._backward(choice, Q)
        return self._bins(hyp, float(A[self.sink, Q]), choice, flow, B0)

    @staticmethod
    def _forward_arcs(Au: np.ndarray, x: np.ndarray, hyp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(choices, A_e) of arcs with words x from sources whose rows of A are Au (n, Q+1).

        The deletion chain A_e(q) = min(best(q), A_e(q-1) + 1) unrolls to q + min over j <= q of (best(j) - j):
        a running minimum along q, so no loop over the hypothesis is needed."""
        ins = (x > 0).astype(np.float64)
        a1 = Au[:, :-1] + (x[:, None] != hyp[None, :])  # (n, Q): x in r_q's slot
        a2 = Au[:, 1:] + ins[:, None]  # (n, Q): x inserted after r_q
        keep_sub = a1 <= a2  # ties: substitution, then insertion, then deletion
        best = np.concatenate([(Au[:, 0] + ins)[:, None], np.where(keep_sub, a1, a2)], axis=1)  # (n, Q+1)
        q = np.arange(best.shape[1], dtype=np.float64)
        run = np.minimum.accumulate(best - q, axis=1)  # (n, Q+1)
        # a deletion only where it is better by more than rounding: ties stay with the operations above
        dele = np.zeros(best.shape, dtype=bool)
        dele[:, 1:] = run[:, :-1] < best[:, 1:] - q[1:] - 1e-9
        c = np.where(keep_sub, SUB, INS).astype(np.int8)
        c = np.concatenate([np.full((len(x), 1), INS, dtype=np.int8), c], axis=1)
        c[dele] = DEL
        return c, np.where(dele, run + q, best)

    def _backward(self, choice: np.ndarray, Q: int) -> tuple[np.ndarray, np.ndarray]:
        """(the mass on each arc at each position, (E, Q+1); the mass that reaches the start at each q).

        Within an arc, mass at q that deletes r_q moves on to q-1 there: a run of deletions adds up the mass
        from its top down, a suffix sum within each run (`_deletion_runs`)."""
        B = np.zeros((self.sink + 1, Q + 1))
        B[self.sink, Q] = 1.0
        flow = np.zeros((len(self.src), Q + 1))
        for g in reversed(self.groups):
            c = choice[g]
            f = _deletion_runs(self.share[g][:, None] * B[self.dst[g]], c == DEL)
            back = np.where(c == INS, f, 0.0)
            back[:, :-1] += np.where(c[:, 1:] == SUB, f[:, 1:], 0.0)
            flow[g] = f
            np.add.at(B, self.src[g], back)
        return flow, B[0]

    def _bins(self, hyp, risk, choice, flow, B0) -> Alignment:
        Q, V2 = len(hyp), len(self.vocab) + 2
        q = np.arange(Q + 1)[None, :]
        bins = np.where(choice == INS, 2 * q, 2 * q - 1)
        word = np.where(choice == DEL, 0, self.word[:, None])
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
            rows = np.nonzero(timed)[0]
            ts = np.bincount(fl, w * self.times[0][rows], minlength=size).astype(np.float64).reshape(2 * Q + 1, V2)
            te = np.bincount(fl, w * self.times[1][rows], minlength=size).astype(np.float64).reshape(2 * Q + 1, V2)
        return Alignment(np.asarray(hyp), risk, gamma, ts, te)


def _deletion_runs(f: np.ndarray, dele: np.ndarray) -> np.ndarray:
    """(n, Q+1): f(q) plus the mass of every position above q that reaches it through deletions (dele(j): the
    mass at j moves to j-1), i.e. the sum of f over q..end, end being the top of q's run of deletions."""
    n, width = f.shape
    ends_here = np.ones((n, width), dtype=bool)  # q's run stops at q unless q+1 deletes down into it
    ends_here[:, :-1] = ~dele[:, 1:]
    top = np.where(ends_here, np.arange(width), width)
    top = np.minimum.accumulate(top[:, ::-1], axis=1)[:, ::-1]  # the first run end at or above q
    suffix = np.zeros((n, width + 1))
    suffix[:, :-1] = np.cumsum(f[:, ::-1], axis=1)[:, ::-1]
    return np.maximum(suffix[:, :-1] - np.take_along_axis(suffix, top + 1, axis=1), 0.0)


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
