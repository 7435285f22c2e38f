"""In-memory word lattices (numpy arrays) and decoder symbol tables; file formats are in formats/lattice_io.py.

Costs are negated natural logs (lower is better), kept as two separate components per arc:
- `graph`: -ln P_lm (plus the decoder's word insertion penalty, in LM units) -- Kaldi's "graph cost";
- `acoustic`: -ln acoustic likelihood, unscaled.
A path's total is `graph_scale * sum(graph) + am_scale * sum(acoustic)` over its arcs and its final state
(for the bundled PocketSphinx lattices: graph_scale 1, am_scale 1/9.5).
"""

from __future__ import annotations

import heapq
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import SmallstateError
from ...files import atomic_write_text, read_text
from .graph import backtrack, concat_ranges, state_levels, viterbi


class LatticeFormatError(SmallstateError):
    """A lattice or symbol table is malformed, or a lattice is unusable (cycle, no final state)."""


class LatticeWarning(UserWarning):
    """A lattice was repaired on the way in (states that lie on no complete path were dropped)."""


# Symbols that are not words: `<eps>`, `<s>`, `</s>`, `<sil>`, `#0`, `[NOISE]`, HTK's `!NULL` / `!SENT_END`.
# `<unk>` is the exception: it stands for a real (unknown) word and is counted and scored as one.
_NON_WORD_PREFIXES = ("#", "<", "[", "!")
_WORD_EXCEPTIONS = frozenset({"<unk>"})


def is_word_symbol(w: str) -> bool:
    return w in _WORD_EXCEPTIONS or not w.startswith(_NON_WORD_PREFIXES)


