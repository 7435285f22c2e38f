"""The service's scoring engine: loads the models, turns validated requests into jobs
(limits, lattice parsing: in the request's thread-pool thread), and computes batches of
jobs on the single worker thread.

Numbers come from the library functions the CLI uses: `compute_components` and
`apply_weights` for hypothesis lists, `LatticeRescorer.expand_many` and
`ExpandedLattice.nbest` for lattices, so a request scores exactly as
`smallstate-lm rescore` does on the same input. All scores are natural log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from smallstate_lm.errors import ConfigError, SmallstateError
from smallstate_lm.rescoring.expand import ExpandConfig, LatticeRescorer
from smallstate_lm.rescoring.lattice import (
    Lattice,
    LatticeFormatError,
    LatticeWarning,
    SymbolTable,
    read_fst_text,
    read_slf_text,
)
from smallstate_lm.rescoring.nbest import Hypothesis, Utterance
from smallstate_lm.rescoring.rescore import Components, apply_weights, compute_components
from smallstate_lm.scoring import NeuralScorer, Weights, check_overlap

from .batcher import Job
from .errors import LimitError, ServiceError
from .metrics import Metrics
from .schemas import LatticeIn, RescoreRequest, ScoreRequest
from .settings import Settings

log = logging.getLogger("smallstate_lm.server")


# ---------------------------------------------------------------------------------------------
# Jobs


@dataclass
class NbestItem:
    """One utterance given as a hypothesis list. `scored` is what the LMs see (context words
    first); `plain` the same hypotheses without the context. Hypothesis ids are positions."""

    scored: Utterance
    plain: Utterance
    ids: list[str]
    context: int  # number of context words in front of every hypothesis of `scored`
    comps: Components | None = None


@dataclass
class LatticeItem:
    utt: str
    lattice: Lattice  # prepared
    n: int  # distinct word sequences to return
    hyps: list[dict] | None = None
    lm_steps: int = 0


@dataclass
class Request:
    kind: str  # "rescore" or "score"
    weights: Weights
    items: list  # NbestItem | LatticeItem, in request order
    fields: list[str]  # request field of each item, for error messages
    nbest: int | None = None
    token_logprobs: bool = False
    tokens_total: int = 0
    tokens_computed: int = 0
    lattice_arcs: int = 0
    error: BaseException | None = None


class ServiceJob(Job):
    def __init__(self, request: Request):
        super().__init__(request.tokens_computed + request.lattice_arcs)
        self.request = request


# ---------------------------------------------------------------------------------------------
# Lattices from request text

_SLF_COUNT = re.compile(r'(?:^|\s|")(N|NODES|L|LINKS)=("(?:[^"\\]|\\.)*"|\S*)', re.M)


def _as_int(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def _check_fst_text(text: str, where: str, max_arcs: int) -> list[str]:
    """Arc count and largest state id against the limits before the parser allocates
    per-state arrays; returns the output labels of the arcs."""
    labels: list[str] = []
    max_state = -1
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            labels.append(parts[3])
            if len(labels) > max_arcs:
                raise LimitError(f"the lattice has more than {max_arcs} arcs (max_lattice_arcs)", where, max_arcs)
        for p in parts[: 2 if len(parts) >= 4 else 1]:
            s = _as_int(p)
            if s is not None and s > max_state:
                max_state = s
    if max_state > max_arcs:
        raise LimitError(f"state id {max_state} is beyond the {max_arcs + 1} states a lattice may have "
                         f"(max_lattice_arcs + 1)", where, max_arcs)
    return labels


def _check_slf_counts(text: str, where: str, max_arcs: int) -> None:
    for m in _SLF_COUNT.finditer(text):
        key, raw = m.group(1), m.group(2)
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        n = _as_int(raw)
        if n is None:
            continue  # the parser names the bad value
        nodes = key in ("N", "NODES")
        limit = max_arcs + 1 if nodes else max_arcs
        if n > limit:
            what = "nodes (max_lattice_arcs + 1)" if nodes else "links (max_lattice_arcs)"
            raise LimitError(f"{key}={n}: a lattice may have at most {limit} {what}", where, limit)


def _symbol_table(words: dict[str, int], where: str) -> SymbolTable:
    pairs = list(words.items())
    if "<eps>" not in words and 0 not in words.values():
        pairs.insert(0, ("<eps>", 0))
    try:
        return SymbolTable(pairs, source=where)
    except LatticeFormatError as e:
        raise ServiceError(str(e), where) from None


def parse_lattice(lat: LatticeIn, where: str, name: str, max_arcs: int) -> Lattice:
    """A request's lattice text -> a prepared Lattice; every problem is a 4xx naming `where`."""
    data_field = f"{where}.data"
    symbols = _symbol_table(lat.words, f"{where}.words") if lat.words is not None else None
    try:
        if lat.format == "openfst-text":
            labels = _check_fst_text(lat.data, data_field, max_arcs)
            if symbols is None:
                numeric = [lb for lb in labels if _as_int(lb) not in (None, 0)]
                if numeric:
                    raise ServiceError(f"arc label {numeric[0]} is a number: give the decoder's symbol table as "
                                       f"'words' (or use words as labels)", f"{where}.words")
                symbols = SymbolTable.from_words([lb for lb in labels if _as_int(lb) is None])
            parsed = read_fst_text(lat.data, symbols, name=data_field)
        else:
            _check_slf_counts(lat.data, data_field, max_arcs)
            parsed = read_slf_text(lat.data, symbols, name=data_field, lattice_name=name)
        if parsed.num_arcs > max_arcs:
            raise LimitError(f"the lattice has {parsed.num_arcs} arcs, more than {max_arcs} (max_lattice_arcs)",
                             data_field, max_arcs)
        parsed.name = name
        return parsed.prepare()
    except LatticeFormatError as e:
        raise ServiceError(str(e), data_field) from None


