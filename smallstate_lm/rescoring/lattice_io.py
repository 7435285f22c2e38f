"""Lattice file formats: one table of what we read, detection, reading and writing.

Formats:
- OpenFST binary with Kaldi `lattice4` weights `(graph, acoustic)` (what `kaldifst.Lattice.read` opens), or
  with tropical weights (`StdVectorFst`, read as graph cost only);
- the OpenFST text form `src dst ilabel olabel graph,acoustic` / `state graph,acoustic` / `state`;
- HTK SLF (gzip or plain), words on links or on nodes, `a=` / `l=` natural-log scores;
- Kaldi lattice archives (binary or text, plain or gzip `lat.N.gz`) and scripts (`key path.ark:offset`), many
  lattices per file (kaldi_archive.py).

A file's format is told by its name where the name tells (`.lat.fst`, `.slf.gz`, `.ark`), else by its first
bytes (`x.lat.gz` may be SLF or a Kaldi archive): see `lattice_format`.

Every reader names the file and the line (or, for binary files, the state and the byte offset) of the first
problem.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Iterator

import numpy as np

from ..files import atomic_write_bytes
from .fst_binary import FST_MAGIC, read_fst_bytes, write_fst_bytes
from .kaldi_archive import iter_kaldi_archive, iter_kaldi_script, looks_like_kaldi_archive, looks_like_kaldi_script
from .lattice import Lattice, LatticeFormatError, SymbolTable, is_word_symbol

FST_MAGIC_BYTES = struct.pack("<i", FST_MAGIC)


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


def _parse_fst_text(text: str, symbols: SymbolTable, name: str, source: str) -> Lattice:
    """Parse the OpenFST text form; errors name `source:line` and the state."""
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
        loc = f"{source}:{n}"
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
    S = max_state + 1
    fg = np.full(S, np.inf)
    fa = np.full(S, np.inf)
    for s, (gc, acc) in finals.items():
        fg[s], fa[s] = gc, acc
    return Lattice(
        name=name, num_states=S, start=first,
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
    return _parse_fst_text(text, symbols, name, name)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise LatticeFormatError(f"{path}: lattice file not found") from None
    except OSError as e:  # a directory, no permission: still one file's error, not the run's
        raise LatticeFormatError(f"{path}: cannot read the lattice file ({e.strerror})") from None


def read_fst(path: str | os.PathLike, symbols: SymbolTable) -> Lattice:
    """Read a binary OpenFST lattice: Kaldi `lattice4` weights `(graph, acoustic)`, or tropical weights
    (`StdVectorFst`, read as graph cost with acoustic 0); a vector or const FST. Words are the output labels.

    The bytes are parsed directly (fst_binary.py), so costs are the file's float32 values exactly.
    """
    path = Path(path)
    return read_fst_bytes(_read_bytes(path), symbols, str(path), utterance_id(path))


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
    """Write a binary OpenFST lattice with Kaldi `lattice4` weights (ilabel = olabel = word), atomically:
    the bytes kaldifst writes for it. Costs are stored as float32 (as in Kaldi); `read_fst` returns them
    exactly.
    """
    atomic_write_bytes(path, write_fst_bytes(lattice, "lattice4"))


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
    data = _read_bytes(path)
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
        i = _slf_number(f, "I", where, int)
        if not 0 <= i < self.N:
            raise LatticeFormatError(f"{where}: node I={i} is outside [0, N={self.N})")
        if i in self.node_line:
            raise LatticeFormatError(f"{where}: node I={i} already defined on line {self.node_line[i]}")
        self.node_line[i] = n
        if "W" in f:
            self.node_word[i] = f["W"]
        if "t" in f:
            self.node_time[i] = _slf_number(f, "t", where)

    def link(self, f: dict[str, str], n: int, where: str) -> None:
        j = _slf_number(f, "J", where, int)
        if not 0 <= j < self.L:
            raise LatticeFormatError(f"{where}: link J={j} is outside [0, L={self.L})")
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


# ----------------------------------------------------------------------------------------------------------
# The one table of lattice formats: detection, naming and reading go through it.

_SNIFF_BYTES = 4096
_SLF_HEAD = re.compile(rb"^[ \t]*(?:VERSION|UTTERANCE)=|^[ \t]*(?:N|NODES)=\d+[ \t]+(?:L|LINKS)=\d+", re.MULTILINE)


def _looks_like_fst(head: bytes) -> bool:
    return head[:4] == FST_MAGIC_BYTES


def _looks_like_slf(head: bytes) -> bool:
    return bool(_SLF_HEAD.search(head))


def _one_fst(path: Path, symbols: SymbolTable | None) -> Generator[tuple[str, Lattice], None, None]:
    yield utterance_id(path), read_fst(path, symbols)


def _one_slf(path: Path, symbols: SymbolTable | None) -> Generator[tuple[str, Lattice], None, None]:
    yield utterance_id(path), read_slf(path, symbols)


def _kaldi_archive(path: Path, symbols: SymbolTable | None) -> Generator[tuple[str, Lattice], None, None]:
    for key, lat, _kind in iter_kaldi_archive(path, symbols):
        yield key, lat


def _kaldi_script(path: Path, symbols: SymbolTable | None) -> Generator[tuple[str, Lattice], None, None]:
    for key, lat, _kind in iter_kaldi_script(path, symbols):
        yield key, lat


@dataclass(frozen=True)
class LatticeFormat:
    name: str
    description: str
    suffixes: tuple[str, ...]  # file names that tell the format by themselves, longest first
    sniff: Callable[[bytes], bool]  # whether a file's first bytes (gunzipped if gzip) are in this format
    needs_symbols: bool  # integer labels, so the decoder's words.txt is needed to read words
    read: Callable[[Path, SymbolTable | None], Generator[tuple[str, Lattice], None, None]]  # each (name, lattice)
    many: bool = False  # one file may hold several lattices


LATTICE_FORMATS = (
    LatticeFormat("openfst", "OpenFST binary (.fst)", (".lat.fst", ".fst"), _looks_like_fst, True, _one_fst),
    LatticeFormat("slf", "HTK SLF (.slf, .slf.gz, or by content as .lat.gz)",
                  (".lm.slf.gz", ".slf.gz", ".lm.slf", ".slf"), _looks_like_slf, False, _one_slf),
    LatticeFormat("kaldi-archive", "Kaldi lattice archive (.ark, .ark.gz, or by content as lat.N.gz)",
                  (".ark.gz", ".ark"), looks_like_kaldi_archive, True, _kaldi_archive, many=True),
    LatticeFormat("kaldi-script", "Kaldi lattice script (.scp: key path.ark:offset)", (".scp",),
                  looks_like_kaldi_script, True, _kaldi_script, many=True),
)
# Names that say nothing of the format (Kaldi's utils/convert_slf.pl writes SLF as <utt>.lat.gz, recipes write
# archives as lat.N.gz): the content decides. They are cut off to name a single-lattice file.
_CONTENT_SUFFIXES = (".lat.gz", ".lat", ".gz")


def _file_head(path: Path) -> bytes:
    """The first bytes of a file, gunzipped when it is gzip (as far as its first bytes go); b"" if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(_SNIFF_BYTES)
    except OSError:  # missing, a directory, no permission: no content to go by
        return b""
    if data[:2] == b"\x1f\x8b":
        try:
            return zlib.decompressobj(wbits=31).decompress(data, _SNIFF_BYTES)
        except zlib.error:
            return b""
    return data


