"""Kaldi lattice archives and scripts, read and written without Kaldi: the names other modules use.

Each job has its module: kaldi_stream.py (an archive's bytes, gunzipped as they are read), kaldi_binary.py
(binary CompactLattice and Lattice objects), kaldi_text.py (text objects), kaldi_table.py (archives and scripts
entry by entry: `iter_kaldi_entries`), kaldi_write.py (objects and archives written). Which inputs are Kaldi
tables (rspecifiers, names, content) is decided in lattice_formats.py.
"""

from __future__ import annotations

from .kaldi_binary import KINDS
from .kaldi_table import Entry, iter_kaldi_entries
from .kaldi_write import KaldiArchiveWriter, KaldiKind, kaldi_lattice_bytes, kaldi_lattice_text
from .lattice_formats import looks_like_kaldi_archive, looks_like_kaldi_script, parse_rspecifier

__all__ = ["KINDS", "Entry", "KaldiArchiveWriter", "KaldiKind", "iter_kaldi_entries", "kaldi_lattice_bytes",
           "kaldi_lattice_text", "looks_like_kaldi_archive", "looks_like_kaldi_script", "parse_rspecifier"]
