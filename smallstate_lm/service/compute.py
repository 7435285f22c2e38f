"""The service's computation: loads the models and scores batches of requests on the worker thread.

It takes library objects (hypothesis lists as `Utterance`s, prepared `Lattice`s, `Weights`) and
returns dataclasses of natural-log scores; it knows neither HTTP nor the request schemas. Numbers
come from the library functions the CLI uses: `compute_components` and `apply_weights` for
hypothesis lists, `build_rescorer(...).expand_many` and `ExpandedLattice.nbest` for lattices, so a
request scores exactly as `smallstate-lm rescore` does on the same input.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np
import torch

from smallstate_lm.device import pick_device
from smallstate_lm.errors import ConfigError, SmallstateError
from smallstate_lm.rescoring.lattice import Lattice, LatticeWarning, SymbolTable
from smallstate_lm.rescoring.lattice_expand import ExpandConfig, build_rescorer
from smallstate_lm.rescoring.lattice_io import read_fst_text
from smallstate_lm.rescoring.nbest import Components, apply_weights, compute_components
from smallstate_lm.rescoring.nbest_io import Hypothesis, Utterance
from smallstate_lm.scoring import NeuralScorer, PrefixTrie, Weights, check_overlap, count_oov, oov_reference

from .batcher import Job
from .errors import ServiceError
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("smallstate_lm.service")


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


@dataclass
class LatticeItem:
    lattice: Lattice  # prepared; its name is the utterance id
    n: int  # distinct word sequences to return
    hyps: list[dict] | None = None  # ExpandedLattice.nbest
    lm_steps: int = 0


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
                                          max_per_state=s.max_per_state, max_states=s.max_states)
        if s.lm is not None:
            self.loaded = load_model(s.lm, self.device)
            batch_tokens = s.batch_tokens or (8192 if self.device.type == "cuda" else 512)
            self.neural = NeuralScorer(self.loaded.model, self.loaded.vocab, self.device, batch_tokens,
                                       s.share_prefixes)
        if s.ngram is not None:
            self.ngram = NgramLM(s.ngram)
        self._describe()

    def _describe(self) -> None:
        from smallstate_lm.models import count_parameters

        s, neural_info = self.s, None
        if self.loaded is not None:
            model = self.loaded.model
            numel = model.state_numel_per_position()
            neural_info = {"path": str(self.loaded.path), "preset": str(self.loaded.config.name),
                           "parameters": count_parameters(model), "vocab_size": len(self.loaded.vocab),
                           "state_numel_per_position": numel,
                           "state_bytes_per_position": numel * next(model.parameters()).element_size(),
                           "config": self.loaded.config.to_dict()}
        self.info = {
            "neural": neural_info,
            "ngram": {"path": str(self.ngram.path), "order": int(self.ngram.order)} if self.ngram else None,
            "device": str(self.device),
            "weights": dataclasses.asdict(self.weights),
            "lattice": {**dataclasses.asdict(self.expand_config), "default_nbest": s.lattice_nbest},
            "batching": {"enabled": s.batching, "batch_tokens": self.neural.batch_tokens if self.neural else None,
                         "max_batch_tokens": s.max_batch_tokens, "max_wait_ms": s.max_wait_ms,
                         "wait_for_arrivals": s.wait_for_arrivals,
                         "max_queue": s.max_queue},
        }
        if self.metrics is not None:
            self.metrics.model.info({
                "lm": neural_info["path"] if neural_info else "",
                "preset": neural_info["preset"] if neural_info else "",
                "vocab_size": str(neural_info["vocab_size"]) if neural_info else "",
                "state_numel_per_position": str(neural_info["state_numel_per_position"]) if neural_info else "",
                "ngram": str(self.ngram.path) if self.ngram else "", "device": str(self.device),
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
        prefix-sharing scorer computes) and lattice arcs."""
        work = Work(kind=kind, weights=weights, items=items, fields=fields, nbest=nbest,
                    token_logprobs=token_logprobs)
        for it in items:
            if isinstance(it, LatticeItem):
                work.lattice_arcs += it.lattice.num_arcs
                continue
            seqs = [h.words for h in it.scored.hyps]
            if self.neural is None:
                work.tokens_total += sum(len(s) + 1 for s in seqs)
                continue
            encoded = [self.neural.encode(s) for s in seqs]
            work.tokens_total += sum(map(len, encoded))
            work.tokens_computed += PrefixTrie(encoded).n_nodes if self.s.share_prefixes else sum(map(len, encoded))
        return work

    # ---- the worker ----------------------------------------------------------------------------
    def run_batch(self, jobs: list[Job], deliver: Callable[[Job, Any], None]) -> None:
        """Score every job (payload: Work) of a batch together: one `compute_components` over all
        their hypothesis lists and sentences, one `expand_many` per distinct weights over their
        lattices; then deliver each job's Result or its error."""
        with torch.inference_mode():  # cheaper than no_grad per op; nothing here needs autograd
            self._run_batch(jobs, deliver)

    def _run_batch(self, jobs: list[Job], deliver: Callable[[Job, Any], None]) -> None:
        t0 = time.perf_counter()
        works: list[Work] = [j.payload for j in jobs]
        for w in works:
            w.error = None
            try:
                self._check_vocabulary(w)
            except SmallstateError as e:
                w.error = self._as_service_error(e, w)
        self._score_lists([w for w in works if w.error is None])
        self._expand_lattices([w for w in works if w.error is None])
        scored = computed = 0
        for job, w in zip(jobs, works):
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
                continue
            scored += result.counts.tokens_total
            computed += result.counts.tokens_computed
            deliver(job, result)
        if self.metrics is not None:
            self.metrics.observe_tokens(scored, computed, time.perf_counter() - t0)

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

    def _score_lists(self, works: list[Work]) -> None:
        pairs = [(w, it) for w in works for it in w.items if isinstance(it, NbestItem)]
        if not pairs:
            return
        try:
            comps, _ = compute_components([it.scored for _, it in pairs], self.neural, self.ngram, progress=False)
            for (_, it), c in zip(pairs, comps):
                it.comps = c
        except Exception:
            # One request must not fail the others: score them one by one to find the culprit.
            log.warning("merged batch failed; scoring its %d requests one by one", len(works), exc_info=True)
            for w in works:
                items = [it for it in w.items if isinstance(it, NbestItem)]
                if not items:
                    continue
                try:
                    comps, _ = compute_components([it.scored for it in items], self.neural, self.ngram,
                                                  progress=False)
                    for it, c in zip(items, comps):
                        it.comps = c
                except SmallstateError as e:
                    w.error = self._as_service_error(e, w)
                except Exception as e:
                    w.error = e

    def _expand_lattices(self, works: list[Work]) -> None:
        groups: dict[tuple, list[tuple[Work, int, LatticeItem]]] = defaultdict(list)
        for w in works:
            for k, it in enumerate(w.items):
                if isinstance(it, LatticeItem):
                    groups[dataclasses.astuple(w.weights)].append((w, k, it))
        for members in groups.values():
            rescorer = build_rescorer(members[0][0].weights, self.loaded, self.ngram, self.expand_config, self.device)

            def failed(i: int, e: BaseException, members=members) -> None:
                w, k, _ = members[i]
                if w.error is None:
                    w.error = (self._as_service_error(e, w, f"{w.fields[k]}.lattice")
                               if isinstance(e, SmallstateError) else e)

            done: set[int] = set()
            try:
                for i, exp in rescorer.expand_many([it.lattice for _, _, it in members], on_error=failed):
                    w, k, it = members[i]
                    done.add(i)
                    it.hyps = exp.nbest(w.weights, it.n)
                    it.lm_steps = exp.stats.lm_rows
            except Exception:
                log.warning("merged lattice expansion failed; expanding the rest one by one", exc_info=True)
                for i, (w, _, it) in enumerate(members):
                    if i in done or w.error is not None:
                        continue
                    try:
                        exp = rescorer.expand(it.lattice)
                        it.hyps = exp.nbest(w.weights, it.n)
                        it.lm_steps = exp.stats.lm_rows
                    except Exception as e:
                        failed(i, e)

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
