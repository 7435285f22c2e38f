"""Binary OpenFST lattices, parsed and written byte for byte with numpy (no kaldifst at run time).

Arc types: Kaldi `lattice4` (weight = float32 graph cost, float32 acoustic cost) and `standard` (one
float32 tropical cost, read as graph cost with acoustic 0). FST types: `vector` (read and write) and
`const` (read). Costs are float32 in the file and come back exactly (as float64). The layout is
formats/fst_layout.py's.

Errors name the source, what was expected and the byte offset where the file stops making sense.

Writing reproduces kaldifst's bytes exactly, the properties field included: that field is not computed at
write time but accumulated while the FST is built, so `built_properties` replays OpenFST's updates.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..lattices.lattice import Lattice, LatticeFormatError, SymbolTable
from .fst_layout import (
    ALIGN,
    FST_MAGIC,
    HAS_ISYMBOLS,
    HAS_OSYMBOLS,
    IS_ALIGNED,
    MAX_NAME,
    MAX_STATES,
    SYMBOLS_MAGIC,
    Props,
    arc_dtype,
    const_state_dtype,
    vector_header,
)

_COSTS = {"lattice4": 2, "standard": 1}  # float32 costs per weight
_INT64 = struct.Struct("<q")


@dataclass
class FstHeader:
    fst_type: str
    arc_type: str
    version: int
    flags: int
    properties: int
    start: int
    num_states: int  # -1: not counted (written to a pipe); the state records run to the end of the file
    num_arcs: int
    end: int  # byte offset just after the header (and the symbol tables)
    output_symbols: dict[int, str] | None  # the file's own output symbol table, if it carries one


@dataclass
class RawFst:
    """A parsed FST; arcs in the file's state order, weights as stored (float32)."""

    header: FstHeader
    num_states: int
    final: np.ndarray  # (S, k) float32
    state: np.ndarray  # (A,) int64, the state each arc leaves
    arcs: np.ndarray  # (A,) structured: ilabel, olabel, weight (k,), nextstate


