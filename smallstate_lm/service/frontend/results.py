"""A request's answer, from its work and the engine's `Scored`: the n-gram of its lists, per utterance its
hypotheses ranked under the request's weights (`ranking`, apply_weights' order, for lists; `ExpandedLattice.nbest`
for lattices, with the transcript and its confidences; as the CLI ranks them), per sentence its log-probs and
perplexity. Natural-log scores in dataclasses; the HTTP side turns them into the response's JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from smallstate_lm.errors import SmallstateError
from smallstate_lm.rescoring.decode.transcript import Decoded, decode_lattice
from smallstate_lm.rescoring.nbest.components import Components, first_pass_components, hypothesis_scores, ranking
from smallstate_lm.rescoring.nbest.confidence import list_confidences
from smallstate_lm.scoring.words import per_word
from smallstate_lm.weights import Weights, oov_counts

from ..errors import ServiceError
from ..messages import Scored
from ..model import Models
from .work import LatticeItem, NbestItem, Work, lm_lengths


@dataclass
class RankedHypothesis:
    """One hypothesis of a result: its components before weighting (natural log; `neural`,
    `ngram` None without that LM), the weighted penalty word_penalty*n_words +
    oov_penalty*n_oov, the weighted `total` and its `rank` (0 = best)."""

    id: str
    words: list[str]
    rank: int
    total: float
    am: float
    graph: float
    neural: float | None
    ngram: float | None
    penalty: float
    n_words: int
    n_oov: int
    expected_errors: float | None = None  # under MBR
    confidences: list[float] | None = None  # per word: the best hypothesis of a list
    neural_tok: list[float] | None = None  # per token (words + </s>), when asked for
    ngram_tok: list[float] | None = None


@dataclass
class RankedUtterance:
    utt: str
    source: Literal["hypotheses", "lattice"]
    hypotheses: list[RankedHypothesis]  # best first, at most the request's nbest
    transcript: Decoded | None = None  # lattices: the best path or the consensus, with word confidences


@dataclass
class LMTotal:
    logprob: float  # natural log, words + </s>
    perplexity: float
    token_logprobs: list[float] | None = None  # when asked for


@dataclass
class SentenceScores:
    words: list[str]
    tokens: int  # words + </s>
    n_oov: int
    neural: LMTotal | None
    ngram: LMTotal | None


@dataclass
class Counts:
    utterances: int
    hypotheses: int
    tokens_total: int
    tokens_computed: int
    lattice_arcs: int
    batch_requests: int
    queue_ms: float
    compute_ms: float


@dataclass
class Result:
    """A request's answer: `items` hold RankedUtterance (rescore) or SentenceScores (score)."""

    items: list[RankedUtterance | SentenceScores]
    weights: Weights
    counts: Counts


def result(models: Models, w: Work, scored: Scored) -> Result:
    """The answer to `w`, given what the engine made of it."""
    t0 = time.perf_counter()
    _take(models, w, scored)
    n_hyps = 0
    items: list[RankedUtterance | SentenceScores] = []
    for it in w.items:
        if isinstance(it, LatticeItem):
            items.append(_ranked_lattice(models, it, w.weights))
            n_hyps += len(it.hyps)
        elif w.kind == "score":
            items.append(_sentence(it, _strip_context(models, it), w.token_logprobs))
            n_hyps += 1
        else:
            ranked, n = _ranked_list(models, it, w)
            items.append(ranked)
            n_hyps += n
    steps = sum(it.lm_steps for it in w.items if isinstance(it, LatticeItem))
    counts = Counts(utterances=len(w.items), hypotheses=n_hyps, tokens_total=w.tokens_total + steps,
                    tokens_computed=w.tokens_computed + steps, lattice_arcs=w.lattice_arcs,
                    batch_requests=scored.batch_size, queue_ms=round(1000 * scored.queue_s, 3),
                    compute_ms=round(1000 * (scored.compute_s + time.perf_counter() - t0), 3))
    return Result(items=items, weights=w.weights, counts=counts)


