"""Lattices made ready for expansion: each lattice's job (`LatticeJob`), and the arrays its expansion reads
(`Prepared`: levels, best completion costs, word ids, first-pass costs), computed for many lattices at once on
the lattices laid end to end (`EndToEnd`), since per-lattice numpy calls are what made expansion slow."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...subword import WordTable
from ...vocab import Vocabulary
from ...weights import Weights, count_oov, oov_reference
from ..lattices.graph import backtrack, completion_costs, sort_groups, state_levels, viterbi
from ..lattices.lattice import Lattice
from .expanded import ExpandStats
from .lm_cache import LmCache


class Arrays:
    """A dataclass of numpy arrays: its fields taken or concatenated together, by name."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)

    def take(self, index):
        return type(self)(*(getattr(self, k)[index] for k in self.names()))

    @classmethod
    def concat(cls, parts: list):
        """One of each field, the parts' rows in order (always a copy: results must not hold a step's arrays)."""
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in cls.names()))


class _Laid:
    """One `Lattice` array of every lattice, laid end to end (state ids offset by each lattice's first state),
    concatenated when first read: a frontier, rebuilt whenever lattices join, reads only some of them."""

    def __init__(self, state_ids: bool = False, dtype: type | None = None):
        self.state_ids, self.dtype = state_ids, dtype

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, e: EndToEnd | None, owner=None):
        if e is None:
            return self
        parts = [getattr(lat, self.name) for lat in e.lats]
        if self.state_ids:
            parts = [p + o for p, o in zip(parts, e.state_offset)]
        value = np.concatenate(parts) if self.dtype is None else np.concatenate(parts).astype(self.dtype)
        e.__dict__[self.name] = value  # later reads find it on the instance
        return value


