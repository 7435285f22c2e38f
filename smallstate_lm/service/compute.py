"""The service's computation: loads the models and scores batches of requests on the worker thread.

It takes library objects (hypothesis lists as `Utterance`s, prepared `Lattice`s, `Weights`) and
returns dataclasses of natural-log scores; it knows neither HTTP nor the request schemas. Numbers
come from the library functions the CLI uses: `compute_components` and `apply_weights` for
hypothesis lists, `build_rescorer(...).expand_many` and `ExpandedLattice.nbest` for lattices, so a
request scores exactly as `smallstate-lm rescore` does on the same input.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch

from smallstate_lm.device import pick_device
from smallstate_lm.errors import ConfigError, SmallstateError
from smallstate_lm.rescoring.lattice import Lattice, LatticeWarning, SymbolTable
from smallstate_lm.rescoring.lattice_expand import ExpandConfig, build_rescorer
from smallstate_lm.rescoring.lattice_io import read_fst_text
from smallstate_lm.rescoring.nbest import Components, apply_weights, compute_components, first_pass_components
from smallstate_lm.rescoring.nbest_io import Hypothesis, Utterance
from smallstate_lm.scoring import (
    NeuralScorer,
    TreeSize,
    Weights,
    check_overlap,
    count_oov,
    oov_reference,
    sorted_groups,
    trie_size,
)
from smallstate_lm.vocab import EOS_ID

from .batcher import Job, drop_expired
from .cost import CostModel, LatticeShape, calibrate, lattice_shape
from .errors import DeadlineExceeded, ServiceError, Unavailable
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("smallstate_lm.service")
_DONE = object()


# ---------------------------------------------------------------------------------------------
# Work in


@dataclass
class NbestItem:
    """One hypothesis list. `scored` is what the LMs see (context words first), `plain` the same
    hypotheses without the context; both have the hypotheses' positions as ids, `ids` holds
    the ids they came with."""

    scored: Utterance
    plain: Utterance
    ids: list[str]
    context: int  # number of context words in front of every hypothesis of `scored`
    comps: Components | None = None
    cost: int = 0  # neural LM tokens computed (trie nodes)
    depth: int = 0  # tokens of its longest hypothesis (with the context and </s>)
    seconds: float = 0.0  # predicted by the cost model
    # scored in pieces (hypothesis indices each) when one step would take too long; their LM scores meanwhile
    neural_tok: list | None = None
    ngram_tok: list | None = None


@dataclass
class LatticeItem:
    lattice: Lattice  # prepared; its name is the utterance id
    n: int  # distinct word sequences to return
    hyps: list[dict] | None = None  # ExpandedLattice.nbest
    lm_steps: int = 0
    seconds: float = 0.0  # predicted by the cost model: an upper bound (beam pruning is not foreseen)
    nbytes: int = 0
    shape: LatticeShape | None = None  # what its expansion may take (computed when the request is prepared)


@dataclass
class Work:
    """One request: its items in request order, the request field of each (for error messages)
    and its token counts (its cost in a batch)."""

    kind: Literal["rescore", "score"]
    weights: Weights
    items: list[NbestItem | LatticeItem]
    fields: list[str]
    nbest: int | None = None  # hypotheses returned per list; None: all
    token_logprobs: bool = False
    tokens_total: int = 0
    tokens_computed: int = 0
    lattice_arcs: int = 0
    seconds: float = 0.0  # predicted: hypothesis lists, plus the lattices' upper bound
    lattice_seconds: float = 0.0  # the lattices' part of it
    nbytes: int = 0  # predicted peak working memory and LM state
    error: BaseException | None = None

    @property
    def cost(self) -> int:
        return self.tokens_computed + self.lattice_arcs


# ---------------------------------------------------------------------------------------------
# Results out


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
    neural_tok: list[float] | None = None  # per token (words + </s>), when asked for
    ngram_tok: list[float] | None = None


@dataclass
class RankedUtterance:
    utt: str
    source: Literal["hypotheses", "lattice"]
    hypotheses: list[RankedHypothesis]  # best first, at most the request's nbest


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


def _ranked(sc: dict, id: str, words: list[str], rank: int, w: Weights, neural: bool, ngram: bool) -> RankedHypothesis:
    """From the scores of apply_weights or ExpandedLattice.nbest (the same keys)."""
    return RankedHypothesis(id=id, words=words, rank=rank, total=sc["total"], am=sc["am"], graph=sc["graph"],
                            neural=sc.get("neural") if neural else None, ngram=sc.get("ngram") if ngram else None,
                            penalty=w.word_penalty * sc["n_words"] + w.oov_penalty * sc["n_oov"],
                            n_words=sc["n_words"], n_oov=sc["n_oov"], expected_errors=sc.get("expected_errors"))


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure (host or device), which a retry later or a smaller request may not meet."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))


def _name(path: str | None) -> str:
    """What /v1/models and /metrics show of a model file: its run directory's or file's name. The server's
    filesystem layout is none of a client's business."""
    return os.path.basename(os.path.normpath(path)) if path else ""


