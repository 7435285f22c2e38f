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

from ..lattices.graph import state_levels
from ..lattices.kbest import Dag
from .posteriors import Laid, lay_out, log_sums

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
    """Lattices prepared once for repeated alignments (see the module docstring): the arcs on complete paths,
    finals as arcs into a sink per lattice, each arc's forward share P(e | dst), the arcs grouped by their
    target's level. One lattice (`Aligner(dag, ...)`) or several (`Aligner.many`): several are aligned in the
    same passes, a level of all of them at a time, each to its own hypothesis, with the numbers each would get
    alone; their arcs stay together, each lattice's kept arcs then its finals."""

    def __init__(self, dag: Dag, scale: float, node_times: np.ndarray | None = None, name: str = "lattice"):
        self._build(lay_out([dag]), scale, None if node_times is None else [node_times], [name])

    @classmethod
    def many(cls, dags: Sequence[Dag], scale: float, names: Sequence[str]) -> "Aligner":
        """`dags` prepared together (no node times: what a consensus decode needs is prepared one at a time).
        Raises SmallstateError naming the first lattice without a complete path of finite cost."""
        al = cls.__new__(cls)
        al._build(lay_out(dags), scale, None, list(names))
        return al

    def _build(self, laid: Laid, scale: float, node_times: list | None, names: list[str]) -> None:
        d, L = laid.dag, laid.n_lattices
        n, src, dst = int(d.n_nodes), d.src, d.dst
        level = state_levels(n, src, dst)
        alpha, beta, log_total = log_sums(laid, scale, level, names)
        keep = np.isfinite(alpha[src]) & np.isfinite(beta[dst])  # pruned dead ends carry no mass
        fkeep = np.isfinite(alpha[d.final_node])
        lat_arc = np.repeat(np.arange(L), np.diff(laid.arc_start))
        lat_fin = np.repeat(np.arange(L), np.diff(laid.final_start))
        # each lattice's kept arcs, then its finals into its sink (node n + l)
        lat = np.concatenate([lat_arc[keep], lat_fin[fkeep]])
        order = np.argsort(lat, kind="stable")
        self.n_lattices, self.starts, self.sinks, self.n_rows = L, laid.node_start[:-1], n + np.arange(L), n + L
        self.lat = lat[order]
        self.arc_start = np.searchsorted(self.lat, np.arange(L + 1))
        self.src = np.concatenate([src[keep], d.final_node[fkeep]])[order]
        self.dst = np.concatenate([dst[keep], self.sinks[lat_fin[fkeep]]])[order]
        alpha = np.concatenate([alpha, log_total])
        log_w = -scale * np.concatenate([d.cost[keep], d.final_cost[fkeep]])[order]
        self.share = np.exp(alpha[self.src] + log_w - alpha[self.dst])  # P(e | dst): sums to 1 into each node
        keys = np.concatenate([d.word_key[keep], np.full(int(fkeep.sum()), -1)])[order]
        # compact word index per lattice: 0 epsilon, 1..V its own words in order
        words = keys >= 0
        radix = int(keys.max(initial=0)) + 1
        code = self.lat[words] * radix + keys[words]  # (lattice, word) as one number
        uniq = np.unique(code)
        first = np.searchsorted(uniq // radix, np.arange(L + 1))
        self.vocabs = [uniq[first[k] : first[k + 1]] % radix for k in range(L)]
        self.word = np.zeros(len(keys), dtype=np.int64)
        self.word[words] = np.searchsorted(uniq, code) - first[self.lat[words]] + 1
        level = np.concatenate([level, np.full(L, level.max(initial=0) + 1)])  # sinks come after every node
        g_order = np.lexsort((self.dst, level[self.dst]))
        cuts = np.flatnonzero(np.diff(level[self.dst[g_order]])) + 1
        self.groups = np.split(g_order, cuts) if len(g_order) else []
        # per group, its target nodes and where each one's arcs start (arcs are sorted by target within a level)
        self.targets = []
        for g in self.groups:
            t = self.dst[g]
            starts = np.flatnonzero(np.concatenate([[True], t[1:] != t[:-1]]))
            self.targets.append((t[starts], starts))
        self.times = None
        if node_times is not None:  # one lattice; a final's arc into the sink takes no time
            t = np.append(np.asarray(node_times[0], dtype=np.float64), 0.0)
            self.times = (t[self.src], np.where(self.dst == n, t[self.src], t[self.dst]))

    @property
    def vocab(self) -> np.ndarray:
        """The one lattice's word keys by compact index - 1."""
        return self.vocabs[0]

    def keys_to_index(self, keys: Sequence[int], k: int = 0) -> np.ndarray:
        """Word keys (decoder ids) -> lattice k's compact indices; a word it lacks gets V+1, which no arc has."""
        vocab = self.vocabs[k]
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(vocab, keys)
        found = (pos < len(vocab)) & (vocab[np.minimum(pos, len(vocab) - 1)] == keys) \
            if len(vocab) else np.zeros(len(keys), dtype=bool)
        return np.where(found, pos + 1, len(vocab) + 1)

    def confidences_of(self, keys: Sequence[int]) -> list[float]:
        """Each of `keys`' posterior in its own bin, the lattice aligned to them (`aligned_confidences`)."""
        return self.align(self.keys_to_index(keys)).confidences().tolist()

    def confidences_many(self, keys: Sequence[Sequence[int]]) -> list[list[float]]:
        """`confidences_of` for every lattice, keys[k] for lattice k, in one set of passes."""
        hyps = [self.keys_to_index(kk, k) for k, kk in enumerate(keys)]
        return [a.confidences().tolist() for a in self.align_many(hyps)]

    def align(self, hyp: np.ndarray) -> Alignment:
        """One forward and one backward pass against `hyp` (compact indices)."""
        return self.align_many([hyp])[0]

    def align_many(self, hyps: Sequence[np.ndarray]) -> list[Alignment]:
        """One forward and one backward pass of every lattice, lattice k against hyps[k] (its compact indices).
        Hypotheses of different lengths share one width, Q = the longest: a lattice's columns past its own
        length only ever see its own (the deletion chain runs up, mass runs down), so they change nothing."""
        lens = np.array([len(h) for h in hyps], dtype=np.int64)
        Q = int(lens.max(initial=0))
        hyp = np.full((self.n_lattices, Q), -1, dtype=np.int64)  # -1: no arc's word, past a hypothesis' end
        for k, h in enumerate(hyps):
            hyp[k, : len(h)] = h
        A = np.zeros((self.n_rows, Q + 1))
        A[self.starts] = np.arange(Q + 1)
        choice = np.empty((len(self.src), Q + 1), dtype=np.int8)
        for g, (nodes, starts) in zip(self.groups, self.targets):
            choice[g], arc_a = self._forward_arcs(A[self.src[g]], self.word[g], hyp[self.lat[g]])
            A[nodes] = np.add.reduceat(self.share[g][:, None] * arc_a, starts, axis=0)
        flow, B = self._backward(choice, lens)
        out = []
        for k, h in enumerate(hyps):
            a, b, q = int(self.arc_start[k]), int(self.arc_start[k + 1]), len(h)
            out.append(self._bins(k, np.asarray(h), float(A[self.sinks[k], q]), choice[a:b, : q + 1],
                                  flow[a:b, : q + 1], B[self.starts[k], : q + 1]))
        return out

    @staticmethod
    def _forward_arcs(Au: np.ndarray, x: np.ndarray, hyp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(choices, A_e) of arcs with words x from sources whose rows of A are Au (n, Q+1), against the
        hypotheses `hyp` (n, Q) of their lattices.

        The deletion chain A_e(q) = min(best(q), A_e(q-1) + 1) unrolls to q + min over j <= q of (best(j) - j):
        a running minimum along q, so no loop over the hypothesis is needed."""
        ins = (x > 0).astype(np.float64)
        a1 = Au[:, :-1] + (x[:, None] != hyp)  # (n, Q): x in r_q's slot
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

    def _backward(self, choice: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the mass on each arc at each position, (E, Q+1); the mass at each node at each position, whose start
        rows are what reaches each lattice's start), from mass 1 at each sink at its hypothesis' length.

        Within an arc, mass at q that deletes r_q moves on to q-1 there: a run of deletions adds up the mass
        from its top down, a suffix sum within each run (`_deletion_runs`)."""
        B = np.zeros((self.n_rows, choice.shape[1]))
        B[self.sinks, lens] = 1.0
        flow = np.zeros(choice.shape)
        for g in reversed(self.groups):
            c = choice[g]
            f = _deletion_runs(self.share[g][:, None] * B[self.dst[g]], c == DEL)
            back = np.where(c == INS, f, 0.0)
            back[:, :-1] += np.where(c[:, 1:] == SUB, f[:, 1:], 0.0)
            flow[g] = f
            np.add.at(B, self.src[g], back)
        return flow, B

    def _bins(self, k: int, hyp, risk, choice, flow, B0) -> Alignment:
        """Lattice k's sausage from its arcs' choices and flows (its slice, its own width)."""
        Q, V2 = len(hyp), len(self.vocabs[k]) + 2
        word_k = self.word[self.arc_start[k] : self.arc_start[k + 1]]
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
            rows = np.nonzero(timed)[0] + self.arc_start[k]
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
