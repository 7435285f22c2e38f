"""Lattice files: OpenFST binary and text, HTK SLF, Kaldi tables (kaldi/), k2 dicts, the format table (resolve).
Imports lattices/ only."""
