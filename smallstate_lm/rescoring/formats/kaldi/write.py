"""Kaldi lattice archives written without Kaldi: the binary object (`compactlattice44` or `lattice4`, the layout
read by kaldi/binary.py), the text object (`ark,t`, as kaldi/text.py reads it) and whole archives, plain or gzip,
written atomically, with a script of their offsets when asked.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ....files import atomic_output, atomic_write_text
from ...lattices.lattice import Lattice, LatticeFormatError, Ragged, concat_ranges
from ..fst_layout import MAX_STATES, Props, vector_header
from .binary import KINDS, ragged

KaldiKind = Literal["compact", "lattice"]
_WRITE_ARC_TYPE = {"compact": "compactlattice44", "lattice": "lattice4"}
_SPACE = re.compile(rb"[ \t\n\r\f\v]")


@dataclass
class _Out:
    """A lattice laid out for writing: arcs sorted by state (A,), states (S,), costs as float32."""

    num_states: int
    start: int
    src: np.ndarray
    dst: np.ndarray
    ilabel: np.ndarray
    olabel: np.ndarray
    cost: np.ndarray  # (A, 2) float32
    final: np.ndarray  # (S, 2) float32, +inf where not final
    arc_tids: Ragged  # (A rows); all empty for kind "lattice" (the id is the ilabel)
    final_tids: Ragged  # (S rows), empty for non-final states


def _layout(lat: Lattice, kind: str) -> _Out:
    """Check `lat` fits a Kaldi lattice of `kind` and lay it out: states keep their ids, each state's arcs their
    order; missing transition-ids are empty strings."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    lat._check_shapes()
    S, A, where = lat.num_states, lat.num_arcs, f"lattice {lat.name!r}"
    if S > MAX_STATES or (A and not 0 <= lat.word.min() <= lat.word.max() < 2**31):
        raise LatticeFormatError(f"{where}: state ids and words must fit in int32 for a Kaldi lattice")
    order = np.argsort(lat.src, kind="stable")  # (A,)
    is_final = lat.is_final()
    with np.errstate(over="ignore"):
        cost = np.stack([lat.graph, lat.acoustic], axis=1)[order].astype(np.float32)  # (A, 2)
        final = np.full((S, 2), np.inf, dtype=np.float32)  # (S, 2) Zero where not final
        final[is_final] = np.stack([lat.final_graph, lat.final_acoustic], axis=1)[is_final]
    if not (np.isfinite(cost).all() and np.isfinite(final[is_final]).all()):
        raise LatticeFormatError(f"{where}: a cost is too large for float32")
    arc_tids = lat.arc_tids.take(order) if lat.arc_tids is not None else Ragged.empty(A)
    ft = lat.final_tids if lat.final_tids is not None else Ragged.empty(S)
    flen = np.where(is_final, ft.lengths(), 0)
    final_tids = ragged(flen, ft.values[concat_ranges(ft.offsets[:-1], flen)])
    src, dst, word = lat.src[order], lat.dst[order], lat.word[order]
    ilabel = word
    if kind == "lattice":
        alen = arc_tids.lengths()
        for rows, what, n in ((np.flatnonzero(alen > 1), "arc", alen), (np.flatnonzero(flen), "final weight", flen)):
            if rows.size:
                i = int(rows[0])
                at = f"arc {src[i]} -> {dst[i]}" if what == "arc" else f"the final weight of state {i}"
                raise LatticeFormatError(f"{where}: {at} carries {n[i]} transition-ids; a Kaldi Lattice (lattice4) "
                                         f"{what} holds {'at most one' if what == 'arc' else 'none'}: write kind "
                                         "'compact' (CompactLattice)")
        ilabel = np.zeros(A, dtype=np.int64)
        ilabel[alen == 1] = arc_tids.values
        arc_tids = Ragged.empty(A)
    return _Out(S, lat.start, src, dst, ilabel, word, cost, final, arc_tids, final_tids)


