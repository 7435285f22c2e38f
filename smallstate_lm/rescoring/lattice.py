"""In-memory word lattices (numpy arrays) and their I/O: OpenFST via kaldifst, and HTK SLF.

Costs are negated natural logs (lower is better), kept as two separate components per arc:
- `graph`: -ln P_lm (plus the decoder's word insertion penalty, in LM units) -- Kaldi's "graph cost";
- `acoustic`: -ln acoustic likelihood, unscaled.
A path's total is `graph_scale * sum(graph) + am_scale * sum(acoustic)` over its arcs and its final state
(for the bundled PocketSphinx lattices: graph_scale 1, am_scale 1/9.5).

Formats:
- OpenFST binary with Kaldi `lattice4` weights `(graph, acoustic)` (what `kaldifst.Lattice.read` opens), or
  with tropical weights (`StdVectorFst`, read as graph cost only);
- the OpenFST text form `src dst ilabel olabel graph,acoustic` / `state graph,acoustic` / `state`;
- HTK SLF (gzip or plain), words on links or on nodes, `a=` / `l=` natural-log scores.

Every reader names the file and the line (or, for binary files, the state) of the first problem.
"""

from __future__ import annotations

import heapq
import math
import os
import re
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SmallstateError
from ..files import atomic_output, atomic_write_text, read_lines


class LatticeFormatError(SmallstateError):
    """A lattice or symbol table is malformed, or a lattice is unusable (cycle, no final state)."""


class LatticeWarning(UserWarning):
    """A lattice was repaired on the way in (states that lie on no complete path were dropped)."""


# Symbols that are not words: `<eps>`, `<s>`, `</s>`, `<sil>`, `#0`, `[NOISE]`, HTK's `!NULL` / `!SENT_END`.
# `<unk>` is the exception: it stands for a real (unknown) word and is counted and scored as one.
_NON_WORD_PREFIXES = ("#", "<", "[", "!")
_WORD_EXCEPTIONS = frozenset({"<unk>"})


def _is_word_symbol(w: str) -> bool:
    return w in _WORD_EXCEPTIONS or not w.startswith(_NON_WORD_PREFIXES)


