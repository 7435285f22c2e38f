"""Kaldi lattice tables without Kaldi: archive streams, binary and text objects, whole tables, the writer.
Imports formats/ and lattices/ only."""