class SymbolTable:
    """Words <-> integer ids of a decoder's `words.txt` (`word id` per line; ids need not be contiguous).

    Id 0 is epsilon (`<eps>`). Reduced tables may keep the original, sparse ids of a larger table so that
    binary lattices written against the large table stay valid.
    """

    def __init__(self, pairs: list[tuple[str, int]], source: str = "<symbols>") -> None:
        if self._fill([w for w, _ in pairs], [i for _, i in pairs]):
            return  # the common case, checked in bulk; the loop below names the first problem
        self._id, self._word = {}, {}
        for w, i in pairs:
            if w in self._id:
                raise LatticeFormatError(f"{source}: word {w!r} appears twice (ids {self._id[w]} and {i})")
            if i in self._word:
                raise LatticeFormatError(f"{source}: id {i} is given to both {self._word[i]!r} and {w!r}")
            if i < 0:
                raise LatticeFormatError(f"{source}: id of {w!r} must be >= 0, got {i}")
            self._id[w] = i
            self._word[i] = w

    @classmethod
    def read(cls, path: str | os.PathLike) -> SymbolTable:
        """Read `word id` lines (spaces or tabs); errors name `file:line`."""
        path = Path(path)
        text = read_text(path, LatticeFormatError, "symbol table")
        tokens = text.split()
        n_lines = text.count("\n") + (not text.endswith("\n"))
        try:  # the common case in bulk (a vocabulary is tens of thousands of lines); the loop names problems
            if tokens and len(tokens) == 2 * n_lines:  # two fields on every line, no blank line
                table = cls._from_columns(tokens[0::2], list(map(int, tokens[1::2])))
                if table is not None:
                    return table
        except ValueError:
            pass
        lines = text.splitlines()
        pairs = []
        seen: dict[str, int] = {}
        seen_id: dict[int, int] = {}
        for n, line in enumerate(lines, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise LatticeFormatError(f"{path}:{n}: expected 'word id', got {line!r}")
            w, s = parts
            try:
                i = int(s)
            except ValueError:
                raise LatticeFormatError(f"{path}:{n}: id of {w!r} must be an integer, got {s!r}") from None
            if i < 0:
                raise LatticeFormatError(f"{path}:{n}: id of {w!r} must be >= 0, got {i}")
            if w in seen:
                raise LatticeFormatError(f"{path}:{n}: word {w!r} already defined on line {seen[w]}")
            if i in seen_id:
                raise LatticeFormatError(f"{path}:{n}: id {i} already used on line {seen_id[i]}")
            seen[w], seen_id[i] = n, n
            pairs.append((w, i))
        if not pairs:
            raise LatticeFormatError(f"{path}: symbol table is empty")
        return cls(pairs, str(path))

    @classmethod
    def _from_columns(cls, words: list[str], ids: list[int]) -> SymbolTable | None:
        """The table of words[i] <-> ids[i], built without pairs; None if a word or an id repeats or an id is
        negative (the caller then finds and names the problem)."""
        table = cls.__new__(cls)
        return table if table._fill(words, ids) else None

    def _fill(self, words: list[str], ids: list[int]) -> bool:
        """Both maps from the columns; False if a word or an id repeats or an id is negative."""
        self._id: dict[str, int] = dict(zip(words, ids))
        self._word: dict[int, str] = dict(zip(ids, words))
        self._mask: np.ndarray | None = None
        self._ids: np.ndarray | None = None
        return len(self._id) == len(words) and len(self._word) == len(ids) and min(ids, default=0) >= 0

    @classmethod
    def from_words(cls, words: list[str]) -> SymbolTable:
        """`<eps>` = 0, then the distinct words in the given order as 1, 2, ..."""
        pairs = [("<eps>", 0)]
        seen = {"<eps>"}
        for w in words:
            if w not in seen:
                seen.add(w)
                pairs.append((w, len(pairs)))
        return cls(pairs)

    def word(self, i: int) -> str:
        try:
            return self._word[int(i)]
        except KeyError:
            raise KeyError(f"id {i} is not in the symbol table") from None

    def id(self, w: str) -> int:
        try:
            return self._id[w]
        except KeyError:
            raise KeyError(f"word {w!r} is not in the symbol table") from None

    def __len__(self) -> int:
        return len(self._id)

    def __contains__(self, w: object) -> bool:
        return w in self._id

    def has_id(self, i: int) -> bool:
        return int(i) in self._word

    def has_ids(self, ids: np.ndarray) -> np.ndarray:
        """`has_id` of each id, vectorised (a table of all ids, made once)."""
        if self._ids is None:
            self._ids = np.zeros(max(self._word, default=0) + 1, dtype=bool)
            self._ids[np.fromiter(self._word, dtype=np.int64, count=len(self._word))] = True
        ids = np.asarray(ids, dtype=np.int64)
        inside = (ids >= 0) & (ids < self._ids.size)
        return inside & self._ids[np.where(inside, ids, 0)]

    def is_word(self, i: int) -> bool:
        """False for epsilon (0) and for markers/fillers (`<s>`, `</s>`, `#0`, `<sil>`, `[NOISE]`, `!NULL`)."""
        i = int(i)
        return i != 0 and is_word_symbol(self.word(i))

    def word_flags(self, ids: np.ndarray) -> np.ndarray:
        """`is_word` of each id (False for ids not in the table), vectorised; each id's symbol is looked
        at once, when first asked for: a lattice uses a few hundred of a vocabulary's words."""
        ids = np.asarray(ids, dtype=np.int64)
        if self._mask is None:
            self._mask = np.full(max(self._word, default=0) + 1, -1, dtype=np.int8)  # -1: not looked at yet
        mask = self._mask
        inside = (ids >= 0) & (ids < mask.size)
        at = np.where(inside, ids, 0)
        asked = np.zeros(mask.size, dtype=bool)  # O(ids + table), no sort: lattices have ~1e5 arcs per batch
        asked[at] = True
        todo = np.flatnonzero(asked & (mask < 0))
        if todo.size:
            word = self._word
            mask[todo] = [i != 0 and i in word and is_word_symbol(word[i]) for i in todo.tolist()]
        return inside & (mask[at] == 1)

    def write(self, path: str | os.PathLike) -> None:
        """Write `word id` lines sorted by id."""
        text = "".join(f"{self._word[i]} {i}\n" for i in sorted(self._word))
        atomic_write_text(path, text)


@dataclass
class Ragged:
    """A list of integer sequences as one flat array: row i is `values[offsets[i]:offsets[i + 1]]`.

    Holds the Kaldi transition-id strings of a lattice's arcs (and final weights), so they survive
    rescoring and can be written back.
    """

    offsets: np.ndarray  # (R + 1,) int64, offsets[0] = 0, non-decreasing
    values: np.ndarray  # (offsets[-1],) int32

    @classmethod
    def from_lists(cls, rows) -> Ragged:
        rows = [np.asarray(r, dtype=np.int32) for r in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([r.size for r in rows])
        return cls(offsets, np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32))

    @classmethod
    def empty(cls, n: int) -> Ragged:
        return cls(np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int32))

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        """(R,) int64: the length of each row."""
        return np.diff(self.offsets)

    def take(self, rows: np.ndarray) -> Ragged:
        """The rows `rows` (any order, repeats allowed; -1 gives an empty row), as a new Ragged."""
        rows = np.asarray(rows, dtype=np.int64)
        some = rows >= 0
        safe = np.where(some, rows, 0)
        counts = np.where(some, self.lengths()[safe] if len(self) else 0, 0)
        offsets = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return Ragged(offsets, self.values[concat_ranges(self.offsets[safe], counts)])

    def tolist(self) -> list[list[int]]:
        return [self[i].tolist() for i in range(len(self))]


