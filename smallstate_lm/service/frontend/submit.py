"""A request's prepared work as the engine takes it (`engine_submit`): each hypothesis list's words as one array
of the neural LM's token ids, each lattice as its prepared arrays, with what the cost model predicts of them. The
vocabulary checks are made here, so that a request in the wrong vocabulary fails alone, before the engine."""

from __future__ import annotations

import itertools

import numpy as np

from smallstate_lm.errors import SmallstateError
from smallstate_lm.vocab import EOS_ID
from smallstate_lm.weights import check_overlap

from ..errors import ServiceError
from ..messages import LatticeJob, ListJob, Submit
from ..model import Models
from .work import LatticeItem, NbestItem, Work, check_encodable, lm_lengths


def engine_submit(models: Models, work: Work, remaining: float, timeout: float) -> Submit:
    """The `Submit` of `work` (its id is the client's to set), `remaining` seconds of its deadline of `timeout`
    left. ServiceError (422) when its hypotheses are mostly outside an LM's vocabulary."""
    field = "sentences" if work.kind == "score" else "utterances"
    lists = [it for it in work.items if isinstance(it, NbestItem)]
    _check_vocabulary(models, lists, field)
    neural = models.neural
    jobs = []
    if neural is not None:
        for it in lists:
            hyps = it.scored.hyps
            words = np.fromiter(lm_lengths(models, [h.words for h in hyps]), dtype=np.int64, count=len(hyps))
            ids = np.fromiter(neural.vocab.ids(itertools.chain.from_iterable(h.words for h in hyps)), dtype=np.int64,
                              count=int(words.sum()))
            tokens = np.insert(ids, np.cumsum(words), EOS_ID)  # </s> after each hypothesis' words
            jobs.append(ListJob(tokens, words + 1, it.seconds, it.depth, it.tree))
    lattices = [LatticeJob(it.lattice, f, it.seconds, it.nbytes, it.context)
                for it, f in zip(work.items, work.fields) if isinstance(it, LatticeItem)]
    return Submit(0, work.kind, work.weights, jobs, lattices, cost=work.cost, seconds=work.seconds,
                  lattice_seconds=work.lattice_seconds, tokens_total=work.tokens_total,
                  tokens_computed=work.tokens_computed, remaining=remaining, timeout=timeout, field=field)


def _check_vocabulary(models: Models, lists: list[NbestItem], field: str) -> None:
    """The overlap check of compute_components, per request: a request in the wrong vocabulary fails alone."""
    sents = [h.words for it in lists for h in it.scored.hyps]
    check_encodable(models, itertools.chain.from_iterable(sents), field)
    try:
        if models.neural is not None:
            check_overlap(sents, models.neural.vocab, "the neural LM")
        if models.ngram is not None:
            check_overlap(sents, models.ngram, "the n-gram")
    except SmallstateError as e:
        raise ServiceError(str(e), field) from None