def _properties(o: _Out) -> int:
    """OpenFST property bits (fst/properties.h) that are certainly true of `o`; others are left unknown."""
    il, ol = o.ilabel, o.olabel
    props = Props.EXPANDED | Props.MUTABLE
    props |= Props.ACCEPTOR if np.array_equal(il, ol) else Props.NOT_ACCEPTOR
    props |= Props.EPSILONS if np.any((il == 0) & (ol == 0)) else Props.NO_EPSILONS
    props |= Props.I_EPSILONS if np.any(il == 0) else Props.NO_I_EPSILONS
    props |= Props.O_EPSILONS if np.any(ol == 0) else Props.NO_O_EPSILONS
    one_arc = (o.cost == 0).all(axis=1) & (o.arc_tids.lengths() == 0)
    one_final = (o.final == 0).all(axis=1) & (o.final_tids.lengths() == 0)
    weighted = not one_arc.all() or np.any(~one_final & np.isfinite(o.final).all(axis=1))
    props |= Props.WEIGHTED if weighted else Props.UNWEIGHTED
    props |= Props.TOP_SORTED | Props.ACYCLIC | Props.INITIAL_ACYCLIC if np.all(o.src < o.dst) else Props.NOT_TOP_SORTED
    return props


def kaldi_lattice_bytes(lat: Lattice, kind: KaldiKind = "compact") -> bytes:
    """The binary object Kaldi writes after `key ` for `lat` as a CompactLattice (`compactlattice44`: ilabel =
    olabel = word, the arc's transition-ids in its weight) or a Lattice (`lattice4`: ilabel = the arc's one
    transition-id or 0, olabel = word). Costs are stored as float32; see formats/kaldi/binary.py for the layout."""
    o = _layout(lat, kind)
    S, compact = o.num_states, kind == "compact"
    header = vector_header(_WRITE_ARC_TYPE[kind], _properties(o), o.start, S)
    flen, alen = o.final_tids.lengths(), o.arc_tids.lengths()
    head = 2 + compact * (1 + flen) + 2  # (S,) words: final weight [, n, ids], int64 arc count
    size = 2 + 2 + compact * (1 + alen) + 1  # (A,) words: labels, weight [, n, ids], next state
    narcs = np.bincount(o.src, minlength=S)  # (S,)
    arc_words = np.bincount(o.src, weights=size, minlength=S).astype(np.int64)  # (S,)
    sw = np.cumsum(head + arc_words) - (head + arc_words)  # (S,) word index of each state's record
    before = np.cumsum(size) - size  # (A,) words of the arcs before each one
    aw = sw[o.src] + head[o.src] + before - (np.cumsum(arc_words) - arc_words)[o.src]  # (A,)
    words = np.zeros(int((head + arc_words).sum()), dtype="<i4")
    words[sw[:, None] + np.arange(2)] = o.final.view("<i4")
    count_at = sw + head - 2
    words[count_at[:, None] + np.arange(2)] = narcs.astype("<i8").view("<i4").reshape(S, 2)
    words[aw], words[aw + 1] = o.ilabel, o.olabel
    words[aw[:, None] + 2 + np.arange(2)] = o.cost.view("<i4")
    if compact:
        words[sw + 2], words[concat_ranges(sw + 3, flen)] = flen, o.final_tids.values
        words[aw + 4], words[concat_ranges(aw + 5, alen)] = alen, o.arc_tids.values
    words[aw + size - 1] = o.dst
    return header + words.tobytes()


def _text_cost(x: np.float32) -> str:
    """As Kaldi prints a cost (C++ `<<`, 6 significant digits) when that is exact, else the shortest exact."""
    if not np.isfinite(x):
        return "BadNumber" if np.isnan(x) else "Infinity" if x > 0 else "-Infinity"
    s = f"{float(x):g}"
    return s if np.float32(s) == x else str(x)


