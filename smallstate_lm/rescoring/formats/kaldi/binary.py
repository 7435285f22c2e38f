"""The binary lattice objects of Kaldi archives, read from an `ArchiveStream`.

Unlike other Kaldi objects, lattices are written *without* the "\\0B" binary marker (lat/kaldi-lattice.cc,
`CompactLatticeHolder::Write`): a binary object is an OpenFST `vector` FST (byte 0 is 214, the first byte of the
FST magic number), with arc type `compactlattice44` (Kaldi `CompactLattice`) or `lattice4` (Kaldi `Lattice`);
`compactlattice84` and `lattice8` (double costs) are read too. The layout is formats/fst_layout.py's: header; then per
state its final weight, int64 arc count and the arcs `int32 ilabel, int32 olabel, weight, int32 nextstate`. A
`lattice4` weight is float32 graph cost, float32 acoustic cost (fstext/lattice-weight.h
`LatticeWeightTpl::Write`); a `compactlattice44` weight is that pair, then int32 n and n int32 transition-ids
(`CompactLatticeWeightTpl::Write`). Zero (not final) is (+inf, +inf) with no transition-ids. Every field is a
multiple of 4 bytes, so a lattice body is an array of int32 words.

A CompactLattice arc has ilabel = olabel = word and carries its transition-ids; a Lattice arc has ilabel = one
transition-id (0: none) and olabel = word. Both are read into a `RawLattice` of kind "compact" or "lattice", so
that the same kind can be written back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ...lattices.lattice import Lattice, LatticeFormatError, Ragged, SymbolTable, concat_ranges
from ..fst_binary import check_costs, word_ids
from ..fst_layout import FST_MAGIC, HAS_ISYMBOLS, HAS_OSYMBOLS, HEADER_TAIL, MAX_STATES, SYMBOLS_MAGIC
from .stream import I32, I64, ArchiveStream

KINDS = ("compact", "lattice")
# arc type -> (kind, float type of the two costs)
_ARC_TYPES = {"compactlattice44": ("compact", "<f4"), "lattice4": ("lattice", "<f4"),
              "compactlattice84": ("compact", "<f8"), "lattice8": ("lattice", "<f8")}
_MAX_IDS = 1 << 24  # transition-ids on one arc: a longer string means a garbled length


@dataclass
class RawLattice:
    """One lattice object as stored: arcs in the file's order (A,), states (S,)."""

    kind: str
    num_states: int
    start: int
    src: np.ndarray  # (A,) int64
    dst: np.ndarray  # (A,) int64
    ilabel: np.ndarray  # (A,) int64
    olabel: np.ndarray  # (A,) int64
    cost: np.ndarray  # (A, 2) float64: graph, acoustic
    final: np.ndarray  # (S, 2) float64, +inf where not final
    arc_tids: Ragged  # (A rows)
    final_tids: Ragged  # (S rows)

    def lattice(self, symbols: SymbolTable, key: str, where: str) -> Lattice:
        """The `Lattice` of this object, named `key`: the start state's arcs first (as fst_binary reads single
        files), words = output labels (checked against `symbols`), costs as stored, +inf finals where not final.
        Errors name `where`."""
        S, start = self.num_states, self.start
        if S == 0 or start < 0:
            raise LatticeFormatError(f"{where}: empty lattice (no states or no start state)")
        order = np.argsort(self.src != start, kind="stable")  # (A,)
        src, dst, cost = self.src[order], self.dst[order], self.cost[order]
        word = word_ids(None, self.olabel[order], src, symbols, where)
        final = self.final.copy()
        check_costs(cost, final, src, dst, start, where)
        if not cost.shape[0] and np.all(final == np.inf):
            raise LatticeFormatError(f"{where}: empty lattice (no arcs and no final states)")
        is_final = np.isfinite(final).all(axis=1)  # (S,) a Zero in either component is no final weight
        final[~is_final] = np.inf
        ft = self.final_tids
        flen = np.where(is_final, ft.lengths(), 0)  # non-final states keep no transition-ids
        return Lattice(
            name=key, num_states=S, start=start, src=src, dst=dst, word=word,
            graph=np.ascontiguousarray(cost[:, 0]), acoustic=np.ascontiguousarray(cost[:, 1]),
            final_graph=np.ascontiguousarray(final[:, 0]), final_acoustic=np.ascontiguousarray(final[:, 1]),
            symbols=symbols, arc_tids=self.arc_tids.take(order),
            final_tids=ragged(flen, ft.values[concat_ranges(ft.offsets[:-1], flen)]),
        )