@dataclass
class Lattice:
    """A weighted acyclic word graph as flat arrays (A arcs, S states).

    Costs are -ln (natural log), lower is better; see the module docstring for the two components.
    After `prepare()`: states are in topological order, start = 0, arcs sorted by source, every state
    lies on a path from the start to a final state.
    """

    name: str  # utterance id
    num_states: int
    start: int
    src: np.ndarray  # (A,) int64
    dst: np.ndarray  # (A,) int64
    word: np.ndarray  # (A,) int64, ids in `symbols`; 0 = epsilon
    graph: np.ndarray  # (A,) float64, -ln P_lm (+ word insertion penalty in LM units)
    acoustic: np.ndarray  # (A,) float64, -ln acoustic likelihood
    final_graph: np.ndarray  # (S,) float64, +inf where the state is not final
    final_acoustic: np.ndarray  # (S,) float64, +inf where the state is not final
    symbols: SymbolTable
    # Kaldi transition-id strings, kept from archives so that written lattices still align: one row per arc
    # (CompactLattice strings; a `Lattice` arc's single input label) and one per state (final weights).
    arc_tids: Ragged | None = None  # (A rows)
    final_tids: Ragged | None = None  # (S rows)
    state_time: np.ndarray | None = None  # (S,) float64 seconds (HTK SLF `t=`), for CTM output

    @property
    def num_arcs(self) -> int:
        return int(self.src.shape[0])

    def is_final(self) -> np.ndarray:
        """(S,) bool."""
        return np.isfinite(self.final_graph) & np.isfinite(self.final_acoustic)

    def _check_shapes(self) -> None:
        S, A = self.num_states, self.src.shape[0]
        for field in ("src", "dst", "word", "graph", "acoustic"):
            if getattr(self, field).shape != (A,):
                raise LatticeFormatError(f"lattice {self.name!r}: {field} has shape "
                                         f"{getattr(self, field).shape}, expected ({A},)")
        for field in ("final_graph", "final_acoustic"):
            if getattr(self, field).shape != (S,):
                raise LatticeFormatError(f"lattice {self.name!r}: {field} has shape "
                                         f"{getattr(self, field).shape}, expected ({S},)")
        if self.state_time is not None and self.state_time.shape != (S,):
            raise LatticeFormatError(f"lattice {self.name!r}: state_time has shape {self.state_time.shape}, "
                                     f"expected ({S},)")
        for field, rows in (("arc_tids", A), ("final_tids", S)):
            r = getattr(self, field)
            if r is not None and len(r) != rows:
                raise LatticeFormatError(f"lattice {self.name!r}: {field} has {len(r)} rows, expected {rows}")
        if S == 0:
            raise LatticeFormatError(f"lattice {self.name!r} is empty (no states)")
        if not 0 <= self.start < S:
            raise LatticeFormatError(f"lattice {self.name!r}: start state {self.start} is not in [0, {S})")
        for field in ("src", "dst"):
            bad = np.flatnonzero((getattr(self, field) < 0) | (getattr(self, field) >= S))
            if bad.size:
                raise LatticeFormatError(f"lattice {self.name!r}: arc {bad[0]} has {field} "
                                         f"{getattr(self, field)[bad[0]]} outside [0, {S})")
        for field in ("graph", "acoustic"):
            bad = np.flatnonzero(~np.isfinite(getattr(self, field)))
            if bad.size:
                raise LatticeFormatError(f"lattice {self.name!r}: state {self.src[bad[0]]}: arc to state "
                                         f"{self.dst[bad[0]]} has a non-finite {field} cost")

    def prepare(self) -> Lattice:
        """A validated copy: topologically sorted (start = 0, arcs sorted by source), trimmed.

        States that are unreachable from the start or reach no final state are dropped with a
        `LatticeWarning`. Raises `LatticeFormatError` for an empty lattice, one without a final state or
        without any complete path, and for a cycle (naming a state on it). Epsilon arcs are kept.
        """
        self._check_shapes()
        S = self.num_states
        final = self.is_final()
        if not final.any():
            raise LatticeFormatError(f"lattice {self.name!r} has no final state")
        fwd = _reach(S, self.src, self.dst, [self.start])
        bwd = _reach(S, self.dst, self.src, np.flatnonzero(final).tolist())
        keep = fwd & bwd
        if not keep[self.start]:
            raise LatticeFormatError(f"lattice {self.name!r} has no path from the start state "
                                     f"{self.start} to a final state")
        n_unreach, n_dead = int((~fwd).sum()), int((fwd & ~bwd).sum())
        if n_unreach or n_dead:
            warnings.warn(f"lattice {self.name!r}: dropped {n_unreach + n_dead} of {S} states "
                          f"({n_unreach} unreachable from the start, {n_dead} reaching no final state)",
                          LatticeWarning, stacklevel=2)
        arc_keep = keep[self.src] & keep[self.dst]
        src, dst = self.src[arc_keep], self.dst[arc_keep]
        order = _topological_order(S, keep, src, dst, self.name)
        new_id = np.full(S, -1, dtype=np.int64)
        new_id[order] = np.arange(order.size, dtype=np.int64)
        nsrc, ndst = new_id[src], new_id[dst]
        perm = np.argsort(nsrc, kind="stable")  # keeps each state's arc order
        arc_rows = np.flatnonzero(arc_keep)[perm]
        return Lattice(
            name=self.name, num_states=int(order.size), start=0,
            src=nsrc[perm], dst=ndst[perm], word=self.word[arc_keep][perm].copy(),
            graph=self.graph[arc_keep][perm].copy(), acoustic=self.acoustic[arc_keep][perm].copy(),
            final_graph=self.final_graph[order].copy(), final_acoustic=self.final_acoustic[order].copy(),
            symbols=self.symbols,
            arc_tids=None if self.arc_tids is None else self.arc_tids.take(arc_rows),
            final_tids=None if self.final_tids is None else self.final_tids.take(order),
            state_time=None if self.state_time is None else self.state_time[order].copy(),
        )

    def _is_prepared(self) -> bool:
        return (self.start == 0 and bool(np.all(self.src < self.dst))
                and bool(np.all(np.diff(self.src) >= 0)))

    def best_path(self, am_scale: float = 1.0, graph_scale: float = 1.0) -> tuple[list[str], float]:
        """Viterbi best path by cost `graph_scale * graph + am_scale * acoustic` (natural log units).

        Returns the path's words (only those with `symbols.is_word`) and its total cost, final weight
        included. An unprepared lattice is prepared first (which may warn or raise).
        """
        lat = self if self._is_prepared() else self.prepare()
        S = lat.num_states
        cost = graph_scale * lat.graph + am_scale * lat.acoustic  # (A,)
        is_final = lat.is_final()
        final = np.full(S, np.inf)  # (S,); computed on final states only, as 0 * inf would be NaN
        final[is_final] = graph_scale * lat.final_graph[is_final] + am_scale * lat.final_acoustic[is_final]
        dist, back = viterbi(S, lat.src, lat.dst, cost, state_levels(S, lat.src, lat.dst))
        total = dist + final
        s = int(np.argmin(total))
        if not math.isfinite(total[s]):
            raise LatticeFormatError(f"lattice {lat.name!r} has no finite-cost complete path")
        path = lat.word[backtrack(back, lat.src, s)]
        words = [lat.symbols.word(w) for w in path[lat.symbols.word_flags(path)].tolist()]
        return words, float(total.min())


