"""HTK Standard Lattice Format (SLF) files, gzip or plain, read into `Lattice`s with natural-log costs.

Every reader names the file and the line of the first problem.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..lattices.lattice import Lattice, LatticeFormatError, SymbolTable, is_word_symbol
from .resolve import read_lattice_file, utterance_id

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
    data = read_lattice_file(path)
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
    return read_slf_text(_slf_text(path), symbols, name=str(path), lattice_name=utterance_id(path))


def _slf_number(fields: dict[str, str], key: str, where: str, kind: type = float, default: str | None = None):
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


def _slf_index(fields: dict[str, str], what: str, count: tuple[str, int], where: str) -> int:
    """The node (`what` "node I") or link ("link J") number of a line, checked against the header's `count`."""
    i = _slf_number(fields, what[-1], where, int)
    if not 0 <= i < count[1]:
        raise LatticeFormatError(f"{where}: {what}={i} is outside [0, {count[0]}={count[1]})")
    return i


@dataclass
class _SlfLines:
    """What the lines of an SLF file say, checked line by line; `links` rows are (line, S, E, W, a, l)."""

    path: str
    header: dict[str, str] = field(default_factory=dict)
    header_line: dict[str, int] = field(default_factory=dict)
    N: int | None = None
    L: int | None = None
    node_word: dict[int, str] = field(default_factory=dict)
    node_time: dict[int, float] = field(default_factory=dict)  # seconds, from `t=`
    node_line: dict[int, int] = field(default_factory=dict)
    links: list[tuple[int, int, int, str | None, float, float]] = field(default_factory=list)
    link_ids: set[int] = field(default_factory=set)
    last: int = 0

    def node(self, f: dict[str, str], n: int, where: str) -> None:
        i = _slf_index(f, "node I", ("N", self.N), where)
        if i in self.node_line:
            raise LatticeFormatError(f"{where}: node I={i} already defined on line {self.node_line[i]}")
        self.node_line[i] = n
        if "W" in f:
            self.node_word[i] = f["W"]
        if "t" in f:
            self.node_time[i] = _slf_number(f, "t", where)

    def link(self, f: dict[str, str], n: int, where: str) -> None:
        j = _slf_index(f, "link J", ("L", self.L), where)
        if j in self.link_ids:
            raise LatticeFormatError(f"{where}: link J={j} appears twice")
        self.link_ids.add(j)
        s, e = _slf_number(f, "S", where, int), _slf_number(f, "E", where, int)
        a, lm = _slf_number(f, "a", where, default="0"), _slf_number(f, "l", where, default="0")
        self.links.append((n, s, e, f.get("W"), a, lm))

    def header_fields(self, f: dict[str, str], n: int, where: str) -> None:
        for k, v in f.items():
            self.header[k], self.header_line[k] = v, n
        if "N" in f:
            self.N = _slf_number(f, "N", where, int)
            if self.N <= 0:
                raise LatticeFormatError(f"{where}: N= must be positive, got {self.N}")
        if "L" in f:
            self.L = _slf_number(f, "L", where, int)
            if self.L < 0:
                raise LatticeFormatError(f"{where}: L= must be >= 0, got {self.L}")

    def header_number(self, key: str, default: float, kind: type = float):
        if key not in self.header:
            return default
        return _slf_number(self.header, key, f"{self.path}:{self.header_line[key]}", kind)


def _slf_scan(text: str, path: str) -> _SlfLines:
    p = _SlfLines(path)
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        p.last = n
        where = f"{path}:{n}"
        f = _slf_fields(line, where)
        if ("I" in f or "J" in f) and (p.N is None or p.L is None):
            raise LatticeFormatError(f"{where}: node/link lines before the N= and L= counts")
        if "I" in f:
            p.node(f, n, where)
        elif "J" in f:
            p.link(f, n, where)
        else:
            p.header_fields(f, n, where)
    if p.N is None or p.L is None:
        missing = " and ".join(k + "=" for k, v in (("N", p.N), ("L", p.L)) if v is None)
        raise LatticeFormatError(f"{path}:{max(p.last, 1)}: no {missing} count in the file")
    if len(p.links) != p.L:
        raise LatticeFormatError(f"{path}:{p.last}: file ends after {len(p.links)} of L={p.L} links (truncated?)")
    for n, s, e, *_ in p.links:
        for node in (s, e):
            if not 0 <= node < p.N or (p.node_line and node not in p.node_line):
                raise LatticeFormatError(f"{path}:{n}: link refers to undefined node {node} (N={p.N})")
    return p