def ragged(lengths: np.ndarray, values: np.ndarray) -> Ragged:
    """A `Ragged` of int32 rows from each row's length (N,) and all rows' values, concatenated."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Ragged(offsets, values.astype(np.int32))


def _read_header(st: ArchiveStream) -> tuple[str, str, int, int]:
    """(kind, float type, start, number of states) from the OpenFST header at `st.pos` (fst.h `FstHeader`)."""
    at = st.pos
    (magic,) = st.take(I32, "the OpenFST magic number")
    if magic != FST_MAGIC:
        raise st.error(f"not a lattice: bad magic number at {st.at(at)}; expected a binary OpenFST lattice (magic "
                       f"{FST_MAGIC}) or a newline (text form) after the key")
    fst_type, arc_type = st.string("FST type"), st.string("arc type")
    version, flags, _props, start, num_states, _num_arcs = st.take(HEADER_TAIL, "the rest of the OpenFST header")
    where = st.at(at)
    if fst_type != "vector":
        raise st.error(f"FST type {fst_type!r} in the header at {where} is not supported (expected vector)")
    if arc_type not in _ARC_TYPES:
        raise st.error(f"arc type {arc_type!r} in the header at {where} is not a Kaldi lattice (expected "
                       f"{', '.join(_ARC_TYPES)})")
    if version < 2:
        raise st.error(f"vector FST version {version} in the header at {where} is not supported (expected 2)")
    if num_states < 0:
        raise st.error(f"the header at {where} does not count the states ({num_states}); an archive entry must")
    if num_states > MAX_STATES or not (start == -1 or 0 <= start < max(num_states, 1)):
        raise st.error(f"corrupt OpenFST header at {where}: start state {start} of {num_states} states")
    for bit, which in ((HAS_ISYMBOLS, "input"), (HAS_OSYMBOLS, "output")):
        if flags & bit:
            _skip_symbols(st, which)
    kind, ftype = _ARC_TYPES[arc_type]
    return kind, ftype, start, num_states


def _skip_symbols(st: ArchiveStream, which: str) -> None:
    """Step over an OpenFST symbol table (symbol-table.cc: magic, name, available key, size, (symbol, key)*)."""
    at = st.pos
    (magic,) = st.take(I32, f"the magic number of the {which} symbol table")
    if magic != SYMBOLS_MAGIC:
        raise st.error(f"corrupt {which} symbol table: bad magic number at {st.at(at)}; expected {SYMBOLS_MAGIC}")
    st.string("symbol table name", 1 << 20)
    _available, size = st.take(struct.Struct("<qq"), f"the size of the {which} symbol table")
    if size < 0:
        raise st.error(f"corrupt {which} symbol table: {size} symbols at {st.at(st.pos - 8)}")
    for _ in range(size):
        st.string("symbol", 1 << 20)
        st.take(I64, "the key of a symbol")


def _truncated(st: ArchiveStream, what: str, at: int) -> LatticeFormatError:
    end = st.limit - st.base if st.limit is not None else len(st.buf)
    return st.error(f"archive ends at {st.at(end)}, inside the lattice (truncated, or a garbled count); expected "
                    f"{what} at {st.at(at)}")


def _walk_lattice(st: ArchiveStream, S: int, fw: int) -> tuple[list[int], list[int], int]:
    """Where each state's record starts and its arc count, for fixed-size `lattice4/8` records; the end."""
    head, arc = fw + 8, fw + 12
    starts: list[int] = []
    counts: list[int] = []
    pos = st.pos
    for s in range(S):
        if not st.need(pos + head):
            raise _truncated(st, f"the final weight and arc count of state {s} of {S}", pos)
        (n,) = I64.unpack_from(st.buf, pos + fw)
        if n < 0:
            raise st.error(f"corrupt lattice: state {s} has a negative arc count ({n}) at {st.at(pos + fw)}")
        if not st.need(pos + head + n * arc):
            raise _truncated(st, f"the {n} arcs of state {s} ({arc} bytes each)", pos + head)
        starts.append(pos)
        counts.append(n)
        pos += head + n * arc
    return starts, counts, pos