def _reach(S: int, frm: np.ndarray, to: np.ndarray, seeds: list[int]) -> np.ndarray:
    """(S,) bool: states reachable from `seeds` following arcs frm -> to (a breadth-first
    frontier at a time, in arrays: lattices are a few dozen arcs deep and thousands wide)."""
    if frm.size and (bool(np.all(frm < to)) or bool(np.all(frm > to))):
        return _reach_dag(S, frm, to, seeds)
    order = np.argsort(frm, kind="stable")
    offsets = np.searchsorted(frm[order], np.arange(S + 1))
    targets = to[order]
    seen = np.zeros(S, dtype=bool)
    frontier = np.unique(np.asarray(seeds, dtype=np.int64))
    seen[frontier] = True
    new = np.zeros(S, dtype=bool)
    while frontier.size:
        new[targets[concat_ranges(offsets[frontier], offsets[frontier + 1] - offsets[frontier])]] = True
        new &= ~seen
        frontier = np.flatnonzero(new)  # sorted and distinct, without np.unique's sort
        seen |= new
        new[frontier] = False
    return seen


def _reach_dag(S: int, frm: np.ndarray, to: np.ndarray, seeds: list[int]) -> np.ndarray:
    """`_reach` on a graph whose numbering is topological (every arc goes up, or every arc goes down): a state
    is reachable iff it is a seed or has an arc from a reachable state, so peeling the states without an arc
    from a live state converges to the reachable ones, in as many rounds as the longest chain of unreachable
    states (none or one for real lattices, where the frontier search takes the lattice's whole depth)."""
    alive = np.ones(S, dtype=bool)
    is_seed = np.zeros(S, dtype=bool)
    is_seed[np.asarray(seeds, dtype=np.int64)] = True
    while True:
        fed = is_seed.copy()
        live = alive[frm]
        fed[to[live]] = True
        drop = alive & ~fed
        if not drop.any():
            return alive
        alive &= ~drop


