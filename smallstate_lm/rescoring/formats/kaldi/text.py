"""The text lattice objects of Kaldi archives (`ark,t`), read from an `ArchiveStream`.

After the key: a newline, OpenFST's printer lines separated by tabs, then an empty line (lat/kaldi-lattice.cc,
`LatticeReader::ReadText`): `src dst word [g,a,t1_t2_..]` / `state [g,a,t1_t2_..]` for a CompactLattice,
`src dst tid word [g,a]` / `state [g,a]` for a Lattice. A weight equal to One (0,0, no ids) is not printed; the
start state's lines come first (it is the source of the first line); infinities are `Infinity`. The lines do not
say which of the two kinds they are: both are tried, as Kaldi does.
"""

from __future__ import annotations

import re

import numpy as np

from ...lattices.lattice import Ragged
from .binary import KINDS, RawLattice
from .stream import ArchiveStream

_TEXT_SPACES = b" \t\r\f\v"
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
_KALDI_FLOATS = {"Infinity": np.inf, "-Infinity": -np.inf, "BadNumber": np.nan}  # LatticeWeightTpl::WriteFloatType
_INT = re.compile(r"\d+")
_TID = re.compile(r"-?\d+")


def _text_float(s: str) -> float | None:
    if s in _KALDI_FLOATS:
        return float(_KALDI_FLOATS[s])
    return float(s) if _NUMBER.fullmatch(s) else None


def _text_weight(s: str, compact: bool) -> tuple[float, float, list[int]] | None:
    """`g,a` (Lattice) or `g,a,t1_t2_..` (CompactLattice, ids may be empty); None if malformed."""
    parts = s.split(",")
    if len(parts) != (3 if compact else 2):
        return None
    g, a = _text_float(parts[0]), _text_float(parts[1])
    tids = parts[2].split("_") if compact and parts[2] else []
    if g is None or a is None or not all(_TID.fullmatch(t) and abs(int(t)) < 2**31 for t in tids):
        return None
    return g, a, [int(t) for t in tids]


class _TextFst:
    """Lines of the text form read as one kind (lat/kaldi-lattice.cc `LatticeReader::ReadText` tries both)."""

    def __init__(self, kind: str) -> None:
        self.kind, self.compact = kind, kind == "compact"
        self.arcs: list[tuple[int, int, int, int, float, float]] = []
        self.arc_tids: list[list[int]] = []
        self.finals: dict[int, tuple[float, float, list[int]]] = {}
        self.start, self.max_state = -1, -1

    def add(self, cols: list[str]) -> str | None:
        """Take one line's columns; the reason it is not a line of this kind, or None."""
        n = len(cols)
        weight = "g,a,t1_t2_..." if self.compact else "g,a"
        arc_cols = 3 if self.compact else 4  # src dst word / src dst tid word, then an optional weight
        if n not in (1, 2, arc_cols, arc_cols + 1):
            return (f"{n} columns; expected 'src dst {'word' if self.compact else 'tid word'} [{weight}]' or "
                    f"'state [{weight}]'")
        head = 1 if n <= 2 else arc_cols  # integer columns
        ints = [int(c) if _INT.fullmatch(c) and int(c) < 2**31 else None for c in cols[:head]]
        if None in ints:
            return "state ids and labels must be integers in [0, 2^31)"
        w = _text_weight(cols[-1], self.compact) if n > head else (0.0, 0.0, [])
        if w is None:
            return f"{'final' if n <= 2 else 'arc'} weight {cols[-1]!r} is not '{weight}'"
        s = ints[0]
        if self.start < 0:
            self.start = s
        if n <= 2:
            if s in self.finals:
                return f"state {s} has a second final weight"
            self.finals[s] = w
            self.max_state = max(self.max_state, s)
            return None
        d, il, ol = (ints[1], ints[2], ints[2]) if self.compact else ints[1:]
        self.arcs.append((s, d, il, ol, w[0], w[1]))
        self.arc_tids.append(w[2] if self.compact else [il] if il else [])
        self.max_state = max(self.max_state, s, d)
        return None

    def raw(self) -> RawLattice:
        S = self.max_state + 1
        a = np.asarray(self.arcs, dtype=np.float64).reshape(-1, 6)  # (A, 6) labels are < 2**53: exact
        final = np.full((S, 2), np.inf)
        for s, (g, ac, _) in self.finals.items():
            final[s] = g, ac
        with np.errstate(over="ignore"):  # Kaldi reads the text into float32 costs
            cost, final = a[:, 4:].astype(np.float32).astype(np.float64), final.astype(np.float32).astype(np.float64)
        rows = [self.finals.get(s, (0, 0, []))[2] for s in range(S)]
        col = [a[:, j].astype(np.int64) for j in range(4)]
        return RawLattice(self.kind, S, self.start, *col, cost, final, Ragged.from_lists(self.arc_tids),
                    Ragged.from_lists(rows))


def read_text(st: ArchiveStream) -> RawLattice:
    """The text form at `st.pos` (white space, a newline, lines, an empty line), as a CompactLattice if every
    line reads as one, else as a Lattice (as `ReadCompactLatticeText` prefers)."""
    while st.need(st.pos + 1) and st.buf[st.pos] in _TEXT_SPACES:
        st.pos += 1
    if not st.need(st.pos + 1) or st.buf[st.pos] != ord("\n"):
        raise st.error("expected a newline after the key (text form)", st.line(st.pos))
    st.pos += 1
    line = st.line(st.pos)
    alive = {kind: _TextFst(kind) for kind in KINDS}
    why: dict[str, str] = {}
    while True:
        raw, more = st.readline()
        text = raw.decode("latin-1")
        cols = text.split()
        if not cols:
            break
        for kind, fst in list(alive.items()):
            reason = fst.add(cols)
            if reason:
                why[kind] = f"line {line}: {reason}"
                del alive[kind]
        if not alive:
            raise st.error(f"bad line {text.strip()!r}: not a CompactLattice ({why['compact']}) nor a Lattice "
                           f"({why['lattice']})", line)
        line += 1
        if not more:
            break
    return next(iter(alive.values())).raw()