def _slf_scales(p: _SlfLines) -> tuple[float, float]:
    """(ln of the log base, the word insertion penalty in natural-log LM units)."""
    base = p.header_number("base", math.e)
    if base <= 1.0:
        raise LatticeFormatError(f"{p.path}:{p.header_line['base']}: base={base} is not supported (need > 1)")
    to_ln = math.log(base)
    lmscale = p.header_number("lmscale", 1.0)
    if lmscale <= 0:
        raise LatticeFormatError(f"{p.path}:{p.header_line['lmscale']}: lmscale must be positive, got {lmscale}")
    return to_ln, -p.header_number("wdpenalty", 0.0) * to_ln / lmscale


def _slf_endpoints(p: _SlfLines) -> tuple[int, list[int]]:
    """The start node and the end nodes: from start=/end=, else the nodes without incoming/outgoing links."""
    N = p.N
    if "start" in p.header:
        start = int(p.header_number("start", 0, int))
    else:
        has_in = np.zeros(N, dtype=bool)
        has_in[[e for _, _, e, *_ in p.links]] = True
        cands = np.flatnonzero(~has_in)
        if cands.size != 1:
            raise LatticeFormatError(f"{p.path}: no start= and {cands.size} nodes without incoming links")
        start = int(cands[0])
    if "end" in p.header:
        ends = [int(p.header_number("end", 0, int))]
    else:
        has_out = np.zeros(N, dtype=bool)
        has_out[[s for _, s, *_ in p.links]] = True
        ends = np.flatnonzero(~has_out).tolist()
    for key, v in (("start", [start]), ("end", ends)):
        if any(not 0 <= x < N for x in v):
            raise LatticeFormatError(f"{p.path}:{p.header_line.get(key, 1)}: {key} node is outside [0, N={N})")
    return start, ends


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
    p = _slf_scan(text, name)
    to_ln, penalty = _slf_scales(p)
    start, ends = _slf_endpoints(p)
    end_set = set(ends)
    link_words = [w if w is not None else p.node_word.get(e, "!NULL") for _, _, e, w, _, _ in p.links]
    if symbols is None:
        symbols = SymbolTable.from_words([w for w in link_words if w != "!NULL"])
    ids = np.zeros(len(p.links), dtype=np.int64)
    graph = np.zeros(len(p.links))
    for k, ((n, _s, e, _w, _a, lm), w) in enumerate(zip(p.links, link_words)):
        real = is_word_symbol(w) and w != "!NULL"
        if w == "!NULL":
            ids[k] = 0
        elif w in symbols:
            ids[k] = symbols.id(w)
        elif real:
            raise LatticeFormatError(f"{name}:{n}: word {w!r} is not in the symbol table ({len(symbols)} symbols)")
        # markers absent from the table (`<sil>`, `[NOISE]`) stay epsilon: id 0
        sentence_end = w == "</s>" or (e in end_set and lm != 0.0)
        graph[k] = -lm * to_ln + (penalty if real or sentence_end else 0.0)
    final = np.full(p.N, np.inf)
    final[ends] = 0.0
    times = None
    if p.node_time and len(p.node_time) == p.N:  # CTM output needs every node's time; partial times are ignored
        times = np.zeros(p.N)
        times[list(p.node_time)] = list(p.node_time.values())
    return Lattice(
        name=lattice_name or utterance_id(name), num_states=p.N, start=start,
        src=np.asarray([s for _, s, *_ in p.links], dtype=np.int64),
        dst=np.asarray([e for _, _, e, *_ in p.links], dtype=np.int64),
        word=ids, graph=graph, acoustic=np.asarray([-a * to_ln for *_, a, _ in p.links], dtype=np.float64),
        final_graph=final, final_acoustic=final.copy(), symbols=symbols, state_time=times,
    )