def lattice_format(path: str | os.PathLike) -> LatticeFormat | None:
    """The format of a lattice file: by its name where the name tells (`.lat.fst`, `.slf.gz`, `.ark`, ...),
    else by its first bytes (gunzipped if gzip); None when it is neither a name nor content we know."""
    name = Path(path).name
    for fmt in LATTICE_FORMATS:
        if name.endswith(fmt.suffixes):
            return fmt
    head = _file_head(Path(path))
    for fmt in LATTICE_FORMATS:
        if head and fmt.sniff(head):
            return fmt
    return None


def utterance_id(path: str | os.PathLike) -> str:
    """The utterance name of a lattice file: its name without the format's suffix (or a name-only suffix such as
    `.lat.gz`)."""
    path = Path(path)
    suffixes = sorted({x for f in LATTICE_FORMATS for x in f.suffixes} | set(_CONTENT_SUFFIXES), key=len,
                      reverse=True)
    for suffix in suffixes:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def _format_of(path: Path, symbols: SymbolTable | None) -> LatticeFormat:
    """The format of an input file, or a `LatticeFormatError` saying why it cannot be read."""
    known = "; ".join(f.description for f in LATTICE_FORMATS)
    if path.is_dir():
        raise LatticeFormatError(f"{path}: is a directory; expected a lattice file ({known})")
    fmt = lattice_format(path)
    if fmt is None and not path.exists():
        raise LatticeFormatError(f"{path}: lattice file not found")
    if fmt is None:
        raise LatticeFormatError(f"{path}: unknown lattice format (neither its name nor its first bytes match); "
                                 f"expected {known}")
    if fmt.needs_symbols and symbols is None:
        raise LatticeFormatError(f"{path}: {fmt.description} lattices need the decoder's symbol table (--words)")
    return fmt


def iter_lattice_file(path: str | os.PathLike, symbols: SymbolTable | None) -> Iterator[tuple[str, Lattice]]:
    """(name, lattice) for every lattice of a file in any format of LATTICE_FORMATS: one for a single-lattice
    file (named by `utterance_id`), one per entry for a Kaldi archive or script (named by its key), read as
    they are needed. Errors name the file (and, in archives, the key and byte offset)."""
    path = Path(path)
    fmt = _format_of(path, symbols)
    for name, lat in fmt.read(path, symbols):
        lat.name = name
        yield name, lat


def read_lattice(path: str | os.PathLike, symbols: SymbolTable | None) -> Lattice:
    """Read a single-lattice file in any format of LATTICE_FORMATS, named after the file (`utterance_id`), or
    the one entry of a Kaldi archive (named by its key); an archive of several lattices is an error (read those
    with `iter_lattice_file`)."""
    path = Path(path)
    fmt = _format_of(path, symbols)
    with contextlib.closing(fmt.read(path, symbols)) as lattices:  # closes an archive left half read
        first = next(lattices, None)
        if first is None:
            raise LatticeFormatError(f"{path}: {fmt.description} holds no lattice")
        if fmt.many and next(lattices, None) is not None:
            raise LatticeFormatError(f"{path}: {fmt.description} holds several lattices; read them one by one "
                                     "(iter_lattice_file)")
    name, lat = first
    lat.name = name
    return lat
