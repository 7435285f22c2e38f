"""Lattice rescoring by history-merged expansion (DESIGN §4).

An expanded state is (lattice state, LM history key): the last n-1 words with
`max_ngram_order=n` (histories sharing them merge, the best one kept, as in Kaldi's
pruned RNNLM rescoring), or the whole word history when exact. Lattice states are
visited level by level in topological order (a level holds states with no arc
between them), and every LM step a level needs — one per (expanded state, word) —
goes through the neural LM in one batched `score` call, its parent states gathered
with `select()`.

Every arc of the expanded graph keeps its score components (acoustic, graph, neural,
n-gram, word and OOV counts), so a sweep of weights re-runs only the cheap Viterbi
search over that graph, never the LM.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import ConfigError, SmallstateError
from ..ngram import LN10, NgramLM
from ..vocab import EOS_ID, Vocabulary
from ..weights import Weights, count_oov, lm_score, log_mix, oov_reference, weighted_total
from .kbest import nbest_dicts
from .lattice import Lattice, LatticeWarning, SymbolTable, concat_ranges, state_levels, viterbi
from .native import as_int64, library, upward


@dataclass
class ExpandConfig:
    max_ngram_order: int | None = 4  # None: exact histories
    beam: float = 12.0  # cost units of the combined score, against the level's best estimate
    max_per_state: int = 64  # expanded states kept per lattice state
    max_states: int = 200_000  # per lattice; beyond it pruning tightens (and says so)
    # lattices expanded together, so that one LM call and one set of array operations serve all their
    # levels; None: 16 with a neural LM (its states are held for all of them), 256 with the n-gram alone
    batch_lattices: int | None = None
    # neural LM state bytes one level of one lattice may create (its LM steps x their history's positions x
    # bytes per position); beyond it the level keeps only its best states (and says it pruned harder), so
    # a lattice built wide (thousands of words after every history) cannot take all of a server's memory.
    # None: no bound
    max_level_bytes: int | None = None

    def __post_init__(self):
        if self.max_ngram_order is not None and self.max_ngram_order < 1:
            raise ConfigError(f"max_ngram_order must be >= 1, got {self.max_ngram_order}")
        if self.beam <= 0 or self.max_per_state < 1 or self.max_states < 1 or (self.batch_lattices or 1) < 1 \
                or (self.max_level_bytes or 1) < 1:
            raise ConfigError("beam, max_per_state, max_states, batch_lattices and max_level_bytes must be positive")

    def lattices_per_batch(self, neural: bool) -> int:
        return self.batch_lattices or (16 if neural else 256)


@dataclass
class ExpandStats:
    lattice_states: int = 0
    lattice_arcs: int = 0
    expanded_states: int = 0
    expanded_arcs: int = 0
    lm_calls: int = 0
    lm_rows: int = 0
    peak_state_bytes: int = 0
    pruned_harder: bool = False
    seconds: float = 0.0


@dataclass
class ExpandedLattice:
    """The expanded graph with per-arc components; nodes are in topological order."""

    name: str
    node_lat: np.ndarray  # (N,) lattice state of each expanded node
    src: np.ndarray  # (E,)
    dst: np.ndarray
    word: np.ndarray  # (E,) decoder symbol id, 0 for epsilon
    acoustic: np.ndarray  # (E,) -ln likelihood
    graph: np.ndarray  # (E,) first-pass cost
    nn: np.ndarray  # (E,) natural-log neural prob of the arc's word, 0 on epsilon
    ng: np.ndarray  # (E,) natural-log n-gram prob
    is_word: np.ndarray  # (E,) 1.0 on word arcs
    oov: np.ndarray  # (E,) 1.0 where the word is outside the LM vocabulary
    final_node: np.ndarray  # (F,) nodes that end a path
    final_acoustic: np.ndarray
    final_graph: np.ndarray
    final_nn: np.ndarray  # log p(</s> | history)
    final_ng: np.ndarray
    symbols: SymbolTable
    stats: ExpandStats = field(default_factory=ExpandStats)
    source: Lattice | None = None  # the prepared input lattice
    arc: np.ndarray | None = None  # (E,) the arc of `source` each arc expands
    first_pass: tuple[float, list[str]] | None = None  # (am_scale, the decoder's best path under it), when known

    # ---- weights -> costs ------------------------------------------------------------
    @staticmethod
    def _costs(w: Weights, acoustic, graph, nn, ng, n_words, oov, has_lm) -> np.ndarray:
        # epsilon arcs carry no LM term: their nn = ng = 0 give 0 log-linearly, linear needs the mask
        m = np.stack([-acoustic, -graph, nn, ng, n_words, oov], axis=1)
        linear = np.where(has_lm > 0, log_mix(w.lam, nn, ng), 0.0) if w.interpolation == "linear" else None
        return -weighted_total(w, m, linear)

    def arc_costs(self, w: Weights) -> np.ndarray:
        return self._costs(w, self.acoustic, self.graph, self.nn, self.ng, self.is_word, self.oov, self.is_word)

    def final_costs(self, w: Weights) -> np.ndarray:
        """Ending at each final node: its final weights and log p(</s> | history); </s> is no word."""
        zeros, ones = np.zeros_like(self.final_nn), np.ones_like(self.final_nn)
        return self._costs(w, self.final_acoustic, self.final_graph, self.final_nn, self.final_ng, zeros, zeros, ones)

    # ---- search ----------------------------------------------------------------------
    def best_arcs(self, w: Weights) -> np.ndarray:
        """The arcs of the best path under `w` (Viterbi), in path order."""
        N = len(self.node_lat)
        order = np.argsort(self.src, kind="stable")  # ties go to the first arc by source, as they always have
        level = state_levels(N, self.src, self.dst)
        dist, back_sorted = viterbi(N, self.src[order], self.dst[order], self.arc_costs(w)[order], level)
        back = np.full(N, -1, dtype=np.int64)
        back[back_sorted >= 0] = order[back_sorted[back_sorted >= 0]]
        fin = dist[self.final_node] + self.final_costs(w)
        node = int(self.final_node[int(np.argmin(fin))])
        arcs = []
        while back[node] >= 0:
            arcs.append(int(back[node]))
            node = int(self.src[back[node]])
        return np.array(arcs[::-1], dtype=np.int64)

    def best_words(self, w: Weights) -> list[str]:
        """The best word sequence under `w` (Viterbi; cheaper than nbest(w, 1))."""
        return [self.symbols.word(int(self.word[e])) for e in self.best_arcs(w).tolist() if self.is_word[e] > 0]

    def best_timed_words(self, w: Weights, frame_shift: float) -> list[tuple[str, float, float]]:
        """(word, start, duration) in seconds along the best path: from the source lattice's state times
        (SLF `t=`), else from its transition-ids (one frame each, `frame_shift` seconds apart, after
        subsampling). Raises ConfigError when the lattice has neither."""
        src = self.source
        no_tids = src is None or src.arc_tids is None or len(src.arc_tids.values) == 0
        if src is None or self.arc is None or (src.state_time is None and no_tids):
            raise ConfigError(f"lattice {self.name}: no word times for a CTM (it has neither node times, as SLF "
                              "`t=`, nor transition-ids, as Kaldi archives)")
        arcs = self.best_arcs(w)
        lat_arc = self.arc[arcs]
        if src.state_time is not None:
            start, end = src.state_time[src.src[lat_arc]], src.state_time[src.dst[lat_arc]]
        else:
            frames = src.arc_tids.lengths()[lat_arc]
            end = np.cumsum(frames) * frame_shift
            start = end - frames * frame_shift
            if len(src.arc_tids.values) == int((src.arc_tids.lengths() > 0).sum()):
                # one transition-id per arc (a Kaldi `Lattice`): a word's label sits on one of its frames, so
                # it is taken to last until the next word's label (or the end); lattice-align-words is exact
                words_at = np.flatnonzero(self.is_word[arcs] > 0)
                nxt = np.append(start[words_at[1:]], end[-1] if len(end) else 0.0)
                end = end.copy()
                end[words_at] = np.maximum(nxt, end[words_at])
        return [(self.symbols.word(int(self.word[e])), float(a), float(b - a))
                for e, a, b in zip(arcs.tolist(), start.tolist(), end.tolist()) if self.is_word[e] > 0]

    def nbest(self, w: Weights, n: int = 1) -> list[dict]:
        """The n best distinct word sequences under `w`, best first, each with its
        components (natural log) and total (higher is better): lazy k-best (kbest.py)."""
        return nbest_dicts(self, w, n)

    def first_pass_words(self, am_scale: float) -> list[str]:
        """The decoder's own best path, by graph + am_scale * acoustic on the source lattice."""
        if self.first_pass is not None and self.first_pass[0] == am_scale:
            return self.first_pass[1]
        return self.source.best_path(am_scale, 1.0)[0]

    def to_lattice(self, w: Weights) -> Lattice:
        """The rescored lattice: acoustic costs untouched, the new LM score folded into
        the graph cost (graph' = cost of everything but the acoustic part, in units
        where the total is graph' + am_scale * acoustic), dead ends trimmed."""
        if w.am_scale <= 0:
            raise ConfigError("writing a rescored lattice needs am_scale > 0")
        am = w.am_scale * self.acoustic
        graph = self.arc_costs(w) - am
        fgraph = self.final_costs(w) - w.am_scale * self.final_acoustic
        N = len(self.node_lat)
        final_graph = np.full(N, np.inf)
        final_ac = np.full(N, np.inf)
        final_graph[self.final_node] = fgraph
        final_ac[self.final_node] = self.final_acoustic
        src = self.source
        carry = src is not None and self.arc is not None
        final_row = np.full(N, -1, dtype=np.int64)  # non-final nodes carry no final transition-ids
        final_row[self.final_node] = self.node_lat[self.final_node]
        lat = Lattice(name=self.name, num_states=N, start=0, src=self.src.copy(), dst=self.dst.copy(),
                      word=self.word.copy(), graph=graph, acoustic=self.acoustic.copy(), final_graph=final_graph,
                      final_acoustic=final_ac, symbols=self.symbols,
                      arc_tids=src.arc_tids.take(self.arc) if carry and src.arc_tids is not None else None,
                      final_tids=src.final_tids.take(final_row) if carry and src.final_tids is not None else None,
                      state_time=src.state_time[self.node_lat] if carry and src.state_time is not None else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LatticeWarning)  # pruned branches end nowhere: trimming them is the point
            return lat.prepare()


