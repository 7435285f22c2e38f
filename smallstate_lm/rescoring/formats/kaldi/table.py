"""Kaldi lattice tables, read without Kaldi: archives (`ark`, `ark,t`, gzip `lat.N.gz`) and scripts (`scp`).

An archive is a sequence of entries `KEY` + one space + a lattice object (util/kaldi-table-inl.h:
`TableWriterArchiveImpl::Write`; a reader also takes a tab, or a newline that stays part of the object). The
object is binary (formats/kaldi/binary.py) or text (formats/kaldi/text.py), told by its first byte. A script lists
`key path.ark:offset` lines, the offset being the byte where the object starts (after `key `).

`iter_kaldi_entries` is the one way in: it yields each entry as it is read, with a `load` that checks its content
and builds the `Lattice`, so that an entry whose content is wrong fails alone. Errors name the archive, the
entry's key and the byte offset (of the gunzipped stream, for gzip) or the line of the problem.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ....files import read_lines
from ...lattices.lattice import Lattice, LatticeFormatError, SymbolTable
from ..resolve import failing
from .binary import RawLattice, read_binary
from .stream import ArchiveStream, open_archive
from .text import read_text

Entry = tuple[str, str, Callable[[], Lattice]]  # (key, kind, load): `load` checks the content and builds it
_MAX_KEY = 4096
_BINARY_MARK = b"\0B"  # Kaldi's marker for other binary objects; lattices are written without it (tolerated)
_SPACE = re.compile(rb"[ \t\n\r\f\v]")
_NOT_SPACE = re.compile(rb"[^ \t\n\r\f\v]")


def _read_key(st: ArchiveStream) -> str | None:
    """The next entry's key (None at the end of the archive), leaving `st.pos` at its object."""
    st.key = None
    while (m := _NOT_SPACE.search(st.buf, st.pos)) is None:
        st.pos = len(st.buf)
        if not st.more():
            return None
    st.pos = m.start()
    st.start_entry()
    while (m := _SPACE.search(st.buf, st.pos)) is None:
        if len(st.buf) > _MAX_KEY:
            raise st.error(f"no space within {_MAX_KEY} bytes of {st.at(0)}; expected 'key ' then a lattice "
                           "(not a Kaldi archive?)")
        if not st.more():
            raise st.error(f"archive ends after the key {bytes(st.buf)[:80]!r} at {st.at(0)} (truncated); expected "
                           "a space and a lattice")
    try:
        st.key = bytes(st.buf[: m.start()]).decode("utf-8")
    except UnicodeDecodeError:
        raise st.error(f"the key at {st.at(0)} is not UTF-8 (not a Kaldi archive?)") from None
    sep = st.buf[m.start()]
    if sep not in b" \t\n":
        raise st.error(f"expected a space after the key at {st.at(m.start())}, got {chr(sep)!r}")
    st.pos = m.start() + (sep != ord("\n"))  # a newline is part of a text object
    return st.key


def _read_object(st: ArchiveStream) -> RawLattice:
    """The lattice at `st.pos`: text if it starts with white space, else binary (lat/kaldi-lattice.cc,
    `CompactLatticeHolder::Read`)."""
    if not st.need(st.pos + 1):
        raise st.error(f"archive ends after the key (truncated); expected a lattice at {st.at(st.pos)}")
    if st.buf[st.pos] in b" \t\n\r\f\v":
        return read_text(st)
    if st.need(st.pos + 2) and st.buf[st.pos: st.pos + 2] == _BINARY_MARK:
        st.pos += 2
    return read_binary(st)


def _archive_entries(path: Path, symbols: SymbolTable) -> Iterator[Entry]:
    """The entries of an archive as they are read: an entry whose bytes frame correctly but whose content is
    wrong (an unknown word, an empty lattice) fails in its own `load`; broken framing (truncation, a bad
    header) ends the iteration with the error, since nothing after it can be found."""
    f, gzipped, size = open_archive(path, "lattice archive")
    with f:
        st = ArchiveStream(f, str(path), gzipped, limit=size)
        while (key := _read_key(st)) is not None:
            raw = _read_object(st)
            yield key, raw.kind, functools.partial(raw.lattice, symbols, key, f"{path}: lattice {key!r}")


