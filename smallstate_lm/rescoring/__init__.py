"""N-best and lattice rescoring: readers/writers, score combination, expansion, WER, tuning."""
