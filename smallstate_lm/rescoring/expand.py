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

import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ConfigError
from ..ngram import NgramLM
from ..scoring import Weights
from ..vocab import EOS_ID, Vocabulary
from .lattice import Lattice, LatticeWarning, SymbolTable


@dataclass
class ExpandConfig:
    max_ngram_order: int | None = 4  # None: exact histories
    beam: float = 12.0  # cost units of the combined score, against the level's best estimate
    max_per_state: int = 64  # expanded states kept per lattice state
    max_states: int = 200_000  # per lattice; beyond it pruning tightens (and says so)

    def __post_init__(self):
        if self.max_ngram_order is not None and self.max_ngram_order < 1:
            raise ConfigError(f"max_ngram_order must be >= 1, got {self.max_ngram_order}")
        if self.beam <= 0 or self.max_per_state < 1 or self.max_states < 1:
            raise ConfigError("beam, max_per_state and max_states must be positive")


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

    # ---- weights -> costs ------------------------------------------------------------
    def _lm_terms(self, w: Weights, nn, ng, is_word):
        if w.interpolation == "linear":
            a, b = _log_mix_weights(w.lam)
            return w.lm_weight * np.where(is_word > 0, np.logaddexp(a + nn, b + ng), 0.0)
        return w.lm_weight * nn + w.ngram_weight * ng

    def arc_costs(self, w: Weights) -> np.ndarray:
        total = (-w.am_scale * self.acoustic - w.graph_scale * self.graph + self._lm_terms(w, self.nn, self.ng,
                                                                                          self.is_word)
                 + w.word_penalty * self.is_word + w.oov_penalty * self.oov)
        return -total

    def final_costs(self, w: Weights) -> np.ndarray:
        ones = np.ones_like(self.final_nn)
        return -(-w.am_scale * self.final_acoustic - w.graph_scale * self.final_graph
                 + self._lm_terms(w, self.final_nn, self.final_ng, ones))

    # ---- search ----------------------------------------------------------------------
    def nbest(self, w: Weights, n: int = 1) -> list[dict]:
        """The n best distinct word sequences under `w`, best first, each with its
        components (natural log) and total (higher is better)."""
        cost = self.arc_costs(w)
        fcost = self.final_costs(w)
        N = len(self.node_lat)
        out_arcs: list[list[int]] = [[] for _ in range(N)]
        for e in np.argsort(self.src, kind="stable"):
            out_arcs[self.src[e]].append(int(e))
        # per node: up to n partial paths (cost, words, arc list), distinct in words
        parts: list[dict[tuple, tuple[float, list[int]]]] = [dict() for _ in range(N)]
        parts[0][()] = (0.0, [])
        finals: dict[tuple, tuple[float, list[int], int]] = {}
        is_final = {int(f): i for i, f in enumerate(self.final_node)}
        for v in range(N):
            if not parts[v]:
                continue
            best = sorted(parts[v].items(), key=lambda kv: kv[1][0])[:n]
            parts[v] = {}
            if v in is_final:
                i = is_final[v]
                for words, (c, arcs) in best:
                    tot = c + fcost[i]
                    if words not in finals or tot < finals[words][0]:
                        finals[words] = (tot, arcs, i)
            for e in out_arcs[v]:
                t = self.dst[e]
                wd = int(self.word[e]) if self.is_word[e] > 0 else None
                for words, (c, arcs) in best:
                    nw = words + (wd,) if wd is not None else words
                    nc = c + cost[e]
                    cur = parts[t].get(nw)
                    if cur is None or nc < cur[0]:
                        parts[t][nw] = (nc, arcs + [e])
            best = None
        ranked = sorted(finals.items(), key=lambda kv: kv[1][0])[:n]
        out = []
        for words, (tot, arcs, fi) in ranked:
            a = np.array(arcs, dtype=np.int64)
            comp = {
                "am": float(-self.acoustic[a].sum() - self.final_acoustic[fi]),
                "graph": float(-self.graph[a].sum() - self.final_graph[fi]),
                "neural": float(self.nn[a].sum() + self.final_nn[fi]),
                "ngram": float(self.ng[a].sum() + self.final_ng[fi]),
                "n_words": int(self.is_word[a].sum()),
                "n_oov": int(self.oov[a].sum()),
                "total": float(-tot),
            }
            out.append({"words": [self.symbols.word(i) for i in words], **comp})
        return out

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
        lat = Lattice(name=self.name, num_states=N, start=0, src=self.src.copy(), dst=self.dst.copy(),
                      word=self.word.copy(), graph=graph, acoustic=self.acoustic.copy(), final_graph=final_graph,
                      final_acoustic=final_ac, symbols=self.symbols)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LatticeWarning)  # pruned branches end nowhere: trimming them is the point
            return lat.prepare()


