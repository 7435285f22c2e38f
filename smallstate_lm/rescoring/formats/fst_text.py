"""The OpenFST text form of a lattice (what `fstprint` writes): read, and printed exactly.

Arcs are `src dst ilabel olabel [graph,acoustic]`, finals `state [graph,acoustic]`; the start state is the source
of the first line. Words are output labels: integer ids of the decoder's symbol table, or the symbols themselves.
A single-cost weight is tropical (acoustic 0); a missing weight is 0. Errors name the source, the line and the
state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..lattices.lattice import Lattice, LatticeFormatError, SymbolTable
from .columns import floats, ints, split_at, split_tokens, strings


def _parse_cost(s: str, where: str) -> tuple[float, float]:
    """`graph,acoustic` (lattice4) or `graph` (tropical: acoustic 0)."""
    parts = s.split(",")
    if len(parts) > 2:
        raise LatticeFormatError(f"{where}: weight {s!r} must be 'graph,acoustic' or a single cost")
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise LatticeFormatError(f"{where}: weight {s!r} is not a number") from None
    if any(math.isnan(v) for v in vals):
        raise LatticeFormatError(f"{where}: weight {s!r} is NaN")
    return (vals[0], vals[1] if len(vals) == 2 else 0.0)



def _label_id(label: str, symbols: SymbolTable) -> int | None:
    """An output label's word id: an integer id of `symbols` (0: epsilon) or a symbol (fstprint with a symbol
    table); None when `symbols` has neither."""
    try:
        w = int(label)
        return w if w == 0 or symbols.has_id(w) else None
    except ValueError:
        w = symbols._id.get(label, -1)
        return w if w >= 0 else None


def _final_weights(num_states: int, states, graph, acoustic) -> tuple[np.ndarray, np.ndarray]:
    """Per-state final graph and acoustic costs: those given for `states`, inf (not final) elsewhere."""
    fg = np.full(num_states, np.inf)
    fa = np.full(num_states, np.inf)
    fg[states], fa[states] = graph, acoustic
    return fg, fa


@dataclass
class _FstTextLines:
    """What the lines of an OpenFST text form say, checked line by line: arcs (A,) and final weights."""

    symbols: SymbolTable
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    word: list[int] = field(default_factory=list)
    graph: list[float] = field(default_factory=list)
    acoustic: list[float] = field(default_factory=list)
    finals: dict[int, tuple[float, float]] = field(default_factory=dict)
    first: int | None = None  # the start state: the source of the first line
    max_state: int = -1

    def add(self, parts: list[str], line: str, loc: str) -> None:
        """Take one line (`parts`, its columns) found at `loc` (`source:line`)."""
        try:
            s = int(parts[0])
            d = int(parts[1]) if len(parts) >= 4 else None
        except ValueError:
            raise LatticeFormatError(f"{loc}: state ids must be integers, got {line.strip()!r}") from None
        where = f"{loc}: state {s}"
        if s < 0 or (d is not None and d < 0):
            raise LatticeFormatError(f"{where}: state ids must be >= 0, got {line.strip()!r}")
        if max(s, d or 0) >= 2**63:
            raise LatticeFormatError(f"{where}: state ids must be below 2**63, got {line.strip()!r}")
        if self.first is None:
            self.first = s
        if len(parts) in (1, 2):
            self._final(parts, s, where)
        elif len(parts) in (4, 5):
            self._arc(parts, s, d, where)
        else:
            raise LatticeFormatError(f"{loc}: expected 'src dst ilabel olabel [graph,acoustic]' or "
                                     f"'state [graph,acoustic]', got {line.strip()!r}")

    def _final(self, parts: list[str], s: int, where: str) -> None:
        gc, acc = _parse_cost(parts[1], where) if len(parts) == 2 else (0.0, 0.0)
        if gc == -math.inf or acc == -math.inf:
            raise LatticeFormatError(f"{where}: final weight {parts[1]!r} is -inf")
        if s in self.finals:
            raise LatticeFormatError(f"{where}: the state has a second final weight")
        if math.isfinite(gc) and math.isfinite(acc):
            self.finals[s] = (gc, acc)
        self.max_state = max(self.max_state, s)

    def _arc(self, parts: list[str], s: int, d: int, where: str) -> None:
        label, symbols = parts[3], self.symbols
        w = _label_id(label, symbols)
        if w is None:
            raise LatticeFormatError(f"{where}: label {label} is not in the symbol table ({len(symbols)} symbols)")
        gc, acc = _parse_cost(parts[4], where) if len(parts) == 5 else (0.0, 0.0)
        if not (math.isfinite(gc) and math.isfinite(acc)):
            raise LatticeFormatError(f"{where}: arc to state {d} has a non-finite weight {parts[4]!r}")
        self.src.append(s)
        self.dst.append(d)
        self.word.append(w)
        self.graph.append(gc)
        self.acoustic.append(acc)
        self.max_state = max(self.max_state, s, d)

    def lattice(self, name: str) -> Lattice:
        if self.first is None:
            raise LatticeFormatError(f"{name}: empty lattice (no arcs and no final states)")
        S = self.max_state + 1
        fg, fa = _final_weights(S, np.fromiter(self.finals, dtype=np.int64, count=len(self.finals)),
                                [gc for gc, _ in self.finals.values()], [acc for _, acc in self.finals.values()])
        return Lattice(
            name=name, num_states=S, start=self.first,
            src=np.asarray(self.src, dtype=np.int64), dst=np.asarray(self.dst, dtype=np.int64),
            word=np.asarray(self.word, dtype=np.int64), graph=np.asarray(self.graph, dtype=np.float64),
            acoustic=np.asarray(self.acoustic, dtype=np.float64), final_graph=fg, final_acoustic=fa,
            symbols=self.symbols,
        )


@dataclass
class FstTextColumns:
    """A text form's columns, as `fst_text_columns` reads them."""

    first: int  # the source of the first line: the start state
    src: np.ndarray
    dst: np.ndarray
    label_index: np.ndarray  # per arc, its output label as an index into `label_names`
    label_names: list[str]  # the distinct output labels as written, in order of first appearance
    graph: np.ndarray
    acoustic: np.ndarray
    final_state: np.ndarray
    final_graph: np.ndarray
    final_acoustic: np.ndarray

    @property
    def max_state(self) -> int:
        return int(max(self.src.max(initial=-1), self.dst.max(initial=-1), self.final_state.max(initial=-1)))


