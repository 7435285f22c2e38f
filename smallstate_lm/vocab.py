"""Vocabulary: words <-> ids with `<s>`, `</s>`, `<unk>` and an OOV policy.

Ids are fixed for the specials (`<s>`=0, `</s>`=1, `<unk>`=2) so every model and
checkpoint agrees on them; regular words follow by descending count, ties broken
alphabetically so that building twice from the same text gives the same ids.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

from .errors import VocabularyError
from .files import atomic_write_text, read_lines

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
SPECIALS = (BOS, EOS, UNK)


@dataclass
class EncodeStats:
    """Counts gathered while mapping words to ids (`</s>` is not counted)."""

    words: int = 0
    oov: int = 0

    @property
    def oov_rate(self) -> float:
        return self.oov / self.words if self.words else 0.0


class Vocabulary:
    """A closed word list; words outside it map to `<unk>`.

    `lowercase=True` folds words before lookup, both when building and when encoding. A word is one token here;
    `subword.SubwordVocabulary` cuts words into pieces behind the same interface.
    """

    subword = False
    spec = "word"  # what its tokens are (a subword vocabulary: the SentencePiece model's spec)

    def __init__(self, words: Sequence[str], lowercase: bool = False):
        words = list(words)
        if tuple(words[:3]) != SPECIALS:
            raise VocabularyError(f"a vocabulary must start with {' '.join(SPECIALS)}")
        index: dict[str, int] = {}
        for i, w in enumerate(words):
            if not w or any(c.isspace() for c in w):
                raise VocabularyError(f"vocabulary entry {i} is empty or holds whitespace: {w!r}")
            if w in index:
                raise VocabularyError(f"vocabulary entry {i} repeats the word {w!r}")
            index[w] = i
        self.words = words
        self.index = index
        self.lowercase = lowercase

    # ---- building -----------------------------------------------------------------
    @classmethod
    def build(
        cls,
        sentences: Iterable[Sequence[str]],
        min_count: int = 1,
        max_size: int | None = None,
        lowercase: bool = False,
    ) -> Vocabulary:
        """Build from tokenised sentences; `max_size` counts the three specials too."""
        if min_count < 1:
            raise VocabularyError(f"min_count must be >= 1, got {min_count}")
        if max_size is not None and max_size <= len(SPECIALS):
            raise VocabularyError(f"max_size must be > {len(SPECIALS)}, got {max_size}")
        counts: Counter[str] = Counter()
        for sent in sentences:
            counts.update(w.lower() if lowercase else w for w in sent)
        for s in SPECIALS:
            counts.pop(s, None)
        kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        if max_size is not None:
            kept = kept[: max_size - len(SPECIALS)]
        if not kept:
            raise VocabularyError("no word reaches min_count; the vocabulary would be empty")
        return cls(list(SPECIALS) + kept, lowercase=lowercase)

    # ---- lookup -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return self.normalise(word) in self.index

    def normalise(self, word: str) -> str:
        return word.lower() if self.lowercase else word

    def encode(self, words: Sequence[str], stats: EncodeStats | None = None) -> list[int]:
        """Map words to ids, OOVs to `<unk>`; updates `stats` when given."""
        ids = list(self.ids(words))
        if stats is not None:
            stats.words += len(ids)
            stats.oov += ids.count(UNK_ID)
        return ids

    def ids(self, words: Iterable[str]) -> Iterator[int]:
        """`encode` as an iterator (e.g. for numpy.fromiter over many hypotheses' words at once)."""
        # map() with the dict's own get: no Python frame per word (this runs for every hypothesis scored)
        return map(self.index.get, map(str.lower, words) if self.lowercase else words, repeat(UNK_ID))

    def token_counts(self, words: Sequence[str]) -> list[int]:
        """The LM's tokens per word (`encode` gives them end to end): one each here."""
        return [1] * len(words)

    def lengths(self, sentences: Iterable[Sequence[str]]) -> list[int]:
        """The LM's tokens of each sentence (without `</s>`): its words here."""
        return list(map(len, sentences))

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.words[i] for i in ids]

    def sample_words(self) -> list[str]:
        """Words to time the LM on (the service's cost model): ones the LM takes as one token each."""
        return self.words[4:]

    # ---- persistence --------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"words": list(self.words), "lowercase": self.lowercase}

    @classmethod
    def from_dict(cls, d: dict) -> Vocabulary:
        """A word vocabulary's record (`subword.vocabulary_of` reads any record, a tokenizer's too)."""
        try:
            return cls(d["words"], lowercase=bool(d.get("lowercase", False)))
        except (KeyError, TypeError) as e:
            raise VocabularyError(f"malformed vocabulary record: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """One word per line; a first line `#lowercase` records the folding policy."""
        path = Path(path)
        text = ("#lowercase\n" if self.lowercase else "") + "\n".join(self.words) + "\n"
        atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        path = Path(path)
        lines = read_lines(path, VocabularyError, "vocabulary file")
        lowercase = bool(lines) and lines[0] == "#lowercase"
        words = lines[1:] if lowercase else lines
        try:
            return cls(words, lowercase=lowercase)
        except VocabularyError as e:
            raise VocabularyError(f"{path}: {e}") from None
