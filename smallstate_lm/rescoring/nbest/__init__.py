"""N-best lists: containers and files, the toolkits' formats, score components, the list's word confidences.
Imports lattices/ and decode/ only."""