def _backward(src: np.ndarray, dst: np.ndarray, cost: np.ndarray, beta: np.ndarray, level: np.ndarray) -> np.ndarray:
    """Best completion cost from each state (`beta` holds the final costs, inf elsewhere), relaxed a
    level at a time from the last (`level`: `state_levels`); works on many lattices laid end to end."""
    beta = np.where(np.isfinite(beta), beta, np.inf)
    lib = library()
    if lib is not None and upward(src, dst, len(beta), cost):  # one pass, last arc first (_native.c)
        lib.ssl_backward_up(len(src), as_int64(src), as_int64(dst), np.ascontiguousarray(cost, dtype=float), beta)
        return beta
    src_level = level[src]
    order = np.argsort(src_level, kind="stable")
    bounds = np.searchsorted(src_level[order], np.arange(int(level.max(initial=0)) + 2))
    for lo, hi in zip(bounds[-2::-1].tolist(), bounds[:0:-1].tolist()):  # the last level first
        if lo < hi:
            a = order[lo:hi]
            np.minimum.at(beta, src[a], cost[a] + beta[dst[a]])
    return beta


def _sort_groups(groups: tuple[np.ndarray, ...], keys: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
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


def _merge_keys(lat_s: np.ndarray, key: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, ...]:
    """Paths merged by (lattice state, key): (each path's merged state, each merged state's best path (the
    lowest cost, the first of equal ones), its first path). Merged states may come in any order: what
    follows orders them by their own values."""
    lib = library()
    if lib is not None:  # one pass with a hash table (_native.c)
        n = len(key)
        member, winner, first = (np.empty(n, dtype=np.int64) for _ in range(3))
        groups = lib.ssl_group_min(n, as_int64(lat_s), as_int64(key), np.ascontiguousarray(cost, dtype=float),
                                   member, winner, first)
        if groups < 0:
            raise MemoryError("merging paths: out of memory")
        return member, winner[:groups], first[:groups]
    order, starts = _sort_groups((lat_s, key), (cost,))
    member = np.empty(len(order), dtype=np.int64)
    member[order] = _segments(starts, len(order))
    return member, order[starts], np.minimum.reduceat(order, starts)


def _segments(starts: np.ndarray, n: int) -> np.ndarray:
    """Group number of each of n sorted rows, given where groups start."""
    return np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))


def _run_index(run: np.ndarray) -> dict[int, slice]:
    """run number -> its rows, of rows sorted by run number."""
    if len(run) == 0:
        return {}
    cut = np.flatnonzero(run[1:] != run[:-1]) + 1
    starts, ends = np.append(0, cut), np.append(cut, len(run))
    return {r: slice(a, e) for r, a, e in zip(run[starts].tolist(), starts.tolist(), ends.tolist())}