def _log_mix_weights(lam: float) -> tuple[float, float]:
    """log(lam), log(1 - lam), with log 0 = -inf."""
    return (math.log(lam) if lam > 0 else -math.inf, math.log1p(-lam) if lam < 1 else -math.inf)


def _levels(lat: Lattice) -> np.ndarray:
    """Longest-path depth of each state: states of one level have no arc between them."""
    level = np.zeros(lat.num_states, dtype=np.int64)
    order = np.argsort(lat.src, kind="stable")
    for e in order:  # states are topologically numbered, arcs sorted by source
        s, t = lat.src[e], lat.dst[e]
        if level[t] < level[s] + 1:
            level[t] = level[s] + 1
    return level


def _backward(lat: Lattice, w: Weights) -> np.ndarray:
    """Best completion cost from each state on the original lattice; the first-pass
    graph cost stands in for all LMs (their weights added), a look-ahead only."""
    lm_scale = w.graph_scale + w.lm_weight + w.ngram_weight
    cost = w.am_scale * lat.acoustic + lm_scale * lat.graph
    beta = w.am_scale * lat.final_acoustic + lm_scale * lat.final_graph
    beta = np.where(np.isfinite(beta), beta, np.inf)
    for e in np.argsort(-lat.src, kind="stable"):
        s, t = lat.src[e], lat.dst[e]
        c = cost[e] + beta[t]
        if c < beta[s]:
            beta[s] = c
    return beta


@dataclass
class _Node:
    lat: int
    key: tuple
    cost: float  # best forward cost (lower is better)
    nn_ref: tuple | None  # (state object index, row)
    ng_state: object | None
    history: tuple  # word ids of the best path (for exact keys and OOV-free lookups)
    idx: int = -1


