"""N-best rescoring: compute every score component once, combine under any weights."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
from tqdm import tqdm

from ...errors import ConfigError, SmallstateError
from ...ngram import NgramLM
from ...scoring.context import context_tokens, ngram_start
from ...weights import Weights, check_overlap, log_mix, oov_counts, oov_reference, weighted_total
from ..decode.wer import pairwise_errors
from .lists import Utterance

if TYPE_CHECKING:  # the n-gram-only path never imports torch
    from ...scoring.scorer import NeuralScorer

# MBR compares hypotheses pairwise (quadratic), so it considers the first ones of each list
# in the decoder's order; the rest are ranked after them by total.
MBR_MAX_HYPS = 100
# expected errors are rounded to this many decimals, so that risks equal up to summation
# order tie (then the higher total wins) the same way here and in tune's vectorised path
MBR_DECIMALS = 9


@dataclass
class Components:
    """One utterance's per-hypothesis scores (natural log), before weighting."""

    am: np.ndarray
    graph: np.ndarray
    n_words: np.ndarray
    n_oov: np.ndarray
    neural: np.ndarray | None = None
    ngram: np.ndarray | None = None
    neural_tok: list[np.ndarray] | None = None  # per hypothesis: words + </s>
    ngram_tok: list[np.ndarray] | None = None
    distances: np.ndarray | None = None  # word edit distances among the MBR candidates, filled on demand

    def matrix(self) -> np.ndarray:
        """(n_hyps, 6) in the order of COMPONENTS; a missing LM contributes zeros."""
        z = np.zeros_like(self.am)
        return np.stack([self.am, self.graph, z if self.neural is None else self.neural,
                         z if self.ngram is None else self.ngram, self.n_words, self.n_oov], axis=1)


def linear_lm(c: Components, lam: float) -> np.ndarray:
    """sum_t log(lam p_nn + (1 - lam) p_ng) per hypothesis."""
    if c.neural_tok is None or c.ngram_tok is None:
        raise ConfigError("linear interpolation needs both a neural LM (--lm) and an n-gram (--ngram)")
    return np.array([log_mix(lam, nn, ng).sum() for nn, ng in zip(c.neural_tok, c.ngram_tok)])


def totals(c: Components, w: Weights) -> np.ndarray:
    return weighted_total(w, c.matrix(), linear_lm(c, w.lam) if w.interpolation == "linear" else None)


def mbr_distances(u: Utterance, c: Components) -> np.ndarray:
    """(n, n) word edit distances among the first MBR_MAX_HYPS hypotheses, cached on `c`."""
    if c.distances is None:
        c.distances = pairwise_errors([h.words for h in u.hyps[:MBR_MAX_HYPS]])
    return c.distances


def expected_errors(tot: np.ndarray, distances: np.ndarray, scale: float) -> np.ndarray:
    """Expected word errors of each MBR candidate against the posterior softmax(scale * total)
    over the candidates."""
    t = scale * tot[: len(distances)]
    p = np.exp(t - t.max())
    return np.round(distances @ (p / p.sum()), MBR_DECIMALS)


