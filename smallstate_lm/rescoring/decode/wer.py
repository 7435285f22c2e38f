"""Word error rate through kaldialign (a maintained Levenshtein aligner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


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
    import kaldialign  # here: importing it (and its metadata lookup) costs every command ~10 ms

    d = kaldialign.edit_distance(list(ref), list(hyp))
    return ErrorCounts(sub=d["sub"], dels=d["del"], ins=d["ins"], ref_words=len(ref))


def correct_words(ref: Sequence[str], hyp: Sequence[str]) -> list[bool]:
    """For each word of `hyp`, whether the WER alignment with `ref` matches it to an equal reference word
    (False for substitutions and insertions): the labels word confidences are judged against."""
    import kaldialign

    eps = "<eps>"  # hypothesis and reference words never spell a marker
    return [r == h for r, h in kaldialign.align(list(ref), list(hyp), eps) if h != eps]


def pairwise_errors(seqs: Sequence[Sequence[str]]) -> np.ndarray:
    """(n, n) word edit distances between every pair of sequences (symmetric, zero diagonal)."""
    import kaldialign

    n = len(seqs)
    d = np.zeros((n, n))
    lists = [list(s) for s in seqs]
    for i in range(n):
        for j in range(i + 1, n):
            d[i, j] = d[j, i] = kaldialign.edit_distance(lists[i], lists[j])["total"]
    return d


def corpus_wer(refs: dict[str, list[str]], hyps: dict[str, list[str]]) -> tuple[ErrorCounts, dict[str, ErrorCounts]]:
    """Corpus and per-utterance counts over the utterances of `refs`; an utterance
    missing from `hyps` counts as an empty hypothesis (all deletions)."""
    per = {u: align_counts(r, hyps.get(u, [])) for u, r in refs.items()}
    total = ErrorCounts()
    for c in per.values():
        total = total + c
    return total, per


def write_wer_report(path, refs: dict[str, list[str]], best: dict[str, list[str]],
                     first_pass: dict[str, list[str]] | None = None) -> tuple[ErrorCounts, ErrorCounts | None]:
    """wer.txt: the corpus line (Kaldi's compute-wer style), the first pass's WER when
    given, then `utt errors ref_words` per utterance. Scores the utterances of `best`
    that have a reference."""
    from ...files import atomic_write_text

    scored = {u: refs[u] for u in best if u in refs}
    if best and refs and not scored:  # a WER over no words would read as 0.00%
        from ...errors import ConfigError

        raise ConfigError(f"--refs: none of the {len(best)} utterances has a reference (their ids are like "
                          f"{next(iter(best))!r}, the references' like {next(iter(refs))!r}); no wer.txt written")
    total, per = corpus_wer(scored, best)
    lines = [f"%WER {100 * total.wer:.2f} [ {total.errors} / {total.ref_words}, {total.ins} ins, "
             f"{total.dels} del, {total.sub} sub ]"]
    first = None
    if first_pass is not None:
        first, _ = corpus_wer(scored, first_pass)
        lines.append(f"first-pass %WER {100 * first.wer:.2f}")
    lines += [f"{u} {c.errors} {c.ref_words}" for u, c in per.items()]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return total, first