# ---------------------------------------------------------------------------------------------
# The computation


class Compute:
    """Models and the batch computation. `load()` and `run_batch()` run on the worker
    thread; the request builders on any thread (they only read the loaded models)."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None):
        if settings.lm is None and settings.ngram is None:
            raise ConfigError("give a neural LM (--lm DIR / SMALLSTATE_LM), an n-gram (--ngram FILE / "
                              "SMALLSTATE_NGRAM), or both")
        self.s = settings
        self.metrics = metrics
        self.neural: NeuralScorer | None = None
        self.ngram = None
        self.loaded = None
        self.device = torch.device("cpu")
        self.weights = Weights()
        self.expand_config = ExpandConfig()
        self.cost = CostModel()
        # measured / predicted seconds of lattice expansion on this server (the prediction is an upper bound:
        # beam pruning keeps real lattices far below it); learned as lattices finish
        self.lattice_ratio = 0.1
        # the time one step of the worker aims at: a new request waits for at most about one step
        self.step_s = settings.slice_ms / 1000
        self.info: dict = {}  # what /v1/models shows

    # ---- loading -------------------------------------------------------------------------------
    def load(self) -> None:
        from smallstate_lm.checkpoint import load_model
        from smallstate_lm.ngram import NgramLM

        s = self.s
        # Repaired lattices (dead states dropped) are normal input for a service, not news.
        warnings.filterwarnings("ignore", category=LatticeWarning)
        if s.threads is not None:
            torch.set_num_threads(s.threads)
        try:
            self.device = pick_device(s.device)
        except RuntimeError as e:
            raise ConfigError(f"device {s.device!r}: {e}") from None
        self.weights = Weights.load(s.weights) if s.weights else Weights()
        self.expand_config = ExpandConfig(max_ngram_order=None if s.exact else s.max_ngram_order, beam=s.beam,
                                          max_per_state=s.max_per_state, max_states=s.max_states,
                                          max_level_bytes=s.max_level_bytes)
        if s.lm is not None:
            # load_model self-checks on this device (finite log-probs of a fixed sentence): a model that fails
            # raises CheckpointError here, and the service never becomes ready
            self.loaded = load_model(s.lm, self.device)
            batch_tokens = s.batch_tokens or (8192 if self.device.type == "cuda" else 512)
            self.neural = NeuralScorer(self.loaded.model, self.loaded.vocab, self.device, batch_tokens,
                                       s.share_prefixes)
        if s.ngram is not None:
            self.ngram = NgramLM(s.ngram)
        with torch.inference_mode():
            self.cost = calibrate(self.neural, self.ngram)
        log.info("cost model on %s: %s", self.device, self.cost)
        self._describe()

    def _describe(self) -> None:
        from smallstate_lm.models import count_parameters

        s, neural_info = self.s, None
        if self.loaded is not None:
            model = self.loaded.model
            numel = model.state_numel_per_position()
            neural_info = {"name": _name(s.lm), "preset": str(self.loaded.config.name),
                           "parameters": count_parameters(model), "vocab_size": len(self.loaded.vocab),
                           "state_numel_per_position": numel,
                           "state_bytes_per_position": numel * next(model.parameters()).element_size(),
                           "config": self.loaded.config.to_dict()}
        self.info = {
            "neural": neural_info,
            "ngram": {"name": _name(s.ngram), "order": int(self.ngram.order)} if self.ngram else None,
            "device": str(self.device),
            "weights": dataclasses.asdict(self.weights),
            "lattice": {**dataclasses.asdict(self.expand_config), "default_nbest": s.lattice_nbest},
            "batching": {"enabled": s.batching, "batch_tokens": self.neural.batch_tokens if self.neural else None,
                         "max_batch_tokens": s.max_batch_tokens, "max_wait_ms": s.max_wait_ms,
                         "wait_for_arrivals": s.wait_for_arrivals,
                         "max_queue": s.max_queue, "slice_ms": s.slice_ms},
            "cost_model": dataclasses.asdict(self.cost),
        }
        if self.metrics is not None:
            self.metrics.model.info({
                "lm": neural_info["name"] if neural_info else "",
                "preset": neural_info["preset"] if neural_info else "",
                "vocab_size": str(neural_info["vocab_size"]) if neural_info else "",
                "state_numel_per_position": str(neural_info["state_numel_per_position"]) if neural_info else "",
                "ngram": _name(s.ngram) if self.ngram else "", "device": str(self.device),
                "torch_threads": str(torch.get_num_threads())})

    def warmup(self) -> list[Work]:
        """A sentence and a two-word lattice: the first real request then finds every code path
        (kernels, allocator, KenLM pages) warm."""
        words = self.loaded.vocab.words[3:8] if self.loaded is not None else ["the", "of", "and"]
        sentence = self.work("score", [self.nbest_item(Utterance("0", [Hypothesis(words=list(words))]), [])],
                             ["sentences[0]"], self.weights)
        fst = f"0 1 {words[0]} {words[0]} 1.0,1.0\n1 2 {words[1]} {words[1]} 1.0,1.0\n2 0.0,0.0\n"
        lat = read_fst_text(fst, SymbolTable.from_words(list(words[:2])), name="warmup")
        lattice = self.work("rescore", [LatticeItem(lat.prepare(), self.s.lattice_nbest)], ["utterances[0]"],
                            self.weights)
        return [sentence, lattice]

    # ---- requests -> work (any thread) -----------------------------------------------------------
    def request_weights(self, overrides: dict[str, Any]) -> Weights:
        """The server's default weights with a request's `overrides`; errors name the field."""
        w = self.weights
        if overrides:
            try:
                w = dataclasses.replace(w, **overrides)
            except ConfigError as e:
                raise ServiceError(str(e), "weights") from None
        if w.interpolation == "linear" and (self.neural is None or self.ngram is None):
            raise ServiceError("linear interpolation needs both a neural LM and an n-gram; this server has "
                               + ("no n-gram" if self.ngram is None else "no neural LM"), "weights.interpolation")
        return w

    @staticmethod
    def nbest_item(utt: Utterance, context: list[str]) -> NbestItem:
        """`utt`'s hypotheses, scored after the `context` words (their own log-probs not counted)."""
        plain = Utterance(utt.utt, [Hypothesis(words=h.words, am=h.am, graph=h.graph, id=str(j))
                                    for j, h in enumerate(utt.hyps)])
        scored = plain
        if context:
            scored = Utterance(utt.utt, [Hypothesis(words=context + h.words, am=h.am, graph=h.graph, id=h.id)
                                         for h in plain.hyps])
        ids = [h.id if h.id is not None else str(j) for j, h in enumerate(utt.hyps)]
        return NbestItem(scored=scored, plain=plain, ids=ids, context=len(context))

    def work(self, kind: Literal["rescore", "score"], items: list[NbestItem | LatticeItem], fields: list[str],
             weights: Weights, nbest: int | None = None, token_logprobs: bool = False) -> Work:
        """A request's work with its token counts (the tokens its hypotheses have, the ones a
        prefix-sharing scorer computes), lattice arcs, and predicted seconds and bytes."""
        work = Work(kind=kind, weights=weights, items=items, fields=fields, nbest=nbest,
                    token_logprobs=token_logprobs)
        neural, ngram, cm = self.neural is not None, self.ngram is not None, self.cost
        lattice_bytes = []
        for it, field in zip(items, fields):
            if isinstance(it, LatticeItem):
                self._check_lattice_vocabulary(it.lattice, f"{field}.lattice")
                work.lattice_arcs += it.lattice.num_arcs
                if it.shape is None:
                    it.shape = lattice_shape(it.lattice, self.expand_config.max_per_state)
                est = cm.lattice(it.shape, self.expand_config.max_level_bytes, neural, ngram)
                it.seconds, it.nbytes = est.seconds, est.nbytes
                work.lattice_seconds += est.seconds
                lattice_bytes.append(est.nbytes)
                continue
            seqs = [h.words for h in it.scored.hyps]
            tokens = sum(len(s) + 1 for s in seqs)
            it.cost, it.depth = tokens, max(len(s) + 1 for s in seqs)
            work.tokens_total += tokens
            if self.neural is not None:
                if self.neural.use_tree and self.neural.share_prefixes:
                    size = self._trie_size(seqs)  # before any work: no model call
                    it.cost, nbytes = size.total_nodes, self._tree_bytes(size)
                else:  # scored level by level or padded: the scorer's own estimate
                    it.cost, nbytes = self.neural.estimate_cost([seqs])
                work.tokens_computed += it.cost
                work.nbytes = max(work.nbytes, nbytes)
            it.seconds = cm.nbest_seconds(it.cost, it.depth, tokens, neural, ngram, self.step_s)
            # lists scored whole share their calls with the request's other lists (and the batch's)
            work.seconds += it.seconds - (cm.call_s if neural and it.seconds <= self.step_s else 0.0)
        if neural and any(isinstance(it, NbestItem) for it in items):
            work.seconds += cm.call_s
        work.seconds += work.lattice_seconds
        # lattices are expanded expand_config.batch_lattices at a time
        together = self.expand_config.lattices_per_batch(neural)
        work.nbytes = max(work.nbytes, sum(sorted(lattice_bytes)[-together:]))
        return work

    def _trie_size(self, seqs: list[list[str]]) -> TreeSize:
        """The size of the prefix trie the scorer builds over `seqs` (`trie_size` of their token ids), with each
        distinct word encoded once: a request of 1,000 x 100 words is sized in a few milliseconds."""
        distinct = set(itertools.chain.from_iterable(seqs))
        ids = dict(zip(distinct, self.neural.vocab.encode(list(distinct))))
        return trie_size([[ids[w] for w in words] + [EOS_ID] for words in seqs])

    def _tree_bytes(self, size: TreeSize) -> int:
        """Peak working memory of scoring a trie of `size` in pieces: its plan's, or the scorer's cap when
        the plan runs in blocks or sub-tries (one hypothesis over the cap is refused by the scorer itself)."""
        cap = self.neural.max_work_bytes
        one = dataclasses.replace(size, total_nodes=size.max_depth, max_nodes=size.max_depth,
                                  path_len=size.max_depth + 1)
        return max(self._plan_bytes(one), min(self._plan_bytes(size), cap if cap is not None else 1 << 62))

    def _plan_bytes(self, size: TreeSize) -> int:
        return size.nbytes(self.neural.model, self.neural.max_work_bytes)

    def expected_seconds(self, work: Work) -> float:
        """What the worker is expected to spend on `work`: hypothesis lists as predicted, lattices at the
        share of their upper bound that this server's lattices have taken so far."""
        return work.seconds - work.lattice_seconds + self.lattice_ratio * work.lattice_seconds

    def _check_lattice_vocabulary(self, lat: Lattice, field: str) -> None:
        """The overlap check of hypothesis lists, on a lattice's words: a lattice in the wrong
        vocabulary is refused like a list in it (422), not scored as all <unk>."""
        words = [[lat.symbols.word(i) for i in lat.word[lat.symbols.word_flags(lat.word)].tolist()]]
        try:
            if self.neural is not None:
                check_overlap(words, self.neural.vocab, "the neural LM")
            if self.ngram is not None:
                check_overlap(words, self.ngram, "the n-gram")
        except SmallstateError as e:
            raise ServiceError(str(e), field) from None

    # ---- the worker ----------------------------------------------------------------------------
    def run_batch(self, jobs: list[Job], deliver: Callable[[Job, Any], None]) -> Iterator[None]:
        """Score every job (payload: Work) of a batch together, a step of about `step_s` predicted
        seconds at a time: the hypothesis lists and sentences of all jobs (small ones together, large
        ones in pieces), then the lattices, one `expand_many` per distinct weights, a step per LM call
        of a level. Each job gets its Result, or its error, from `deliver` as soon as it is ready; the
        work of a job that expired (cancelled, past its deadline, shutdown) stops at the next step.
        The batcher runs the steps in time slices, between which other batches run."""
        steps = self._steps(jobs, deliver)
        while True:
            # Per step, not around the generator: batches interleave on the worker thread, and a mode entered
            # before a yield would leak into another batch's steps and be undone by them.
            with torch.inference_mode():
                if next(steps, _DONE) is _DONE:
                    return
            yield

    def _steps(self, jobs: list[Job], deliver: Callable[[Job, Any], None]) -> Iterator[None]:
        t0 = time.perf_counter()
        totals = [0, 0]  # tokens scored and computed, for the throughput metric
        live = []
        for job in jobs:
            w: Work = job.payload
            w.error = None
            if self._stop(job, "queued"):
                deliver(job, w.error)
                continue
            try:
                self._check_vocabulary(w)
            except SmallstateError as e:
                w.error = self._as_service_error(e, w)
            live.append(job)
        lattices = [job for job in live if any(isinstance(it, LatticeItem) for it in job.payload.items)]

        def lists_done(job: Job) -> None:  # a request of hypothesis lists only is answered at once
            if job not in lattices or job.payload.error is not None:
                self._answer(job, t0, deliver, totals)

        yield from self._score_lists(live, lists_done)
        lattices = [job for job in lattices if job.payload.error is None]
        yield from self._expand_lattices(lattices, lambda job: self._answer(job, t0, deliver, totals))
        if self.metrics is not None:
            self.metrics.observe_tokens(totals[0], totals[1], time.perf_counter() - t0)

    def _stop(self, job: Job, stage: str = "running") -> bool:
        """Whether the job's work stops here: it failed, or it expired (then its error says so)."""
        w: Work = job.payload
        if w.error is None and drop_expired(job, stage, self.metrics):
            w.error = DeadlineExceeded("the request's work was stopped: it was cancelled or its deadline passed")
        return w.error is not None

    def _answer(self, job: Job, t0: float, deliver: Callable[[Job, Any], None], totals: list[int]) -> None:
        w: Work = job.payload
        result = None
        if w.error is None:
            try:
                result = self._result(w, job, t0)
            except SmallstateError as e:
                w.error = self._as_service_error(e, w)
            except Exception as e:  # a bug: the route turns it into a 500 and it is logged
                w.error = e
        if result is None:
            deliver(job, w.error)
            return
        totals[0] += result.counts.tokens_total
        totals[1] += result.counts.tokens_computed
        deliver(job, result)

    def _as_service_error(self, e: BaseException, w: Work, field: str | None = None) -> ServiceError:
        if isinstance(e, ServiceError):
            return e
        return ServiceError(str(e), field or ("sentences" if w.kind == "score" else "utterances"))

    def _check_vocabulary(self, w: Work) -> None:
        """The overlap check of compute_components, per request: a request in the wrong
        vocabulary fails alone instead of failing the batch it shares."""
        sents = [h.words for it in w.items if isinstance(it, NbestItem) for h in it.scored.hyps]
        if self.neural is not None:
            check_overlap(sents, self.neural.vocab, "the neural LM")
        if self.ngram is not None:
            check_overlap(sents, self.ngram, "the n-gram")

    def _score_lists(self, jobs: list[Job], done: Callable[[Job], None]) -> Iterator[None]:
        """The jobs' hypothesis lists, the smallest requests first, a step per about `step_s` of predicted
        work: small lists share a `compute_components` call; a list predicted to take longer than a step
        is scored in pieces of whole hypotheses (sharing their prefixes) that each fit one. `done(job)`
        once a job's lists are scored (or it failed or stopped)."""
        jobs = sorted(jobs, key=lambda j: j.cost)
        units = []  # (job, item, hypothesis indices of a piece or None for all, predicted seconds)
        for job in jobs:
            if job.payload.error is not None:
                continue
            for it in job.payload.items:
                if isinstance(it, NbestItem):
                    units += self._units(job, it)
        left = Counter(job for job, *_ in units)
        parts_left = Counter(id(it) for _, it, part, _ in units if part is not None)
        for job in jobs:
            if not left[job]:
                done(job)
        chunk, seconds = [], self.cost.call_s  # whole lists share their call
        for k, unit in enumerate(units):
            chunk.append(unit)
            seconds += unit[3] - (self.cost.call_s if unit[2] is None else 0.0)
            if seconds >= self.step_s or k == len(units) - 1:
                live = [u for u in chunk if not self._stop(u[0])]
                whole = [(job, it) for job, it, part, _ in live if part is None]
                if whole:
                    self._score_chunk(whole)
                for job, it, part, _ in live:
                    if part is not None:
                        self._score_part(job, it, part)
                        parts_left[id(it)] -= 1
                        if parts_left[id(it)] == 0 and job.payload.error is None:
                            it.comps = self._assembled(it)
                for job, *_ in chunk:
                    left[job] -= 1
                    if left[job] == 0:
                        done(job)
                chunk, seconds = [], self.cost.call_s
                yield

    def _units(self, job: Job, it: NbestItem) -> list[tuple]:
        """`it` as one unit of work, or as pieces of whole hypotheses (sorted, so that hypotheses sharing
        a prefix stay together) of at most a step's worth of trie nodes each."""
        hyps = it.scored.hyps
        if it.seconds <= self.step_s or len(hyps) == 1:
            return [(job, it, None, it.seconds)]
        grain = self.cost.grain_nodes(it.depth, self.step_s) if self.neural is not None else \
            max(1, int(self.step_s / self.cost.ngram_s))
        # "" ends every sequence: the trie's end-of-sentence node, and a prefix sorts before what extends it
        pieces = [(group, size.total_nodes) for group, size in
                  sorted_groups([h.words + [""] for h in hyps], lambda size: size.total_nodes <= grain)]
        per_node = (it.seconds - len(pieces) * self.cost.call_s) / max(1, sum(n for _, n in pieces))
        n = len(hyps)
        it.neural_tok, it.ngram_tok = [None] * n, [None] * n
        return [(job, it, np.array(p), self.cost.call_s + per_node * k) for p, k in pieces]

    def _score_part(self, job: Job, it: NbestItem, part: np.ndarray) -> None:
        """The LM scores of some of `it`'s hypotheses (the request's vocabulary was checked as a whole)."""
        words = [it.scored.hyps[j].words for j in part.tolist()]
        try:
            if self.neural is not None:
                for j, t in zip(part.tolist(), self.neural.token_logprobs([words])[0]):
                    it.neural_tok[j] = t
            if self.ngram is not None:
                for j, w in zip(part.tolist(), words):
                    it.ngram_tok[j] = self.ngram.token_logprobs(w)
        except Exception as e:
            job.payload.error = self._failure(e, job.payload)

    def _assembled(self, it: NbestItem) -> Components:
        """The Components of a list scored in pieces, as `compute_components` gives them."""
        known = oov_reference(self.neural.vocab if self.neural is not None else None, self.ngram)
        c = first_pass_components(it.scored, known)
        if self.neural is not None:
            c.neural_tok, c.neural = it.neural_tok, np.array([t.sum() for t in it.neural_tok])
        if self.ngram is not None:
            c.ngram_tok, c.ngram = it.ngram_tok, np.array([t.sum() for t in it.ngram_tok])
        it.neural_tok = it.ngram_tok = None
        return c

    def _failure(self, e: BaseException, w: Work, field: str | None = None) -> BaseException:
        """What a job that raised `e` answers: the client's error (4xx), 503 when memory ran out (the
        worker goes on), else the exception itself (a bug: 500, logged)."""
        if isinstance(e, SmallstateError):
            return self._as_service_error(e, w, field)
        if _out_of_memory(e):
            log.warning("a request ran out of memory: %s", str(e).split("\n")[0][:200])
            e.__traceback__ = None  # its frames hold what ran out of memory: let it go now
            error = Unavailable("the server has not enough memory for this request now: retry later, or send it in "
                                "smaller parts", retry_after=5)
            error.__suppress_context__ = True
            return error
        return e

    def _score_chunk(self, pairs: list[tuple[Job, NbestItem]]) -> None:
        try:
            comps, _ = compute_components([it.scored for _, it in pairs], self.neural, self.ngram, progress=False)
            for (_, it), c in zip(pairs, comps):
                it.comps = c
        except Exception as e:
            # One request must not fail the others: score them one by one to find the culprit.
            by_job: dict[Job, list[NbestItem]] = defaultdict(list)
            if len({job for job, _ in pairs}) == 1:
                pairs[0][0].payload.error = self._failure(e, pairs[0][0].payload)
                return
            log.warning("merged batch failed; scoring its requests one by one", exc_info=not _out_of_memory(e))
            for job, it in pairs:
                by_job[job].append(it)
            for job, items in by_job.items():
                if self._stop(job):
                    continue
                try:
                    comps, _ = compute_components([it.scored for it in items], self.neural, self.ngram,
                                                  progress=False)
                    for it, c in zip(items, comps):
                        it.comps = c
                except Exception as e:
                    job.payload.error = self._failure(e, job.payload)

    def _expand_lattices(self, jobs: list[Job], done: Callable[[Job], None]) -> Iterator[None]:
        """The jobs' lattices, one expansion per distinct weights, a step per level; `done(job)`
        once all lattices of a job are expanded (or it failed or stopped)."""
        groups: dict[tuple, list[tuple[Job, int, LatticeItem]]] = defaultdict(list)
        for job in jobs:
            for k, it in enumerate(job.payload.items):
                if isinstance(it, LatticeItem):
                    groups[dataclasses.astuple(job.payload.weights)].append((job, k, it))
        left = Counter(job for members in groups.values() for job, _, _ in members)

        def finished(job: Job) -> None:
            left[job] -= 1
            if left[job] == 0:
                done(job)

        for members in groups.values():
            yield from self._expand_group(members, finished)

    def _expand_group(self, members: list[tuple[Job, int, LatticeItem]],
                      finished: Callable[[Job], None]) -> Iterator[None]:
        """One expansion of lattices sharing weights, paused after every LM call of about `step_s`. When it
        fails, the lattices not yet done are expanded one at a time, with the same stops and pauses, to find
        the one that fails."""
        accounted: set[int] = set()
        spent = [0.0]

        def failed(i: int, e: BaseException) -> None:
            job, k, _ = members[i]
            w = job.payload
            if w.error is None:
                w.error = self._failure(e, w, f"{w.fields[k]}.lattice")

        def take(i: int, exp) -> None:
            job, _, it = members[i]
            it.hyps = exp.nbest(job.payload.weights, it.n)
            it.lm_steps = exp.stats.lm_rows
            accounted.add(i)
            finished(job)

        def stop(i: int) -> bool:  # between LM calls: a lattice of a failed or expired job is dropped
            return self._stop(members[i][0])

        def run(indices: list[int]) -> Iterator[None]:
            rescorer = build_rescorer(members[0][0].payload.weights, self.loaded, self.ngram, self.expand_config,
                                      self.device)
            rescorer.rows_per_call = lambda step: self.cost.rows_per_call(step + 2, self.step_s)
            t = time.perf_counter()
            for out in rescorer.expand_many([members[i][2].lattice for i in indices], on_error=lambda k, e:
                                            failed(indices[k], e), should_stop=lambda k: stop(indices[k]),
                                            pause=True):
                if out is not None:
                    take(indices[out[0]], out[1])
                spent[0] += time.perf_counter() - t
                yield
                t = time.perf_counter()
            spent[0] += time.perf_counter() - t

        try:
            yield from run(list(range(len(members))))
        except Exception as e:
            rest = [i for i in range(len(members)) if i not in accounted]
            if len(rest) == 1:
                failed(rest[0], e)
                rest = []
            else:
                log.warning("merged lattice expansion failed; expanding the rest one by one",
                            exc_info=not _out_of_memory(e))
            for i in rest:
                if stop(i):
                    continue
                try:
                    yield from run([i])
                except Exception as e:
                    failed(i, e)
        bound = sum(it.seconds for i, (_, _, it) in enumerate(members) if i in accounted)
        if bound > 0 and spent[0] > 0:  # learn what share of the bound this server's lattices take
            self.lattice_ratio = min(1.0, max(0.01, 0.8 * self.lattice_ratio + 0.2 * spent[0] / bound))
        for i, (job, _, _) in enumerate(members):  # failed or stopped: answered with their error
            if i not in accounted:
                finished(job)

    # ---- results --------------------------------------------------------------------------------
    def _strip_context(self, it: NbestItem) -> Components:
        """Components of the plain hypotheses from those scored after the context words."""
        c, k = it.comps, it.context
        if k == 0:
            return c
        known = oov_reference(self.neural.vocab if self.neural is not None else None, self.ngram)
        hyps = it.plain.hyps
        out = Components(am=c.am, graph=c.graph, n_words=np.array([len(h.words) for h in hyps], dtype=np.float64),
                         n_oov=np.array([count_oov(h.words, known) for h in hyps], dtype=np.float64))
        if c.neural_tok is not None:
            out.neural_tok = [t[k:] for t in c.neural_tok]
            out.neural = np.array([t.sum() for t in out.neural_tok])
        if c.ngram_tok is not None:
            out.ngram_tok = [t[k:] for t in c.ngram_tok]
            out.ngram = np.array([t.sum() for t in out.ngram_tok])
        return out

    def _result(self, w: Work, job: Job, t0: float) -> Result:
        n_hyps = 0
        items: list[RankedUtterance | SentenceScores] = []
        for it in w.items:
            if isinstance(it, LatticeItem):
                items.append(self._ranked_lattice(it, w.weights))
                n_hyps += len(it.hyps)
            elif w.kind == "score":
                items.append(self._sentence(it, self._strip_context(it), w.token_logprobs))
                n_hyps += 1
            else:
                ranked, n = self._ranked_list(it, w)
                items.append(ranked)
                n_hyps += n
        steps = sum(it.lm_steps for it in w.items if isinstance(it, LatticeItem))
        counts = Counts(utterances=len(w.items), hypotheses=n_hyps, tokens_total=w.tokens_total + steps,
                        tokens_computed=w.tokens_computed + steps, lattice_arcs=w.lattice_arcs,
                        batch_requests=job.batch_size, queue_ms=round(1000 * (job.t_start - job.t_submit), 3),
                        compute_ms=round(1000 * (time.perf_counter() - t0), 3))
        return Result(items=items, weights=w.weights, counts=counts)

    def _ranked_list(self, it: NbestItem, w: Work) -> tuple[RankedUtterance, int]:
        """The list ranked under the request's weights, cut to its nbest; and how many it had."""
        c = self._strip_context(it)
        ranked = apply_weights([it.plain], [c], w.weights)[0].hyps
        out = []
        for h in ranked[: w.nbest]:
            j = int(h.id)
            r = _ranked(h.scores, it.ids[j], h.words, h.scores["rank"], w.weights, self.neural is not None,
                        self.ngram is not None)
            if w.token_logprobs:
                r.neural_tok = c.neural_tok[j].tolist() if c.neural_tok is not None else None
                r.ngram_tok = c.ngram_tok[j].tolist() if c.ngram_tok is not None else None
            out.append(r)
        return RankedUtterance(it.plain.utt, "hypotheses", out), len(ranked)

    def _ranked_lattice(self, it: LatticeItem, w: Weights) -> RankedUtterance:
        name = it.lattice.name
        if not it.hyps:
            raise ServiceError(f"lattice {name!r}: no complete path survived pruning", "utterances")
        hyps = [_ranked(h, str(rank), h["words"], rank, w, self.neural is not None, self.ngram is not None)
                for rank, h in enumerate(it.hyps)]
        return RankedUtterance(name, "lattice", hyps)

    @staticmethod
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