def ranking(u: Utterance, c: Components, w: Weights) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(order best-first, totals, expected errors of the MBR candidates or None)."""
    tot = totals(c, w)
    if w.mbr_scale <= 0:
        return np.argsort(-tot, kind="stable"), tot, None
    risk = expected_errors(tot, mbr_distances(u, c), w.mbr_scale)
    n = len(risk)
    head = np.lexsort((-tot[:n], risk))  # fewest expected errors, ties to the higher total
    tail = n + np.argsort(-tot[n:], kind="stable")
    return np.concatenate([head, tail]), tot, risk


@dataclass
class ScoreStats:
    utterances: int = 0
    hypotheses: int = 0
    tokens_total: int = 0
    tokens_computed: int = 0
    oov_rate: float = 0.0
    seconds: float = 0.0


def first_pass_components(u: Utterance, known) -> Components:
    """`u`'s Components without LM scores: the decoder's scores, word and OOV counts (`known`: `oov_reference`)."""
    return Components(am=np.array([h.am for h in u.hyps]), graph=np.array([h.graph for h in u.hyps]),
                      n_words=np.array([len(h.words) for h in u.hyps], dtype=np.float64),
                      n_oov=np.array(oov_counts([h.words for h in u.hyps], known), dtype=np.float64))


def compute_components(utts: Sequence[Utterance], neural: NeuralScorer | None = None, ngram: NgramLM | None = None,
                       progress: bool = True, check: bool = True,
                       sizes: Sequence | None = None,
                       contexts: Sequence[Sequence[Sequence[str]]] | None = None,
                       ngram_context: bool = False) -> tuple[list[Components], ScoreStats]:
    """Score every hypothesis with each LM given; the neural LM sees all utterances
    in batches (prefix-shared unless its scorer says otherwise). `check=False`: the caller has
    made check_overlap's vocabulary checks on these hypotheses already; `sizes`: each utterance's
    trie size (`TreeSize`) as the neural LM's scorer sees it, when the caller has them. `contexts`: per
    utterance, the sentences said before it (oldest first), which the neural LM reads before its hypotheses
    (and the n-gram too with `ngram_context`; else it starts at `<s>`)."""
    for u in utts:
        if not u.hyps:
            raise SmallstateError(f"utterance {u.utt!r} has an empty hypothesis list")
    t0 = time.perf_counter()
    sents = [h.words for u in utts for h in u.hyps]
    stats = ScoreStats(utterances=len(utts), hypotheses=len(sents))
    known = oov_reference(neural.vocab if neural is not None else None, ngram)
    if neural is not None and check:
        check_overlap(sents, neural.vocab, "the neural LM")
    if ngram is not None and check:
        check_overlap(sents, ngram, f"the n-gram {ngram.path}")
    comps = [first_pass_components(u, known) for u in utts]
    words_total = sum(len(s) for s in sents)
    stats.oov_rate = float(sum(c.n_oov.sum() for c in comps) / words_total) if words_total else 0.0
    if neural is not None:
        before = (neural.tokens_total, neural.tokens_computed)
        chunk = 64  # utterances per progress update; the scorer batches within
        for i in tqdm(range(0, len(utts), chunk), disable=not progress, desc="neural LM", unit="chunk"):
            part = utts[i : i + chunk]
            ctx = ([context_tokens(neural.vocab, c) for c in contexts[i : i + chunk]]
                   if contexts is not None else None)
            tok = neural.token_logprobs([[h.words for h in u.hyps] for u in part],
                                        sizes[i : i + chunk] if sizes is not None else None, ctx)
            for c, t in zip(comps[i : i + chunk], tok):
                c.neural_tok = t
                c.neural = np.array([x.sum() for x in t])
        stats.tokens_total = neural.tokens_total - before[0]
        stats.tokens_computed = neural.tokens_computed - before[1]
    if ngram is not None:
        for i, (u, c) in enumerate(zip(utts, comps)):
            start = ngram_start(ngram, contexts[i]) if ngram_context and contexts is not None and contexts[i] else None
            c.ngram_tok = [ngram.token_logprobs(h.words, start) for h in u.hyps]
            c.ngram = np.array([x.sum() for x in c.ngram_tok])
    stats.seconds = time.perf_counter() - t0
    return comps, stats


def hypothesis_scores(c: Components, tot: np.ndarray, risk: np.ndarray | None, j: int,
                      rank: int | None = None) -> dict:
    """Hypothesis j's scores as a ranked list carries them: its components (natural log; `neural`/`ngram` only
    with that LM), word and OOV counts, `total`, its `rank` when given and, among the MBR candidates,
    `expected_errors`."""
    scores = {"am": float(c.am[j]), "graph": float(c.graph[j]), "n_words": int(c.n_words[j]),
              "n_oov": int(c.n_oov[j]), "total": float(tot[j])}
    if rank is not None:
        scores["rank"] = rank
    if c.neural is not None:
        scores["neural"] = float(c.neural[j])
    if c.ngram is not None:
        scores["ngram"] = float(c.ngram[j])
    if risk is not None and j < len(risk):
        scores["expected_errors"] = float(risk[j])
    return scores


def apply_weights(utts: Sequence[Utterance], comps: Sequence[Components], w: Weights) -> list[Utterance]:
    """New utterances with hypotheses sorted best-first (highest total, or fewest expected
    errors under MBR), each carrying its components, `total`, `rank` and, under MBR,
    `expected_errors` in `scores`."""
    out = []
    for u, c in zip(utts, comps):
        order, tot, risk = ranking(u, c, w)
        hyps = []
        for rank, j in enumerate(order):
            h = u.hyps[j]
            hyps.append(type(h)(words=h.words, am=h.am, graph=h.graph, id=h.id,
                                scores=hypothesis_scores(c, tot, risk, j, rank)))
        out.append(Utterance(u.utt, hyps))
    return out
