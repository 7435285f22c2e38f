"""The level engine of lattice expansion: the lattices in flight laid end to end (`Frontier`), so that one level
of every one of them is merged, pruned, numbered and stepped by the same array operations, and what a run keeps
from step to step (`Run`): the paths waiting for a later level and the records its results are built from.

An expanded state is (lattice state, LM history key). Within each lattice the result is what a dict of its
states, updated arc by arc, would give: paths merged by (state, history key) keeping the best cost (ties to the
first arrival), states of a lattice state ordered by cost (ties by first arrival), capped, beam-pruned against
the best estimate of their own lattice, numbered in that order. The engine never calls an LM: it lists the
steps a level needs (`Queries`) and takes their scores back (`Scores`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ...vocab import EOS_ID
from ...weights import Weights, lm_score
from ..lattices.graph import concat_ranges, run_index, segments, sort_groups
from .expanded import ExpandedLattice
from .prepare import Arrays, EndToEnd, LatticeJob, Prepared


def merge_keys(lat_s: np.ndarray, key: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, ...]:
    """Paths merged by (lattice state, key): (each path's merged state, each merged state's best path (the
    lowest cost, the first of equal ones), its first path). Merged states may come in any order: what
    follows orders them by their own values."""
    order, starts = sort_groups((lat_s, key), (cost,))
    member = np.empty(len(order), dtype=np.int64)
    member[order] = segments(starts, len(order))
    return member, order[starts], np.minimum.reduceat(order, starts)


@dataclass
class Paths(Arrays):
    """Paths on their way to a lattice state, one per row, in arrival order."""

    run: np.ndarray  # the number of their lattice in the input
    state: np.ndarray  # the lattice state they reach (the lattice's own id)
    key: np.ndarray  # their history key id (`LmCache`)
    obj: np.ndarray  # the LM state object that holds their neural state (-1: no neural LM)
    row: np.ndarray  # their row in it
    ng: np.ndarray  # their n-gram state id (-1: no n-gram)
    arrival: np.ndarray  # their arrival id: the node they become is known once their level is merged
    cost: np.ndarray  # their cost so far (combined score, lower is better)


# What a step records of the expanded graph, one structured row per arc or final node: a finished lattice's
# rows are one slice of each step's record, so a row's fields travel together.
ARC_ROW = np.dtype([
    ("src_node", np.int64),  # the node the arc leaves
    ("arrival", np.int64),  # the arrival id of the path it carries (its node once known)
    ("lat_arc", np.int64),  # the lattice arc it expands
    ("nn", np.float64),  # natural-log neural prob of the arc's word, 0 on epsilon
    ("ng", np.float64),  # natural-log n-gram prob
    ("oov", np.float64),  # 1.0 where the word is outside the LMs' vocabulary
])
FINAL_ROW = np.dtype([
    ("node", np.int64),  # a node that ends a path
    ("acoustic", np.float64),  # its lattice state's final acoustic cost
    ("graph", np.float64),  # its final graph cost
    ("nn", np.float64),  # natural-log neural prob of </s>
    ("ng", np.float64),  # natural-log n-gram prob of </s>
])


def structured(dtype: np.dtype, **columns: np.ndarray) -> np.ndarray:
    """Rows of `dtype` from one array per field."""
    out = np.empty(len(columns[dtype.names[0]]), dtype=dtype)
    for name in dtype.names:
        out[name] = columns[name]
    return out


def concat_rows(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """`np.concatenate` of structured rows of one dtype (none: no rows), done on them as opaque bytes: numpy
    would promote the dtypes field by field in Python, which costs more than the copy."""
    raw = np.dtype((np.void, dtype.itemsize))
    return np.concatenate([p.view(raw) for p in parts]).view(dtype) if parts else np.zeros(0, dtype=dtype)


def columns(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Each field of structured rows copied out on its own: the searches want contiguous arrays, and a result
    kept for long should not hold the rows it no longer needs."""
    return {k: np.ascontiguousarray(rows[k]) for k in rows.dtype.names}