class _Expansion:
    """One lattice of an expansion run: its prepared arrays (`_prepare_group`), the step of the run at
    which it started (level L of it is expanded at step start + L), its pruning limits, and the
    assembly of its result from what the run's steps recorded."""

    def __init__(self, rescorer: "LatticeRescorer", lat: Lattice, run: int):
        self.t0 = time.perf_counter()
        self.r = rescorer
        self.run = run  # its number in the input: the frontier keeps lattices in that order
        self.lat = lat = lat.prepare()
        self.stats = ExpandStats(lattice_states=lat.num_states, lattice_arcs=len(lat.src))
        self.start_step = 0
        self.first_arrival = 0
        self.n_nodes = 0
        self.per_state_cap, self.beam = rescorer.cfg.max_per_state, rescorer.cfg.beam
        # set by _prepare_group
        self.is_word = self.arc_lm = self.arc_oov = self.arc_gword = self.first_pass = np.zeros(0)
        self.level_of = self.beta = self.out_start = np.zeros(0)
        self.n_levels = 0
        self.first_pass_words: list[str] | None = None

    @property
    def last_step(self) -> int:
        return self.start_step + self.n_levels - 1

    def result(self, run: "_Run") -> ExpandedLattice:
        lat, r = self.lat, self.run
        steps = [run.records[s] for s in range(self.start_step, self.last_step + 1)]
        fin_i, fin_f, arc_i, arc_f, nodes = [], [], [], [], []
        for rec in steps:
            for index, ints, floats, ints_out, floats_out in ((rec.arcs, rec.arc_int, rec.arc_float, arc_i, arc_f),
                                                              (rec.finals, rec.fin_int, rec.fin_float, fin_i, fin_f)):
                sl = index.get(r)
                if sl is not None:
                    ints_out.append(ints[:, sl])
                    floats_out.append(floats[:, sl])
            sl = rec.nodes.get(r)
            if sl is not None:
                nodes.append(rec.node_lat[sl])
        if not fin_i:
            raise ConfigError(f"lattice {lat.name}: every path was pruned; widen --beam")
        fin_node = np.concatenate(fin_i, axis=1)[0]
        fin = np.concatenate(fin_f, axis=1)
        src, arrival, lat_arc = np.concatenate(arc_i, axis=1) if arc_i else np.zeros((3, 0), dtype=np.int64)
        nn, ng, oov = np.concatenate(arc_f, axis=1) if arc_f else np.zeros((3, 0))
        dst = run.node_of_arrival(arrival)
        keep = dst >= 0  # arcs into pruned states go
        src, dst, lat_arc, nn, ng, oov = src[keep], dst[keep], lat_arc[keep], nn[keep], ng[keep], oov[keep]
        node_lat = np.concatenate(nodes) if nodes else np.zeros(0, dtype=np.int64)
        st = self.stats
        st.expanded_states, st.expanded_arcs = len(node_lat), len(src)
        st.seconds = time.perf_counter() - self.t0
        return ExpandedLattice(
            name=lat.name, node_lat=node_lat, src=src, dst=dst, word=lat.word[lat_arc].astype(np.int64),
            acoustic=lat.acoustic[lat_arc], graph=lat.graph[lat_arc], nn=nn, ng=ng,
            is_word=self.is_word[lat_arc].astype(np.float64), oov=oov, final_node=fin_node,
            final_acoustic=fin[0], final_graph=fin[1], final_nn=fin[2], final_ng=fin[3], symbols=lat.symbols,
            stats=st, source=lat, arc=lat_arc,
            first_pass=None if self.first_pass_words is None else (self.r.w.am_scale, self.first_pass_words))


def _prepare_group(rescorer: "LatticeRescorer", xs: list[_Expansion]) -> None:
    """Set the arrays of lattices joining a run, computed for all of them at once on the lattices laid
    end to end: levels, best completion costs, word ids, and the decoder's own best path."""
    if not xs:
        return
    w = rescorer.w
    cat = np.concatenate
    lats = [x.lat for x in xs]
    ns = np.array([lat.num_states for lat in lats], dtype=np.int64)
    na = np.array([len(lat.src) for lat in lats], dtype=np.int64)
    soff = np.cumsum(ns) - ns
    src, dst = cat([lat.src + o for lat, o in zip(lats, soff)]), cat([lat.dst + o for lat, o in zip(lats, soff)])
    word = cat([lat.word for lat in lats]).astype(np.int64)
    acoustic, graph = cat([lat.acoustic for lat in lats]), cat([lat.graph for lat in lats])
    final_ac, final_gr = cat([lat.final_acoustic for lat in lats]), cat([lat.final_graph for lat in lats])
    S = int(ns.sum())
    level = state_levels(S, src, dst)
    lm_scale = w.graph_scale + w.lm_weight + w.ngram_weight
    beta = _backward(src, dst, w.am_scale * acoustic + lm_scale * graph,
                     w.am_scale * final_ac + lm_scale * final_gr, level)
    is_word, arc_lm, arc_oov, arc_gword = _word_arrays(rescorer, lats, word, na)
    first_pass = w.am_scale * acoustic + w.graph_scale * graph
    fp_words = _first_pass_words(lats, src, dst, word, graph + w.am_scale * acoustic,
                                 np.where(np.isfinite(final_gr), final_gr + w.am_scale * final_ac, np.inf),
                                 level, soff, ns)
    state_cut, arc_cut = np.cumsum(ns)[:-1], np.cumsum(na)[:-1]
    per_state = [np.split(a, state_cut) for a in (level, beta)]
    per_arc = [np.split(a, arc_cut) for a in (is_word, arc_lm, arc_oov, arc_gword, first_pass)]
    for k, x in enumerate(xs):
        x.level_of, x.beta = per_state[0][k], per_state[1][k]
        x.is_word, x.arc_lm, x.arc_oov, x.arc_gword, x.first_pass = (a[k] for a in per_arc)
        x.out_start = np.searchsorted(x.lat.src, np.arange(x.lat.num_states + 1))  # arcs are sorted by source
        x.n_levels = int(x.level_of.max()) + 1 if x.lat.num_states else 0
        x.first_pass_words = fp_words[k]


