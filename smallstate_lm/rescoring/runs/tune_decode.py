"""The decode of lattices and the posterior scales, chosen on dev lattices once their weights are tuned
(`tune --decode viterbi,mbr`): each setting re-decodes the stored expanded lattices, no LM call.

- Viterbi: the transcript is the best path; `posterior_scale`, which only shapes its word confidences, is the
  one whose confidences explain the most (highest NCE against the references).
- MBR (the consensus, decode/consensus.py): `mbr_scale`, the posterior scale of the decision, is the one with the fewest
  word errors (ties: the higher NCE), then `word_penalty` is searched once more over its grid under it, since the
  consensus trades insertions for deletions differently from the best path (the other weights keep their Viterbi
  values: each setting costs a consensus decode of every lattice); then `posterior_scale` for its confidences,
  by NCE as above. The decision and the confidences get separate scales because they want different ones: on
  our dev sets the consensus does best with a sharp posterior, calibrated confidences need a flatter one.
- With both, MBR is kept only when it makes fewer errors than Viterbi on the dev set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...errors import ConfigError, SmallstateError
from ...weights import DECODES, Weights
from ..decode.confidence_eval import label_transcripts, nce
from ..decode.transcript import decode_lattices
from ..decode.wer import align_counts

# posterior scales tried; a scale multiplies the weighted total, so 1 is the rescoring weights' own sharpness
POSTERIOR_GRID = [0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0]
# the consensus's decision scales: on the dev lattices its best was the grid's top (3) in 7 of 8 folds, so the
# grid goes on towards the best path's (an infinite scale puts all the mass on it)
MBR_GRID = POSTERIOR_GRID + [4.0, 6.0, 10.0]


@dataclass(frozen=True)
class DecodePoint:
    decode: str
    weight: str  # the scale this point moved: posterior_scale or mbr_scale
    scale: float
    errors: int
    nce: float


@dataclass(frozen=True)
class DecodeChoice:
    weights: Weights  # with the chosen decode and scales (and, for MBR, word_penalty)
    errors: int
    nce: float  # of the chosen decode's confidences on the dev set
    points: list[DecodePoint]  # every scale tried, at the tuned weights

    def lines(self, ref_words: int) -> list[str]:
        """One line per (decode, scale searched): WER and NCE against the scale."""
        out = []
        for d, k in dict.fromkeys((p.decode, p.weight) for p in self.points):
            cells = [f"{p.scale:g}:{100 * p.errors / ref_words:.2f}/{p.nce:.3f}" for p in self.points
                     if (p.decode, p.weight) == (d, k)]
            out.append(f"{d}: WER%/NCE vs {k}: " + "  ".join(cells))
        return out


def parse_decodes(text: str) -> tuple[str, ...]:
    """`viterbi`, `mbr` or `viterbi,mbr` -> the decodes to choose among; errors name the option."""
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in DECODES]
    if bad or not names:
        raise ConfigError(f"--decode: expected viterbi, mbr or viterbi,mbr, got {text!r}")
    return names


def _better(a: DecodePoint, b: DecodePoint | None) -> bool:
    """Fewer errors, then a higher NCE (nan, when every word is right or every word wrong, never wins)."""
    if b is None or a.errors != b.errors:
        return b is None or a.errors < b.errors
    return not math.isnan(a.nce) and (math.isnan(b.nce) or a.nce > b.nce)


def _decode_all(expanded: Sequence, refs: Mapping[str, list[str]], w: Weights) -> tuple[int, float, dict]:
    """(word errors, NCE of the confidences, the words of each lattice) of every lattice decoded under `w`."""
    out = {e.name: d for e, d in zip(expanded, _decoded(expanded, w))}
    errors = sum(align_counts(refs[u], d.words).errors for u, d in out.items())
    score = nce(*label_transcripts(refs, {u: (d.words, d.confidences) for u, d in out.items()}))
    return errors, score, {u: d.words for u, d in out.items()}


def _confidence_scale(expanded, refs, w: Weights, errors: int) -> tuple[Weights, float, list[DecodePoint]]:
    """`w` with the posterior_scale whose confidences of `w`'s transcripts have the highest NCE."""
    words = [d.words for d in _decoded(expanded, w)]
    points, best = [], None
    for s in POSTERIOR_GRID:
        ws = dataclasses.replace(w, posterior_scale=s)
        # the confidences of those words, each lattice aligned to them (a Viterbi decode given its words)
        conf = _decoded(expanded, dataclasses.replace(ws, decode="viterbi"), words)
        hyps = {e.name: (ww, d.confidences) for e, ww, d in zip(expanded, words, conf)}
        p = DecodePoint(w.decode, "posterior_scale", s, errors, nce(*label_transcripts(refs, hyps)))
        points.append(p)
        if _better(p, best):
            best = p
    return dataclasses.replace(w, posterior_scale=best.scale), best.nce, points


def _mbr(expanded, refs, tuned: Weights, grid) -> tuple[Weights, int, list[DecodePoint]]:
    """The consensus's mbr_scale by errors on `expanded`, then its word_penalty (module docstring)."""
    points, best, best_w = [], None, None
    for m in MBR_GRID:
        w = dataclasses.replace(tuned, decode="mbr", mbr_scale=m, posterior_scale=m)
        e, score, _ = _decode_all(expanded, refs, w)
        p = DecodePoint("mbr", "mbr_scale", m, e, score)
        points.append(p)
        if _better(p, best):
            best, best_w = p, w
    for v in (grid or {}).get("word_penalty", []):
        w = dataclasses.replace(best_w, word_penalty=v)
        e, score, _ = _decode_all(expanded, refs, w)
        p = DecodePoint("mbr", "mbr_scale", best.scale, e, score)
        if _better(p, best):
            best, best_w = p, w
    return best_w, best.errors, points


def choose_decode(expanded: Sequence, refs: Mapping[str, list[str]], tuned: Weights, viterbi_errors: int,
                  decodes: Sequence[str], grid: Mapping[str, list[float]] | None = None) -> DecodeChoice:
    """The decode among `decodes` and its scales (module docstring), from weights `tuned` by Viterbi with
    `viterbi_errors` on `expanded`; `grid` gives word_penalty's values for the MBR pass (none: no pass)."""
    points: list[DecodePoint] = []
    cands: dict[str, tuple[int, float, Weights]] = {}
    if "viterbi" in decodes:
        w, score, pts = _confidence_scale(expanded, refs, dataclasses.replace(tuned, decode="viterbi"),
                                          viterbi_errors)
        cands["viterbi"] = (viterbi_errors, score, w)
        points += pts
    if "mbr" in decodes:
        w, errors, pts = _mbr(expanded, refs, tuned, grid)
        w, score, pts2 = _confidence_scale(expanded, refs, w, errors)
        cands["mbr"] = (errors, score, w)
        points += pts + pts2
    pick = "viterbi" if "viterbi" in cands and ("mbr" not in cands or cands["viterbi"][0] <= cands["mbr"][0]) \
        else "mbr"
    errors, score, w = cands[pick]
    return DecodeChoice(w, errors, score, points)


def _decoded(expanded: Sequence, w: Weights, words: Sequence[list[str]] | None = None) -> list:
    """`decode_lattices` of every lattice under `w` (given its words, where `words` has them); the first
    lattice's error, if any, is raised."""
    out = decode_lattices(expanded, w, words if words is not None else [None] * len(expanded))
    for d in out:
        if isinstance(d, SmallstateError):
            raise d
    return out