class _Bytes:
    """A cursor over the file's bytes that raises `LatticeFormatError` naming the source and offset."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.source, self.pos = data, source, 0

    def error(self, msg: str) -> LatticeFormatError:
        return LatticeFormatError(f"{self.source}: {msg}")

    def take(self, fmt: str, what: str, part: str = "the OpenFST header") -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise self.error(f"file ends inside {part} after {len(self.data)} bytes (truncated?); "
                             f"expected {what} at byte {self.pos}")
        out = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return out

    def string(self, what: str, part: str = "the OpenFST header", limit: int = MAX_NAME) -> str:
        at = self.pos
        (n,) = self.take("<i", f"the length of the {what}", part)
        if not 0 <= n <= limit:
            raise self.error(f"corrupt file: the {what} in {part} has length {n} at byte {at}; "
                             f"expected 0 to {limit}")
        (raw,) = self.take(f"<{n}s", f"the {n} bytes of the {what}", part)
        return raw.decode("utf-8", "replace")


def read_fst_header(data: bytes, source: str) -> FstHeader:
    """The header of a binary OpenFST file (and its symbol tables, of which the output one is kept);
    raises `LatticeFormatError` unless it is a `vector` or `const` FST of `lattice4` or `standard` arcs."""
    b = _Bytes(data, source)
    if len(data) < 4 or struct.unpack_from("<i", data)[0] != FST_MAGIC:
        raise b.error(f"not a binary OpenFST file (bad magic number at byte 0; expected {FST_MAGIC})")
    b.pos = 4
    fst_type, arc_type = b.string("FST type"), b.string("arc type")
    (version,) = b.take("<i", "the version")
    (flags,) = b.take("<i", "the flags")
    (props,) = b.take("<Q", "the properties")
    (start,) = b.take("<q", "the start state")
    (num_states,) = b.take("<q", "the number of states")
    (num_arcs,) = b.take("<q", "the number of arcs")
    if arc_type not in _COSTS:
        raise b.error(f"arc type {arc_type!r} is not supported (expected lattice4 or standard)")
    if fst_type not in ("vector", "const"):
        raise b.error(f"FST type {fst_type!r} is not supported (expected vector or const)")
    if version < (2 if fst_type == "vector" else 1):
        raise b.error(f"{fst_type} FST version {version} is not supported (expected "
                      f"{'2' if fst_type == 'vector' else '1 or 2'})")
    counted = -1 if fst_type == "vector" else 0  # a vector FST written to a pipe does not count its states
    at = b.pos - 16
    if not counted <= num_states <= MAX_STATES:
        raise b.error(f"corrupt OpenFST header: {num_states} states at byte {at}; expected 0 to {MAX_STATES}")
    if not 0 <= num_arcs < 2**62:
        raise b.error(f"corrupt OpenFST header: {num_arcs} arcs at byte {at + 8}; expected a count >= 0")
    if num_states >= 0 and not (start == -1 or 0 <= start < num_states):
        raise b.error(f"corrupt OpenFST header: start state {start} at byte {at - 8} is outside the "
                      f"{num_states} states")
    if flags & HAS_ISYMBOLS:
        _symbol_table(b, "input")
    osyms = _symbol_table(b, "output") if flags & HAS_OSYMBOLS else None
    if version == 1:  # const FST version 1 is always aligned
        flags |= IS_ALIGNED
    return FstHeader(fst_type, arc_type, version, flags, props, start, num_states, num_arcs, b.pos, osyms)


def _symbol_table(b: _Bytes, which: str) -> dict[int, str]:
    """An OpenFST binary symbol table at the cursor: key -> symbol."""
    part = f"the {which} symbol table"
    at = b.pos
    (magic,) = b.take("<i", "its magic number", part)
    if magic != SYMBOLS_MAGIC:
        raise b.error(f"corrupt {which} symbol table: bad magic number at byte {at}; expected {SYMBOLS_MAGIC}")
    b.string("table name", part, limit=1 << 20)
    _available, size = b.take("<qq", "its available key and size", part)
    if not 0 <= size <= len(b.data):
        raise b.error(f"corrupt {which} symbol table: {size} symbols at byte {b.pos - 8}")
    table = {}
    for _ in range(size):
        symbol = b.string("symbol", part, limit=1 << 20)
        (key,) = b.take("<q", f"the key of symbol {symbol!r}", part)
        table[key] = symbol
    return table


def _vector_records(b: _Bytes, num_states: int, k: int) -> tuple[list[int], list[int], str | None]:
    """Walk the state records of a vector FST from the cursor: where each state's record starts, how many
    complete arcs of it the file holds, and the first problem with the sizes (None if they add up to the
    file's size exactly). The walk is sequential (each record's size is in the record), so the loop only
    reads; `_size_problem` explains why it stopped."""
    data, n = b.data, len(b.data)
    head, arc_size, at_count = 4 * k + 8, 4 * k + 12, 4 * k
    unpack = _INT64.unpack_from
    starts: list[int] = []
    counts: list[int] = []
    pos, last, s = b.pos, n - head, 0  # a record's final weight and count must start by `last`
    todo = num_states if num_states >= 0 else n  # not counted: as many as the file holds
    while s < todo and pos <= last:
        (narcs,) = unpack(data, pos + at_count)
        starts.append(pos)
        counts.append(narcs)
        s += 1
        if narcs < 0:
            break
        pos += head + narcs * arc_size
    return starts, counts, _size_problem(starts, counts, pos, n, num_states, k)


def _size_problem(starts: list[int], counts: list[int], pos: int, n: int, num_states: int, k: int) -> str | None:
    """Why the walk of `_vector_records` stopped at byte `pos` of `n`, if not at the end of the last state;
    trims the walk's last state to what the file holds."""
    head, arc_size = 4 * k + 8, 4 * k + 12
    of = f" of {num_states}" if num_states >= 0 else ""
    s = len(starts)
    if s and counts[-1] < 0:
        at = starts.pop() + 4 * k
        return f"corrupt file: state {s - 1} has a negative arc count ({counts.pop()}) at byte {at}; expected >= 0"
    if pos > n:
        narcs, counts[-1] = counts[-1], (n - starts[-1] - head) // arc_size
        return (f"file ends inside the arcs of state {s - 1}{of} after {n} bytes (truncated); expected {narcs} "
                f"arcs of {arc_size} bytes from byte {starts[-1] + head}")
    if s < num_states and pos == n:  # ends on a record boundary: a cut there and a garbled count look the same
        return (f"file ends at byte {pos} after {s} of the {num_states} states its header announces "
                f"(truncated, or a corrupt header); expected the record of state {s} there")
    if (s < num_states or num_states < 0) and pos < n:
        return (f"file ends inside state {s}{of} after {n} bytes (truncated); expected its final weight and arc "
                f"count at byte {pos}")
    if pos != n:
        return f"corrupt file: {n - pos} bytes after the last of its {s} states at byte {pos}; expected the end"
    return None


