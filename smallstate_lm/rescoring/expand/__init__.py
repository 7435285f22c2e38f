"""Lattice expansion with the LMs: jobs prepared, the level engine (frontier), the LM cache, expanded lattices.
Imports lattices/ only."""
