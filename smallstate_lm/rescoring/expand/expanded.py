"""The result of expanding a lattice with the LMs: the expanded graph, every arc with its score components
kept apart (acoustic, graph, neural, n-gram, word and OOV counts), so that a sweep of weights re-runs only the
cheap searches over it (best path, n-best, the rescored lattice), never an LM."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError
from ...weights import Weights, log_mix, weighted_total
from ..lattices.graph import backtrack, state_levels, viterbi
from ..lattices.kbest import Dag, ScoredPath, nbest_paths
from ..lattices.lattice import Lattice, LatticeWarning, SymbolTable


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
    # (N,) each node's lattice state's level: every arc goes up a level, so passes can go a level at a time
    node_level: np.ndarray | None = None

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

    def dag(self, w: Weights) -> Dag:
        """The expanded graph under `w` as a `kbest.Dag` (costs -ln; word keys -1 on epsilon and non-word arcs):
        what the k-best search, posteriors and the consensus decode run on."""
        word_key = np.where(self.is_word > 0, self.word, -1)
        return Dag(len(self.node_lat), self.src, self.dst, self.arc_costs(w), self.final_node, self.final_costs(w),
                   word_key)

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
        return backtrack(back, self.src, int(self.final_node[int(np.argmin(fin))]))

    def best_words(self, w: Weights) -> list[str]:
        """The best word sequence under `w` (Viterbi; cheaper than nbest(w, 1))."""
        return [self.symbols.word(int(self.word[e])) for e in self.best_arcs(w).tolist() if self.is_word[e] > 0]

    def _check_times(self) -> None:
        src = self.source
        no_tids = src is None or src.arc_tids is None or len(src.arc_tids.values) == 0
        if src is None or self.arc is None or (src.state_time is None and no_tids):
            raise ConfigError(f"lattice {self.name}: no word times for a CTM (it has neither node times, as SLF "
                              "`t=`, nor transition-ids, as Kaldi archives)")

    def labels_on_one_frame(self) -> bool:
        """One transition-id per arc (a Kaldi `Lattice`, not a CompactLattice): a word's label then sits on one
        of its frames, and the word is taken to last until the next word's label."""
        tids = self.source.arc_tids if self.source is not None else None
        return (self.source.state_time is None and tids is not None and len(tids.values) > 0
                and len(tids.values) == int((tids.lengths() > 0).sum()))

    def node_times(self, frame_shift: float) -> np.ndarray:
        """(N,) seconds from the start at each expanded node: its source state's SLF time, else the frames
        (transition-ids, `frame_shift` seconds each) on the way to it; a Kaldi lattice is time-synchronous, so
        every path gives a state the same time (the latest is taken). Raises ConfigError without times."""
        self._check_times()
        src = self.source
        if src.state_time is not None:
            return src.state_time[self.node_lat]
        frames = src.arc_tids.lengths().astype(np.float64)
        t = np.zeros(src.num_states)
        level = state_levels(src.num_states, src.src, src.dst)
        order = np.argsort(level[src.dst], kind="stable")
        cuts = np.flatnonzero(np.diff(level[src.dst][order])) + 1
        for a in np.split(order, cuts) if len(order) else []:
            np.maximum.at(t, src.dst[a], t[src.src[a]] + frames[a])
        return t[self.node_lat] * frame_shift

    def best_timed_words(self, w: Weights, frame_shift: float) -> list[tuple[str, float, float]]:
        """(word, start, duration) in seconds along the best path: from the source lattice's state times
        (SLF `t=`), else from its transition-ids (one frame each, `frame_shift` seconds apart, after
        subsampling). Raises ConfigError when the lattice has neither."""
        self._check_times()
        src = self.source
        arcs = self.best_arcs(w)
        lat_arc = self.arc[arcs]
        if src.state_time is not None:
            start, end = src.state_time[src.src[lat_arc]], src.state_time[src.dst[lat_arc]]
        else:
            frames = src.arc_tids.lengths()[lat_arc]
            end = np.cumsum(frames) * frame_shift
            start = end - frames * frame_shift
            if self.labels_on_one_frame():  # lattice-align-words would be exact
                words_at = np.flatnonzero(self.is_word[arcs] > 0)
                nxt = np.append(start[words_at[1:]], end[-1] if len(end) else 0.0)
                end = end.copy()
                end[words_at] = np.maximum(nxt, end[words_at])
        return [(self.symbols.word(int(self.word[e])), float(a), float(b - a))
                for e, a, b in zip(arcs.tolist(), start.tolist(), end.tolist()) if self.is_word[e] > 0]

    def nbest(self, w: Weights, n: int = 1) -> list[ScoredPath]:
        """The n best distinct word sequences under `w`, best first, each with its
        components (natural log) and total (higher is better): lazy k-best (lattices/kbest.py)."""
        return nbest_paths(self, w, n)

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