def _topological_order(S: int, keep: np.ndarray, src: np.ndarray, dst: np.ndarray, name: str) -> np.ndarray:
    """Kept states in topological order, smallest id first among the ready ones (so an already sorted
    lattice keeps its numbering). After trimming, the start is the only state without predecessors, so it
    comes first. A cycle raises, naming a state on it."""
    if bool(np.all(src < dst)):  # numbered in topological order already: smallest-first Kahn is the identity
        return np.flatnonzero(keep).astype(np.int64)
    indeg = np.bincount(dst, minlength=S)
    order_arcs = np.argsort(src, kind="stable")
    offsets = np.searchsorted(src[order_arcs], np.arange(S + 1))
    targets = dst[order_arcs].tolist()
    indeg_l = indeg.tolist()
    heap = [int(s) for s in np.flatnonzero(keep & (indeg == 0))]
    heapq.heapify(heap)
    out: list[int] = []
    while heap:
        s = heapq.heappop(heap)
        out.append(s)
        for t in targets[offsets[s]:offsets[s + 1]]:
            indeg_l[t] -= 1
            if indeg_l[t] == 0:
                heapq.heappush(heap, t)
    if len(out) < int(keep.sum()):
        done = np.zeros(S, dtype=bool)
        done[out] = True
        # Every state left over has a left-over predecessor; walking back through them must repeat.
        left = np.flatnonzero(keep & ~done)
        pred: dict[int, int] = {}
        for a, b in zip(src.tolist(), dst.tolist()):
            if not done[a] and not done[b]:
                pred.setdefault(b, a)
        s, visited = int(left[0]), set()
        while s not in visited:
            visited.add(s)
            s = pred[s]
        raise LatticeFormatError(f"lattice {name!r} has a cycle through state {s}")
    return np.asarray(out, dtype=np.int64)
