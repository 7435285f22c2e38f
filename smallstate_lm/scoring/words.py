"""Log-probabilities per word from log-probabilities per token: a subword LM scores a word as its pieces, and
the word's log-probability is the sum of theirs (the chain rule over the pieces)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def per_word(vocab, sentences: Sequence[Sequence[str]], per_token: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each sentence's token log-probs (of `vocab.encode(words) + [</s>]`) as one per word and one for `</s>`: a
    word's pieces summed; a word vocabulary's tokens are its words already."""
    if not vocab.subword:
        return list(per_token)
    out = []
    for words, lp in zip(sentences, per_token):
        counts = np.asarray(vocab.token_counts(words) + [1], dtype=np.int64)
        if len(lp) != counts.sum():
            raise ValueError(f"{len(lp)} token log-probs for {counts.sum()} tokens of {len(words)} words")
        out.append(np.add.reduceat(lp, np.cumsum(counts) - counts))
    return out
