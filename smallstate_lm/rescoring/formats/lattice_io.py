"""Reading lattice inputs, one path for every format, and OpenFST lattice files.

An input (a lattice file or a Kaldi rspecifier) is resolved once by `resolve.resolve_input`; then
`lattice_inputs` turns it into `LatticeInput`s, one per lattice (one for an OpenFST or SLF file, one per entry of a
Kaldi archive or script, one per FSA of a k2 file), each read by its `load` when it is needed, by the reader of its
format: fst_binary.py (OpenFST binary), slf.py (HTK SLF), kaldi/table.py (Kaldi archives and scripts),
k2.py (k2/icefall `torch.save(fsa.as_dict())`). `read_lattice` reads a single lattice the same way.

Every reader names the file and the line (or, for binary files, the state and the byte offset) of the first
problem. The readers of the text forms (formats/fst_text.py, formats/slf.py) are importable from here too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ...files import atomic_write_bytes
from ..lattices.lattice import Lattice, LatticeFormatError, SymbolTable
from .fst_binary import read_fst_bytes, write_fst_bytes
from .fst_text import lattice_to_text, read_fst_text
from .k2 import iter_k2_entries
from .kaldi.table import Entry, iter_kaldi_entries
from .resolve import (
    LATTICE_FORMATS,
    LatticeFormat,
    ResolvedInput,
    failing,
    lattice_format,
    read_lattice_file,
    resolve_input,
    utterance_id,
)
from .slf import read_slf, read_slf_text

__all__ = ["LATTICE_FORMATS", "LatticeInput", "lattice_format", "lattice_inputs", "lattice_to_text", "read_fst",
           "read_fst_text", "read_lattice", "read_slf", "read_slf_text", "utterance_id", "write_fst"]


def read_fst(path: str | os.PathLike, symbols: SymbolTable) -> Lattice:
    """Read a binary OpenFST lattice: Kaldi `lattice4` weights `(graph, acoustic)`, or tropical weights
    (`StdVectorFst`, read as graph cost with acoustic 0); a vector or const FST. Words are the output labels.

    The bytes are parsed directly (formats/fst_binary.py), so costs are the file's float32 values exactly.
    """
    path = Path(path)
    return read_fst_bytes(read_lattice_file(path), symbols, str(path), utterance_id(path))


def write_fst(path: str | os.PathLike, lattice: Lattice) -> None:
    """Write a binary OpenFST lattice with Kaldi `lattice4` weights (ilabel = olabel = word), atomically:
    the bytes kaldifst writes for it. Costs are stored as float32 (as in Kaldi); `read_fst` returns them
    exactly.
    """
    atomic_write_bytes(path, write_fst_bytes(lattice, "lattice4"))


# ----------------------------------------------------------------------------------------------------------
# Lattice inputs

# The reader of each format that holds one lattice per file; the formats with `many` are Kaldi tables.
_READ_ONE: dict[str, Callable[[Path, SymbolTable | None], Lattice]] = {"openfst": read_fst, "slf": read_slf}


@dataclass
class LatticeInput:
    """One lattice to rescore: its name (utterance id), where it came from (for messages) and how to get it.
    Lattices of a Kaldi archive or script also name that archive and the entry kind, so that the rescored
    ones are written back as an archive of the same kind."""

    name: str
    origin: str  # the file, or `archive[key]`
    load: Callable[[], Lattice]
    archive: str | None = None  # the Kaldi archive or script, or the k2 file (as given) the lattice came from
    kind: str | None = None  # Kaldi entry kind ("compact", "lattice") or k2 file kind ("k2-fsa", "k2-fsavec")


def _readable_format(source: ResolvedInput, symbols: SymbolTable | None) -> LatticeFormat:
    """The format of an input, or a `LatticeFormatError` saying why it cannot be read."""
    path, fmt = source.path, source.format
    known = "; ".join(f.description for f in LATTICE_FORMATS)
    if source.error is not None:
        raise source.error
    if path.is_dir():
        raise LatticeFormatError(f"{path}: is a directory; expected a lattice file ({known})")
    if fmt is None and not path.exists():
        raise LatticeFormatError(f"{path}: lattice file not found")
    if fmt is None:
        raise LatticeFormatError(f"{path}: unknown lattice format (neither its name nor its first bytes match); "
                                 f"expected {known}")
    if fmt.needs_symbols and symbols is None:
        raise LatticeFormatError(f"{source}: {fmt.description} lattices need the decoder's symbol table (--words)")
    return fmt


def _read_one(source: ResolvedInput, symbols: SymbolTable | None) -> Lattice:
    """The lattice of a one-lattice file, named after the file (`utterance_id`)."""
    return _READ_ONE[_readable_format(source, symbols).name](source.path, symbols)


def _entries(source: ResolvedInput, symbols: SymbolTable | None) -> Iterator[Entry]:
    """The (key, kind, load) entries of a Kaldi archive or script input, read as they are taken, or the FSAs
    of a k2 file."""
    fmt = _readable_format(source, symbols).name
    if fmt == "k2":
        return iter_k2_entries(source.path, symbols)
    return iter_kaldi_entries(source.path, symbols, fmt == "kaldi-script")


def _archive_inputs(source: ResolvedInput, symbols: SymbolTable | None) -> Iterator[LatticeInput]:
    spec = source.spec
    try:  # an entry with bad content fails alone, in its load; broken framing ends the archive here
        with contextlib.closing(_entries(source, symbols)) as entries:
            for key, kind, load in entries:
                yield LatticeInput(key, f"{spec}[{key}]", load, spec, kind)
    except LatticeFormatError as e:  # the archive cannot be read on from here: report it, go on with the next
        yield LatticeInput(f"{spec}#error", spec, failing(e), spec)


def lattice_inputs(specs: Iterable[str | os.PathLike | ResolvedInput],
                   symbols: SymbolTable | None) -> Iterator[LatticeInput]:
    """The lattices of the given inputs, lazily, in order: a lattice file (.fst, SLF) is one; a Kaldi archive
    (`lat.1.gz`, `x.ark`, or an rspecifier `ark:...` / `scp:lat.scp`) or script is read entry by entry as the
    rescoring goes (the archive is never held whole); a k2 file (.pt) gives one per FSA. An input is resolved once
    (`resolve_input`; inputs resolved already are not looked at again). A file that cannot be read becomes an input
    whose `load` raises."""
    for spec in specs:
        source = resolve_input(spec)
        if source.many:
            yield from _archive_inputs(source, symbols)
        else:
            yield LatticeInput(utterance_id(source.path), str(source.path),
                               functools.partial(_read_one, source, symbols))


def read_lattice(path: str | os.PathLike | ResolvedInput, symbols: SymbolTable | None) -> Lattice:
    """Read a single-lattice file in any format of LATTICE_FORMATS, named after the file (`utterance_id`), or
    the one entry of a Kaldi archive (named by its key); an archive of several lattices is an error (read those
    with `lattice_inputs`)."""
    source = resolve_input(path)
    if not source.many:
        return _read_one(source, symbols)
    what = source.format.description
    with contextlib.closing(_entries(source, symbols)) as entries:  # closes an archive left half read
        first = next(entries, None)
        if first is None:
            raise LatticeFormatError(f"{source.path}: {what} holds no lattice")
        lattice = first[2]()
        if next(entries, None) is not None:
            raise LatticeFormatError(f"{source.path}: {what} holds several lattices; read them one by one "
                                     "(lattice_inputs)")
    return lattice
