"""N-best (and, later, lattice) rescoring."""