# ---------------------------------------------------------------------------------------------
# The engine


def _unique_prefixes(seqs: list[list[int]]) -> int:
    """Nodes of the prefix trie: the tokens a prefix-sharing scorer computes."""
    root: dict = {}
    n = 0
    for s in seqs:
        node = root
        for t in s:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                n += 1
            node = nxt
    return n


def _finite_json(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except ValueError:  # an overflow to inf/NaN from extreme (but finite) lattice costs
        raise ServiceError("a score is not finite: the input's scores or costs are too large", "utterances") from None


class Engine:
    """Models and the batch computation. `load()` and `run_batch()` run on the worker
    thread; `prepare_*()` on any thread (they only read the loaded models)."""

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
        self.info: dict = {}

    # ---- loading -------------------------------------------------------------------------------
    def load(self) -> None:
        from smallstate_lm.checkpoint import load_model
        from smallstate_lm.device import pick_device
        from smallstate_lm.models import count_parameters
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
        neural_info = None
        if s.lm is not None:
            self.loaded = load_model(s.lm, self.device)
            batch_tokens = s.batch_tokens or (8192 if self.device.type == "cuda" else 512)
            self.neural = NeuralScorer(self.loaded.model, self.loaded.vocab, self.device, batch_tokens,
                                       s.share_prefixes)
            model = self.loaded.model
            numel = model.state_numel_per_position()
            neural_info = {"path": str(self.loaded.path), "preset": str(self.loaded.config.name),
                           "parameters": count_parameters(model), "vocab_size": len(self.loaded.vocab),
                           "state_numel_per_position": numel,
                           "state_bytes_per_position": numel * next(model.parameters()).element_size(),
                           "config": self.loaded.config.to_dict()}
        if s.ngram is not None:
            self.ngram = NgramLM(s.ngram)
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

    def warmup_requests(self) -> list[Request]:
        """A sentence and a two-word lattice: the first real request then finds every code path
        (kernels, allocator, KenLM pages) warm."""
        words = self.loaded.vocab.words[3:8] if self.loaded is not None else ["the", "of", "and"]
        sentence = self.prepare_score(ScoreRequest(sentences=[" ".join(words)]))
        fst = f"0 1 {words[0]} {words[0]} 1.0,1.0\n1 2 {words[1]} {words[1]} 1.0,1.0\n2 0.0,0.0\n"
        lattice = self.prepare_rescore(RescoreRequest.model_validate(
            {"utterances": [{"id": "warmup", "lattice": {"format": "openfst-text", "data": fst}}]}))
        return [sentence, lattice]

    # ---- requests -> jobs (any thread) -----------------------------------------------------------
    def _weights(self, req: RescoreRequest) -> Weights:
        w = self.weights
        if req.weights is not None:
            given = req.weights.model_dump(exclude_none=True)
            try:
                w = dataclasses.replace(w, **given)
            except ConfigError as e:
                raise ServiceError(str(e), "weights") from None
        if w.interpolation == "linear" and (self.neural is None or self.ngram is None):
            raise ServiceError("linear interpolation needs both a neural LM and an n-gram; this server has "
                               + ("no n-gram" if self.ngram is None else "no neural LM"), "weights.interpolation")
        return w

    def _count_tokens(self, req: Request, seqs: list[list[str]]) -> None:
        """Add one utterance's hypotheses (word lists, context included) to the token counts."""
        if self.neural is None:
            req.tokens_total += sum(len(s) + 1 for s in seqs)
            return
        encoded = [self.neural.encode(s) for s in seqs]
        req.tokens_total += sum(map(len, encoded))
        req.tokens_computed += _unique_prefixes(encoded) if self.s.share_prefixes else sum(map(len, encoded))

    def prepare_rescore(self, body: RescoreRequest) -> Request:
        s = self.s
        if len(body.utterances) > s.max_utterances:
            raise LimitError(f"{len(body.utterances)} utterances, more than the limit of {s.max_utterances} "
                             f"(max_utterances)", "utterances", s.max_utterances)
        if body.nbest is not None and body.nbest > s.max_nbest:
            raise LimitError(f"nbest={body.nbest} is over the limit of {s.max_nbest} (max_nbest)", "nbest",
                             s.max_nbest)
        req = Request(kind="rescore", weights=self._weights(body), items=[], fields=[], nbest=body.nbest,
                      token_logprobs=body.return_token_logprobs)
        for i, u in enumerate(body.utterances):
            where = f"utterances[{i}]"
            if u.hypotheses is not None:
                req.items.append(self._nbest_item(req, u, where))
            else:
                if u.context is not None:
                    raise ServiceError("'context' is supported for hypothesis lists only, not for lattices",
                                       f"{where}.context")
                lat = parse_lattice(u.lattice, f"{where}.lattice", u.id, s.max_lattice_arcs)
                req.lattice_arcs += lat.num_arcs
                req.items.append(LatticeItem(utt=u.id, lattice=lat, n=body.nbest or s.lattice_nbest))
            req.fields.append(where)
        return req

    def _nbest_item(self, req: Request, u, where: str) -> NbestItem:
        s = self.s
        if len(u.hypotheses) > s.max_hypotheses:
            raise LimitError(f"{len(u.hypotheses)} hypotheses, more than the limit of {s.max_hypotheses} "
                             f"(max_hypotheses)", f"{where}.hypotheses", s.max_hypotheses)
        context = u.context.split() if u.context else []
        if len(context) > s.max_words:
            raise LimitError(f"{len(context)} context words, more than the limit of {s.max_words} (max_words)",
                             f"{where}.context", s.max_words)
        plain, scored, ids = [], [], []
        for j, h in enumerate(u.hypotheses):
            words = list(h.words) if h.words is not None else h.text.split()
            if len(words) > s.max_words:
                key = "words" if h.words is not None else "text"
                raise LimitError(f"{len(words)} words, more than the limit of {s.max_words} (max_words)",
                                 f"{where}.hypotheses[{j}].{key}", s.max_words)
            plain.append(Hypothesis(words=words, am=h.am_score, graph=h.graph_score, id=str(j)))
            if context:
                scored.append(Hypothesis(words=context + words, am=h.am_score, graph=h.graph_score, id=str(j)))
            ids.append(h.id if h.id is not None else str(j))
        plain_utt = Utterance(u.id, plain)
        scored_utt = Utterance(u.id, scored) if context else plain_utt
        self._count_tokens(req, [h.words for h in scored_utt.hyps])
        return NbestItem(scored=scored_utt, plain=plain_utt, ids=ids, context=len(context))

    def prepare_score(self, body: ScoreRequest) -> Request:
        s = self.s
        if len(body.sentences) > s.max_utterances:
            raise LimitError(f"{len(body.sentences)} sentences, more than the limit of {s.max_utterances} "
                             f"(max_utterances)", "sentences", s.max_utterances)
        req = Request(kind="score", weights=self.weights, items=[], fields=[],
                      token_logprobs=body.return_token_logprobs)
        for i, text in enumerate(body.sentences):
            words = text.split()
            if len(words) > s.max_words:
                raise LimitError(f"{len(words)} words, more than the limit of {s.max_words} (max_words)",
                                 f"sentences[{i}]", s.max_words)
            utt = Utterance(str(i), [Hypothesis(words=words, id="0")])
            self._count_tokens(req, [words])
            req.items.append(NbestItem(scored=utt, plain=utt, ids=["0"], context=0))
            req.fields.append(f"sentences[{i}]")
        return req

    # ---- the worker ----------------------------------------------------------------------------
    def run_batch(self, jobs: list[ServiceJob], deliver: Callable[[Job, Any], None]) -> None:
        """Score every job of a batch together: one `compute_components` over all their
        hypothesis lists and sentences, one `expand_many` per distinct weights over their
        lattices; then deliver each job's response body (bytes) or its error."""
        with torch.inference_mode():  # cheaper than no_grad per op; nothing here needs autograd
            self._run_batch(jobs, deliver)

    def _run_batch(self, jobs: list[ServiceJob], deliver: Callable[[Job, Any], None]) -> None:
        t0 = time.perf_counter()
        reqs = [j.request for j in jobs]
        for r in reqs:
            r.error = None
            try:
                self._check_vocabulary(r)
            except SmallstateError as e:
                r.error = self._as_service_error(e, r)
        self._score_lists([r for r in reqs if r.error is None])
        self._expand_lattices([r for r in reqs if r.error is None])
        scored = computed = 0
        for job, r in zip(jobs, reqs):
            if r.error is not None:
                deliver(job, r.error)
                continue
            try:
                body = self._format(r, job, t0)
            except SmallstateError as e:
                deliver(job, self._as_service_error(e, r))
                continue
            except Exception as e:  # a bug: the route turns it into a 500 and it is logged
                deliver(job, e)
                continue
            steps = sum(it.lm_steps for it in r.items if isinstance(it, LatticeItem))
            scored += r.tokens_total + steps
            computed += r.tokens_computed + steps
            deliver(job, body)
        if self.metrics is not None:
            self.metrics.observe_tokens(scored, computed, time.perf_counter() - t0)

    def _as_service_error(self, e: BaseException, r: Request, field: str | None = None) -> ServiceError:
        if isinstance(e, ServiceError):
            return e
        return ServiceError(str(e), field or ("sentences" if r.kind == "score" else "utterances"))

    def _check_vocabulary(self, r: Request) -> None:
        """The overlap check of compute_components, per request: a request in the wrong
        vocabulary fails alone instead of failing the batch it shares."""
        sents = [h.words for it in r.items if isinstance(it, NbestItem) for h in it.scored.hyps]
        if self.neural is not None:
            check_overlap(sents, self.neural.vocab, "the neural LM")
        if self.ngram is not None:
            check_overlap(sents, self.ngram, "the n-gram")

    def _score_lists(self, reqs: list[Request]) -> None:
        pairs = [(r, it) for r in reqs for it in r.items if isinstance(it, NbestItem)]
        if not pairs:
            return
        try:
            comps, _ = compute_components([it.scored for _, it in pairs], self.neural, self.ngram, progress=False)
            for (_, it), c in zip(pairs, comps):
                it.comps = c
        except Exception:
            # One request must not fail the others: score them one by one to find the culprit.
            log.warning("merged batch failed; scoring its %d requests one by one", len(reqs), exc_info=True)
            for r in reqs:
                items = [it for it in r.items if isinstance(it, NbestItem)]
                if not items:
                    continue
                try:
                    comps, _ = compute_components([it.scored for it in items], self.neural, self.ngram,
                                                  progress=False)
                    for it, c in zip(items, comps):
                        it.comps = c
                except SmallstateError as e:
                    r.error = self._as_service_error(e, r)
                except Exception as e:
                    r.error = e

    def _expand_lattices(self, reqs: list[Request]) -> None:
        groups: dict[tuple, list[tuple[Request, int, LatticeItem]]] = defaultdict(list)
        for r in reqs:
            for k, it in enumerate(r.items):
                if isinstance(it, LatticeItem):
                    groups[dataclasses.astuple(r.weights)].append((r, k, it))
        model = self.loaded.model if self.loaded is not None else None
        vocab = self.loaded.vocab if self.loaded is not None else None
        for members in groups.values():
            rescorer = LatticeRescorer(members[0][0].weights, model, vocab, self.ngram, self.expand_config,
                                       self.device)

            def failed(i: int, e: BaseException, members=members) -> None:
                r, k, _ = members[i]
                if r.error is None:
                    r.error = (self._as_service_error(e, r, f"{r.fields[k]}.lattice")
                               if isinstance(e, SmallstateError) else e)

            done: set[int] = set()
            try:
                for i, exp in rescorer.expand_many([it.lattice for _, _, it in members], on_error=failed):
                    r, k, it = members[i]
                    done.add(i)
                    it.hyps = exp.nbest(r.weights, it.n)
                    it.lm_steps = exp.stats.lm_rows
            except Exception:
                log.warning("merged lattice expansion failed; expanding the rest one by one", exc_info=True)
                for i, (r, _, it) in enumerate(members):
                    if i in done or r.error is not None:
                        continue
                    try:
                        exp = rescorer.expand(it.lattice)
                        it.hyps = exp.nbest(r.weights, it.n)
                        it.lm_steps = exp.stats.lm_rows
                    except Exception as e:
                        failed(i, e)

    # ---- formatting -----------------------------------------------------------------------------
    def _strip_context(self, it: NbestItem) -> Components:
        """Components of the plain hypotheses from those scored after the context words."""
        c, k = it.comps, it.context
        if k == 0:
            return c
        known = self.neural.vocab if self.neural is not None else self.ngram
        hyps = it.plain.hyps
        out = Components(am=c.am, graph=c.graph, n_words=np.array([len(h.words) for h in hyps], dtype=np.float64),
                         n_oov=np.array([sum(1 for w in h.words if w not in known) for h in hyps], dtype=np.float64))
        if c.neural_tok is not None:
            out.neural_tok = [t[k:] for t in c.neural_tok]
            out.neural = np.array([t.sum() for t in out.neural_tok])
        if c.ngram_tok is not None:
            out.ngram_tok = [t[k:] for t in c.ngram_tok]
            out.ngram = np.array([t.sum() for t in out.ngram_tok])
        return out

    def _format(self, r: Request, job: ServiceJob, t0: float) -> bytes:
        w = r.weights
        n_hyps = 0
        results = []
        for it in r.items:
            if isinstance(it, NbestItem):
                c = self._strip_context(it)
                if r.kind == "score":
                    results.append(self._sentence(it, c, r.token_logprobs))
                    n_hyps += 1
                    continue
                ranked = apply_weights([it.plain], [c], w)[0].hyps
                n_hyps += len(ranked)
                hyps = []
                for h in ranked[: r.nbest]:
                    j, sc = int(h.id), h.scores
                    d = {"id": it.ids[j], "words": h.words, "rank": sc["rank"], "total": sc["total"], "am": sc["am"],
                         "graph": sc["graph"], "neural": sc.get("neural"), "ngram": sc.get("ngram"),
                         "penalty": w.word_penalty * sc["n_words"] + w.oov_penalty * sc["n_oov"],
                         "n_words": sc["n_words"], "n_oov": sc["n_oov"]}
                    if "expected_errors" in sc:
                        d["expected_errors"] = sc["expected_errors"]
                    if r.token_logprobs:
                        d["token_logprobs"] = {
                            "neural": c.neural_tok[j].tolist() if c.neural_tok is not None else None,
                            "ngram": c.ngram_tok[j].tolist() if c.ngram_tok is not None else None}
                    hyps.append(d)
                results.append({"id": it.plain.utt, "source": "hypotheses", "best": hyps[0], "hypotheses": hyps})
            else:
                if not it.hyps:
                    raise ServiceError(f"lattice {it.utt!r}: no complete path survived pruning", "utterances")
                hyps = [{"id": str(rank), "words": h["words"], "rank": rank, "total": h["total"], "am": h["am"],
                         "graph": h["graph"], "neural": h["neural"] if self.neural is not None else None,
                         "ngram": h["ngram"] if self.ngram is not None else None,
                         "penalty": w.word_penalty * h["n_words"] + w.oov_penalty * h["n_oov"],
                         "n_words": h["n_words"], "n_oov": h["n_oov"]} for rank, h in enumerate(it.hyps)]
                n_hyps += len(hyps)
                results.append({"id": it.utt, "source": "lattice", "best": hyps[0], "hypotheses": hyps})
        steps = sum(it.lm_steps for it in r.items if isinstance(it, LatticeItem))
        usage = {"utterances": len(r.items), "hypotheses": n_hyps, "tokens_total": r.tokens_total + steps,
                 "tokens_computed": r.tokens_computed + steps,
                 "lattice_arcs": r.lattice_arcs, "batch_requests": job.batch_size,
                 "queue_ms": round(1000 * (job.t_start - job.t_submit), 3),
                 "compute_ms": round(1000 * (time.perf_counter() - t0), 3)}
        if r.kind == "score":
            return _finite_json({"sentences": results, "usage": usage})
        return _finite_json({"utterances": results, "weights": dataclasses.asdict(w), "usage": usage})

    def _sentence(self, it: NbestItem, c: Components, token_logprobs: bool) -> dict:
        words = it.plain.hyps[0].words
        n = len(words) + 1

        def lm(total: np.ndarray | None, toks: list[np.ndarray] | None) -> dict | None:
            if total is None:
                return None
            lp = float(total[0])
            d = {"logprob": lp, "perplexity": float(np.exp(-lp / n))}
            if token_logprobs:
                d["token_logprobs"] = toks[0].tolist()
            return d

        return {"words": words, "tokens": n, "n_oov": int(c.n_oov[0]), "neural": lm(c.neural, c.neural_tok),
                "ngram": lm(c.ngram, c.ngram_tok)}
