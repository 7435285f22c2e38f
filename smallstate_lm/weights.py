"""Score weights and their one combination, without torch: an n-gram-only
rescoring or tuning run imports this, never the neural side (scoring/scorer.py).

Every hypothesis keeps its components separately — am, graph, neural, ngram, the
word count and OOV count — so a sweep over weights re-ranks cached numbers and never
calls an LM again. All scores are natural log.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from .errors import ConfigError, VocabularyError
from .files import atomic_write_text

# how a lattice's transcript is chosen: its best path, or the consensus (minimum Bayes risk) decode
DECODES = ("viterbi", "mbr")
_TEXT_FIELDS = ("interpolation", "decode")


@dataclass
class Weights:
    """total = am_scale*am + graph_scale*graph + lm_weight*neural + ngram_weight*ngram
               + word_penalty*n_words + oov_penalty*n_oov        (interpolation="loglinear")

    With interpolation="linear" the neural and n-gram terms are replaced by
    lm_weight * sum_t log(lam * p_nn(t) + (1 - lam) * p_ng(t)).
    mbr_scale > 0 picks hypotheses of an n-best list by minimum Bayes risk instead of the
    highest total: the posterior over the list is softmax(mbr_scale * total) and the
    hypothesis with the fewest expected word errors against it wins (0 = highest total).
    Lattices are decoded by their best path (decode="viterbi") or by consensus (decode="mbr": the word
    sequence with the fewest expected word errors, rescoring/decode/consensus.py, under the posterior
    exp(mbr_scale * total), or exp(posterior_scale * total) when mbr_scale is 0); their word confidences
    are posteriors under exp(posterior_scale * total).
    Defaults suit a decoder whose am is a raw acoustic log-likelihood (Kaldi-style
    acoustic scale 1/10) and whose graph score is a natural-log LM probability;
    graph_scale=0 replaces the first-pass LM instead of adding to it.
    """

    am_scale: float = 0.1
    graph_scale: float = 1.0
    lm_weight: float = 0.5
    ngram_weight: float = 0.5
    word_penalty: float = 0.0
    oov_penalty: float = 0.0
    interpolation: Literal["loglinear", "linear"] = "loglinear"
    lam: float = 0.5
    mbr_scale: float = 0.0
    posterior_scale: float = 0.7  # the confidences of the dev lattices explain the most near it (docs/results.md)
    decode: Literal["viterbi", "mbr"] = "viterbi"

    def __post_init__(self):
        if self.interpolation not in ("loglinear", "linear"):
            raise ConfigError(f"interpolation must be 'loglinear' or 'linear', got {self.interpolation!r}")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"lam must lie in [0, 1], got {self.lam}")
        if self.mbr_scale < 0:
            raise ConfigError(f"mbr_scale must be >= 0 (0 = no MBR), got {self.mbr_scale}")
        if self.decode not in DECODES:
            raise ConfigError(f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}")
        if not self.posterior_scale > 0:  # 0 would make every path equally likely: no posterior at all
            raise ConfigError(f"posterior_scale must be > 0, got {self.posterior_scale}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"weight {f.name} must be finite, got {v}")

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> None:
        atomic_write_text(Path(path), json.dumps({**asdict(self), **(extra or {})}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Weights":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: weights file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object of weights")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: (v if k in _TEXT_FIELDS else float(v)) for k, v in d.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: bad weight value ({e})") from None


def log_mix(lam: float, nn, ng):
    """Per-token log(lam * p_nn + (1 - lam) * p_ng) from natural-log probabilities (log 0 = -inf)."""
    a = math.log(lam) if lam > 0 else -math.inf
    b = math.log1p(-lam) if lam < 1 else -math.inf
    return np.logaddexp(a + nn, b + ng)


def lm_score(w: Weights, nn, ng):
    """The weighted LM contribution of per-token (or per-hypothesis) neural and n-gram
    log-probs: log-linear, or per-token linear interpolation scaled by lm_weight."""
    if w.interpolation == "linear":
        return w.lm_weight * log_mix(w.lam, nn, ng)
    return w.lm_weight * nn + w.ngram_weight * ng


# The score components of a hypothesis (or of a lattice arc), in the order of weight_vector.
COMPONENTS = ("am", "graph", "neural", "ngram", "n_words", "n_oov")


def weight_vector(w: Weights) -> np.ndarray:
    """(6,) the log-linear weights in COMPONENTS order; a (K, 6) stack of them scores K weightings at once."""
    return np.array([w.am_scale, w.graph_scale, w.lm_weight, w.ngram_weight, w.word_penalty, w.oov_penalty])


def weighted_total(w: Weights, components: np.ndarray, linear_lm: np.ndarray | None = None) -> np.ndarray:
    """The one weighted total, natural log, higher is better.

    components: (N, 6) in COMPONENTS order (log-probs and scores, counts). With interpolation="linear"
    `linear_lm` (N,) replaces the neural and n-gram columns: each row's sum over its tokens of
    log(lam p_nn + (1 - lam) p_ng), which the caller computes because only it has the tokens.
    """
    if w.interpolation != "linear":
        return components @ weight_vector(w)
    if linear_lm is None:
        raise ConfigError("linear interpolation needs both a neural LM (--lm) and an n-gram (--ngram)")
    rest = components[:, [0, 1, 4, 5]] @ np.array([w.am_scale, w.graph_scale, w.word_penalty, w.oov_penalty])
    return rest + w.lm_weight * linear_lm


def oov_reference(vocab, ngram):
    """What decides whether a word is out of vocabulary: the neural LM's vocabulary when there is
    one, else the n-gram's (anything with `in`), else nothing (None)."""
    return vocab if vocab is not None else ngram


def count_oov(words: Sequence[str], known) -> int:
    """Words of `words` outside `known` (see oov_reference); 0 when `known` is None."""
    return 0 if known is None else sum(1 for w in words if w not in known)


def oov_counts(sentences: Sequence[Sequence[str]], known) -> list[int]:
    """count_oov of each sentence, asking `known` once per distinct word: the sentences of an n-best
    list repeat a few dozen words, and asking a vocabulary (or KenLM) costs more than a set lookup."""
    if known is None:
        return [0] * len(sentences)
    unknown = {w for w in set().union(*sentences) if w not in known} if sentences else set()
    if not unknown:
        return [0] * len(sentences)
    return [sum(1 for w in s if w in unknown) for s in sentences]


def check_overlap(sentences: Sequence[Sequence[str]], known, what: str, min_known: float = 0.5) -> float:
    """Fraction of word tokens that `known` contains; below `min_known` the decoder's
    words and the LM's vocabulary do not match (wrong model, case folding...)."""
    counts = Counter(itertools.chain.from_iterable(sentences))  # each distinct word asked once
    total = sum(counts.values())
    if total == 0:
        return 1.0
    hit = sum(c for w, c in counts.items() if w in known)
    rate = hit / total
    if rate < min_known:
        sample = [w for s in sentences for w in s if w not in known][:5]
        raise VocabularyError(f"{what}: only {100 * rate:.1f}% of {total} hypothesis words are in its vocabulary "
                              f"(e.g. {', '.join(sample)}); wrong model, or a case/normalisation mismatch?")
    return rate