@dataclass
class Record:
    """What one step of a run produced, rows sorted by run number, indexed by it (`run_index`)."""

    nodes: dict[int, slice]
    node_lat: np.ndarray  # kept lattice states, in node order
    arcs: dict[int, slice]
    arc: np.ndarray  # ARC_ROW
    finals: dict[int, slice]
    final: np.ndarray  # FINAL_ROW

    @classmethod
    def empty(cls) -> Record:
        return cls({}, np.zeros(0, dtype=np.int64), {}, np.zeros(0, dtype=ARC_ROW), {}, np.zeros(0, dtype=FINAL_ROW))


class Run:
    """What an expansion run keeps across steps, whichever lattices are in flight: the paths waiting for a
    later step (`Paths` chunks by step, in arrival order), the node each arrival became (by arrival id), and
    each step's records until the lattices that wrote them are done."""

    def __init__(self):
        self.pending: dict[int, list[Paths]] = {}
        self.records: dict[int, Record] = {}
        self.n_arrivals = 0
        self._node_base = 0
        self._nodes = np.full(1024, -1, dtype=np.int64)

    def add(self, step: int, paths: Paths) -> None:
        self.pending.setdefault(step, []).append(paths)

    def queue(self, target: np.ndarray, paths: Paths) -> None:
        """Paths to wait for the steps `target` (one per path); each step's keep their order."""
        if not len(target):
            return
        if target.min() == target.max():
            self.add(int(target[0]), paths)
            return
        order = np.argsort(target, kind="stable")
        t_sorted = target[order]
        cut = np.flatnonzero(t_sorted[1:] != t_sorted[:-1]) + 1
        for a, e in zip(np.append(0, cut).tolist(), np.append(cut, len(order)).tolist()):
            self.add(int(t_sorted[a]), paths.take(order[a:e]))

    def take(self, step: int) -> Paths | None:
        chunks = self.pending.pop(step, None)
        if not chunks:
            return None
        return chunks[0] if len(chunks) == 1 else Paths.concat(chunks)

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
        refs = {o for chunks in self.pending.values() for p in chunks for o in np.unique(p.obj).tolist()}
        refs.discard(-1)
        return refs

    def result(self, job: LatticeJob, am_scale: float) -> ExpandedLattice:
        """A finished lattice's expanded graph, from the records of its steps."""
        lat = job.lat
        recs = [self.records[s] for s in range(job.start_step, job.last_step + 1)]
        finals = [rec.final[sl] for rec in recs if (sl := rec.finals.get(job.run)) is not None]
        if not finals:
            raise ConfigError(f"lattice {lat.name}: every path was pruned; widen --beam")
        arc_rows = concat_rows([rec.arc[sl] for rec in recs if (sl := rec.arcs.get(job.run)) is not None], ARC_ROW)
        dst = self.node_of_arrival(arc_rows["arrival"])
        arc_rows, dst = arc_rows[dst >= 0], dst[dst >= 0]  # arcs into pruned states go
        node_lat = np.concatenate([rec.node_lat[sl] for rec in recs if (sl := rec.nodes.get(job.run)) is not None]
                                  or [np.zeros(0, dtype=np.int64)])
        st = job.stats
        st.expanded_states, st.expanded_arcs = len(node_lat), len(arc_rows)
        st.seconds = time.perf_counter() - job.t0
        a, fin = columns(arc_rows), columns(concat_rows(finals, FINAL_ROW))
        lat_arc = a["lat_arc"]
        return ExpandedLattice(
            name=lat.name, node_lat=node_lat, src=a["src_node"], dst=dst, word=lat.word[lat_arc].astype(np.int64),
            acoustic=lat.acoustic[lat_arc], graph=lat.graph[lat_arc], nn=a["nn"], ng=a["ng"],
            is_word=job.prep.is_word[lat_arc].astype(np.float64), oov=a["oov"], final_node=fin["node"],
            final_acoustic=fin["acoustic"], final_graph=fin["graph"], final_nn=fin["nn"], final_ng=fin["ng"],
            symbols=lat.symbols, stats=st, source=lat, arc=lat_arc, node_level=job.prep.level[node_lat],
            first_pass=None if job.first_pass_words is None else (am_scale, job.first_pass_words))