def _gather(data: bytes, offsets: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """(len(offsets),) records of `dtype` read at the given byte offsets."""
    raw = np.frombuffer(data, dtype=np.uint8)
    picked = raw[offsets[:, None] + np.arange(dtype.itemsize)]  # (N, itemsize)
    return picked.reshape(-1).view(dtype)


def _read_vector(b: _Bytes, h: FstHeader) -> RawFst:
    k = _COSTS[h.arc_type]
    starts, counts, problem = _vector_records(b, h.num_states, k)
    n = np.asarray(counts, dtype=np.int64)  # (S,) arcs of each state
    state = np.repeat(np.arange(n.size, dtype=np.int64), n)  # (A,)
    within = np.arange(state.size) - (np.cumsum(n) - n)[state]  # (A,) index of each arc within its state
    at = np.asarray(starts, dtype=np.int64)[state] + 4 * k + 8 + within * (4 * k + 12)  # (A,)
    arcs = _gather(b.data, at, arc_dtype(k))
    num_states = len(starts) if h.num_states < 0 else h.num_states
    # a bad arc before the sizes go wrong means garbled data, whatever the sizes say after it
    bad = _first_bad_arc(arcs, state, within, at, num_states)
    if bad or problem:
        raise b.error(bad or problem)
    final = _gather(b.data, np.asarray(starts, dtype=np.int64), np.dtype([("w", "<f4", (k,))]))["w"]
    return RawFst(h, num_states, final, state, arcs)


def _read_const(b: _Bytes, h: FstHeader) -> RawFst:
    k = _COSTS[h.arc_type]
    tables, offsets = [], []
    for dtype, count, what in ((const_state_dtype(k), h.num_states, "states"), (arc_dtype(k), h.num_arcs, "arcs")):
        if h.flags & IS_ALIGNED:
            b.pos += -b.pos % ALIGN
        if b.pos + count * dtype.itemsize > len(b.data):
            raise b.error(f"file ends inside the table of {what} after {len(b.data)} bytes (truncated); "
                          f"expected {count} records of {dtype.itemsize} bytes from byte {b.pos}")
        tables.append(np.frombuffer(b.data, dtype=dtype, count=count, offset=b.pos))
        offsets.append(b.pos)
        b.pos += count * dtype.itemsize
    states, arcs = tables
    if b.pos != len(b.data):
        raise b.error(f"corrupt file: {len(b.data) - b.pos} bytes after the table of arcs at byte {b.pos}; "
                      "expected the file to end there")
    first, n = states["pos"].astype(np.int64), states["narcs"].astype(np.int64)  # (S,), (S,)
    over = np.flatnonzero(first + n > h.num_arcs)
    if over.size:
        s = int(over[0])
        raise b.error(f"corrupt file: state {s} (record at byte {offsets[0] + s * states.dtype.itemsize}) has arcs "
                      f"{first[s]} to {first[s] + n[s]}; expected them within the {h.num_arcs} arcs")
    state = np.repeat(np.arange(n.size, dtype=np.int64), n)  # (A',) arcs in state order
    within = np.arange(state.size) - (np.cumsum(n) - n)[state]
    index = first[state] + within  # (A',) each arc's place in the table of arcs
    at = offsets[1] + index * arcs.dtype.itemsize  # (A',)
    arcs = arcs[index]
    bad = _first_bad_arc(arcs, state, within, at, h.num_states)
    if bad:
        raise b.error(bad)
    return RawFst(h, h.num_states, states["final"].reshape(-1, k), state, arcs)


def _first_bad_arc(arcs: np.ndarray, state: np.ndarray, within: np.ndarray, at: np.ndarray,
                   num_states: int) -> str | None:
    """The first arc with a negative label or a next state outside the FST, described; None if none."""
    dest = arcs["nextstate"]
    bad = np.flatnonzero((arcs["ilabel"] < 0) | (arcs["olabel"] < 0) | (dest < 0) | (dest >= num_states))
    if not bad.size:
        return None
    i = int(bad[0])
    what = (f"its next state {dest[i]} is outside the {num_states} states" if not 0 <= dest[i] < num_states
            else f"its label {min(arcs['ilabel'][i], arcs['olabel'][i])} is negative")
    return (f"corrupt file: arc {within[i]} of state {state[i]} at byte {at[i]}: {what}; "
            "expected arcs 'ilabel olabel weight nextstate'")


def read_fst_raw(data: bytes, source: str) -> RawFst:
    """Parse a binary OpenFST file (the layout of formats/fst_layout.py) without interpreting labels or weights."""
    h = read_fst_header(data, source)
    b = _Bytes(data, source)
    b.pos = h.end
    fst = _read_vector(b, h) if h.fst_type == "vector" else _read_const(b, h)
    if h.start >= fst.num_states:  # checked with the header unless the states were not counted there
        raise b.error(f"corrupt file: the start state {h.start} is outside the {fst.num_states} states")
    return fst


def read_fst_bytes(data: bytes, symbols: SymbolTable, source: str = "<bytes>", name: str | None = None) -> Lattice:
    """A `Lattice` from the bytes of a binary OpenFST file: words are the output labels (ids of `symbols`, or
    mapped through the file's own output symbol table when it carries one); `lattice4` weights give (graph,
    acoustic), `standard` ones (graph, 0). Costs are the file's float32 values exactly.

    Arcs come in the order `fstprint` lists them (the start state's first, then by state), as the text
    route this replaces did. Errors name `source`, the state and, for damaged files, the byte offset.
    """
    fst = read_fst_raw(data, source)
    S, start = fst.num_states, fst.header.start
    if S == 0 or start < 0:
        raise LatticeFormatError(f"{source}: empty lattice (no states or no start state)")
    state, arcs = fst.state, fst.arcs  # in state order: with start 0 (the usual) its arcs are first already
    if start != 0:
        order = np.argsort(state != start, kind="stable")  # (A,) the start state's arcs first
        state, arcs = state[order], arcs[order]
    word = word_ids(fst.header.output_symbols, arcs["olabel"], state, symbols, source)
    with np.errstate(invalid="ignore"):  # a garbled weight may be a signalling NaN: check_costs names it
        cost = arcs["weight"].astype(np.float64)  # (A, k)
        final = fst.final.astype(np.float64)  # (S, k)
    check_costs(cost, final, state, arcs["nextstate"], start, source)
    if not cost.shape[0] and np.all(final == np.inf):
        raise LatticeFormatError(f"{source}: empty lattice (no arcs and no final states)")
    if final.shape[1] == 1:  # tropical: the one cost is the graph cost
        cost, final = np.pad(cost, ((0, 0), (0, 1))), np.pad(final, ((0, 0), (0, 1)))
    is_final = np.isfinite(final).all(axis=1)  # (S,) a Zero in either component is no final weight
    final[~is_final] = np.inf
    return Lattice(
        name=source if name is None else name, num_states=S, start=start,
        src=state, dst=arcs["nextstate"].astype(np.int64), word=word,
        graph=np.ascontiguousarray(cost[:, 0]), acoustic=np.ascontiguousarray(cost[:, 1]),
        final_graph=np.ascontiguousarray(final[:, 0]), final_acoustic=np.ascontiguousarray(final[:, 1]),
        symbols=symbols,
    )


def word_ids(osyms: dict[int, str] | None, olabel: np.ndarray, state: np.ndarray, symbols: SymbolTable,
              source: str) -> np.ndarray:
    """(A,) int64 ids in `symbols` of the output labels; a label unknown to `symbols` raises, naming the
    first such arc's state."""
    labels, inverse = np.unique(olabel.astype(np.int64), return_inverse=True)  # (U,), (A,)
    if osyms is None:
        ids, shown = labels, labels.tolist()
        known = (labels == 0) | symbols.has_ids(labels)
    else:  # the file names its labels: look the names up in `symbols`
        missing = [x for x in labels.tolist() if x not in osyms]
        if missing:
            raise LatticeFormatError(f"{source}: label {missing[0]} is not in the file's own output symbol table")
        shown = [osyms[x] for x in labels.tolist()]
        ids = np.asarray([symbols.id(w) if w in symbols else -1 for w in shown], dtype=np.int64)
        known = ids >= 0
    bad = np.flatnonzero(~known[inverse])
    if bad.size:
        i = int(bad[0])
        raise LatticeFormatError(f"{source}: state {state[i]}: label {shown[inverse[i]]} is not in the symbol "
                                 f"table ({len(symbols)} symbols)")
    return ids[inverse].astype(np.int64)


def check_costs(cost: np.ndarray, final: np.ndarray, state: np.ndarray, dst: np.ndarray, start: int,
                 source: str) -> None:
    """Arc costs must be finite, and no final cost NaN or -inf (+inf in a component means not final)."""
    def shown(w: np.ndarray) -> str:
        return ",".join(f"{x:g}" for x in w.tolist())

    bad = np.flatnonzero(~np.isfinite(cost).all(axis=1))
    if bad.size:
        i = int(bad[0])
        what = "is NaN" if np.isnan(cost[i]).any() else f"to state {dst[i]} is not finite"
        raise LatticeFormatError(f"{source}: state {state[i]}: the weight '{shown(cost[i])}' of the arc {what}")
    bad = np.flatnonzero((np.isnan(final) | (final == -np.inf)).any(axis=1))
    if bad.size:
        s = int(bad[np.argmax(bad == start)]) if start in bad else int(bad[0])  # fstprint lists the start first
        what = "is NaN" if np.isnan(final[s]).any() else "is -inf"
        raise LatticeFormatError(f"{source}: state {s}: final weight '{shown(final[s])}' {what}")


# ----------------------------------------------------------------------------------------------------------
# Writing

# what an FST with states and a start but no arcs or finals knows about itself (kaldifst writes 0x806a5a950003)
_NEW_FST = (Props.EXPANDED | Props.MUTABLE | Props.ACCEPTOR | Props.I_DETERMINISTIC | Props.O_DETERMINISTIC
            | Props.NO_EPSILONS | Props.NO_I_EPSILONS | Props.NO_O_EPSILONS | Props.I_SORTED | Props.O_SORTED
            | Props.UNWEIGHTED | Props.ACYCLIC | Props.INITIAL_ACYCLIC | Props.TOP_SORTED | Props.UNWEIGHTED_CYCLES)


def _set(props: int, yes: int, no: int) -> int:
    return (props | yes) & ~no


def built_properties(src: np.ndarray, dst: np.ndarray, word: np.ndarray, cost: np.ndarray,
                     final: np.ndarray) -> int:
    """The properties field kaldifst writes for a lattice built as `write_fst` used to build it with kaldifst:
    add every state, set the start, add the arcs in order (ilabel = olabel = word), then set the finals.

    A mutable OpenFST FST does not compute its properties when written: every AddArc and SetFinal updates
    the bits it can decide cheaply (AddArcProperties, SetFinalProperties), and the writer stores what that
    left. So the field depends on how the FST was built; replaying those updates for the build order above
    reproduces kaldifst's bytes (checked in tests/test_fst_binary.py). Arcs here are sorted by source, each
    state's in the order they were added: src, dst, word (A,); cost (A, k) and final (S, k) float32.
    """
    props = _NEW_FST
    if src.size:  # an arc forgets determinism and unweighted cycles; acyclicity it derives from top-sortedness
        props &= ~(Props.I_DETERMINISTIC | Props.O_DETERMINISTIC | Props.UNWEIGHTED_CYCLES | Props.ACYCLIC
                   | Props.INITIAL_ACYCLIC)
    if np.any(word == 0):
        props = _set(props, Props.EPSILONS | Props.I_EPSILONS | Props.O_EPSILONS,
                     Props.NO_EPSILONS | Props.NO_I_EPSILONS | Props.NO_O_EPSILONS)
    if np.any((src[1:] == src[:-1]) & (word[1:] < word[:-1])):  # compared with the state's previous arc
        props = _set(props, Props.NOT_I_SORTED | Props.NOT_O_SORTED, Props.I_SORTED | Props.O_SORTED)
    weighted_arc = np.any((cost != 0).any(axis=1) & (cost != np.inf).any(axis=1))  # neither One nor Zero
    weighted_final = np.any((final != 0).any(axis=1) & (final != np.inf).any(axis=1))
    if weighted_arc or weighted_final:
        props = _set(props, Props.WEIGHTED, Props.UNWEIGHTED)
    if np.any(dst <= src):
        props = _set(props, Props.NOT_TOP_SORTED, Props.TOP_SORTED)
    if src.size and props & Props.TOP_SORTED:
        props |= Props.ACYCLIC | Props.INITIAL_ACYCLIC
    return props


def write_fst_bytes(lat: Lattice, arc_type: str = "lattice4") -> bytes:
    """The bytes of `lat` as a binary OpenFST `vector` FST with `lattice4` weights (graph, acoustic) or
    `standard` ones (graph cost only: the lattice's acoustic costs must be 0), ilabel = olabel = word;
    the same bytes kaldifst writes for the lattice. States keep their ids; each state's arcs keep their
    order. Costs are stored as float32 (round to nearest), as in Kaldi.
    """
    if arc_type not in _COSTS:
        raise ValueError(f"arc type {arc_type!r} is not supported (expected lattice4 or standard)")
    lat._check_shapes()
    k, S, A = _COSTS[arc_type], lat.num_states, lat.num_arcs
    where = f"lattice {lat.name!r}"
    if k == 1 and np.any(lat.acoustic != 0):
        raise ValueError(f"{where} has acoustic costs; a tropical (standard) FST holds only one cost")
    if S > MAX_STATES or (A and not 0 <= lat.word.min() <= lat.word.max() <= MAX_STATES):
        raise LatticeFormatError(f"{where}: state ids and words must fit in int32 for an OpenFST file")
    order = np.argsort(lat.src, kind="stable")  # (A,) by state, each state's arcs in their order
    src, dst, word = lat.src[order], lat.dst[order], lat.word[order]
    is_final = lat.is_final()
    with np.errstate(over="ignore"):
        cost = np.stack([lat.graph, lat.acoustic], axis=1)[order, :k].astype(np.float32)  # (A, k)
        final = np.full((S, k), np.inf, dtype=np.float32)  # (S, k): Zero where not final
        final[is_final] = np.stack([lat.final_graph, lat.final_acoustic], axis=1)[is_final, :k]
    if not (np.isfinite(cost).all() and np.isfinite(final[is_final]).all()):
        raise LatticeFormatError(f"{where}: a cost is too large for float32")
    props = built_properties(src, dst, word, cost, final)
    header = vector_header(arc_type, props, lat.start, S)
    head = np.zeros(S, dtype=[("final", "<f4", (k,)), ("narcs", "<i8")])  # (S,) what precedes each state's arcs
    head["final"], head["narcs"] = final, np.bincount(src, minlength=S)
    arcs = np.zeros(A, dtype=arc_dtype(k))
    arcs["ilabel"] = arcs["olabel"] = word
    arcs["weight"], arcs["nextstate"] = cost, dst
    out = np.zeros(len(header) + S * head.itemsize + A * arcs.itemsize, dtype=np.uint8)
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    before = np.cumsum(head["narcs"]) - head["narcs"]  # (S,) arcs before each state's
    at = len(header) + np.arange(S) * head.itemsize + before * arcs.itemsize  # (S,) byte offset of each record
    out[at[:, None] + np.arange(head.itemsize)] = head.view(np.uint8).reshape(S, head.itemsize)
    within = np.arange(A) - before[src]  # (A,) each arc's index within its state
    arc_at = at[src] + head.itemsize + within * arcs.itemsize  # (A,)
    out[arc_at[:, None] + np.arange(arcs.itemsize)] = arcs.view(np.uint8).reshape(A, arcs.itemsize)
    return out.tobytes()