class SymbolTable:
    """Words <-> integer ids of a decoder's `words.txt` (`word id` per line; ids need not be contiguous).

    Id 0 is epsilon (`<eps>`). Reduced tables may keep the original, sparse ids of a larger table so that
    binary lattices written against the large table stay valid.
    """

    def __init__(self, pairs: list[tuple[str, int]], source: str = "<symbols>") -> None:
        self._id: dict[str, int] = {}
        self._word: dict[int, str] = {}
        for w, i in pairs:
            if w in self._id:
                raise LatticeFormatError(f"{source}: word {w!r} appears twice (ids {self._id[w]} and {i})")
            if i in self._word:
                raise LatticeFormatError(f"{source}: id {i} is given to both {self._word[i]!r} and {w!r}")
            if i < 0:
                raise LatticeFormatError(f"{source}: id of {w!r} must be >= 0, got {i}")
            self._id[w] = i
            self._word[i] = w
        self._mask: np.ndarray | None = None

    @classmethod
    def read(cls, path: str | os.PathLike) -> SymbolTable:
        """Read `word id` lines (spaces or tabs); errors name `file:line`."""
        path = Path(path)
        lines = read_lines(path, LatticeFormatError, "symbol table")
        pairs: list[tuple[str, int]] = []
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

    def is_word(self, i: int) -> bool:
        """False for epsilon (0) and for markers/fillers (`<s>`, `</s>`, `#0`, `<sil>`, `[NOISE]`, `!NULL`)."""
        i = int(i)
        return i != 0 and _is_word_symbol(self.word(i))

    def word_mask(self) -> np.ndarray:
        """(max_id + 1,) bool: `is_word` for every id, for vectorised use (`mask[lattice.word]`)."""
        if self._mask is None:
            mask = np.zeros(max(self._word, default=0) + 1, dtype=bool)
            for i, w in self._word.items():
                mask[i] = i != 0 and _is_word_symbol(w)
            self._mask = mask
        return self._mask

    def write(self, path: str | os.PathLike) -> None:
        """Write `word id` lines sorted by id."""
        text = "".join(f"{self._word[i]} {i}\n" for i in sorted(self._word))
        atomic_write_text(path, text)


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
        return Lattice(
            name=self.name, num_states=int(order.size), start=0,
            src=nsrc[perm], dst=ndst[perm], word=self.word[arc_keep][perm].copy(),
            graph=self.graph[arc_keep][perm].copy(), acoustic=self.acoustic[arc_keep][perm].copy(),
            final_graph=self.final_graph[order].copy(), final_acoustic=self.final_acoustic[order].copy(),
            symbols=self.symbols,
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
        by_dst = np.argsort(lat.dst, kind="stable")
        offsets = np.searchsorted(lat.dst[by_dst], np.arange(S + 1))  # (S+1,) incoming arcs of each state
        dist = np.full(S, np.inf)
        back = np.full(S, -1, dtype=np.int64)  # best incoming arc
        dist[0] = 0.0
        src_sorted, cost_sorted = lat.src[by_dst], cost[by_dst]
        for s in range(1, S):  # topological order: every source of s is done
            lo, hi = offsets[s], offsets[s + 1]
            if lo == hi:
                continue
            cand = dist[src_sorted[lo:hi]] + cost_sorted[lo:hi]
            j = int(np.argmin(cand))
            dist[s], back[s] = cand[j], by_dst[lo + j]
        total = dist + final
        s = int(np.argmin(total))
        if not math.isfinite(total[s]):
            raise LatticeFormatError(f"lattice {lat.name!r} has no finite-cost complete path")
        arcs = []
        while s != 0:
            a = int(back[s])
            arcs.append(a)
            s = int(lat.src[a])
        mask = lat.symbols.word_mask()
        words = [lat.symbols.word(w) for w in lat.word[arcs[::-1]] if w < mask.size and mask[w]]
        return words, float(total.min())


def _reach(S: int, frm: np.ndarray, to: np.ndarray, seeds: list[int]) -> np.ndarray:
    """(S,) bool: states reachable from `seeds` following arcs frm -> to."""
    order = np.argsort(frm, kind="stable")
    offsets = np.searchsorted(frm[order], np.arange(S + 1))
    targets = to[order]
    seen = np.zeros(S, dtype=bool)
    seen[seeds] = True
    stack = list(seeds)
    while stack:
        s = stack.pop()
        nxt = targets[offsets[s]:offsets[s + 1]]
        new = nxt[~seen[nxt]]
        seen[new] = True
        stack.extend(new.tolist())
    return seen


def _topological_order(S: int, keep: np.ndarray, src: np.ndarray, dst: np.ndarray, name: str) -> np.ndarray:
    """Kept states in topological order, smallest id first among the ready ones (so an already sorted
    lattice keeps its numbering). After trimming, the start is the only state without predecessors, so it
    comes first. A cycle raises, naming a state on it."""
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


# ----------------------------------------------------------------------------------------------------------
# OpenFST text and binary

_FST_SUFFIXES = (".lat.fst", ".fst", ".lm.slf.gz", ".lat.slf.gz", ".slf.gz", ".lat.gz", ".slf", ".lat", ".gz")


def _stem(path: Path) -> str:
    name = path.name
    for suf in _FST_SUFFIXES:
        if name.endswith(suf) and len(name) > len(suf):
            return name[: -len(suf)]
    return name


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


def _parse_fst_text(text: str, symbols: SymbolTable, name: str, source: str, line_numbers: bool,
                    num_states: int | None = None, start: int | None = None) -> Lattice:
    """Parse the OpenFST text form; `line_numbers` False (binary files) names only the state in errors."""
    src: list[int] = []
    dst: list[int] = []
    word: list[int] = []
    g: list[float] = []
    ac: list[float] = []
    finals: dict[int, tuple[float, float]] = {}
    first: int | None = None
    max_state = -1
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        loc = f"{source}:{n}" if line_numbers else source
        try:
            s = int(parts[0])
            d = int(parts[1]) if len(parts) >= 4 else None
        except ValueError:
            raise LatticeFormatError(f"{loc}: state ids must be integers, got {line.strip()!r}") from None
        where = f"{loc}: state {s}"
        if s < 0 or (d is not None and d < 0):
            raise LatticeFormatError(f"{where}: state ids must be >= 0, got {line.strip()!r}")
        if first is None:
            first = s
        if len(parts) in (1, 2):
            gc, acc = _parse_cost(parts[1], where) if len(parts) == 2 else (0.0, 0.0)
            if gc == -math.inf or acc == -math.inf:
                raise LatticeFormatError(f"{where}: final weight {parts[1]!r} is -inf")
            if s in finals:
                raise LatticeFormatError(f"{where}: the state has a second final weight")
            if math.isfinite(gc) and math.isfinite(acc):
                finals[s] = (gc, acc)
            max_state = max(max_state, s)
            continue
        if len(parts) not in (4, 5):
            raise LatticeFormatError(f"{loc}: expected 'src dst ilabel olabel [graph,acoustic]' or "
                                     f"'state [graph,acoustic]', got {line.strip()!r}")
        label = parts[3]
        try:
            w = int(label)
            known = w == 0 or symbols.has_id(w)
        except ValueError:  # symbolic labels (fstprint with a symbol table)
            w = symbols._id.get(label, -1)
            known = w >= 0
        if not known:
            raise LatticeFormatError(f"{where}: label {label} is not in the symbol table ({len(symbols)} symbols)")
        gc, acc = _parse_cost(parts[4], where) if len(parts) == 5 else (0.0, 0.0)
        if not (math.isfinite(gc) and math.isfinite(acc)):
            raise LatticeFormatError(f"{where}: arc to state {d} has a non-finite weight {parts[4]!r}")
        src.append(s)
        dst.append(d)
        word.append(w)
        g.append(gc)
        ac.append(acc)
        max_state = max(max_state, s, d)
    if first is None:
        raise LatticeFormatError(f"{source}: empty lattice (no arcs and no final states)")
    S = max_state + 1 if num_states is None else num_states
    if max_state >= S:
        raise LatticeFormatError(f"{source}: state {max_state} is beyond the {S} states of the lattice")
    fg = np.full(S, np.inf)
    fa = np.full(S, np.inf)
    for s, (gc, acc) in finals.items():
        fg[s], fa[s] = gc, acc
    return Lattice(
        name=name, num_states=S, start=first if start is None else start,
        src=np.asarray(src, dtype=np.int64), dst=np.asarray(dst, dtype=np.int64),
        word=np.asarray(word, dtype=np.int64), graph=np.asarray(g, dtype=np.float64),
        acoustic=np.asarray(ac, dtype=np.float64), final_graph=fg, final_acoustic=fa, symbols=symbols,
    )


def read_fst_text(text: str, symbols: SymbolTable, name: str = "<text>") -> Lattice:
    """Parse the OpenFST text form: arcs `src dst ilabel olabel [graph,acoustic]`, finals `state [weight]`.

    The start state is the source of the first line (OpenFST's convention). Words are output labels:
    integer ids of `symbols`, or the symbols themselves. A single-cost weight is tropical (acoustic 0);
    a missing weight is 0. Errors name `name:line` and the state.
    """
    return _parse_fst_text(text, symbols, name, name, line_numbers=True)


_FST_MAGIC = 2125659606
_ARC_SIZES = {"lattice4": (20, 8), "standard": (16, 4)}  # bytes per arc, bytes per final weight


def _read_fst_header(path: Path, data: bytes) -> str:
    """Check the OpenFST header (and for a vector FST without symbol tables, the exact file size);
    return the arc type. Done here so that bad files get a clear error rather than kaldifst's stderr."""
    def fail(msg: str) -> LatticeFormatError:
        return LatticeFormatError(f"{path}: {msg}")

    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise fail(f"file ends inside the OpenFST header after {len(data)} bytes (truncated?)")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    def string() -> str:
        (n,) = take("<i")
        if not 0 <= n <= 256:
            raise fail("corrupt OpenFST header")
        (raw,) = take(f"<{n}s")
        return raw.decode("ascii", "replace")

    if len(data) < 4 or struct.unpack_from("<i", data)[0] != _FST_MAGIC:
        raise fail("not a binary OpenFST file (bad magic number)")
    pos = 4
    fst_type, arc_type = string(), string()
    _version, flags, _props, _start, num_states, _num_arcs = take("<iiQqqq")
    if arc_type not in _ARC_SIZES:
        raise fail(f"arc type {arc_type!r} is not supported (expected lattice4 or standard)")
    if fst_type != "vector":
        raise fail(f"FST type {fst_type!r} is not supported (expected vector)")
    if flags & 0x3 == 0 and num_states >= 0:  # no symbol tables: the state records follow
        arc_bytes, weight_bytes = _ARC_SIZES[arc_type]
        p = pos
        for s in range(num_states):
            if p + weight_bytes + 8 > len(data):
                raise fail(f"file ends inside state {s} of {num_states} (truncated)")
            (narcs,) = struct.unpack_from("<q", data, p + weight_bytes)
            p += weight_bytes + 8 + narcs * arc_bytes
            if narcs < 0 or p > len(data):
                raise fail(f"file ends inside the arcs of state {s} of {num_states} (truncated)")
        if p != len(data):
            raise fail(f"{len(data) - p} unexpected bytes after the last state")
    return arc_type


def read_fst(path: str | os.PathLike, symbols: SymbolTable) -> Lattice:
    """Read a binary OpenFST lattice: Kaldi `lattice4` weights `(graph, acoustic)`, or tropical weights
    (`StdVectorFst`, read as graph cost with acoustic 0). Words are the output labels.

    Costs come through the text form, so they carry its 6 significant digits.
    """
    import kaldifst

    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LatticeFormatError(f"{path}: lattice file not found") from None
    arc_type = _read_fst_header(path, data)
    fst = (kaldifst.Lattice if arc_type == "lattice4" else kaldifst.StdVectorFst).read(str(path))
    if fst is None:
        raise LatticeFormatError(f"{path}: kaldifst could not read this {arc_type} FST (corrupt file?)")
    if fst.num_states == 0 or fst.start < 0:
        raise LatticeFormatError(f"{path}: empty lattice (no states or no start state)")
    return _parse_fst_text(str(fst), symbols, _stem(path), str(path), line_numbers=False,
                           num_states=fst.num_states, start=fst.start)


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


def write_fst(path: str | os.PathLike, lattice: Lattice) -> None:
    """Write a binary OpenFST lattice with Kaldi `lattice4` weights (ilabel = olabel = word), atomically.

    Costs are stored as float32 (as in Kaldi); `read_fst` returns them with 6 significant digits.
    """
    import kaldifst

    path = Path(path)
    lattice._check_shapes()
    fst = kaldifst.Lattice()
    for _ in range(lattice.num_states):
        fst.add_state()
    fst.start = lattice.start
    for s, d, w, g, a in zip(lattice.src.tolist(), lattice.dst.tolist(), lattice.word.tolist(),
                             lattice.graph.tolist(), lattice.acoustic.tolist()):
        fst.add_arc(s, kaldifst.LatticeArc(w, w, kaldifst.LatticeWeight(g, a), d))
    for s in np.flatnonzero(lattice.is_final()).tolist():
        fst.set_final(s, kaldifst.LatticeWeight(float(lattice.final_graph[s]), float(lattice.final_acoustic[s])))
    with atomic_output(path) as tmp:
        if not fst.write(str(tmp)):
            raise OSError(f"{path}: kaldifst could not write the lattice")


# ----------------------------------------------------------------------------------------------------------
# HTK SLF

_SLF_FIELD = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\]|\\.)*"|\S*)')
_SLF_ALIASES = {"NODES": "N", "LINKS": "L", "WORD": "W", "START": "S", "END": "E", "acoustic": "a",
                "language": "l", "time": "t"}