class EndToEnd:
    """Prepared lattices (`Lattice.prepare`) laid end to end, their state ids offset, so that one array operation
    serves all of them."""

    src = _Laid(state_ids=True)  # (A,) sorted, as each prepared lattice's arcs are
    dst = _Laid(state_ids=True)
    word = _Laid(dtype=np.int64)
    acoustic = _Laid()
    graph = _Laid()
    final_acoustic = _Laid()  # (S,)
    final_graph = _Laid()

    def __init__(self, lats: list[Lattice]):
        self.lats = lats
        self.num_states = np.array([lat.num_states for lat in lats], dtype=np.int64)  # (K,)
        self.num_arcs = np.array([len(lat.src) for lat in lats], dtype=np.int64)  # (K,)
        self.state_offset = np.cumsum(self.num_states) - self.num_states  # (K,) id of each lattice's first state
        self.arc_offset = np.cumsum(self.num_arcs) - self.num_arcs  # (K,) and of its first arc

    @cached_property
    def out_start(self) -> np.ndarray:
        """(S + 1,) the first out-arc of each state (and the number of arcs last)."""
        out = np.zeros(self.total_states + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.src, minlength=self.total_states), out=out[1:])
        return out

    @property
    def total_states(self) -> int:
        return int(self.num_states.sum())

    def owner_of_states(self) -> np.ndarray:
        """(S,) the lattice of each state."""
        return np.repeat(np.arange(len(self.num_states)), self.num_states)

    def owner_of_arcs(self) -> np.ndarray:
        """(A,) the lattice of each arc."""
        return np.repeat(np.arange(len(self.num_arcs)), self.num_arcs)

    def split(self, per_state: list[np.ndarray], per_arc: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Arrays over all states and over all arcs cut into each lattice's pieces: [lattice][array]."""
        state_cut, arc_cut = np.cumsum(self.num_states)[:-1], np.cumsum(self.num_arcs)[:-1]
        pieces = [np.split(a, state_cut) for a in per_state] + [np.split(a, arc_cut) for a in per_arc]
        return [list(p) for p in zip(*pieces)]


@dataclass
class Prepared(Arrays):
    """One lattice's arrays for its expansion under the rescorer's weights (local ids)."""

    level: np.ndarray  # (S,) longest-path depth: the level is expanded at the job's start step + level
    beta: np.ndarray  # (S,) best completion cost by the first-pass scores, the beam's look-ahead
    is_word: np.ndarray  # (A,) bool: the arc's label is a word (not epsilon, not a marker)
    lm_token: np.ndarray  # (A,) its neural LM token id (0 on non-word arcs)
    oov: np.ndarray  # (A,) 1.0 where the word is outside the LMs' vocabulary
    word_id: np.ndarray  # (A,) its `LmCache.word_id`, -1 on non-word arcs
    first_pass: np.ndarray  # (A,) am_scale * acoustic + graph_scale * graph


class LatticeJob:
    """One lattice of an expansion run: its prepared arrays, the step of the run at which it started (level L
    of it is expanded at step start_step + L), its pruning limits and counts."""

    def __init__(self, lat: Lattice, run: int, per_state_cap: int, beam: float):
        self.t0 = time.perf_counter()
        self.run = run  # its number in the input: the frontier keeps lattices in that order
        self.lat = lat = lat.prepare()
        self.stats = ExpandStats(lattice_states=lat.num_states, lattice_arcs=len(lat.src))
        self.start_step = 0
        self.first_arrival = 0
        self.n_nodes = 0
        self.per_state_cap, self.beam = per_state_cap, beam
        self.prep: Prepared | None = None  # set by prepare_group
        self.n_levels = 0
        self.first_pass_words: list[str] | None = None
        self.context_positions = 0  # neural LM state positions its start holds beyond <s> (`LmStart`)

    @property
    def last_step(self) -> int:
        return self.start_step + self.n_levels - 1


def prepare_group(jobs: list[LatticeJob], w: Weights, vocab: Vocabulary | None, cache: LmCache,
                  first_pass_words: bool = True, words: WordTable | None = None) -> None:
    """Set the arrays of lattices joining a run, and (with `first_pass_words`) the decoder's own best path of
    each. `words`: a subword LM's table of words (their LM tokens are its indices)."""
    if not jobs:
        return
    lats = [j.lat for j in jobs]
    e = EndToEnd(lats)
    level = state_levels(e.total_states, e.src, e.dst)
    lm_scale = w.graph_scale + w.lm_weight + w.ngram_weight
    beta = completion_costs(e.src, e.dst, w.am_scale * e.acoustic + lm_scale * e.graph,
                            w.am_scale * e.final_acoustic + lm_scale * e.final_graph, level)
    arrays = _word_arrays(lats, e, vocab, cache, words)
    first_pass = w.am_scale * e.acoustic + w.graph_scale * e.graph
    fp_words = [None] * len(lats)
    if first_pass_words:
        fp_words = _first_pass_words(lats, e, e.graph + w.am_scale * e.acoustic,
                                     np.where(np.isfinite(e.final_graph),
                                              e.final_graph + w.am_scale * e.final_acoustic, np.inf), level)
    for job, split, words_of in zip(jobs, e.split([level, beta], [*arrays, first_pass]), fp_words):
        job.prep = Prepared(*split)
        job.n_levels = int(job.prep.level.max()) + 1
        job.first_pass_words = words_of


def _word_arrays(lats: list[Lattice], e: EndToEnd, vocab: Vocabulary | None, cache: LmCache,
                 words: WordTable | None = None) -> tuple[np.ndarray, ...]:
    """Per arc of the lattices laid end to end: is it a word, its LM token id (a subword LM's: the word's index in
    `words`), its OOV count, and its `word_id`; each distinct word id of each symbol table is looked up once."""
    word = e.word
    is_word = np.zeros(len(word), dtype=bool)
    arc_lm = np.zeros(len(word), dtype=np.int64)
    arc_oov = np.zeros(len(word), dtype=np.float64)
    arc_gword = np.full(len(word), -1, dtype=np.int64)
    table = e.owner_of_arcs()
    tables: dict[int, list[int]] = {}
    for k, lat in enumerate(lats):
        tables.setdefault(id(lat.symbols), []).append(k)
    known = oov_reference(vocab, cache.ngram)
    for members in tables.values():
        sym = lats[members[0]].symbols
        rows = np.flatnonzero(np.isin(table, members)) if len(tables) > 1 else np.arange(len(word))
        ids, inverse = _distinct(word[rows])
        at = rows[sym.word_flags(ids)[inverse]]
        is_word[at] = True
        ids, inverse = _distinct(word[at])
        strings = [sym.word(i) for i in ids.tolist()]
        if words is not None:
            arc_lm[at] = np.array([words.index(ws) for ws in strings], dtype=np.int64)[inverse]
        elif vocab is not None:
            arc_lm[at] = np.array([vocab.encode([ws])[0] for ws in strings], dtype=np.int64)[inverse]
        arc_oov[at] = np.array([float(count_oov([ws], known)) for ws in strings])[inverse]
        arc_gword[at] = np.array([cache.word_id(ws) for ws in strings], dtype=np.int64)[inverse]
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


def _first_pass_words(lats: list[Lattice], e: EndToEnd, cost: np.ndarray, final: np.ndarray,
                      level: np.ndarray) -> list[list[str] | None]:
    """Each lattice's best path by `graph + am_scale * acoustic` (what `Lattice.best_path` gives),
    by one Viterbi search over the lattices laid end to end; None where a lattice has no finite path."""
    dist, back = viterbi(e.total_states, e.src, e.dst, cost, level, sources=e.state_offset)
    total = dist + final
    order, starts = sort_groups((e.owner_of_states(),), (total,))
    best = order[starts]  # the first state of each lattice with the lowest total
    out: list[list[str] | None] = [None] * len(lats)
    for k in np.flatnonzero(np.isfinite(total[best])).tolist():
        sym, path = lats[k].symbols, e.word[backtrack(back, e.src, int(best[k]))]
        out[k] = [sym.word(wd) for wd in path[sym.word_flags(path)].tolist()]
    return out
