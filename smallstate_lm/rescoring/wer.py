"""Word error rate through kaldialign (a maintained Levenshtein aligner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import kaldialign


@dataclass
class ErrorCounts:
    sub: int = 0
    dels: int = 0
    ins: int = 0
    ref_words: int = 0

    @property
    def errors(self) -> int:
        return self.sub + self.dels + self.ins

    @property
    def wer(self) -> float:
        return self.errors / self.ref_words if self.ref_words else float(self.errors > 0)

    def __add__(self, o: "ErrorCounts") -> "ErrorCounts":
        return ErrorCounts(self.sub + o.sub, self.dels + o.dels, self.ins + o.ins, self.ref_words + o.ref_words)

    def to_dict(self) -> dict:
        return {"wer": self.wer, "errors": self.errors, "sub": self.sub, "del": self.dels, "ins": self.ins,
                "ref_words": self.ref_words}


def align_counts(ref: Sequence[str], hyp: Sequence[str]) -> ErrorCounts:
    d = kaldialign.edit_distance(list(ref), list(hyp))
    return ErrorCounts(sub=d["sub"], dels=d["del"], ins=d["ins"], ref_words=len(ref))


def corpus_wer(refs: dict[str, list[str]], hyps: dict[str, list[str]]) -> tuple[ErrorCounts, dict[str, ErrorCounts]]:
    """Corpus and per-utterance counts over the utterances of `refs`; an utterance
    missing from `hyps` counts as an empty hypothesis (all deletions)."""
    per = {u: align_counts(r, hyps.get(u, [])) for u, r in refs.items()}
    total = ErrorCounts()
    for c in per.values():
        total = total + c
    return total, per
