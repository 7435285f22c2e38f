"""Word confidences for an n-best list's best hypothesis: each word's posterior, the probability under
softmax(scale * total) over the list of the hypotheses that say that word in its place once aligned
to the best one (Levenshtein alignment). The list's analogue of a lattice word's posterior in its
slot (decode/transcript.py); the same `posterior_scale` sets the posterior's sharpness."""

from __future__ import annotations

from typing import Sequence

import kaldialign
import numpy as np

from ...weights import Weights
from .lists import Utterance

_GAP = " "  # never a word: every reader and the service split words on whitespace


def _id_aligner():
    """kaldialign's alignment of integer sequences itself, where this kaldialign has it as before: its public
    `align` builds symbol tables on every call, which cost more than the alignment of two short hypotheses.
    Checked on an example at import; None (the public `align`) otherwise."""
    try:
        from kaldialign import _kaldialign

        if _kaldialign.align([1, 2, 3], [1, 3, 4], 0, False) == [(1, 1), (2, 0), (3, 3), (0, 4)]:
            return _kaldialign.align
    except Exception:  # another kaldialign: the public way
        pass
    return None


_ALIGN_IDS = _id_aligner()


def list_confidences(words: Sequence[Sequence[str]], totals: np.ndarray, scale: float, best: int = 0) -> list[float]:
    """The confidence in [0, 1] of each word of hypothesis `best` of the list `words` (scored `totals`, natural
    log) under the posterior softmax(scale * totals)."""
    ref = list(words[best])
    if not ref:
        return []
    z = scale * np.asarray(totals, dtype=np.float64)
    post = np.exp(z - z.max())
    post /= post.sum()
    conf = np.zeros(len(ref))
    ids = None if _ALIGN_IDS is None else {w: k + 1 for k, w in enumerate(dict.fromkeys(ref))}
    ref_ids = None if ids is None else [ids[w] for w in ref]
    gap = _GAP if ids is None else 0
    for j, hyp in enumerate(words):
        if post[j] == 0.0:
            continue
        if j == best or list(hyp) == ref:
            conf += post[j]
            continue
        if len(hyp) == len(ref):
            same = [r == h for r, h in zip(ref, hyp)]
            if len(same) - sum(same) == 1:  # one substitution: the only alignment of cost 1, no search needed
                conf[same] += post[j]
                continue
        i = 0
        for r, h in _align(ref, ref_ids, hyp, ids):
            if r == gap:
                continue  # an insertion: no word of the best one
            if r == h:
                conf[i] += post[j]
            i += 1
    return np.clip(conf, 0.0, 1.0).tolist()


def _align(ref: list[str], ref_ids: list[int] | None, hyp: Sequence[str], ids: dict[str, int] | None) -> list[tuple]:
    """The Levenshtein alignment of `hyp` to `ref`: pairs of words, or of their ids (`ref_ids`, new words of `hyp`
    added to `ids`; 0 = the gap) when there are ids."""
    if ids is None:
        return kaldialign.align(ref, list(hyp), _GAP)
    n = len(ids)
    return _ALIGN_IDS(ref_ids, [ids.setdefault(w, n + k + 1) for k, w in enumerate(hyp)], 0, False)


def with_confidences(ranked: Sequence[Utterance], w: Weights) -> list[Utterance]:
    """`ranked` (apply_weights' output: best first, `total` in each hypothesis's scores) with the word confidences
    of each list's best hypothesis set (`Hypothesis.confidences`)."""
    for u in ranked:
        if u.hyps:
            totals = np.array([h.scores["total"] for h in u.hyps])
            u.hyps[0].confidences = list_confidences([h.words for h in u.hyps], totals, w.posterior_scale)
    return list(ranked)