def _slf_fields(line: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    line = line.rstrip()
    while pos < len(line):
        m = _SLF_FIELD.match(line, pos)
        if not m:
            raise LatticeFormatError(f"{where}: expected 'key=value' fields, got {line[pos:].strip()!r}")
        key, val = m.group(1), m.group(2)
        if val.startswith('"'):
            val = re.sub(r"\\(.)", r"\1", val[1:-1])
        key = _SLF_ALIASES.get(key, key)
        if key in out:
            raise LatticeFormatError(f"{where}: field {key}= appears twice")
        out[key] = val
        pos = m.end()
    return out


def _slf_text(path: Path) -> str:
    """File contents as text; gzip is recognised by its magic bytes, not its name."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LatticeFormatError(f"{path}: lattice file not found") from None
    if data[:2] == b"\x1f\x8b":
        chunks: list[bytes] = []
        rest = data
        while rest:  # gzip members may be concatenated
            d = zlib.decompressobj(wbits=31)
            try:
                chunks.append(d.decompress(rest))
            except zlib.error as e:
                line = b"".join(chunks).count(b"\n") + 1
                raise LatticeFormatError(f"{path}:{line}: corrupt gzip data ({e})") from None
            if not d.eof:
                line = b"".join(chunks).count(b"\n") + 1
                raise LatticeFormatError(f"{path}:{line}: gzip data ends early (truncated file)")
            rest = d.unused_data
            if rest[:2] != b"\x1f\x8b":
                break
        data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise LatticeFormatError(f"{path}:{line}: not UTF-8 text") from None


def read_slf(path: str | os.PathLike, symbols: SymbolTable | None = None) -> Lattice:
    """Read an HTK SLF file (gzip or plain); see `read_slf_text`. Errors name `file:line`."""
    path = Path(path)
    return read_slf_text(_slf_text(path), symbols, name=str(path), lattice_name=_stem(path))


def read_slf_text(text: str, symbols: SymbolTable | None = None, name: str = "<text>",
                  lattice_name: str | None = None) -> Lattice:
    """Parse HTK Standard Lattice Format text into graph/acoustic costs; errors name `name:line`.

    - Nodes are states (`I=`); links are arcs (`J= S= E=`). A link's word is its own `W=`, else the
      `W=` of its end node. `!NULL`, `<s>`, `</s>`, `<sil>` and fillers are not words (`is_word` False):
      id 0 for `!NULL` or a marker absent from `symbols`.
    - acoustic cost = -a (natural log; `base=` other than e is converted). `acscale` is not applied.
    - graph cost = -l + p, with p = -wdpenalty / lmscale (the insertion penalty in LM units) on every
      link that carries a word, and on the link that carries the sentence end (`W=</s>`, or a link into
      the end node with a non-zero `l=`, where PocketSphinx puts the `</s>` LM score). This matches the
      decoder's FST lattices, whose word arcs and final weights are -ln P + 0.06627.
    - The `end=` node (default: every node without outgoing links) is final with cost 0.

    If `symbols` is None a table is built from the lattice's words.
    """
    path = name  # what error messages call the source
    lines = text.splitlines()
    header: dict[str, str] = {}
    header_line: dict[str, int] = {}
    N = L = None
    node_word: dict[int, str] = {}
    node_line: dict[int, int] = {}
    links: list[tuple[int, int, int, str | None, float, float]] = []  # line, S, E, W, a, l
    link_ids: set[int] = set()
    last = 0

    def number(fields: dict[str, str], key: str, where: str, kind: type = float, default: str | None = None):
        raw = fields.get(key, default)
        if raw is None:
            raise LatticeFormatError(f"{where}: missing {key}= field")
        try:
            x = kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise LatticeFormatError(f"{where}: {key}= must be {what}, got {raw!r}") from None
        if kind is float and not math.isfinite(x):
            raise LatticeFormatError(f"{where}: {key}= must be finite, got {raw!r}")
        return x

    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        last = n
        where = f"{path}:{n}"
        f = _slf_fields(line, where)
        if "I" in f or "J" in f:
            if N is None or L is None:
                raise LatticeFormatError(f"{where}: node/link lines before the N= and L= counts")
        if "I" in f:
            i = number(f, "I", where, int)
            if not 0 <= i < N:
                raise LatticeFormatError(f"{where}: node I={i} is outside [0, N={N})")
            if i in node_line:
                raise LatticeFormatError(f"{where}: node I={i} already defined on line {node_line[i]}")
            node_line[i] = n
            if "W" in f:
                node_word[i] = f["W"]
        elif "J" in f:
            j = number(f, "J", where, int)
            if not 0 <= j < L:
                raise LatticeFormatError(f"{where}: link J={j} is outside [0, L={L})")
            if j in link_ids:
                raise LatticeFormatError(f"{where}: link J={j} appears twice")
            link_ids.add(j)
            s, e = number(f, "S", where, int), number(f, "E", where, int)
            a, lm = number(f, "a", where, default="0"), number(f, "l", where, default="0")
            links.append((n, s, e, f.get("W"), a, lm))
        else:
            for k, v in f.items():
                header[k], header_line[k] = v, n
            if "N" in f:
                N = number(f, "N", where, int)
                if N <= 0:
                    raise LatticeFormatError(f"{where}: N= must be positive, got {N}")
            if "L" in f:
                L = number(f, "L", where, int)
                if L < 0:
                    raise LatticeFormatError(f"{where}: L= must be >= 0, got {L}")
    if N is None or L is None:
        missing = " and ".join(k + "=" for k, v in (("N", N), ("L", L)) if v is None)
        raise LatticeFormatError(f"{path}:{max(last, 1)}: no {missing} count in the file")
    if len(links) != L:
        raise LatticeFormatError(f"{path}:{last}: file ends after {len(links)} of L={L} links (truncated?)")

    def hnum(key: str, default: float) -> float:
        if key not in header:
            return default
        return number(header, key, f"{path}:{header_line[key]}")

    base = hnum("base", math.e)
    if base <= 1.0:
        raise LatticeFormatError(f"{path}:{header_line['base']}: base={base} is not supported (need > 1)")
    to_ln = math.log(base)
    lmscale = hnum("lmscale", 1.0)
    if lmscale <= 0:
        raise LatticeFormatError(f"{path}:{header_line['lmscale']}: lmscale must be positive, got {lmscale}")
    penalty = -hnum("wdpenalty", 0.0) * to_ln / lmscale  # LM units, added to the graph cost

    for n, s, e, *_ in links:
        for node in (s, e):
            if not 0 <= node < N or (node_line and node not in node_line):
                raise LatticeFormatError(f"{path}:{n}: link refers to undefined node {node} (N={N})")
    if "start" in header:
        start = int(number(header, "start", f"{path}:{header_line['start']}", int))
    else:
        has_in = np.zeros(N, dtype=bool)
        has_in[[e for _, _, e, *_ in links]] = True
        cands = np.flatnonzero(~has_in)
        if cands.size != 1:
            raise LatticeFormatError(f"{path}: no start= and {cands.size} nodes without incoming links")
        start = int(cands[0])
    if "end" in header:
        ends = [int(number(header, "end", f"{path}:{header_line['end']}", int))]
    else:
        has_out = np.zeros(N, dtype=bool)
        has_out[[s for _, s, *_ in links]] = True
        ends = np.flatnonzero(~has_out).tolist()
    for key, v in (("start", [start]), ("end", ends)):
        if any(not 0 <= x < N for x in v):
            raise LatticeFormatError(f"{path}:{header_line.get(key, 1)}: {key} node is outside [0, N={N})")
    end_set = set(ends)

    link_words = [w if w is not None else node_word.get(e, "!NULL") for _, _, e, w, _, _ in links]
    if symbols is None:
        symbols = SymbolTable.from_words([w for w in link_words if w != "!NULL"])
    ids = np.zeros(len(links), dtype=np.int64)
    graph = np.zeros(len(links))
    for k, ((n, _s, e, _w, _a, lm), w) in enumerate(zip(links, link_words)):
        real = _is_word_symbol(w) and w != "!NULL"
        if w == "!NULL":
            ids[k] = 0
        elif w in symbols:
            ids[k] = symbols.id(w)
        elif real:
            raise LatticeFormatError(f"{path}:{n}: word {w!r} is not in the symbol table ({len(symbols)} symbols)")
        # markers absent from the table (`<sil>`, `[NOISE]`) stay epsilon: id 0
        sentence_end = w == "</s>" or (e in end_set and lm != 0.0)
        graph[k] = -lm * to_ln + (penalty if real or sentence_end else 0.0)
    final = np.full(N, np.inf)
    final[ends] = 0.0
    return Lattice(
        name=lattice_name or _stem(Path(name)), num_states=N, start=start,
        src=np.asarray([s for _, s, *_ in links], dtype=np.int64),
        dst=np.asarray([e for _, _, e, *_ in links], dtype=np.int64),
        word=ids, graph=graph, acoustic=np.asarray([-a * to_ln for *_, a, _ in links], dtype=np.float64),
        final_graph=final, final_acoustic=final.copy(), symbols=symbols,
    )