def fst_text_columns(text: str, costs: bool = True) -> FstTextColumns | None:
    """The columns of a text form whose every line is an arc or final line with finite weights, read a column
    at a time (`columns`) as the line-by-line reader reads them field by field: a 2 MB request of lattices in a
    fraction of the time. None for any other text, which the line-by-line reader then reads or refuses with its
    exact error. `costs=False`: the weights are neither read nor checked (all 0), for what needs the lattice's
    structure only (its cost before any work)."""
    t = split_tokens(text)
    if t is None or len(t.start) == 0 or not np.isin(t.fields[t.column == 0], (1, 2, 4, 5)).all():
        return None
    arc, first_field = t.fields >= 4, t.column == 0
    arc_rows, final_rows = arc & first_field, ~arc & first_field
    d, st, en = t.data, t.start, t.end

    def col(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        at = np.flatnonzero(mask)
        return d, st[at], en[at]

    src, dst = ints(*col(arc_rows)), ints(*col(arc & (t.column == 1)))
    final_state, first = ints(*col(final_rows)), ints(d, st[:1], en[:1])
    if src is None or dst is None or final_state is None or first is None:
        return None  # not plain numbers: the line-by-line reader reads or refuses them
    labels = strings(*col(arc & (t.column == 3)))
    graph, acoustic = np.zeros(len(src)), np.zeros(len(src))
    final_graph, final_acoustic = np.zeros(len(final_state)), np.zeros(len(final_state))
    if costs:  # lines without a weight keep 0
        weighted = t.fields[arc_rows] == 5
        final_weighted = t.fields[final_rows] == 2
        try:
            graph[weighted], acoustic[weighted] = _weights(*col(arc & (t.column == 4)))
            final_graph[final_weighted], final_acoustic[final_weighted] = _weights(*col(~arc & (t.column == 1)))
        except ValueError:
            return None
    cols = FstTextColumns(int(first[0]), src, dst, labels[0], labels[1], graph, acoustic, final_state, final_graph,
                          final_acoustic)
    if not all(np.isfinite(x).all() for x in (graph, acoustic, final_graph, final_acoustic)):
        return None  # the line-by-line reader says which weight
    if len(np.unique(final_state)) < len(final_state):
        return None  # and that a state is final twice
    return cols


def _weights(data: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`graph,acoustic` or a single (graph) cost per span, as two arrays; ValueError for any other."""
    commas, at = split_at(data, start, end, ",")
    if (commas > 1).any():
        raise ValueError("a weight of three parts")
    two = np.flatnonzero(commas == 1)
    acoustic = np.zeros(len(start))
    acoustic[two] = floats(data, at[two] + 1, end[two])
    return floats(data, start, at), acoustic


def read_fst_text(text: str, symbols: SymbolTable, name: str = "<text>",
                  columns: FstTextColumns | None = None) -> Lattice:
    """Parse the OpenFST text form: arcs `src dst ilabel olabel [graph,acoustic]`, finals `state [weight]`.

    The start state is the source of the first line (OpenFST's convention). Words are output labels:
    integer ids of `symbols`, or the symbols themselves. A single-cost weight is tropical (acoustic 0);
    a missing weight is 0. Errors name `name:line` and the state. `columns`: `fst_text_columns(text)`
    when the caller has them already.
    """
    columns = columns if columns is not None else fst_text_columns(text)
    if columns is not None:
        lat = _from_columns(columns, symbols, name)
        if lat is not None:
            return lat
    lines = _FstTextLines(symbols)
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if parts:
            lines.add(parts, line, f"{name}:{n}")
    return lines.lattice(name)


def _from_columns(c: FstTextColumns, symbols: SymbolTable, name: str) -> Lattice | None:
    """The lattice of `c`; None when a label is not in `symbols` (the line-by-line reader names the line)."""
    ids = [_label_id(label, symbols) for label in c.label_names]
    if None in ids:
        return None
    S = c.max_state + 1
    fg, fa = _final_weights(S, c.final_state, c.final_graph, c.final_acoustic)
    word = np.asarray(ids, dtype=np.int64)[c.label_index]
    return Lattice(name=name, num_states=S, start=c.first, src=c.src, dst=c.dst, word=word, graph=c.graph,
                   acoustic=c.acoustic, final_graph=fg, final_acoustic=fa, symbols=symbols)


def lattice_to_text(lattice: Lattice) -> str:
    """The OpenFST text form (`src dst word word graph,acoustic`; finals `state graph,acoustic`), start
    state's lines first, costs printed exactly (shortest round-trip repr)."""
    order = np.argsort(lattice.src != lattice.start, kind="stable")  # the start's arcs first
    lines = [f"{s}\t{d}\t{w}\t{w}\t{g!r},{a!r}" for s, d, w, g, a in zip(
        lattice.src[order].tolist(), lattice.dst[order].tolist(), lattice.word[order].tolist(),
        lattice.graph[order].tolist(), lattice.acoustic[order].tolist())]
    finals = np.flatnonzero(lattice.is_final())
    finals = finals[np.argsort(finals != lattice.start, kind="stable")]
    final_lines = [f"{s}\t{g!r},{a!r}" for s, g, a in zip(finals.tolist(), lattice.final_graph[finals].tolist(),
                                                          lattice.final_acoustic[finals].tolist())]
    if finals.size and finals[0] == lattice.start and not np.any(lattice.src == lattice.start):
        lines = final_lines[:1] + lines + final_lines[1:]
    else:
        lines += final_lines
    return "\n".join(lines) + "\n"