def _walk_compact(st: ArchiveStream, S: int, fw: int) -> tuple[list[int], list[int], list[int], int]:
    """Where each state's record and each arc starts, and each state's arc count, for `compactlattice` records
    (the transition-id strings make every record's size depend on the one before); the end."""
    starts: list[int] = []
    counts: list[int] = []
    arcs: list[int] = []
    buf, need, i32 = st.buf, st.need, I32.unpack_from
    pos = st.pos
    for s in range(S):
        if not need(pos + fw + 4):
            raise _truncated(st, f"the final weight of state {s} of {S}", pos)
        (m,) = i32(buf, pos + fw)
        if not 0 <= m <= _MAX_IDS:
            raise st.error(f"corrupt lattice: the final weight of state {s} has {m} transition-ids at "
                           f"{st.at(pos + fw)}; expected 0 to {_MAX_IDS}")
        starts.append(pos)
        pos += fw + 4 + 4 * m
        if not need(pos + 8):
            raise _truncated(st, f"the transition-ids and arc count of state {s}", pos - 4 * m)
        (n,) = I64.unpack_from(buf, pos)
        if n < 0:
            raise st.error(f"corrupt lattice: state {s} has a negative arc count ({n}) at {st.at(pos)}")
        counts.append(n)
        pos += 8
        for a in range(n):
            if not need(pos + 12 + fw):
                raise _truncated(st, f"arc {a} of the {n} arcs of state {s}", pos)
            (k,) = i32(buf, pos + 8 + fw)
            if not 0 <= k <= _MAX_IDS:
                raise st.error(f"corrupt lattice: arc {a} of state {s} has {k} transition-ids at "
                               f"{st.at(pos + 8 + fw)}; expected 0 to {_MAX_IDS}")
            arcs.append(pos)
            pos += 16 + fw + 4 * k
            if not need(pos):
                raise _truncated(st, f"the transition-ids and next state of arc {a} of state {s}", pos - 4 - 4 * k)
    return starts, counts, arcs, pos


def _weights(words: np.ndarray, at: np.ndarray, ftype: str) -> np.ndarray:
    """(N, 2) float64: the (graph, acoustic) pairs that start at the given word indices."""
    k = np.dtype(ftype).itemsize // 2  # words per weight
    raw = np.ascontiguousarray(words[at[:, None] + np.arange(k)])  # (N, k) int32
    with np.errstate(invalid="ignore"):  # a garbled cost may be a signalling NaN: _check_costs names it
        return raw.view(ftype).reshape(-1, 2).astype(np.float64)


def read_binary(st: ArchiveStream) -> RawLattice:
    """The binary lattice object at `st.pos` (see the module docstring), leaving `st.pos` after it."""
    kind, ftype, start, S = _read_header(st)
    fw = 2 * np.dtype(ftype).itemsize
    body = st.pos
    if kind == "compact":
        starts, counts, arc_starts, end = _walk_compact(st, S, fw)
    else:
        starts, counts, end = _walk_lattice(st, S, fw)
    words = np.frombuffer(st.buf, dtype="<i4", count=(end - body) // 4, offset=body).copy()  # the body, int32s
    st.pos = end
    k = fw // 4
    sw = (np.asarray(starts, dtype=np.int64) - body) // 4  # (S,) word index of each state's record
    n = np.asarray(counts, dtype=np.int64)  # (S,)
    state = np.repeat(np.arange(S, dtype=np.int64), n)  # (A,)
    if kind == "compact":
        aw = (np.asarray(arc_starts, dtype=np.int64) - body) // 4  # (A,) word index of each arc
        flen, alen = words[sw + k], words[aw + 2 + k]  # (S,), (A,) transition-ids of each
        final_tids = ragged(flen, words[concat_ranges(sw + k + 1, flen)])
        arc_tids = ragged(alen, words[concat_ranges(aw + k + 3, alen)])
        dst = words[aw + k + 3 + alen]
    else:
        within = np.arange(state.size) - (np.cumsum(n) - n)[state]  # (A,) each arc's index within its state
        aw = sw[state] + k + 2 + within * (k + 3)
        dst = words[aw + k + 2]
        tid = words[aw]
        arc_tids, final_tids = ragged((tid != 0).astype(np.int64), tid[tid != 0]), Ragged.empty(S)
    ilabel, olabel = words[aw].astype(np.int64), words[aw + 1].astype(np.int64)
    bad = np.flatnonzero((ilabel < 0) | (olabel < 0) | (dst < 0) | (dst >= S))
    if bad.size:
        i = int(bad[0])
        what = (f"its next state {dst[i]} is outside the {S} states" if not 0 <= dst[i] < S
                else f"its label {min(ilabel[i], olabel[i])} is negative")
        raise st.error(f"corrupt lattice: arc of state {state[i]} at {st.at(body + 4 * int(aw[i]))}: {what}")
    return RawLattice(kind, S, start, state, dst.astype(np.int64), ilabel, olabel, _weights(words, aw + 2, ftype),
                _weights(words, sw, ftype), arc_tids, final_tids)
