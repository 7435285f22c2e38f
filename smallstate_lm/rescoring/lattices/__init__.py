"""Lattices in memory: the arrays and symbol tables (lattice), searches over flat acyclic graphs (graph), k-best.
Imports nothing else of rescoring/."""