def kaldi_lattice_text(lat: Lattice, kind: KaldiKind = "compact") -> str:
    """The text object Kaldi writes after `key ` (`ark,t`): a newline, OpenFST's printer lines (start state
    first, then by state id; weights equal to One omitted; Zero finals printed only for states without
    arcs), then an empty line. Costs print as Kaldi prints them where 6 digits are exact, else exactly."""
    o = _layout(lat, kind)
    compact = kind == "compact"
    first = np.searchsorted(o.src, np.arange(o.num_states + 1))  # (S+1,) each state's arcs
    alen = o.arc_tids.lengths()
    lines = [""]

    def weight(w: np.ndarray, tids: np.ndarray) -> str:
        costs = f"{_text_cost(w[0])},{_text_cost(w[1])}"
        return costs + ("," + "_".join(map(str, tids.tolist())) if compact else "")

    for s in [o.start] + [s for s in range(o.num_states) if s != o.start]:
        for i in range(first[s], first[s + 1]):
            labels = f"{o.olabel[i]}" if compact else f"{o.ilabel[i]}\t{o.olabel[i]}"
            one = not o.cost[i].any() and not alen[i]
            lines.append(f"{s}\t{o.dst[i]}\t{labels}" + ("" if one else "\t" + weight(o.cost[i], o.arc_tids[i])))
        fw, ftids = o.final[s], o.final_tids[s]
        if np.isfinite(fw).all() or first[s] == first[s + 1]:
            one = not fw.any() and not ftids.size
            lines.append(f"{s}" + ("" if one else "\t" + weight(fw, ftids)))
    return "\n".join(lines) + "\n\n"


class KaldiArchiveWriter:
    """Writes a Kaldi lattice archive, atomically: entries go to a temporary file that is renamed to `path`
    when the `with` block ends without an exception (and removed otherwise). Gzip when `path` ends in .gz
    (as Kaldi recipes' lat.N.gz); binary, or text (`ark,t`) with `binary=False`.

    kind "compact" writes CompactLattices (each arc's transition-ids in its weight), "lattice" writes Lattices
    (an arc may carry at most one transition-id, its ilabel). Lattices without `arc_tids`/`final_tids` get empty
    strings. With `scp`, also writes a Kaldi script `key path:offset` of the entries (plain archives only).

        with KaldiArchiveWriter("lat.1.gz") as w:
            w.write("utt1", lattice)
    """

    def __init__(self, path: str | os.PathLike, kind: KaldiKind = "compact", binary: bool = True,
                 scp: str | os.PathLike | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.path, self.kind, self.binary = Path(path), kind, binary
        self.gzipped = self.path.name.endswith(".gz")
        if scp is not None and self.gzipped:
            raise ValueError(f"{path}: an scp cannot point into a gzip archive (offsets need a plain file)")
        self.scp = None if scp is None else Path(scp)
        self._stack: contextlib.ExitStack | None = None
        self._scp_lines: list[str] = []
        self._offset = 0

    def __enter__(self) -> KaldiArchiveWriter:
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(atomic_output(self.path))
            f = stack.enter_context(open(tmp, "wb"))
            if self.gzipped:
                f = stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=6, mtime=0))
            self._f, self._stack = f, stack.pop_all()
        return self

    def write(self, key: str, lattice: Lattice) -> None:
        """Append one entry: `key`, a space, the lattice (see `kaldi_lattice_bytes` / `kaldi_lattice_text`)."""
        if self._stack is None:
            raise RuntimeError("KaldiArchiveWriter.write outside its `with` block")
        if not key or _SPACE.search(key.encode("utf-8")):
            raise ValueError(f"a Kaldi key must be non-empty and without white space, got {key!r}")
        obj = (kaldi_lattice_bytes(lattice, self.kind) if self.binary
               else kaldi_lattice_text(lattice, self.kind).encode("ascii"))
        head = key.encode("utf-8") + b" "
        self._f.write(head + obj)
        self._scp_lines.append(f"{key} {self.path}:{self._offset + len(head)}\n")
        self._offset += len(head) + len(obj)

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(exc_type, exc, tb)  # closes; renames the archive into place, or removes it on an exception
        if exc_type is None and self.scp is not None:
            atomic_write_text(self.scp, "".join(self._scp_lines))
