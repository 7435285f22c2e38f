"""The per-state lattice expansion as it was before the array version (issue 16), kept
verbatim as the test oracle for tests/test_expand_arrays.py: the array expansion must
give the same expanded graph. Not part of the package.

Lattice rescoring by history-merged expansion.

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
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from smallstate_lm.errors import ConfigError, SmallstateError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, ExpandedLattice, ExpandStats
from smallstate_lm.rescoring.lattices.lattice import Lattice
from smallstate_lm.vocab import EOS_ID, Vocabulary
from smallstate_lm.weights import Weights, count_oov, lm_score, oov_reference


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
    nn_ref: tuple | None  # (state object id, row)
    ng_state: object | None
    history: tuple  # decoder word ids along the best path into this node
    idx: int = -1


class _Expansion:
    """One lattice's expansion, advanced one level at a time by the driver, which
    merges the LM steps of many lattices into one batched call."""

    def __init__(self, rescorer: "LatticeRescorer", lat: Lattice):
        self.t0 = time.perf_counter()
        self.r = rescorer
        lat = lat.prepare()
        self.lat = lat
        w = rescorer.w
        sym = lat.symbols
        self.stats = ExpandStats(lattice_states=lat.num_states, lattice_arcs=len(lat.src))
        self.is_word = np.array([sym.is_word(int(i)) for i in lat.word], dtype=bool)
        self.words_str = {i: sym.word(i) for i in set(int(x) for x in lat.word[self.is_word])}
        vocab, ngram = rescorer.vocab, rescorer.ngram
        self.lm_ids = {i: vocab.encode([ws])[0] for i, ws in self.words_str.items()} if vocab is not None else {}
        known = oov_reference(vocab, ngram)
        self.oov = {i: float(count_oov([ws], known)) for i, ws in self.words_str.items()}
        self.first_pass = w.am_scale * lat.acoustic + w.graph_scale * lat.graph
        self.beta = _backward(lat, w)
        self.out_arcs: list[list[int]] = [[] for _ in range(lat.num_states)]
        for e in range(len(lat.src)):
            self.out_arcs[lat.src[e]].append(e)
        levels = _levels(lat)
        by_level: dict[int, list[int]] = defaultdict(list)
        for st in range(lat.num_states):
            by_level[int(levels[st])].append(st)
        self.levels = [by_level[k] for k in sorted(by_level)]
        self.level = 0
        self.nodes_at: dict[int, dict[tuple, _Node]] = defaultdict(dict)
        self.all_nodes: list[_Node] = []
        self.arcs: list[tuple] = []  # (src node, dst node, lattice arc, nn, ng, oov)
        self.finals: list[tuple] = []  # (node, final acoustic, final graph, nn </s>, ng </s>)
        self.per_state_cap, self.beam = rescorer.cfg.max_per_state, rescorer.cfg.beam
        self.live: list[_Node] = []
        self.steps: list[tuple[_Node, int]] = []
        self.step_of: dict[tuple[int, int], int] = {}

    def start(self, nn_ref) -> None:
        ng = self.r.ngram.initial_state() if self.r.ngram is not None else None
        self.nodes_at[self.lat.start][()] = _Node(lat=self.lat.start, key=(), cost=0.0, nn_ref=nn_ref, ng_state=ng,
                                                  history=())

    @property
    def done(self) -> bool:
        return self.level >= len(self.levels)

    def prepare_level(self) -> list[tuple[tuple | None, int]]:
        """Prune this level's nodes and list the LM steps it needs as (parent state ref,
        LM token id; -1 for </s>). May return [] (a level of epsilon arcs only)."""
        cfg = self.r.cfg
        live: list[_Node] = []
        for st in self.levels[self.level]:
            live.extend(sorted(self.nodes_at.pop(st, {}).values(), key=lambda n: n.cost)[: self.per_state_cap])
        if live:
            best_est = min(n.cost + self.beta[n.lat] for n in live)
            live = [n for n in live if n.cost + self.beta[n.lat] <= best_est + self.beam]
        for n in live:
            n.idx = len(self.all_nodes)
            self.all_nodes.append(n)
        if len(self.all_nodes) > cfg.max_states and not self.stats.pruned_harder:
            self.stats.pruned_harder = True
            self.per_state_cap = max(1, self.per_state_cap // 4)
            self.beam /= 2
        self.live = live
        self.steps, self.step_of = [], {}
        for n in live:
            for e in self.out_arcs[n.lat]:
                if self.is_word[e]:
                    k = (n.idx, int(self.lat.word[e]))
                    if k not in self.step_of:
                        self.step_of[k] = len(self.steps)
                        self.steps.append((n, int(self.lat.word[e])))
            if np.isfinite(self.lat.final_graph[n.lat]):
                self.step_of[(n.idx, -1)] = len(self.steps)
                self.steps.append((n, -1))
        if self.r.model is None:
            return []
        return [(n.nn_ref, EOS_ID if wd < 0 else self.lm_ids[wd]) for n, wd in self.steps]

    def finish_level(self, nn_lp: np.ndarray | None, new_obj: int | None, row0: int) -> None:
        """Take this level's neural log-probs (rows row0.. of the shared call, whose
        output state is object `new_obj`), add the n-gram, and propagate."""
        w, lat, ngram = self.r.w, self.lat, self.r.ngram
        n_steps = len(self.steps)
        nn = nn_lp if nn_lp is not None else np.zeros(n_steps)
        ng = np.zeros(n_steps)
        ng_next: list[object] = [None] * n_steps
        if ngram is not None:
            for i, (n, wd) in enumerate(self.steps):
                if wd < 0:
                    ng[i] = ngram.score_eos(n.ng_state)
                else:
                    ng[i], ng_next[i] = ngram.score_word(n.ng_state, self.words_str[wd])
        lm = lm_score(w, nn, ng)
        for n in self.live:
            if np.isfinite(lat.final_graph[n.lat]):
                i = self.step_of[(n.idx, -1)]
                self.finals.append((n, lat.final_acoustic[n.lat], lat.final_graph[n.lat], nn[i], ng[i]))
            for e in self.out_arcs[n.lat]:
                t = int(lat.dst[e])
                if self.is_word[e]:
                    wd = int(lat.word[e])
                    i = self.step_of[(n.idx, wd)]
                    oov = self.oov[wd]
                    c = n.cost + self.first_pass[e] - lm[i] - w.word_penalty - w.oov_penalty * oov
                    hist = n.history + (wd,)
                    nn_ref = (new_obj, row0 + i) if new_obj is not None else None
                    ng_state = ng_next[i]
                    rec = (n, e, nn[i], ng[i], oov)
                else:
                    c = n.cost + self.first_pass[e]
                    hist, nn_ref, ng_state = n.history, n.nn_ref, n.ng_state
                    rec = (n, e, 0.0, 0.0, 0.0)
                key = self.r._key(hist)
                succ = self.nodes_at[t].get(key)
                if succ is None:
                    succ = _Node(lat=t, key=key, cost=c, nn_ref=nn_ref, ng_state=ng_state, history=hist)
                    self.nodes_at[t][key] = succ
                elif c < succ.cost:
                    succ.cost, succ.nn_ref, succ.ng_state, succ.history = c, nn_ref, ng_state, hist
                self.arcs.append((rec[0], succ, rec[1], rec[2], rec[3], rec[4]))
        self.live, self.steps, self.step_of = [], [], {}
        self.level += 1

    def state_refs(self) -> set[int]:
        return {nd.nn_ref[0] for d in self.nodes_at.values() for nd in d.values() if nd.nn_ref is not None}

    def result(self) -> ExpandedLattice:
        lat = self.lat
        if not self.finals:
            raise ConfigError(f"lattice {lat.name}: every path was pruned; widen --beam")
        arcs = [a for a in self.arcs if a[1].idx >= 0]  # drop arcs into pruned nodes
        st = self.stats
        st.expanded_states, st.expanded_arcs = len(self.all_nodes), len(arcs)
        st.seconds = time.perf_counter() - self.t0
        E = len(arcs)
        lat_arc = np.array([a[2] for a in arcs], dtype=np.int64).reshape(E)

        def col(k):
            return np.array([a[k] for a in arcs], dtype=np.float64).reshape(E)

        fin = self.finals
        return ExpandedLattice(
            name=lat.name,
            node_lat=np.array([n.lat for n in self.all_nodes], dtype=np.int64),
            src=np.array([a[0].idx for a in arcs], dtype=np.int64).reshape(E),
            dst=np.array([a[1].idx for a in arcs], dtype=np.int64).reshape(E),
            word=lat.word[lat_arc].astype(np.int64), acoustic=lat.acoustic[lat_arc], graph=lat.graph[lat_arc],
            nn=col(3), ng=col(4), is_word=self.is_word[lat_arc].astype(np.float64), oov=col(5),
            final_node=np.array([f[0].idx for f in fin], dtype=np.int64),
            final_acoustic=np.array([f[1] for f in fin], dtype=np.float64),
            final_graph=np.array([f[2] for f in fin], dtype=np.float64),
            final_nn=np.array([f[3] for f in fin], dtype=np.float64),
            final_ng=np.array([f[4] for f in fin], dtype=np.float64),
            symbols=lat.symbols, stats=st, source=lat)


class LatticeRescorer:
    """Expands lattices with a neural LM and/or an n-gram under given weights.

    `expand_many` advances up to `cfg.batch_lattices` lattices together, level by
    level, so each LM call carries the steps of all of them: one lattice level alone
    holds too few steps to keep a CPU's caches or a GPU busy.
    """

    def __init__(self, weights: Weights, model=None, vocab: Vocabulary | None = None, ngram: NgramLM | None = None,
                 config: ExpandConfig | None = None, device: str | torch.device = "cpu"):
        if model is None and ngram is None:
            raise ConfigError("lattice rescoring needs a neural LM, an n-gram, or both")
        if model is not None and vocab is None:
            raise ConfigError("a neural LM needs its vocabulary")
        self.w, self.model, self.vocab, self.ngram = weights, model, vocab, ngram
        self.cfg = config or ExpandConfig()
        self.device = torch.device(device)
        self.lm_calls = 0

    def _key(self, history: tuple) -> tuple:
        n = self.cfg.max_ngram_order
        if n is None:
            return history
        return history[-(n - 1):] if n > 1 else ()  # the whole history while it is shorter than n - 1

    def expand(self, lat: Lattice) -> ExpandedLattice:
        return next(iter(self.expand_many([lat])))[1]

    @torch.no_grad()
    def expand_many(self, lats, on_error=None, should_stop=None, pause: bool = False):
        """Yield (index, ExpandedLattice) as lattices finish (not in input order).
        `lats` may be an iterable of Lattice or of callables returning one; a
        SmallstateError from preparing one is passed to `on_error(index, error)`
        (raised when no handler is given) and that lattice is skipped.

        `should_stop(index) -> bool` is asked before a lattice starts and between levels:
        True drops it (nothing is yielded for it) and frees its states, so a server stops
        the work of a request that was cancelled or timed out. With `pause`, None is also
        yielded after every level: a caller may stop there, do other work, and resume."""
        objs: dict[int, object] = {}
        next_obj = 0
        if self.model is not None:
            objs[0] = self.model.initial_state(1, self.device)
            next_obj = 1
        source = iter(enumerate(lats))
        active: list[tuple[int, _Expansion]] = []
        exhausted = False
        while True:
            while not exhausted and len(active) < self.cfg.lattices_per_batch(self.model is not None):
                try:
                    i, item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                if should_stop is not None and should_stop(i):
                    continue
                try:
                    x = _Expansion(self, item() if callable(item) else item)
                except SmallstateError as e:
                    if on_error is None:
                        raise
                    on_error(i, e)
                    continue
                x.start((0, 0) if self.model is not None else None)
                active.append((i, x))
            if not active:
                return
            requests = [(i, x, x.prepare_level()) for i, x in active]
            total = sum(len(r) for _, _, r in requests)
            lp, new_obj = None, None
            if total:
                refs = [ref for _, _, r in requests for ref, _ in r]
                tokens = torch.tensor([[tok] for _, _, r in requests for _, tok in r], dtype=torch.long,
                                      device=self.device)
                logp, new_state = self.model.score(tokens, self._gather(refs, objs))
                lp = logp[:, 0].double().cpu().numpy()
                new_obj, next_obj = next_obj, next_obj + 1
                objs[new_obj] = new_state.compact()
                self.lm_calls += 1
            live_bytes = sum(o.nbytes for o in objs.values())
            row0 = 0
            still = []
            for i, x, r in requests:
                n = len(r)
                if n:
                    x.stats.lm_calls += 1
                    x.stats.lm_rows += n
                x.stats.peak_state_bytes = max(x.stats.peak_state_bytes, live_bytes)
                x.finish_level(lp[row0: row0 + n] if n else None, new_obj if n else None, row0)
                row0 += n
                if x.done:
                    try:
                        yield i, x.result()
                    except SmallstateError as e:
                        if on_error is None:
                            raise
                        on_error(i, e)
                elif should_stop is None or not should_stop(i):
                    still.append((i, x))
            active = still
            if self.model is not None:
                refs_live = {0} | {o for _, x in active for o in x.state_refs()}
                for k in list(objs):
                    if k not in refs_live:
                        del objs[k]
            if pause:
                yield None

    def _gather(self, refs: list[tuple], objs: dict[int, object]):
        """One state with row i = refs[i] = (object, row), across state objects."""
        src: dict[int, list[int]] = defaultdict(list)
        dst: dict[int, list[int]] = defaultdict(list)
        for i, (o, r) in enumerate(refs):
            src[o].append(r)
            dst[o].append(i)
        if len(src) == 1:
            (o, rows), = src.items()
            if rows == list(range(objs[o].batch_size)):
                return objs[o]
        pieces = [(objs[o], torch.as_tensor(src[o], device=self.device), torch.as_tensor(dst[o], device=self.device))
                  for o in src]
        return type(pieces[0][0]).assemble(pieces, len(refs)).compact()


def reference_nbest(self, w: Weights, n: int = 1) -> list[dict]:
    """`ExpandedLattice.nbest` as it was before the lazy k-best (lattices/kbest.py): up to n partial
    word sequences per node; `self` is an ExpandedLattice."""
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
