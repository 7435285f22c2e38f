"""Lattice inputs and their formats: the one table of formats, and each input resolved once.

An input is a lattice file or a Kaldi rspecifier (`ark:lat.1.ark`, `scp:lat.scp`, `ark:gunzip -c lat.1.gz|`).
`resolve_input` decides its format once: by the rspecifier, else by the file's name where the name tells
(`.lat.fst`, `.slf.gz`, `.ark`, `.scp`, `.pt`), else by the file's first bytes, gunzipped if gzip (`x.lat.gz` may be SLF
or a Kaldi archive, `lat.list` a Kaldi script). Every later step (does it need the symbol table, does it hold
many lattices, how is it read, what is a lattice in it called) asks the `ResolvedInput` instead of looking again.

Every file of a lattice input is opened by `open_lattice_file`, so a missing or unreadable file is reported the
same way whatever its format.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from ..lattices.lattice import Lattice, LatticeFormatError
from .fst_layout import FST_MAGIC_BYTES

_SNIFF_BYTES = 4096
_SLF_HEAD = re.compile(rb"^[ \t]*(?:VERSION|UTTERANCE)=|^[ \t]*(?:N|NODES)=\d+[ \t]+(?:L|LINKS)=\d+", re.MULTILINE)
_KEY_THEN_BINARY = re.compile(rb"\s*[^\s]{1,256}[ \t](?:\0B)?" + re.escape(FST_MAGIC_BYTES))
_KEY_THEN_TEXT = re.compile(rb"\s*[^\s]{1,256}[ \t]*\r?\n"  # key line, then a first text-form line:
                            rb"\d+(?:[ \t]+\d+){0,3}(?:[ \t]+[^\s,]*,[^\s,]*(?:,[\d_-]*)?)?[ \t]*(?:\r?\n|\Z)")
_SCP_LINE = re.compile(rb"[^\s]+[ \t]+[^\s|]+:\d+[ \t\r]*")


def looks_like_fst(head: bytes) -> bool:
    """Whether `head`, the first bytes of a file, start a binary OpenFST file (its magic number)."""
    return head[:4] == FST_MAGIC_BYTES


def looks_like_slf(head: bytes) -> bool:
    """Whether `head` holds an HTK SLF header line (`VERSION=`, `UTTERANCE=` or the `N= L=` counts)."""
    return bool(_SLF_HEAD.search(head))


def looks_like_kaldi_archive(head: bytes) -> bool:
    """Whether `head`, the first bytes of a file (gunzipped if gzip), start a Kaldi lattice archive: a key, a
    space, then a binary OpenFST lattice (the FST magic number) or the text form (a newline and an FST line)."""
    return bool(_KEY_THEN_BINARY.match(head) or _KEY_THEN_TEXT.match(head))


def looks_like_torch_save(head: bytes) -> bool:
    """Whether `head` starts a torch.save file (k2's `torch.save(fsa.as_dict())`): a zip archive whose first
    member is `<name>/data.pkl`."""
    if head[:4] != b"PK\x03\x04" or len(head) < 30:
        return False
    name_len = int.from_bytes(head[26:28], "little")
    return head[30:30 + name_len].endswith(b"data.pkl")


def looks_like_kaldi_script(head: bytes) -> bool:
    """Whether the first complete lines of `head` are all `key path:offset` (a Kaldi scp into archives)."""
    lines = [x for x in head.split(b"\n")[:-1] if x.strip()][:20]
    return bool(lines) and all(_SCP_LINE.fullmatch(x) for x in lines)


@dataclass(frozen=True)
class LatticeFormat:
    name: str
    description: str
    suffixes: tuple[str, ...]  # file names that tell the format by themselves, longest first
    sniff: Callable[[bytes], bool]  # whether a file's first bytes (gunzipped if gzip) are in this format
    needs_symbols: bool  # integer labels, so the decoder's words.txt is needed to read words
    many: bool = False  # one file may hold several lattices


# Tried in this order, by name and then by content: a Kaldi archive is tried before a script because a script's
# `key path:offset` test is the looser one.
LATTICE_FORMATS = (
    LatticeFormat("openfst", "OpenFST binary (.fst)", (".lat.fst", ".fst"), looks_like_fst, True),
    LatticeFormat("slf", "HTK SLF (.slf, .slf.gz, or by content as .lat.gz)",
                  (".lm.slf.gz", ".slf.gz", ".lm.slf", ".slf"), looks_like_slf, False),
    LatticeFormat("kaldi-archive", "Kaldi lattice archive (.ark, .ark.gz, or by content as lat.N.gz)",
                  (".ark.gz", ".ark"), looks_like_kaldi_archive, True, many=True),
    LatticeFormat("kaldi-script", "Kaldi lattice script (.scp: key path.ark:offset)", (".scp",),
                  looks_like_kaldi_script, True, many=True),
    LatticeFormat("k2", "k2/icefall Fsa or FsaVec (.pt: torch.save(fsa.as_dict()))", (".pt",), looks_like_torch_save,
                  True, many=True),
)
FORMATS = {f.name: f for f in LATTICE_FORMATS}
# Names that say nothing of the format (Kaldi's utils/convert_slf.pl writes SLF as <utt>.lat.gz, recipes write
# archives as lat.N.gz): the content decides. They are cut off to name a single-lattice file.
_CONTENT_SUFFIXES = (".lat.gz", ".lat", ".gz")
_NAME_SUFFIXES = sorted({x for f in LATTICE_FORMATS for x in f.suffixes} | set(_CONTENT_SUFFIXES), key=len,
                        reverse=True)


def open_lattice_file(path: str | os.PathLike, what: str = "lattice file") -> BinaryIO:
    """`path` opened for reading bytes; a file that cannot be opened raises `LatticeFormatError` naming it and
    saying why."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise LatticeFormatError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise LatticeFormatError(f"{path}: is a directory; expected a {what}") from None
    except OSError as e:  # no permission, ...: still one file's error, not the run's
        raise LatticeFormatError(f"{path}: cannot read the {what} ({e.strerror})") from None


def failing(err: Exception) -> Callable[[], Lattice]:
    """A `load` that raises `err`: an input or an archive entry that cannot be read fails alone, when it is
    loaded, and the others are still read."""
    def load() -> Lattice:
        raise err
    return load


def read_lattice_file(path: str | os.PathLike) -> bytes:
    """The bytes of a single-lattice file (see `open_lattice_file` for its errors)."""
    with open_lattice_file(path) as f:
        return f.read()


def _file_head(path: Path) -> bytes:
    """The first bytes of a file, gunzipped when it is gzip (as far as its first bytes go); b"" if unreadable."""
    try:
        with open_lattice_file(path) as f:
            data = f.read(_SNIFF_BYTES)
    except LatticeFormatError:  # missing, a directory, no permission: no content to go by
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
    for suffix in _NAME_SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return path.stem


# ----------------------------------------------------------------------------------------------------------
# Kaldi rspecifiers

# What reads as meant for Kaldi (`ark...:` or `scp...:` with any options); `_rspecifier_parts` then accepts only
# Kaldi's own options.
_RSPECIFIER = re.compile(r"^(?:ark|scp)(?:,[a-z]+)*:|^[a-z]+(?:,[a-z]+)*,(?:ark|scp)(?:,[a-z]+)*:")
_RSPEC_OPTIONS = {"b", "t", "s", "ns", "cs", "ncs", "o", "no", "p", "np", "bg"}
_GUNZIP = re.compile(r"\s*(?:gunzip -c|gzip -cd|gzip -dc|zcat)\s+(\S+)\s*\|\s*")


def _rspecifier_parts(spec: str | os.PathLike) -> tuple[list[str], str] | None:
    """(options, rest) of `ark...:rest` / `scp...:rest`; None for a plain path."""
    if not isinstance(spec, str):
        return None
    head, sep, rest = spec.partition(":")
    opts = head.split(",")
    if not sep or not set(opts) <= _RSPEC_OPTIONS | {"ark", "scp"} or ("ark" in opts) == ("scp" in opts):
        return None
    return opts, rest


def parse_rspecifier(spec: str | os.PathLike) -> tuple[str, Path]:
    """("ark" or "scp", file) of a Kaldi rspecifier (`ark:lat.1.ark`, `ark,t:x.txt`, `scp:lat.scp`,
    `ark:gunzip -c lat.1.gz|`) or a plain path (an scp if it ends in .scp). Options are accepted and ignored:
    text/binary and gzip are recognised from the bytes. Other commands, and stdin, are refused."""
    parts = _rspecifier_parts(spec)
    if parts is None:
        path = Path(spec)
        return ("scp" if path.name.endswith(".scp") else "ark"), path
    opts, rest = parts
    if m := _GUNZIP.fullmatch(rest):
        rest = m.group(1)
    elif rest == "-" or rest.rstrip().endswith("|"):
        raise LatticeFormatError(f"{spec}: reading a pipe or stdin is not supported; give the archive file "
                                 "(gzip is read directly)")
    return ("ark" if "ark" in opts else "scp"), Path(rest)


# ----------------------------------------------------------------------------------------------------------
# An input, resolved


@dataclass(frozen=True)
class ResolvedInput:
    """A lattice input as given (`spec`), the file it names and its format (None: neither the name nor the
    content is one we know, or the file is missing). `error`: why an rspecifier cannot be read (a pipe)."""

    spec: str
    path: Path
    format: LatticeFormat | None
    error: LatticeFormatError | None = None

    @property
    def many(self) -> bool:
        """A Kaldi archive or script, or a k2 file: read entry by entry, written back as one file."""
        return self.format is not None and self.format.many

    def __str__(self) -> str:
        return self.spec

    def __fspath__(self) -> str:  # workers in other processes get the input as the user gave it
        return self.spec


def is_rspecifier(spec: str | os.PathLike) -> bool:
    """Whether `spec` is meant as a Kaldi rspecifier (`ark:...`, `scp:...`, `ark,t:...`) rather than a file."""
    return bool(_RSPECIFIER.match(str(spec)))


def resolve_input(spec: str | os.PathLike | ResolvedInput) -> ResolvedInput:
    """The format of an input, decided once (see the module docstring); an input already resolved is returned
    as it is. Reads at most the first 4 KiB of one file, and only where neither an rspecifier nor the name
    tells."""
    if isinstance(spec, ResolvedInput):
        return spec
    text = str(spec)
    if is_rspecifier(text):
        try:
            kind, path = parse_rspecifier(text)
        except LatticeFormatError as e:
            return ResolvedInput(text, Path(text), FORMATS["kaldi-archive"], e)
        return ResolvedInput(text, path, FORMATS["kaldi-script" if kind == "scp" else "kaldi-archive"])
    path = Path(spec)
    return ResolvedInput(str(path), path, lattice_format(path))