@dataclass
class Live:
    """The expanded states a level kept, in node order within each lattice (lattice by lattice)."""

    idx: np.ndarray  # node number within its lattice's expanded graph
    lat: np.ndarray  # lattice state (global id in the frontier)
    owner: np.ndarray  # the frontier slot of its lattice
    key: np.ndarray  # the rest as in `Paths`, of the best path into the state
    cost: np.ndarray
    obj: np.ndarray
    row: np.ndarray
    ng: np.ndarray


@dataclass
class Steps:
    """How a level's LM steps and out-arcs line up: steps are one per distinct (state, word) of the out-arcs,
    then one for </s> where the state is final; each out-arc reads its word's step."""

    node: np.ndarray  # (n,) the live state (position in `Live`) each step extends
    arc_of_step: np.ndarray  # (n,) the first out-arc with the step's word; -1 for </s>
    arc: np.ndarray  # (m,) the live states' out-arcs (global arc ids)
    arc_node: np.ndarray  # (m,) the live state each leaves
    arc_step: np.ndarray  # (m,) the step of its word; -1 on epsilon arcs
    final: np.ndarray  # (f,) the live states that are final
    final_step: np.ndarray  # (f,) their </s> step


@dataclass
class Queries:
    """The LM steps one level needs, one row each (n rows), for the LMs to answer."""

    obj: np.ndarray  # the LM state object of the history
    row: np.ndarray  # its row there
    token: np.ndarray  # the neural LM's token id (EOS_ID for </s>)
    ng: np.ndarray  # the history's n-gram state id
    key: np.ndarray  # the history's key id
    word: np.ndarray  # the decoder's symbol id of the word, -1 for </s>
    gword: np.ndarray  # its `LmCache.word_id`, -1 for </s>
    run: np.ndarray  # the number of the step's lattice in the input
    per_lattice: np.ndarray  # (K,) the steps of each frontier slot

    @classmethod
    def empty(cls, n_lattices: int) -> Queries:
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none, none, none, none, none, none, np.zeros(n_lattices, dtype=np.int64))


@dataclass
class Scores:
    """The LMs' answers to `Queries`, one row each."""

    nn: np.ndarray  # natural-log neural prob of the word (0 without a neural LM)
    ng: np.ndarray  # natural-log n-gram prob (0 without an n-gram)
    ng_next: np.ndarray  # the n-gram state id after the word
    key_next: np.ndarray  # the history key id after the word
    obj: np.ndarray  # the LM state object holding the neural state after the word (-1: none)
    row: np.ndarray  # its row there


@dataclass
class LevelBudget:
    """The neural LM state bytes one level of one lattice may create (`ExpandConfig.max_level_bytes`)."""

    max_bytes: int
    per_position: int  # bytes of one row's state per history position
    per_row: int  # bytes of one row's state however long its history


