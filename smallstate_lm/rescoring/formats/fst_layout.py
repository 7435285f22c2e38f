"""OpenFST's binary layout: what every reader and writer of binary FSTs here (single `.fst` files in
formats/fst_binary.py, the objects of Kaldi archives in formats/kaldi/binary.py and formats/kaldi/write.py) agrees on.

From OpenFST's fst.h (`FstHeader`), vector-fst.h, const-fst.h, symbol-table.cc and properties.h; everything
little-endian:
- header: int32 magic, fst type and arc type as (int32 length, bytes), int32 version, int32 flags,
  uint64 properties, int64 start, int64 number of states, int64 number of arcs;
- the input and output symbol tables when the flags say so: int32 magic, name, int64 available key,
  int64 size, then (symbol, int64 key) pairs;
- `vector`: per state its final weight, int64 arc count, then the arcs `int32 ilabel, int32 olabel,
  weight, int32 nextstate`; a state that is not final has weight Zero (+inf in every component);
- `const`: a table of states (final weight, uint32 first arc, arc count, input and output epsilon
  counts), then one table of all arcs; both start on a 16-byte boundary in aligned files.
A weight is k float32 costs: k = 2 for Kaldi's `lattice4` (graph, acoustic), 1 for `standard` (tropical).
"""

from __future__ import annotations

import struct

import numpy as np

FST_MAGIC = 2125659606
FST_MAGIC_BYTES = struct.pack("<i", FST_MAGIC)  # b"\xd6\xfd\xb2\x7e": byte 0 is 214, Kaldi's test for binary
SYMBOLS_MAGIC = 2125658996
HAS_ISYMBOLS, HAS_OSYMBOLS, IS_ALIGNED = 0x1, 0x2, 0x4  # header flags
HEADER_TAIL = struct.Struct("<iiQqqq")  # version, flags, properties, start, number of states, number of arcs
MAX_STATES = 2**31 - 1  # state ids and labels are int32
MAX_NAME = 256  # FST and arc type names are short: a longer length means a garbled header
ALIGN = 16  # const FSTs align their tables to this in aligned files

class Props:
    """OpenFST's property bits (fst/properties.h): the header's properties field is an OR of them."""

    EXPANDED, MUTABLE = 0x1, 0x2
    ACCEPTOR, NOT_ACCEPTOR, I_DETERMINISTIC, O_DETERMINISTIC = 0x10000, 0x20000, 0x40000, 0x100000
    EPSILONS, NO_EPSILONS, I_EPSILONS, NO_I_EPSILONS = 0x400000, 0x800000, 0x1000000, 0x2000000
    O_EPSILONS, NO_O_EPSILONS = 0x4000000, 0x8000000
    I_SORTED, NOT_I_SORTED, O_SORTED, NOT_O_SORTED = 0x10000000, 0x20000000, 0x40000000, 0x80000000
    WEIGHTED, UNWEIGHTED = 0x100000000, 0x200000000
    ACYCLIC, INITIAL_ACYCLIC, TOP_SORTED, NOT_TOP_SORTED = 0x800000000, 0x2000000000, 0x4000000000, 0x8000000000
    UNWEIGHTED_CYCLES = 0x800000000000


def arc_dtype(k: int) -> np.dtype:
    """One arc record with a weight of `k` float32 costs (vector and const FSTs alike)."""
    return np.dtype([("ilabel", "<i4"), ("olabel", "<i4"), ("weight", "<f4", (k,)), ("nextstate", "<i4")])


def const_state_dtype(k: int) -> np.dtype:
    """One state record of a const FST."""
    return np.dtype([("final", "<f4", (k,)), ("pos", "<u4"), ("narcs", "<u4"), ("niepsilons", "<u4"),
                     ("noepsilons", "<u4")])


def pack_string(s: str) -> bytes:
    """A header string: int32 length, then the bytes."""
    raw = s.encode("ascii")
    return struct.pack("<i", len(raw)) + raw


def vector_header(arc_type: str, properties: int, start: int, num_states: int) -> bytes:
    """The header of a `vector` FST (version 2, no symbol tables) as OpenFST writes it to a file: the arcs are
    not counted (0)."""
    return (FST_MAGIC_BYTES + pack_string("vector") + pack_string(arc_type)
            + HEADER_TAIL.pack(2, 0, properties, start, num_states, 0))