def _take(models: Models, w: Work, scored: Scored) -> None:
    """Each list's Components (the engine's neural log-probs, the n-gram's here) and each lattice's n-best and
    transcript, from its expansion."""
    lists = [it for it in w.items if isinstance(it, NbestItem)]
    for k, it in enumerate(lists):
        c = first_pass_components(it.scored, models.known)
        if scored.neural is not None:
            words = [h.words for h in it.scored.hyps]
            lens = np.asarray(lm_lengths(models, words), dtype=np.int64) + 1  # the LM's tokens and </s>
            c.neural_tok = per_word(models.neural.vocab, words, np.split(scored.neural[k], np.cumsum(lens)[:-1]))
            c.neural = np.array([x.sum() for x in c.neural_tok])
        if models.ngram is not None:  # from <s>: an n-gram has no history across a sentence's end
            c.ngram_tok = [models.ngram.token_logprobs(h.words) for h in it.plain.hyps]
            c.ngram = np.array([x.sum() for x in c.ngram_tok])
        it.comps = c
    lattices = [(it, f) for it, f in zip(w.items, w.fields) if isinstance(it, LatticeItem)]
    for (it, field), exp in zip(lattices, scored.lattices):
        exp.source = it.lattice
        it.hyps = exp.nbest(w.weights, it.n)
        if it.hyps:
            try:  # a forward-backward and an alignment: about what expanding the lattice with an n-gram costs
                it.transcript = decode_lattice(exp, w.weights, it.hyps[0].words)
            except SmallstateError as e:
                raise ServiceError(str(e), f"{field}.lattice") from None
        it.lm_steps = exp.stats.lm_rows


def _ranked(models: Models, sc: dict, id: str, words: list[str], rank: int, w: Weights) -> RankedHypothesis:
    """From the scores of apply_weights or of a lattice's ScoredPath (the same keys)."""
    return RankedHypothesis(id=id, words=words, rank=rank, total=sc["total"], am=sc["am"], graph=sc["graph"],
                            neural=sc.get("neural") if models.neural is not None else None,
                            ngram=sc.get("ngram") if models.ngram is not None else None,
                            penalty=w.word_penalty * sc["n_words"] + w.oov_penalty * sc["n_oov"],
                            n_words=sc["n_words"], n_oov=sc["n_oov"], expected_errors=sc.get("expected_errors"))


def _strip_context(models: Models, it: NbestItem) -> Components:
    """Components of the plain hypotheses from those scored after the context words (the neural LM's; the
    n-gram scored the plain ones)."""
    c, k = it.comps, it.context
    if k == 0:
        return c
    hyps, known = it.plain.hyps, models.known
    out = Components(am=c.am, graph=c.graph, n_words=np.array([len(h.words) for h in hyps], dtype=np.float64),
                     n_oov=np.array(oov_counts([h.words for h in hyps], known), dtype=np.float64))
    if c.neural_tok is not None:
        out.neural_tok = [t[k:] for t in c.neural_tok]
        out.neural = np.array([t.sum() for t in out.neural_tok])
    out.ngram_tok, out.ngram = c.ngram_tok, c.ngram
    return out


def _ranked_list(models: Models, it: NbestItem, w: Work) -> tuple[RankedUtterance, int]:
    """The list ranked under the request's weights, cut to its nbest; and how many it had."""
    c = _strip_context(models, it)
    # `ranking` is apply_weights' order; the ranked copies of every hypothesis it would make are not needed
    order, tot, risk = ranking(it.plain, c, w.weights)
    hyps = it.plain.hyps
    confidences = list_confidences([hyps[j].words for j in order], tot[order], w.weights.posterior_scale)
    out = []
    for rank, j in enumerate(order[: w.nbest].tolist()):
        r = _ranked(models, hypothesis_scores(c, tot, risk, j), it.ids[j], hyps[j].words, rank, w.weights)
        if w.token_logprobs:
            r.neural_tok = c.neural_tok[j].tolist() if c.neural_tok is not None else None
            r.ngram_tok = c.ngram_tok[j].tolist() if c.ngram_tok is not None else None
        out.append(r)
    if out:
        out[0].confidences = confidences
    return RankedUtterance(it.plain.utt, "hypotheses", out), len(hyps)


def _ranked_lattice(models: Models, it: LatticeItem, w: Weights) -> RankedUtterance:
    name = it.lattice.name
    if not it.hyps:
        raise ServiceError(f"lattice {name!r}: no complete path survived pruning", "utterances")
    hyps = [_ranked(models, h.scores(), str(rank), h.words, rank, w) for rank, h in enumerate(it.hyps)]
    return RankedUtterance(name, "lattice", hyps, it.transcript)


def _sentence(it: NbestItem, c: Components, token_logprobs: bool) -> SentenceScores:
    words = it.plain.hyps[0].words
    n = len(words) + 1

    def lm(total: np.ndarray | None, toks: list[np.ndarray] | None) -> LMTotal | None:
        if total is None:
            return None
        lp = float(total[0])
        return LMTotal(logprob=lp, perplexity=float(np.exp(-lp / n)),
                       token_logprobs=toks[0].tolist() if token_logprobs else None)

    return SentenceScores(words=words, tokens=n, n_oov=int(c.n_oov[0]), neural=lm(c.neural, c.neural_tok),
                          ngram=lm(c.ngram, c.ngram_tok))
