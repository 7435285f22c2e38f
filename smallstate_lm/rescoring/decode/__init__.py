"""From a (rescored) lattice to words: posteriors, consensus and confidences, transcripts, WER and NCE.
Imports lattices/ only."""