class Frontier:
    """The lattices in flight (`LatticeJob`s, increasing run numbers) laid end to end, one level of all of them
    at a time: `prepare` merges and prunes what arrived and lists the LM steps, `finish` takes their scores,
    records the level and passes the paths on. Per-lattice counts live here as arrays while the frontier
    stands, and are written back to the jobs by `sync`."""

    def __init__(self, jobs: list[LatticeJob], run: Run, w: Weights, budget: LevelBudget | None):
        self.jobs, self.run, self.w, self.budget = jobs, run, w, budget
        self.laid = e = EndToEnd([j.lat for j in jobs])
        self.prep = Prepared.concat([j.prep for j in jobs])
        self.arc_owner = e.owner_of_arcs()
        self.runs = np.array([j.run for j in jobs], dtype=np.int64)  # increasing
        self.start_step = np.array([j.start_step for j in jobs], dtype=np.int64)
        self.context_positions = np.array([j.context_positions for j in jobs], dtype=np.int64)
        self.last_step = np.array([j.last_step for j in jobs], dtype=np.int64)
        self.out_start = e.out_start
        self.local_state = np.arange(e.total_states) - np.repeat(e.state_offset, e.num_states)
        self.local_arc = np.arange(int(e.num_arcs.sum())) - np.repeat(e.arc_offset, e.num_arcs)
        self.n_words = int(e.word.max()) + 2 if len(e.word) else 1
        self.n_nodes = np.array([j.n_nodes for j in jobs], dtype=np.int64)
        self.cap = np.array([j.per_state_cap for j in jobs], dtype=np.int64)
        self.beams = np.array([j.beam for j in jobs], dtype=np.float64)
        self.harder = np.array([j.stats.pruned_harder for j in jobs], dtype=bool)
        self.cut = np.zeros(len(jobs), dtype=bool)  # a level lost states to max_level_bytes
        self.lm_calls = np.array([j.stats.lm_calls for j in jobs], dtype=np.int64)
        self.lm_rows = np.array([j.stats.lm_rows for j in jobs], dtype=np.int64)
        self.peak = np.array([j.stats.peak_state_bytes for j in jobs], dtype=np.int64)
        self.alive = np.ones(len(jobs), dtype=bool)
        self.live: Live | None = None  # between prepare and finish
        self.steps: Steps | None = None

    def retire(self, done: np.ndarray, stopped_runs: list[int]) -> None:
        """Lattices that finished (slots `done`) or were stopped leave: their counts are written back."""
        self.sync(done)
        self.alive[done] = False
        if stopped_runs:
            self.alive[np.isin(self.runs, stopped_runs)] = False

    def sync(self, slots: np.ndarray | None = None) -> None:
        """Write the per-lattice counts back to the jobs (all, or those of `slots`)."""
        for k in range(len(self.jobs)) if slots is None else slots.tolist():
            j = self.jobs[k]
            j.n_nodes, j.per_state_cap, j.beam = int(self.n_nodes[k]), int(self.cap[k]), float(self.beams[k])
            st = j.stats
            st.pruned_harder, st.lm_calls = bool(self.harder[k] or self.cut[k]), int(self.lm_calls[k])
            st.lm_rows = int(self.lm_rows[k])
            st.peak_state_bytes = int(self.peak[k])

    def count_level(self, per_lattice: np.ndarray, called: bool, live_bytes: int) -> None:
        if called:
            self.lm_calls += per_lattice > 0
            self.lm_rows += per_lattice
        self.peak = np.maximum(self.peak, live_bytes)

    def _arrivals(self, step: int) -> tuple[np.ndarray, np.ndarray, Paths] | None:
        """The paths waiting for this step, of lattices still in flight, in arrival order: (their slots,
        their lattice states as global ids, the paths)."""
        paths = self.run.take(step)
        if paths is None:
            return None
        slot = np.minimum(np.searchsorted(self.runs, paths.run), len(self.runs) - 1)
        here = (self.runs[slot] == paths.run) & self.alive[slot]  # a lattice stopped since they were queued: dropped
        if not here.all():
            slot, paths = slot[here], paths.take(here)
        return slot, self.laid.state_offset[slot] + paths.state, paths

    def _merge_and_prune(self, step: int, max_states: int) -> Live | None:
        got = self._arrivals(step)
        if got is None or len(got[0]) == 0:
            return None
        owner, lat_s, p = got
        member, winner, first_arrival = merge_keys(lat_s, p.key, p.cost)
        m_lat, m_cost, m_owner = lat_s[winner], p.cost[winner], owner[winner]
        kept = self._prune(step, m_lat, m_cost, m_owner, first_arrival)
        kb = m_owner[kept]
        per_lattice = np.bincount(kb, minlength=len(self.jobs))
        idx = concat_ranges(self.n_nodes, per_lattice)  # numbered on per lattice
        self.n_nodes += per_lattice
        over = (self.n_nodes > max_states) & ~self.harder
        if over.any():  # from the next level on
            self.harder |= over
            self.cap[over] = np.maximum(1, self.cap[over] // 4)
            self.beams[over] /= 2
        node_of = np.full(len(winner), -1, dtype=np.int64)
        node_of[kept] = idx
        self.run.set_nodes(p.arrival, node_of[member])
        w_kept = winner[kept]
        return Live(idx=idx, lat=m_lat[kept], owner=kb, key=p.key[w_kept], cost=m_cost[kept], obj=p.obj[w_kept],
                    row=p.row[w_kept], ng=p.ng[w_kept])

    def _prune(self, step: int, m_lat: np.ndarray, m_cost: np.ndarray, m_owner: np.ndarray,
               first_arrival: np.ndarray) -> np.ndarray:
        """Which merged states a level keeps, lattice by lattice (global state order): the best `cap` of each
        lattice state, those within the beam of their lattice's best estimate, and within the level budget."""
        rank_order, state_starts = sort_groups((m_lat,), (m_cost, first_arrival))
        rank = np.arange(len(rank_order)) - state_starts[segments(state_starts, len(rank_order))]
        kept = rank_order[rank < self.cap[m_owner[rank_order]]]
        kb = m_owner[kept]
        est = m_cost[kept] + self.prep.beta[m_lat[kept]]
        if len(kept):
            seg = np.flatnonzero(np.concatenate([[True], kb[1:] != kb[:-1]]))
            best = np.minimum.reduceat(est, seg)[segments(seg, len(kept))]
            sel = est <= best + self.beams[kb]
            kept, kb, est = kept[sel], kb[sel], est[sel]
        if len(kept) and self.budget is not None:
            keep = self._within_level_bytes(step, m_lat[kept], kb, est)
            if keep is not None:
                kept = kept[keep]
        return kept

    def _within_level_bytes(self, step: int, lat_s: np.ndarray, owner: np.ndarray,
                            est: np.ndarray) -> np.ndarray | None:
        """Which of a level's states (global lattice state, owner slot, cost estimate; grouped by owner) to
        keep so that no lattice's level creates more LM state than the budget: a state's steps are
        bounded by its out-arcs plus its </s>, each holding the history's positions; over the budget, a
        lattice keeps its best states (at least one), and its stats say it was pruned harder. None: all fit."""
        b = self.budget
        rows = self.out_start[lat_s + 1] - self.out_start[lat_s] + np.isfinite(self.laid.final_graph[lat_s])
        # levels bound the words of a history; + <s>, + the step, + what the lattice was read after
        positions = step - self.start_step[owner] + 2 + self.context_positions[owner]
        nbytes = rows * (positions * b.per_position + b.per_row)
        per_lattice = np.bincount(owner, weights=nbytes, minlength=len(self.jobs))
        over = np.flatnonzero(per_lattice > b.max_bytes)
        if not len(over):
            return None
        keep = np.ones(len(lat_s), dtype=bool)
        for k in over.tolist():
            at = np.flatnonzero(owner == k)
            order = at[np.argsort(est[at], kind="stable")]
            fits = np.cumsum(nbytes[order]) <= b.max_bytes
            fits[0] = True
            keep[order[~fits]] = False
            self.cut[k] = True
        return keep

    def prepare(self, step: int, max_states: int) -> Queries:
        """Prune every lattice's level and list the LM steps it needs."""
        live = self.live = self._merge_and_prune(step, max_states)
        if live is None:
            self.steps = None
            return Queries.empty(len(self.jobs))
        steps = self.steps = self._line_up(live)
        is_eos = steps.arc_of_step < 0
        safe = np.where(is_eos, 0, steps.arc_of_step)

        def of_word(per_arc: np.ndarray, eos: int) -> np.ndarray:  # lattices without arcs: </s> steps only
            return np.where(is_eos, eos, per_arc[safe]) if len(per_arc) else np.full(len(is_eos), eos)

        owner = live.owner[steps.node]
        return Queries(obj=live.obj[steps.node], row=live.row[steps.node], token=of_word(self.prep.lm_token, EOS_ID),
                       ng=live.ng[steps.node], key=live.key[steps.node], word=of_word(self.laid.word, -1),
                       gword=of_word(self.prep.word_id, -1), run=self.runs[owner],
                       per_lattice=np.bincount(owner, minlength=len(self.jobs)))

    def _line_up(self, live: Live) -> Steps:
        """The level's steps and out-arcs (`Steps`); steps are ordered by live state, a state's words in
        the order of its out-arcs, its </s> last."""
        counts = self.out_start[live.lat + 1] - self.out_start[live.lat]
        arc = concat_ranges(self.out_start[live.lat], counts)
        node = np.repeat(np.arange(len(counts)), counts)  # position among the live states
        is_word = self.prep.is_word[arc]
        pair = np.where(is_word, node * self.n_words + self.laid.word[arc], -1 - np.arange(len(arc)))
        uniq, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
        word_step = first[uniq >= 0]  # out-arc position of each distinct (state, word)
        final = np.flatnonzero(np.isfinite(self.laid.final_graph[live.lat]))
        # </s> goes after the state's word steps: its sort position is past every out-arc of the level
        step_node = np.concatenate([node[word_step], final])
        step_order = np.lexsort((np.concatenate([word_step, np.full(len(final), len(arc))]), step_node))
        step_of_pos = np.empty(len(step_order), dtype=np.int64)
        step_of_pos[step_order] = np.arange(len(step_order))
        n_fill = int((uniq < 0).sum())  # np.unique sorted the per-arc fillers of epsilon arcs first
        arc_step = (np.where(is_word, step_of_pos[np.clip(inverse - n_fill, 0, None)], -1) if len(word_step)
                    else np.full(len(arc), -1, dtype=np.int64))
        return Steps(node=step_node[step_order],
                     arc_of_step=np.concatenate([arc[word_step], np.full(len(final), -1)])[step_order],
                     arc=arc, arc_node=node, arc_step=arc_step, final=final,
                     final_step=step_of_pos[len(word_step) + np.arange(len(final))])

    def finish(self, step: int, s: Scores) -> None:
        """Take the level's scores, record the level and pass the paths on to later steps."""
        live, steps = self.live, self.steps
        self.live, self.steps = None, None
        if live is None:
            self.run.records[step] = Record.empty()
            return
        w = self.w
        arc, node = steps.arc, steps.arc_node
        word_arc = steps.arc_step >= 0
        j = np.where(word_arc, steps.arc_step, len(steps.node))  # epsilon arcs: a padding row (there may be no steps)
        nn, ng, lm = (np.append(a, 0.0) for a in (s.nn, s.ng, lm_score(w, s.nn, s.ng)))
        key_next, ng_next, new_obj, new_row = (np.append(a, -1) for a in (s.key_next, s.ng_next, s.obj, s.row))
        oov = np.where(word_arc, self.prep.oov[arc], 0.0)
        cost = np.where(word_arc, live.cost[node] + self.prep.first_pass[arc] - lm[j] - w.word_penalty
                        - w.oov_penalty * oov, live.cost[node] + self.prep.first_pass[arc])
        owner = self.arc_owner[arc]

        def carry(after: np.ndarray, before: np.ndarray) -> np.ndarray:  # a word arc moves the history on
            return np.where(word_arc, after[j], before[node])

        dst = self.laid.dst[arc]
        paths = Paths(run=self.runs[owner], state=self.local_state[dst], key=carry(key_next, live.key),
                      obj=carry(new_obj, live.obj), row=carry(new_row, live.row), ng=carry(ng_next, live.ng),
                      arrival=self.run.arrivals(len(arc)), cost=cost)
        self.run.queue(self.start_step[owner] + self.prep.level[dst], paths)
        fin = steps.final
        fl = live.lat[fin]
        self.run.records[step] = Record(
            nodes=run_index(self.runs[live.owner]), node_lat=self.local_state[live.lat],
            arcs=run_index(paths.run),
            arc=structured(ARC_ROW, src_node=live.idx[node], arrival=paths.arrival, lat_arc=self.local_arc[arc],
                           nn=np.where(word_arc, nn[j], 0.0), ng=np.where(word_arc, ng[j], 0.0), oov=oov),
            finals=run_index(self.runs[live.owner[fin]]),
            final=structured(FINAL_ROW, node=live.idx[fin], acoustic=self.laid.final_acoustic[fl],
                             graph=self.laid.final_graph[fl], nn=nn[steps.final_step], ng=ng[steps.final_step]))