class LatticeRescorer:
    """Expands lattices with a neural LM and/or an n-gram under given weights."""

    def __init__(self, weights: Weights, model=None, vocab: Vocabulary | None = None, ngram: NgramLM | None = None,
                 config: ExpandConfig | None = None, device: str | torch.device = "cpu"):
        if model is None and ngram is None:
            raise ConfigError("lattice rescoring needs a neural LM, an n-gram, or both")
        if model is not None and vocab is None:
            raise ConfigError("a neural LM needs its vocabulary")
        self.w, self.model, self.vocab, self.ngram = weights, model, vocab, ngram
        self.cfg = config or ExpandConfig()
        self.device = torch.device(device)

    def _key(self, history: tuple) -> tuple:
        n = self.cfg.max_ngram_order
        if n is None:
            return history
        return history[len(history) - (n - 1):] if n > 1 else ()

    @torch.no_grad()
    def expand(self, lat: Lattice) -> ExpandedLattice:
        t0 = time.perf_counter()
        lat = lat.prepare()
        w, cfg = self.w, self.cfg
        sym = lat.symbols
        stats = ExpandStats(lattice_states=lat.num_states, lattice_arcs=len(lat.src))
        is_word_sym = np.array([sym.is_word(int(i)) for i in lat.word], dtype=bool)
        lm_ids = {}
        words_str = {}
        for i in set(int(x) for x in lat.word[is_word_sym]):
            words_str[i] = sym.word(i)
            if self.vocab is not None:
                lm_ids[i] = self.vocab.encode([words_str[i]])[0]
        oov_of = {i: (self.vocab is not None and words_str[i] not in self.vocab)
                  or (self.vocab is None and self.ngram is not None and words_str[i] not in self.ngram)
                  for i in words_str}
        am_cost = w.am_scale * lat.acoustic + w.graph_scale * lat.graph
        levels = _levels(lat)
        beta = _backward(lat, w)
        out_arcs: list[list[int]] = [[] for _ in range(lat.num_states)]
        for e in range(len(lat.src)):
            out_arcs[lat.src[e]].append(e)
        by_level: dict[int, list[int]] = defaultdict(list)
        for s in range(lat.num_states):
            by_level[int(levels[s])].append(s)

        state_objs: dict[int, object] = {}
        if self.model is not None:
            state_objs[0] = self.model.initial_state(1, self.device)
        next_obj = 1
        start = _Node(lat=lat.start, key=(), cost=0.0, nn_ref=(0, 0) if self.model is not None else None,
                      ng_state=self.ngram.initial_state() if self.ngram is not None else None, history=())
        nodes_at: dict[int, dict[tuple, _Node]] = defaultdict(dict)
        nodes_at[lat.start][()] = start
        all_nodes: list[_Node] = []
        arcs: list[tuple] = []  # (src node, dst node, lattice arc, nn, ng, oov)
        finals: list[tuple] = []  # (node, final acoustic, final graph, nn eos, ng eos)
        per_state_cap, beam = cfg.max_per_state, cfg.beam

        def lm_cost(nn, ng, oov):
            if w.interpolation == "linear":
                a, b = _log_mix_weights(w.lam)
                return -(w.lm_weight * np.logaddexp(a + nn, b + ng)) - w.word_penalty - w.oov_penalty * oov
            return -(w.lm_weight * nn + w.ngram_weight * ng) - w.word_penalty - w.oov_penalty * oov

        for level in sorted(by_level):
            states = by_level[level]
            live: list[_Node] = []
            for s in states:
                cand = sorted(nodes_at.pop(s, {}).values(), key=lambda n: n.cost)[:per_state_cap]
                live.extend(cand)
            if not live:
                continue
            best_est = min(n.cost + beta[n.lat] for n in live)
            live = [n for n in live if n.cost + beta[n.lat] <= best_est + beam]
            for n in live:
                n.idx = len(all_nodes)
                all_nodes.append(n)
            if len(all_nodes) > cfg.max_states and not stats.pruned_harder:
                stats.pruned_harder = True
                per_state_cap = max(1, per_state_cap // 4)
                beam = beam / 2
            # the LM steps this level needs: (node, word) pairs, plus </s> at final states
            steps: dict[tuple[int, int], int] = {}
            step_list: list[tuple[_Node, int]] = []
            for n in live:
                for e in out_arcs[n.lat]:
                    if is_word_sym[e]:
                        k = (n.idx, int(lat.word[e]))
                        if k not in steps:
                            steps[k] = len(step_list)
                            step_list.append((n, int(lat.word[e])))
                if np.isfinite(lat.final_graph[n.lat]):
                    k = (n.idx, -1)
                    steps[k] = len(step_list)
                    step_list.append((n, -1))
            nn_lp = np.zeros(len(step_list))
            ng_lp = np.zeros(len(step_list))
            ng_next: list[object] = [None] * len(step_list)
            new_obj = None
            if step_list and self.model is not None:
                tokens = torch.tensor([[EOS_ID if wd < 0 else lm_ids[wd]] for _, wd in step_list],
                                      dtype=torch.long, device=self.device)
                parent = self._gather([n.nn_ref for n, _ in step_list], state_objs)
                lp, new_state = self.model.score(tokens, parent)
                nn_lp = lp[:, 0].double().cpu().numpy()
                stats.lm_calls += 1
                stats.lm_rows += len(step_list)
                new_obj = next_obj
                next_obj += 1
                state_objs[new_obj] = new_state
            if step_list and self.ngram is not None:
                for i, (n, wd) in enumerate(step_list):
                    if wd < 0:
                        ng_lp[i] = self.ngram.score_eos(n.ng_state)
                    else:
                        ng_lp[i], ng_next[i] = self.ngram.score_word(n.ng_state, words_str[wd])
            live_bytes = sum(st.nbytes for st in state_objs.values())
            stats.peak_state_bytes = max(stats.peak_state_bytes, live_bytes)
            # propagate
            for n in live:
                if np.isfinite(lat.final_graph[n.lat]):
                    i = steps[(n.idx, -1)]
                    finals.append((n, lat.final_acoustic[n.lat], lat.final_graph[n.lat], nn_lp[i], ng_lp[i]))
                for e in out_arcs[n.lat]:
                    t = int(lat.dst[e])
                    if is_word_sym[e]:
                        wd = int(lat.word[e])
                        i = steps[(n.idx, wd)]
                        oov = 1.0 if oov_of[wd] else 0.0
                        c = n.cost + am_cost[e] + lm_cost(nn_lp[i], ng_lp[i], oov)
                        hist = n.history + (wd,)
                        nn_ref = (new_obj, i) if new_obj is not None else None
                        ng_state = ng_next[i]
                        rec = (n, e, nn_lp[i], ng_lp[i], oov)
                    else:
                        c = n.cost + am_cost[e]
                        hist, nn_ref, ng_state = n.history, n.nn_ref, n.ng_state
                        rec = (n, e, 0.0, 0.0, 0.0)
                    key = self._key(hist)
                    succ = nodes_at[t].get(key)
                    if succ is None:
                        succ = _Node(lat=t, key=key, cost=c, nn_ref=nn_ref, ng_state=ng_state, history=hist)
                        nodes_at[t][key] = succ
                    elif c < succ.cost:
                        succ.cost, succ.nn_ref, succ.ng_state, succ.history = c, nn_ref, ng_state, hist
                    arcs.append((rec[0], succ, rec[1], rec[2], rec[3], rec[4]))
            # state objects no live node refers to any more can go
            if self.model is not None:
                refs = {nd.nn_ref[0] for d in nodes_at.values() for nd in d.values()}
                for k in list(state_objs):
                    if k not in refs:
                        del state_objs[k]

        if not finals:
            raise ConfigError(f"lattice {lat.name}: every path was pruned; widen --beam")
        # keep arcs whose destination was expanded
        arcs = [a for a in arcs if a[1].idx >= 0]
        stats.expanded_states = len(all_nodes)
        stats.expanded_arcs = len(arcs)
        stats.seconds = time.perf_counter() - t0
        E = len(arcs)
        lat_arc = np.array([a[2] for a in arcs], dtype=np.int64).reshape(E)
        is_word = is_word_sym[lat_arc].astype(np.float64) if E else np.zeros(0)
        return ExpandedLattice(
            name=lat.name,
            node_lat=np.array([n.lat for n in all_nodes], dtype=np.int64),
            src=np.array([a[0].idx for a in arcs], dtype=np.int64).reshape(E),
            dst=np.array([a[1].idx for a in arcs], dtype=np.int64).reshape(E),
            word=lat.word[lat_arc].astype(np.int64) if E else np.zeros(0, dtype=np.int64),
            acoustic=lat.acoustic[lat_arc] if E else np.zeros(0),
            graph=lat.graph[lat_arc] if E else np.zeros(0),
            nn=np.array([a[3] for a in arcs], dtype=np.float64).reshape(E),
            ng=np.array([a[4] for a in arcs], dtype=np.float64).reshape(E),
            is_word=is_word,
            oov=np.array([a[5] for a in arcs], dtype=np.float64).reshape(E),
            final_node=np.array([f[0].idx for f in finals], dtype=np.int64),
            final_acoustic=np.array([f[1] for f in finals], dtype=np.float64),
            final_graph=np.array([f[2] for f in finals], dtype=np.float64),
            final_nn=np.array([f[3] for f in finals], dtype=np.float64),
            final_ng=np.array([f[4] for f in finals], dtype=np.float64),
            symbols=sym, stats=stats)

    def _gather(self, refs: list[tuple], objs: dict[int, object]):
        """One state with row i = refs[i] = (object, row), across state objects."""
        by_obj: dict[int, list[int]] = defaultdict(list)
        pos: dict[int, list[int]] = defaultdict(list)
        for i, (o, r) in enumerate(refs):
            by_obj[o].append(r)
            pos[o].append(i)
        parts, order = [], []
        for o, rows in by_obj.items():
            parts.append(objs[o].select(torch.as_tensor(rows, device=self.device)))
            order.extend(pos[o])
        st = parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)
        inv = torch.empty(len(order), dtype=torch.long, device=self.device)
        inv[torch.as_tensor(order, device=self.device)] = torch.arange(len(order), device=self.device)
        if order != sorted(order):
            st = st.select(inv)
        return st.compact()