def _word_arrays(rescorer: "LatticeRescorer", lats: list[Lattice], word: np.ndarray, na: np.ndarray):
    """Per arc of the lattices laid end to end: is it a word, its LM token id, its OOV count, and the
    rescorer's id of its string; each distinct word id of each symbol table is looked up once."""
    is_word = np.zeros(len(word), dtype=bool)
    arc_lm = np.zeros(len(word), dtype=np.int64)
    arc_oov = np.zeros(len(word), dtype=np.float64)
    arc_gword = np.full(len(word), -1, dtype=np.int64)
    table = np.repeat(np.arange(len(lats)), na)
    tables: dict[int, list[int]] = {}
    for k, lat in enumerate(lats):
        tables.setdefault(id(lat.symbols), []).append(k)
    vocab, ngram = rescorer.vocab, rescorer.ngram
    known = oov_reference(vocab, ngram)
    for members in tables.values():
        sym = lats[members[0]].symbols
        rows = np.flatnonzero(np.isin(table, members)) if len(tables) > 1 else np.arange(len(word))
        ids, inverse = _distinct(word[rows])
        flags = sym.word_flags(ids)
        at = rows[flags[inverse]]
        is_word[at] = True
        ids, inverse = _distinct(word[at])
        strings = [sym.word(i) for i in ids.tolist()]
        if vocab is not None:
            arc_lm[at] = np.array([vocab.encode([ws])[0] for ws in strings], dtype=np.int64)[inverse]
        arc_oov[at] = np.array([float(count_oov([ws], known)) for ws in strings])[inverse]
        arc_gword[at] = np.array([rescorer.word_id(ws) for ws in strings], dtype=np.int64)[inverse]
    return is_word, arc_lm, arc_oov, arc_gword


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(values, return_inverse=True)` of small non-negative ints (word ids), without a sort."""
    top = int(values.max(initial=-1)) + 1
    if top > 4 * len(values) + (1 << 20):
        ids, inverse = np.unique(values, return_inverse=True)
        return ids, inverse.reshape(-1)
    present = np.zeros(top, dtype=bool)
    present[values] = True
    ids = np.flatnonzero(present)
    slot = np.zeros(top, dtype=np.int64)
    slot[ids] = np.arange(len(ids))
    return ids, slot[values]


def _first_pass_words(lats: list[Lattice], src, dst, word, cost, final, level, soff, ns) -> list[list[str] | None]:
    """Each lattice's best path by `graph + am_scale * acoustic` (what `Lattice.best_path` gives),
    by one Viterbi search over the lattices laid end to end; None where a lattice has no finite path."""
    dist, back = viterbi(int(ns.sum()), src, dst, cost, level, sources=soff)
    total = dist + final
    owner = np.repeat(np.arange(len(lats)), ns)
    order, starts = _sort_groups((owner,), (total,))
    best = order[starts]  # the first state of each lattice with the lowest total
    ok = np.isfinite(total[best])
    steps_lat, steps_arc = [], []
    cur, lat_of = best[ok], np.flatnonzero(ok)
    while len(cur):
        more = cur != soff[lat_of]
        cur, lat_of = cur[more], lat_of[more]
        a = back[cur]
        steps_lat.append(lat_of)
        steps_arc.append(a)
        cur = src[a]
    out: list[list[str] | None] = [None] * len(lats)
    for k in np.flatnonzero(ok).tolist():
        out[k] = []
    if steps_lat:
        lat_ids, arcs = np.concatenate(steps_lat), np.concatenate(steps_arc)
        o = np.lexsort((-np.repeat(np.arange(len(steps_lat)), [len(s) for s in steps_lat]), lat_ids))
        lat_ids, arcs = lat_ids[o], arcs[o]  # per lattice, from the first arc of its path
        for k, sl in _run_index(lat_ids).items():
            sym, path = lats[k].symbols, word[arcs[sl]]
            out[k] = [sym.word(wd) for wd in path[sym.word_flags(path)].tolist()]
    return out


@dataclass
class _Record:
    """What one step of a run produced, rows sorted by run number, indexed by it (`_run_index`)."""

    nodes: dict[int, slice]
    node_lat: np.ndarray  # kept lattice states, in node order
    arcs: dict[int, slice]
    arc_int: np.ndarray  # (3, n): source node, arrival id, lattice arc
    arc_float: np.ndarray  # (3, n): neural, n-gram, OOV
    finals: dict[int, slice]
    fin_int: np.ndarray  # (1, n): node
    fin_float: np.ndarray  # (4, n): final acoustic, final graph, neural </s>, n-gram </s>


class _Run:
    """What an expansion run keeps across steps, whichever lattices are in flight: the paths waiting for
    a later step (`pending[step]`, chunks in arrival order: run number, lattice state, key, object, row,
    n-gram state, arrival id as ints, cost as floats), the node each arrival became (by arrival id), and
    each step's records until the lattices that wrote them are done."""

    def __init__(self):
        self.pending: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.records: dict[int, _Record] = {}
        self.n_arrivals = 0
        self._node_base = 0
        self._nodes = np.full(1024, -1, dtype=np.int64)

    def add(self, step: int, ints: np.ndarray, cost: np.ndarray) -> None:
        self.pending.setdefault(step, []).append((ints, cost))

    def take(self, step: int) -> tuple[np.ndarray, np.ndarray] | None:
        chunks = self.pending.pop(step, None)
        if not chunks:
            return None
        if len(chunks) == 1:
            return chunks[0]
        return np.concatenate([c[0] for c in chunks], axis=1), np.concatenate([c[1] for c in chunks])

    def arrivals(self, n: int) -> np.ndarray:
        """Ids for n new arrivals (their nodes unknown, -1, until their step)."""
        first = self.n_arrivals
        self.n_arrivals += n
        need = self.n_arrivals - self._node_base
        if need > len(self._nodes):
            grown = np.full(max(need, 2 * len(self._nodes)), -1, dtype=np.int64)
            grown[: len(self._nodes)] = self._nodes
            self._nodes = grown
        return np.arange(first, first + n, dtype=np.int64)

    def set_nodes(self, arrival: np.ndarray, node: np.ndarray) -> None:
        self._nodes[arrival - self._node_base] = node

    def node_of_arrival(self, arrival: np.ndarray) -> np.ndarray:
        return self._nodes[arrival - self._node_base]

    def forget_before(self, step: int, arrival: int) -> None:
        """Drop records of steps before `step` and nodes of arrivals before `arrival`: no lattice in flight
        needs them."""
        for s in [s for s in self.records if s < step]:
            del self.records[s]
        drop = arrival - self._node_base
        if drop > len(self._nodes) // 2:
            self._nodes = self._nodes[drop:].copy()
            self._node_base = arrival

    def state_refs(self) -> set[int]:
        """LM state objects that waiting paths point into."""
        refs = {o for chunks in self.pending.values() for ints, _ in chunks for o in np.unique(ints[3]).tolist()}
        refs.discard(-1)
        return refs


class _Frontier:
    """The lattices in flight laid end to end (state and arc ids offset), so that one level of
    every one of them is merged, pruned, numbered and stepped by the same array operations:
    per-lattice Python work is what made expansion slow. Within each lattice the result is
    what a dict of its states, updated arc by arc, would give: paths merged by (state,
    history key) keeping the best cost (ties to the first arrival), states of a lattice
    state ordered by cost (ties by first arrival), capped, beam-pruned against the best
    estimate of their own lattice, numbered in that order."""

    def __init__(self, xs: list[_Expansion], run: _Run):
        self.xs, self.run = xs, run
        cat = np.concatenate
        ns = np.array([x.lat.num_states for x in xs], dtype=np.int64)
        na = np.array([len(x.lat.src) for x in xs], dtype=np.int64)
        self.soff, aoff = np.cumsum(ns) - ns, np.cumsum(na) - na
        self.arc_owner = np.repeat(np.arange(len(xs)), na)
        self.runs = np.array([x.run for x in xs], dtype=np.int64)  # increasing
        self.start_step = np.array([x.start_step for x in xs], dtype=np.int64)
        self.beta = cat([x.beta for x in xs])
        self.out_start = cat([x.out_start[:-1] + a for x, a in zip(xs, aoff)] + [[int(na.sum())]])
        self.dst = cat([x.lat.dst + o for x, o in zip(xs, self.soff)])
        self.local_state = cat([np.arange(n) for n in ns])
        self.local_arc = cat([np.arange(n) for n in na])
        self.word = cat([x.lat.word for x in xs])
        self.is_word = cat([x.is_word for x in xs])
        self.arc_lm, self.arc_oov, self.arc_gword = (cat([getattr(x, k) for x in xs])
                                                     for k in ("arc_lm", "arc_oov", "arc_gword"))
        self.first_pass = cat([x.first_pass for x in xs])
        self.final_graph = cat([x.lat.final_graph for x in xs])
        self.final_acoustic = cat([x.lat.final_acoustic for x in xs])
        self.level_of = cat([x.level_of for x in xs])
        self.last_step = np.array([x.last_step for x in xs], dtype=np.int64)
        self.n_words = int(self.word.max()) + 2 if len(self.word) else 1
        # per lattice, changing as levels go; written back by sync()
        self.n_nodes = np.array([x.n_nodes for x in xs], dtype=np.int64)
        self.cap = np.array([x.per_state_cap for x in xs], dtype=np.int64)
        self.beams = np.array([x.beam for x in xs], dtype=np.float64)
        self.harder = np.array([x.stats.pruned_harder for x in xs], dtype=bool)
        self.cut = np.zeros(len(xs), dtype=bool)  # a level lost states to max_level_bytes
        self.lm_calls = np.array([x.stats.lm_calls for x in xs], dtype=np.int64)
        self.lm_rows = np.array([x.stats.lm_rows for x in xs], dtype=np.int64)
        self.peak = np.array([x.stats.peak_state_bytes for x in xs], dtype=np.int64)
        self.alive = np.ones(len(xs), dtype=bool)
        self.live: dict[str, np.ndarray] = {}
        self.steps: dict[str, np.ndarray] = {}
        self.step_owner = np.zeros(0, dtype=np.int64)  # the slot of each of the level's steps

    def retire(self, done: np.ndarray, stopped_runs: list[int]) -> None:
        """Lattices that finished (slots `done`) or were stopped leave: their counts are written back."""
        self.sync(done)
        self.alive[done] = False
        if stopped_runs:
            self.alive[np.isin(self.runs, stopped_runs)] = False

    def sync(self, slots: np.ndarray | None = None) -> None:
        """Write the per-lattice counts back to the lattices (all, or those of `slots`)."""
        for k in range(len(self.xs)) if slots is None else slots.tolist():
            x = self.xs[k]
            x.n_nodes, x.per_state_cap, x.beam = int(self.n_nodes[k]), int(self.cap[k]), float(self.beams[k])
            st = x.stats
            st.pruned_harder, st.lm_calls = bool(self.harder[k] or self.cut[k]), int(self.lm_calls[k])
            st.lm_rows = int(self.lm_rows[k])
            st.peak_state_bytes = int(self.peak[k])

    def count_level(self, per_lattice: np.ndarray, called: bool, live_bytes: int) -> None:
        if called:
            self.lm_calls += per_lattice > 0
            self.lm_rows += per_lattice
        self.peak = np.maximum(self.peak, live_bytes)

    def _arrivals(self, step: int) -> tuple[np.ndarray, ...] | None:
        """The paths waiting for this step, of lattices still in flight, in arrival order (global state ids)."""
        got = self.run.take(step)
        if got is None:
            return None
        ints, cost = got
        run, local, key, obj, row, ng, arrival = ints
        slot = np.minimum(np.searchsorted(self.runs, run), len(self.runs) - 1)
        here = (self.runs[slot] == run) & self.alive[slot]  # a lattice stopped since they were queued: dropped
        if not here.all():
            slot, local, key, cost, obj, row, ng, arrival = (a[here] for a in (slot, local, key, cost, obj, row, ng,
                                                                               arrival))
        return slot, self.soff[slot] + local, key, cost, obj, row, ng, arrival

    def _merge_and_prune(self, step: int, max_states: int) -> dict[str, np.ndarray]:
        got = self._arrivals(step)
        if got is None or len(got[0]) == 0:
            return {}
        owner, lat_s, key, cost, obj, row, ng, arrival = got
        member, winner, first_arrival = _merge_keys(lat_s, key, cost)
        m_lat, m_cost, m_owner = lat_s[winner], cost[winner], owner[winner]
        rank_order, state_starts = _sort_groups((m_lat,), (m_cost, first_arrival))
        rank = np.arange(len(rank_order)) - state_starts[_segments(state_starts, len(rank_order))]
        kept = rank_order[rank < self.cap[m_owner[rank_order]]]  # lattice by lattice (global state order)
        kb = m_owner[kept]
        est = m_cost[kept] + self.beta[m_lat[kept]]
        if len(kept):
            seg = np.flatnonzero(np.concatenate([[True], kb[1:] != kb[:-1]]))
            best = np.minimum.reduceat(est, seg)[_segments(seg, len(kept))]
            sel = est <= best + self.beams[kb]
            kept, kb, est = kept[sel], kb[sel], est[sel]
        if len(kept) and self.xs[0].r.cfg.max_level_bytes is not None:
            keep = self._within_level_bytes(step, m_lat[kept], kb, est)
            if keep is not None:
                kept, kb = kept[keep], kb[keep]
        per_lattice = np.bincount(kb, minlength=len(self.xs))
        idx = concat_ranges(self.n_nodes, per_lattice)  # numbered on per lattice
        self.n_nodes += per_lattice
        over = (self.n_nodes > max_states) & ~self.harder
        if over.any():  # from the next level on
            self.harder |= over
            self.cap[over] = np.maximum(1, self.cap[over] // 4)
            self.beams[over] /= 2
        node_of = np.full(len(winner), -1, dtype=np.int64)
        node_of[kept] = idx
        self.run.set_nodes(arrival, node_of[member])
        w_kept = winner[kept]
        return {"idx": idx, "lat": m_lat[kept], "owner": kb, "key": key[w_kept], "cost": m_cost[kept],
                "obj": obj[w_kept], "row": row[w_kept], "ng": ng[w_kept]}

    def _within_level_bytes(self, step: int, lat_s: np.ndarray, owner: np.ndarray,
                            est: np.ndarray) -> np.ndarray | None:
        """Which of a level's states (global lattice state, owner slot, cost estimate; grouped by owner) to
        keep so that no lattice's level creates more LM state than `max_level_bytes`: a state's steps are
        bounded by its out-arcs plus its </s>, each holding the history's positions; over the budget, a
        lattice keeps its best states (at least one), and its stats say it was pruned harder. None: all fit."""
        r = self.xs[0].r
        if r.model is None:
            return None
        rows = self.out_start[lat_s + 1] - self.out_start[lat_s] + np.isfinite(self.final_graph[lat_s])
        positions = step - self.start_step[owner] + 2  # levels bound the words of a history; + <s>, + the step
        nbytes = rows * (positions * r.state_bytes[0] + r.state_bytes[1])
        budget = r.cfg.max_level_bytes
        per_lattice = np.bincount(owner, weights=nbytes, minlength=len(self.xs))
        over = np.flatnonzero(per_lattice > budget)
        if not len(over):
            return None
        keep = np.ones(len(lat_s), dtype=bool)
        for k in over.tolist():
            at = np.flatnonzero(owner == k)
            order = at[np.argsort(est[at], kind="stable")]
            fits = np.cumsum(nbytes[order]) <= budget
            fits[0] = True
            keep[order[~fits]] = False
            self.cut[k] = True
        return keep

    def prepare(self, step: int, max_states: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Prune every lattice's level and list the LM steps it needs: (parent state object,
        row, LM token id) per step, one per distinct (state, word) of the out-arcs, then one
        for </s> where the state is final; and the number of steps of each lattice."""
        live = self.live = self._merge_and_prune(step, max_states)
        if not live:
            self.steps = {}
            empty = self.step_owner = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, np.zeros(len(self.xs), dtype=np.int64)
        counts = self.out_start[live["lat"] + 1] - self.out_start[live["lat"]]
        arc = concat_ranges(self.out_start[live["lat"]], counts)  # arcs are sorted by source
        node = np.repeat(np.arange(len(counts)), counts)  # position among the live states
        is_word = self.is_word[arc]
        word = np.where(is_word, self.word[arc], -1)
        pair = np.where(is_word, node * self.n_words + word, -1 - np.arange(len(arc)))
        uniq, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
        word_step = first[uniq >= 0]  # out-arc position of each distinct (state, word)
        final = np.flatnonzero(np.isfinite(self.final_graph[live["lat"]]))
        # </s> goes after the state's word steps: its sort position is past every out-arc of the level
        step_node = np.concatenate([node[word_step], final])
        step_order = np.lexsort((np.concatenate([word_step, np.full(len(final), len(arc))]), step_node))
        step_arc = np.concatenate([arc[word_step], np.full(len(final), -1)])[step_order]
        step_node = step_node[step_order]
        step_of_pos = np.empty(len(step_order), dtype=np.int64)
        step_of_pos[step_order] = np.arange(len(step_order))
        n_fill = int((uniq < 0).sum())  # np.unique sorted the per-arc fillers of epsilon arcs first
        arc_step = (np.where(is_word, step_of_pos[np.clip(inverse - n_fill, 0, None)], -1) if len(word_step)
                    else np.full(len(arc), -1, dtype=np.int64))
        final_step = step_of_pos[len(word_step) + np.arange(len(final))]
        is_eos = step_arc < 0
        safe = np.where(is_eos, 0, step_arc)

        def of_word(per_arc: np.ndarray, eos: int) -> np.ndarray:  # lattices without arcs: </s> steps only
            return np.where(is_eos, eos, per_arc[safe]) if len(per_arc) else np.full(len(step_arc), eos)

        self.steps = {"node": step_node, "word": of_word(self.word, -1), "gword": of_word(self.arc_gword, -1),
                      "arc": arc, "arc_node": node, "arc_step": arc_step, "final": final, "final_step": final_step}
        token = of_word(self.arc_lm, EOS_ID)
        self.step_owner = live["owner"][step_node]
        per_lattice = np.bincount(self.step_owner, minlength=len(self.xs))
        return live["obj"][step_node], live["row"][step_node], token, per_lattice

    def finish(self, step: int, nn_lp: np.ndarray | None, new_at: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Take the level's neural log-probs (step i's is nn_lp[i]; the state after it is row new_at[1][i] of
        state object new_at[0][i]), add the n-gram, record the level and pass the paths on to later steps."""
        live, steps = self.live, self.steps
        self.live, self.steps = {}, {}
        if live:
            self._propagate(step, live, steps, self.xs[0].r, nn_lp, new_at)
        else:
            empty_i, empty_f = np.zeros((3, 0), dtype=np.int64), np.zeros((3, 0))
            self.run.records[step] = _Record({}, np.zeros(0, dtype=np.int64), {}, empty_i, empty_f, {},
                                             np.zeros((1, 0), dtype=np.int64), np.zeros((4, 0)))

    def _propagate(self, step, live, steps, r, nn_lp, new_at) -> None:
        w = r.w
        n_steps = len(steps["node"])
        nn = nn_lp if nn_lp is not None else np.zeros(n_steps)
        ng, ng_next = r.ngram_steps(live["ng"][steps["node"]], steps["gword"])
        key_next = r.child_keys(live["key"][steps["node"]], steps["word"], steps["gword"])
        lm = lm_score(w, nn, ng)
        fin, fs = steps["final"], steps["final_step"]
        fl = live["lat"][fin]
        fin_run = self.runs[live["owner"][fin]]
        arc, node, i = steps["arc"], steps["arc_node"], steps["arc_step"]
        word_arc = i >= 0
        # epsilon arcs index one padding row past the steps (a level may have no steps at all)
        j = np.where(word_arc, i, n_steps)
        nn, ng, lm = np.append(nn, 0.0), np.append(ng, 0.0), np.append(lm, 0.0)
        key_next, ng_next = np.append(key_next, -1), np.append(ng_next, -1)
        new_obj, new_row = ((np.append(new_at[0], -1), np.append(new_at[1], -1)) if new_at is not None
                            else (np.full(n_steps + 1, -1, dtype=np.int64),) * 2)
        oov = np.where(word_arc, self.arc_oov[arc], 0.0)
        cost = np.where(word_arc, live["cost"][node] + self.first_pass[arc] - lm[j] - w.word_penalty
                        - w.oov_penalty * oov, live["cost"][node] + self.first_pass[arc])
        owner = self.arc_owner[arc]
        arc_run = self.runs[owner]
        arrival = self.run.arrivals(len(arc))
        ints = np.stack([arc_run, self.local_state[self.dst[arc]], np.where(word_arc, key_next[j], live["key"][node]),
                         np.where(word_arc, new_obj[j], live["obj"][node]),
                         np.where(word_arc, new_row[j], live["row"][node]),
                         np.where(word_arc, ng_next[j], live["ng"][node]), arrival])
        target = self.start_step[owner] + self.level_of[self.dst[arc]]
        if len(arc) and target.min() == target.max():
            self.run.add(int(target[0]), ints, cost)
        elif len(arc):
            order = np.argsort(target, kind="stable")  # arrivals keep arc order within each lattice
            t_sorted = target[order]
            cut = np.flatnonzero(t_sorted[1:] != t_sorted[:-1]) + 1
            for a, e in zip(np.append(0, cut).tolist(), np.append(cut, len(order)).tolist()):
                sel = order[a:e]
                self.run.add(int(t_sorted[a]), ints[:, sel], cost[sel])
        nn_arc, ng_arc = np.where(word_arc, nn[j], 0.0), np.where(word_arc, ng[j], 0.0)
        kept_run = self.runs[live["owner"]]
        self.run.records[step] = _Record(
            nodes=_run_index(kept_run), node_lat=self.local_state[live["lat"]],
            arcs=_run_index(arc_run), arc_int=np.stack([live["idx"][node], arrival, self.local_arc[arc]]),
            arc_float=np.stack([nn_arc, ng_arc, oov]),
            finals=_run_index(fin_run), fin_int=live["idx"][fin][None],
            fin_float=np.stack([self.final_acoustic[fl], self.final_graph[fl], nn[fs], ng[fs]]))


class _SortedRuns:
    """int64 keys -> (float, int64), in sorted runs each more than twice the size of the next: a lookup is
    one searchsorted per run (log2 n of them at most), and each key is merged O(log n) times, however long a
    run of lattices grows the table (inserting into one sorted array would copy all of it every level)."""

    def __init__(self):
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found, value, value) for sorted keys; 0.0 and -1 where not found."""
        hit = np.zeros(len(keys), dtype=bool)
        a, b = np.zeros(len(keys)), np.full(len(keys), -1, dtype=np.int64)
        for k, va, vb in self.runs:
            pos = np.minimum(np.searchsorted(k, keys), len(k) - 1)
            here = (k[pos] == keys) & ~hit
            a[here], b[here] = va[pos[here]], vb[pos[here]]
            hit |= here
        return hit, a, b

    def add(self, keys: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """New keys (sorted, none present yet) and their values."""
        if len(keys) == 0:
            return
        self.runs.append((keys, a, b))
        # each run more than twice the next: at most log2(n) runs
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            merged = [np.concatenate([x, y]) for x, y in zip(self.runs.pop(-2), self.runs.pop())]
            order = np.argsort(merged[0], kind="stable")
            self.runs.append(tuple(m[order] for m in merged))


_KEY_BITS = 21  # bits per word of a packed history key (word ids + 1, 0 = no word): three words in an int64


class LatticeRescorer:
    """Expands lattices with a neural LM and/or an n-gram under given weights.

    `expand_many` advances up to `cfg.batch_lattices` lattices together, level by
    level, so each LM call carries the steps of all of them: one lattice level alone
    holds too few steps to keep a CPU's caches or a GPU busy.

    History keys and n-gram states are interned as integers for the rescorer's life, and
    KenLM is asked once per (n-gram state, word): lattices of one run share their words.
    """

    def __init__(self, weights: Weights, model=None, vocab: Vocabulary | None = None, ngram: NgramLM | None = None,
                 config: ExpandConfig | None = None, device="cpu"):
        if model is None and ngram is None:
            raise ConfigError("lattice rescoring needs a neural LM, an n-gram, or both")
        if model is not None and vocab is None:
            raise ConfigError("a neural LM needs its vocabulary")
        self.w, self.model, self.vocab, self.ngram = weights, model, vocab, ngram
        self.cfg = config or ExpandConfig()
        self.device = device
        self.state_bytes = (0, 0)  # LM state bytes per position and per row
        if model is not None:  # an n-gram-only run never imports torch
            import torch

            self.device = torch.device(device)
            size = next(model.parameters()).element_size()
            self.state_bytes = (model.state_numel_per_position() * size, model.state_numel_fixed() * size)
        self.lm_calls = 0
        # rows of one LM call at a step (None: a level in one call); with `pause`, expand_many yields
        # between the calls of a level, so a server can bound the time between two of its checks
        self.rows_per_call: Callable[[int], int] | None = None
        self._keys: list[tuple] = [()]  # key id -> history key (decoder word ids)
        self._key_id: dict[tuple, int] = {(): 0}
        self._child: dict[tuple[int, int], int] = {}  # (key id, word) -> key id after the word
        self._ng_states: list = []
        self._ng_id: dict = {}
        self._ng_cache = _SortedRuns()  # (n-gram state id, word id + 1; 0 </s>) packed -> (ln p, state id after)
        self._words: list[str] = []
        self._word_ids: dict[str, int] = {}

    def _key(self, history: tuple) -> tuple:
        n = self.cfg.max_ngram_order
        if n is None:
            return history
        return history[-(n - 1):] if n > 1 else ()  # the whole history while it is shorter than n - 1

    def child_keys(self, parents: np.ndarray, words: np.ndarray, gwords: np.ndarray) -> np.ndarray:
        """History key ids after each (key id, word); -1 where the word is -1 (</s>). `gwords` are the
        same words as `word_id`s: up to order 4 a key is their packed last n-1 ids, computed in arrays."""
        n = self.cfg.max_ngram_order
        if n is not None and n <= 1 + 63 // _KEY_BITS:
            mask = np.int64((1 << (_KEY_BITS * (n - 1))) - 1)
            return np.where(gwords >= 0, ((parents << _KEY_BITS) | (gwords + 1)) & mask, -1)
        out = np.full(len(parents), -1, dtype=np.int64)
        steps = np.flatnonzero(words >= 0)
        if steps.size == 0:
            return out
        pairs, inverse = np.unique(np.stack([parents[steps], words[steps]], axis=1), axis=0, return_inverse=True)
        child, keys, key_id = self._child, self._keys, self._key_id
        ids = np.empty(len(pairs), dtype=np.int64)
        for i, (k, wd) in enumerate(pairs.tolist()):  # each distinct step once: levels repeat them a lot
            c = child.get((k, wd))
            if c is None:
                key = self._key(keys[k] + (wd,))
                c = key_id.get(key)
                if c is None:
                    c = key_id[key] = len(keys)
                    keys.append(key)
                child[(k, wd)] = c
            ids[i] = c
        out[steps] = ids[inverse.reshape(-1)]
        return out

    def ng_id(self, state) -> int:
        i = self._ng_id.get(state)
        if i is None:
            i = self._ng_id[state] = len(self._ng_states)
            self._ng_states.append(state)
        return i

    def word_id(self, word: str) -> int:
        """The rescorer's id of a word string (lattices may come with different symbol tables)."""
        i = self._word_ids.get(word)
        if i is None:
            if len(self._words) >= (1 << _KEY_BITS) - 2:
                raise ConfigError(f"more than {(1 << _KEY_BITS) - 2} distinct words in one run")
            i = self._word_ids[word] = len(self._words)
            self._words.append(word)
        return i

    def ngram_steps(self, states: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ln p of each step's word (a `word_id`), or of </s> where it is -1; the n-gram state id after it).
        Answers are kept for the rescorer's life (`_SortedRuns`), so a level looks up the pairs seen before
        at once and asks KenLM only for new ones."""
        n = len(states)
        if self.ngram is None:
            return np.zeros(n), np.full(n, -1, dtype=np.int64)
        pair = (states << _KEY_BITS) | (words + 1)  # word ids are below 2**_KEY_BITS - 1 (word_id checks)
        uniq, inverse = np.unique(pair, return_inverse=True)
        hit, lp, nxt = self._ng_cache.find(uniq)
        new = np.flatnonzero(~hit)
        if len(new):
            new_keys = uniq[new]
            got_lp, got_next = np.empty(len(new)), np.full(len(new), -1, dtype=np.int64)
            model, new_state, ln10 = self.ngram.model, self.ngram.new_state, LN10  # KenLM itself: ~40k calls a run
            ng_states, words_of, ng_index = self._ng_states, self._words, self._ng_id
            mask = (1 << _KEY_BITS) - 1
            for k, key in enumerate(new_keys.tolist()):
                s, wd = key >> _KEY_BITS, (key & mask) - 1
                after = new_state()
                got_lp[k] = model.BaseScore(ng_states[s], words_of[wd] if wd >= 0 else "</s>", after) * ln10
                if wd >= 0:
                    i = ng_index.get(after)
                    if i is None:
                        i = ng_index[after] = len(ng_states)
                        ng_states.append(after)
                    got_next[k] = i
            lp[new], nxt[new] = got_lp, got_next
            self._ng_cache.add(new_keys, got_lp, got_next)
        inverse = inverse.reshape(-1)
        return lp[inverse], nxt[inverse]

    def expand(self, lat: Lattice) -> ExpandedLattice:
        return next(iter(self.expand_many([lat])))[1]

    def expand_many(self, lats, on_error=None, should_stop=None, pause: bool = False):
        """Yield (index, ExpandedLattice) as lattices finish (not in input order).
        `lats` may be an iterable of Lattice or of callables returning one; a
        SmallstateError from preparing one is passed to `on_error(index, error)`
        (raised when no handler is given) and that lattice is skipped.

        `should_stop(index) -> bool` is asked before a lattice starts and between levels:
        True drops it (nothing is yielded for it) and frees its states, so a server stops
        the work of a request that was cancelled or timed out. With `pause`, None is also
        yielded after every level and between the LM calls of a level (`rows_per_call`): a caller
        may stop there, do other work, and resume; a lattice stopped between two calls of a level
        has no more rows computed."""
        objs: dict[int, object] = {}
        next_obj = 0
        if self.model is not None:
            objs[0] = self.model.initial_state(1, self.device)
            next_obj = 1
        source = iter(enumerate(lats))
        batch = self.cfg.lattices_per_batch(self.model is not None)
        run = _Run()
        active: list[_Expansion] = []
        frontier: _Frontier | None = None
        step = 0
        while True:
            joined: list[_Expansion] = []
            while len(active) + len(joined) < batch:
                taken = self._take(source, batch - len(active) - len(joined), on_error, should_stop)
                if not taken:
                    break
                joined += self._join(taken, run, step, on_error)
            if joined:
                if frontier is not None:
                    frontier.sync()
                active += joined
                frontier = None
            if not active:
                return
            if frontier is None:
                frontier = _Frontier(active, run)
            obj, row, tok, per_lattice = frontier.prepare(step, self.cfg.max_states)
            lp, new_at, halted = None, None, set()
            if self.model is not None and len(tok):
                lp = np.zeros(len(tok))
                new_at = (np.full(len(tok), -1, dtype=np.int64), np.full(len(tok), -1, dtype=np.int64))
                rows = max(1, self.rows_per_call(step)) if self.rows_per_call is not None else len(tok)
                for a in range(0, len(tok), rows):
                    part = np.arange(a, min(a + rows, len(tok)))
                    if a > 0 and pause:  # a wide level is not one unstoppable call
                        yield None
                        if should_stop is not None:
                            halted |= {x.run for x in active if x.run not in halted and should_stop(x.run)}
                    if halted:  # the rows of lattices stopped meanwhile are not computed
                        part = part[~np.isin(frontier.runs[frontier.step_owner[part]], list(halted))]
                        if not len(part):
                            continue
                    lp[part] = self._lm_call(obj[part], row[part], tok[part], objs, next_obj)
                    new_at[0][part], new_at[1][part] = next_obj, np.arange(len(part))
                    next_obj += 1
            frontier.count_level(per_lattice, lp is not None, sum(o.nbytes for o in objs.values()))
            frontier.finish(step, lp, new_at)
            done = np.flatnonzero((frontier.last_step == step) & frontier.alive & ~np.isin(frontier.runs, list(halted)))
            stopped = ([x for x in active if x.run in halted or (x.last_step > step and should_stop(x.run))]
                       if should_stop is not None else [])
            if len(done) or stopped:
                # the frontier keeps the lattices that left (their rows are skipped) until the next one joins
                frontier.retire(done, [x.run for x in stopped])
                for k in done.tolist():
                    x = frontier.xs[k]
                    try:
                        yield x.run, x.result(run)
                    except SmallstateError as e:
                        if on_error is None:
                            raise
                        on_error(x.run, e)
                gone = {frontier.xs[k].run for k in done.tolist()} | {x.run for x in stopped}
                active = [x for x in active if x.run not in gone]
                run.forget_before(min((x.start_step for x in active), default=step + 1),
                                  min((x.first_arrival for x in active), default=run.n_arrivals))
            step += 1
            if self.model is not None:
                refs_live = {0} | run.state_refs()
                for k in list(objs):
                    if k not in refs_live:
                        del objs[k]
            if pause:
                yield None

    def _take(self, source, n: int, on_error, should_stop) -> list[_Expansion]:
        """Up to n lattices from `source` (an iterator of (index, lattice or callable)), those that are not
        stopped and prepare without error."""
        out: list[_Expansion] = []
        for i, item in source if n > 0 else ():
            if should_stop is None or not should_stop(i):
                try:
                    out.append(_Expansion(self, item() if callable(item) else item, i))
                except SmallstateError as e:
                    if on_error is None:
                        raise
                    on_error(i, e)
            if len(out) == n:
                break
        return out

    def _join(self, xs: list[_Expansion], run: _Run, step: int, on_error) -> list[_Expansion]:
        """Start lattices at `step`: their arrays, and a path at each start state. A lattice whose arrays
        cannot be made (a SmallstateError) goes to `on_error(index, error)` (raised without one) and is
        left out; the others start."""
        try:
            _prepare_group(self, xs)
        except SmallstateError as e:
            if len(xs) > 1:  # one at a time, to find which
                return [x for one in xs for x in self._join([one], run, step, on_error)]
            if on_error is None:
                raise
            on_error(xs[0].run, e)
            return []
        ng = self.ng_id(self.ngram.initial_state()) if self.ngram is not None else -1
        obj = 0 if self.model is not None else -1
        for x in xs:
            x.start_step, x.first_arrival = step, run.n_arrivals
            ints = np.array([[x.run], [0], [0], [obj], [0 if obj == 0 else -1], [ng], run.arrivals(1).tolist()],
                            dtype=np.int64)
            run.add(step + int(x.level_of[0]), ints, np.zeros(1))
        return xs

    def _lm_call(self, obj: np.ndarray, row: np.ndarray, tok: np.ndarray, objs: dict[int, object],
                 new_obj: int) -> np.ndarray:
        """One batched LM step for rows of the lattices' level: log-probs per row, the new state stored as
        `new_obj`."""
        import torch

        with torch.no_grad():
            tokens = torch.as_tensor(tok, dtype=torch.long, device=self.device)[:, None]
            logp, new_state = self.model.score(tokens, self._gather(obj, row, objs))
            objs[new_obj] = new_state.compact()
        self.lm_calls += 1
        return logp[:, 0].double().cpu().numpy()

    def _gather(self, obj: np.ndarray, row: np.ndarray, objs: dict[int, object]):
        """One state with row i = row[i] of state object obj[i]."""
        import torch

        uniq, first = np.unique(obj, return_index=True)
        uniq = uniq[np.argsort(first)]  # pieces in order of first use
        if len(uniq) == 1 and np.array_equal(row, np.arange(objs[int(uniq[0])].batch_size)):
            return objs[int(uniq[0])]
        pieces = []
        for o in uniq.tolist():
            at = np.flatnonzero(obj == o)
            pieces.append((objs[o], torch.as_tensor(row[at], device=self.device),
                           torch.as_tensor(at, device=self.device)))
        return type(pieces[0][0]).assemble(pieces, len(obj)).compact()


def build_rescorer(weights: Weights, lm=None, ngram: NgramLM | None = None, config: ExpandConfig | None = None,
                   device=None) -> LatticeRescorer:
    """The one way every front end (CLI, Ray workers, the service) builds a lattice rescorer.

    `lm` is a loaded neural LM (`checkpoint.load_model`'s result: model + vocabulary) or None;
    `ngram` a KenLM model or None; `device` defaults to where the LM's weights are.
    """
    if lm is None:
        return LatticeRescorer(weights, None, None, ngram, config, device or "cpu")
    if device is None:
        device = next(lm.model.parameters()).device
    return LatticeRescorer(weights, lm.model, lm.vocab, ngram, config, device)