def _script_target(target: str, scp: Path, where: str) -> tuple[Path, int | None]:
    """(archive, byte offset of the object or None: the file holds one object) of an scp line's rxfilename."""
    if target == "-" or target.endswith("|"):
        raise LatticeFormatError(f"{where}: {target!r} reads a pipe or stdin; commands are not run here: give "
                                 "'path.ark:offset'")
    if target.endswith("]"):
        raise LatticeFormatError(f"{where}: {target!r}: ranges apply to matrices, not lattices")
    m = re.fullmatch(r"(.+):(\d+)", target)
    path, offset = (Path(m.group(1)), int(m.group(2))) if m else (Path(target), None)
    if not path.is_absolute() and not path.exists() and (scp.parent / path).exists():
        path = scp.parent / path  # Kaldi resolves from the working directory; also try the scp's own
    return path, offset


class _ScriptReader:
    """Reads the objects a script's lines point at. Consecutive lines into one archive share its open file,
    which stays open (in `stack`) until a line points elsewhere."""

    def __init__(self, scp: Path, symbols: SymbolTable, stack: contextlib.ExitStack) -> None:
        self.scp, self.symbols, self.stack = scp, symbols, stack
        self.current: tuple[Path, BinaryIO, int] | None = None  # (path, open file, size)

    def _archive(self, path: Path, where: str) -> tuple[BinaryIO, int]:
        if self.current is None or self.current[0] != path:
            self.stack.close()
            self.current = None
            f, gzipped, size = open_archive(path, f"lattice archive (named on {where})")
            self.stack.enter_context(f)
            if gzipped:
                raise LatticeFormatError(f"{where}: {path} is gzip-compressed; an scp can only point into an "
                                         "uncompressed archive (gunzip it, or read the archive itself)")
            self.current = (path, f, size)
        return self.current[1], self.current[2]

    def entry(self, parts: list[str], line: str, where: str) -> Entry:
        """The entry of one line (`parts`: its key and target), framed; raises if the line cannot be read."""
        if len(parts) != 2:
            raise LatticeFormatError(f"{where}: expected 'key path.ark:offset', got {line.strip()!r}")
        key = parts[0]
        path, offset = _script_target(parts[1].strip(), self.scp, where)
        f, size = self._archive(path, where)
        f.seek(offset or 0)
        st = ArchiveStream(f, f"{path} (from {where})", False, base=offset or 0, limit=size)
        st.key = key
        raw = _read_object(st)
        return key, raw.kind, functools.partial(raw.lattice, self.symbols, key, f"{path}: lattice {key!r} (from "
                                                f"{where})")


def _script_entries(scp: Path, symbols: SymbolTable) -> Iterator[Entry]:
    """The entries a script names, one per line; every line stands alone, so a line that cannot be read (a bad
    offset, a missing archive) is that entry's failure (its `load` raises) and the next line is read."""
    lines = read_lines(scp, LatticeFormatError, "lattice script (scp)")
    with contextlib.ExitStack() as stack:
        reader = _ScriptReader(scp, symbols, stack)
        for n, line in enumerate(lines, 1):
            parts = line.split(maxsplit=1)
            if not parts:
                continue
            where = f"{scp}:{n}"
            try:
                yield reader.entry(parts, line, where)
            except LatticeFormatError as e:
                yield (parts[0] if len(parts) == 2 else where), "compact", failing(e)


def iter_kaldi_entries(path: str | os.PathLike, symbols: SymbolTable, script: bool = False) -> Iterator[Entry]:
    """(key, kind, load) for each lattice of a Kaldi archive, or with `script` of the lines of a Kaldi script,
    lazily: the archive is read as the entries are taken (plain or gzip, by its magic bytes; binary or text
    entries), never held whole. A script's archives must be uncompressed (gzip cannot be sought into).

    kind is "compact" (CompactLattice) or "lattice" (Lattice). `load()` builds the `Lattice` named by the key:
    words are the output labels, ids of `symbols`; `arc_tids` hold each arc's transition-ids and `final_tids`
    each state's (empty rows for non-final states); costs are the stored float32 values exactly (float64
    arrays; natural log, graph and acoustic). An entry whose content is wrong (or, in a script, a line that
    cannot be read) fails alone, in its `load`; broken archive framing ends the iteration with the error,
    naming the archive, the key and the byte offset or line.
    """
    if symbols is None:
        raise LatticeFormatError(f"{path}: Kaldi lattices have integer word labels: give the decoder's words.txt")
    return _script_entries(Path(path), symbols) if script else _archive_entries(Path(path), symbols)
