"""N-best and lattice rescoring, in rooms that import one way: lattices/ <- formats/, decode/ <- nbest/, expand/
<- runs/ (tests/test_architecture.py holds the rule; docs/architecture.md draws it)."""
