"""What was said before an utterance, as the LMs see it: the previous transcripts of its document (oldest
first), turned into the neural LM's tokens (each sentence's words, then `</s>`, so the utterance's first word
follows a boundary as it did in training across sentences, `train --context-sentences`) and into the n-gram's
state after the context's last words. Both LMs then score an utterance's hypotheses or lattice from there
instead of from `<s>`. Imports no torch: the neural state is made by `neural_start`, on the LM's device."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..vocab import EOS_ID, Vocabulary

Sentences = Sequence[Sequence[str]]


def context_tokens(vocab: Vocabulary, sentences: Sentences) -> list[int]:
    """The neural LM's tokens for `sentences` read one after the other: each one's ids then `</s>`."""
    out: list[int] = []
    for s in sentences:
        out += vocab.encode(s) + [EOS_ID]
    return out


def ngram_start(ngram, sentences: Sentences):
    """The n-gram's state after the context's words (from `<s>`, the sentences' words in a row: an n-gram
    trained sentence by sentence has no `</s>` inside a history), or its `<s>` state without context."""
    state = ngram.initial_state()
    for s in sentences:
        for w in s:
            _, state = ngram.score_word(state, w)
    return state


def neural_start(model, tokens: Sequence[int], device):
    """The neural LM's state after `<s>` and `tokens` (one row); None without tokens (start at `<s>`)."""
    if not tokens:
        return None
    import torch

    with torch.no_grad():
        x = torch.as_tensor([list(tokens)], dtype=torch.long, device=device)  # (1, T)
        _, state = model.score(x, model.initial_state(1, device))
    return state


@dataclass
class History:
    """The last `k` chosen transcripts of one document (oldest first): what its next utterance is read after."""

    k: int
    said: deque = field(default_factory=deque)

    def __post_init__(self):
        if self.k < 0:
            raise ConfigError(f"context utterances must be >= 0, got {self.k}")

    def add(self, words: Sequence[str]) -> None:
        if self.k == 0:
            return
        self.said.append(list(words))
        while len(self.said) > self.k:
            self.said.popleft()

    def sentences(self) -> list[list[str]]:
        return list(self.said)
