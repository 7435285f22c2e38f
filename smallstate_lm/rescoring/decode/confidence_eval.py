"""How good word confidences are, against the reference: normalised cross entropy (NCE) and expected
calibration error (ECE), with the reliability table behind the ECE, and a reliability diagram.

A hypothesis word is correct when the WER alignment with the reference matches it (`wer.correct_words`).
NCE (NIST's measure) is the share of the label entropy that the confidences explain:

    H_max  = -(n_c ln p_c + n_e ln(1 - p_c))           p_c = n_c / n, the fraction of correct words
    H_conf = -(sum over correct words of ln c + sum over errors of ln(1 - c))
    NCE    = (H_max - H_conf) / H_max

1 for perfect confidences, 0 for a constant p_c, negative for worse than that. Confidences are clipped into
[clip, 1 - clip] first (a word given exactly 1 that is wrong would otherwise cost an infinite entropy). ECE splits
[0, 1] into equal bins and averages |accuracy - mean confidence| over them, weighted by their word counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ...errors import SmallstateError
from .wer import correct_words

DEFAULT_CLIP = 1e-4
DEFAULT_BINS = 10


@dataclass(frozen=True)
class ReliabilityBin:
    lo: float
    hi: float
    words: int
    confidence: float  # mean confidence of its words (nan when empty)
    accuracy: float  # fraction of them correct (nan when empty)


@dataclass(frozen=True)
class ConfidenceReport:
    words: int
    correct: int
    nce: float
    ece: float
    mean_confidence: float
    bins: list[ReliabilityBin]

    def line(self) -> str:
        return (f"{self.words} words, {100 * self.correct / max(self.words, 1):.1f}% correct, mean confidence "
                f"{self.mean_confidence:.3f}, NCE {self.nce:.3f}, ECE {self.ece:.3f}")


def _checked(conf: Sequence[float], correct: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    c, y = np.asarray(conf, dtype=np.float64), np.asarray(correct, dtype=bool)
    if c.shape != y.shape or c.ndim != 1:
        raise SmallstateError(f"confidences ({c.size}) and correctness labels ({y.size}) must be two equal lists")
    if c.size and (not np.all(np.isfinite(c)) or c.min() < 0 or c.max() > 1):
        raise SmallstateError("confidences must lie in [0, 1]")
    return c, y


def nce(conf: Sequence[float], correct: Sequence[bool], clip: float = DEFAULT_CLIP) -> float:
    """Normalised cross entropy (module docstring); nan when every word is correct or every word wrong (the
    labels then carry no entropy to explain)."""
    c, y = _checked(conf, correct)
    n, n_c = y.size, int(y.sum())
    if n_c in (0, n):
        return math.nan
    p = n_c / n
    h_max = -(n_c * math.log(p) + (n - n_c) * math.log1p(-p))
    c = np.clip(c, clip, 1 - clip)
    h_conf = -(np.log(c[y]).sum() + np.log1p(-c[~y]).sum())
    return float((h_max - h_conf) / h_max)


def reliability(conf: Sequence[float], correct: Sequence[bool], n_bins: int = DEFAULT_BINS) -> list[ReliabilityBin]:
    """Words by confidence into `n_bins` equal bins of [0, 1] (1.0 into the last), each with its mean confidence
    and accuracy."""
    if n_bins < 1:
        raise SmallstateError(f"n_bins must be >= 1, got {n_bins}")
    c, y = _checked(conf, correct)
    idx = np.minimum((c * n_bins).astype(np.int64), n_bins - 1)
    out = []
    for b in range(n_bins):
        m = idx == b
        k = int(m.sum())
        out.append(ReliabilityBin(b / n_bins, (b + 1) / n_bins, k, float(c[m].mean()) if k else math.nan,
                                  float(y[m].mean()) if k else math.nan))
    return out


def ece(conf: Sequence[float], correct: Sequence[bool], n_bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error over `n_bins` equal bins (module docstring); 0 for no words."""
    bins = reliability(conf, correct, n_bins)
    n = sum(b.words for b in bins)
    return float(sum(b.words * abs(b.accuracy - b.confidence) for b in bins if b.words) / n) if n else 0.0


def evaluate_confidences(conf: Sequence[float], correct: Sequence[bool], n_bins: int = DEFAULT_BINS,
                         clip: float = DEFAULT_CLIP) -> ConfidenceReport:
    c, y = _checked(conf, correct)
    return ConfidenceReport(words=int(y.size), correct=int(y.sum()), nce=nce(c, y, clip), ece=ece(c, y, n_bins),
                            mean_confidence=float(c.mean()) if c.size else math.nan, bins=reliability(c, y, n_bins))


def label_transcripts(refs: Mapping[str, Sequence[str]],
                      hyps: Mapping[str, tuple[Sequence[str], Sequence[float]]]) -> tuple[list[float], list[bool]]:
    """(every confidence, whether its word is correct) over the utterances of `hyps` (utt -> (words,
    confidences)); raises SmallstateError, naming it, for an utterance without a reference or whose words and
    confidences differ in number."""
    conf, correct = [], []
    for utt, (words, cs) in hyps.items():
        if utt not in refs:
            raise SmallstateError(f"utterance {utt!r}: no reference to judge its confidences against")
        if len(words) != len(cs):
            raise SmallstateError(f"utterance {utt!r}: {len(words)} words but {len(cs)} confidences")
        conf.extend(float(x) for x in cs)
        correct.extend(correct_words(refs[utt], words))
    return conf, correct


def reliability_table(reports: Mapping[str, ConfidenceReport]) -> str:
    """A Markdown table: per confidence bin, each report's word count and accuracy."""
    names = list(reports)
    head = "| confidence | " + " | ".join(f"{n}: words | {n}: accuracy" for n in names) + " |"
    rule = "|---|" + "---|---|" * len(names)
    rows = []
    for k, b in enumerate(next(iter(reports.values())).bins if names else []):
        cells = []
        for n in names:
            r = reports[n].bins[k]
            cells += [str(r.words), "-" if not r.words else f"{r.accuracy:.2f}"]
        rows.append(f"| {b.lo:.1f}-{b.hi:.1f} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])


def plot_reliability(reports: Mapping[str, ConfidenceReport], path: str) -> bool:
    """A reliability diagram (accuracy against mean confidence per bin, one line per report) as a PNG; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    for name, r in reports.items():
        xs = [b.confidence for b in r.bins if b.words]
        ys = [b.accuracy for b in r.bins if b.words]
        ax.plot(xs, ys, marker="o", label=f"{name} (NCE {r.nce:.3f}, ECE {r.ece:.3f})")
    ax.set_xlabel("mean word confidence in bin")
    ax.set_ylabel("fraction of words correct")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
