"""The engine's worker: it scores the batches of work the batcher hands it, on the one thread that touches the
models, in steps of about `slice_ms` between which deadlines, hang-ups and shutdown are honoured. It runs the
neural LM over hypothesis lists (token ids prepared by a front-end) and expands lattices (both LMs); the n-gram of
lists, ranking, n-best searches and confidences are the front-ends'. Numbers come from the library functions the
CLI uses (`NeuralScorer`, `LatticeRescorer.expand_many`), so a request scores exactly as `smallstate-lm rescore`
does on the same input."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from smallstate_lm.errors import SmallstateError
from smallstate_lm.rescoring.expand.expanded import ExpandedLattice
from smallstate_lm.scoring.trie import sorted_groups

from ..admission import expected_seconds
from ..cost import lattices_together
from ..errors import DeadlineExceeded, ServiceError, Unavailable
from ..messages import LatticeJob, ListJob, Scored, Submit
from ..metrics import Metrics
from ..model import Models
from .batcher import Job, drop_expired

log = logging.getLogger("smallstate_lm.service")
_DONE = object()
Deliver = Callable[[Job, Any], None]


@dataclass
class EngineWork:
    """A submit as the worker scores it: what it got, what it made so far, and its error once it has one."""

    submit: Submit
    neural: list[list[np.ndarray] | None] = field(default_factory=list)  # per list, per hypothesis
    lattices: list[ExpandedLattice | None] = field(default_factory=list)
    lm_steps: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.neural = [None] * len(self.submit.lists)
        self.lattices = [None] * len(self.submit.lattices)


class Worker:
    """Runs batches (`run_batch`) on the worker thread and learns, from the lattices it expands, how
    much of their predicted upper bound they take."""

    def __init__(self, models: Models, metrics: Metrics | None = None):
        self.models = models
        self.metrics = metrics
        # measured / predicted seconds of lattice expansion on this server (the prediction is an upper bound:
        # beam pruning keeps real lattices far below it); learned as lattices finish
        self.lattice_ratio = 0.1

    def expected_seconds(self, seconds: float, lattice_seconds: float) -> float:
        """What the worker is expected to spend on work predicted to take `seconds`, `lattice_seconds` of them its
        lattices' upper bound: hypothesis lists as predicted, lattices at the share of their upper bound that this
        server's lattices have taken so far."""
        return expected_seconds(seconds, lattice_seconds, self.lattice_ratio)

    def run_batch(self, jobs: list[Job], deliver: Deliver) -> Iterator[None]:
        """Score every job (payload: EngineWork) of a batch together, a step of about `step_s` predicted
        seconds at a time: the hypothesis lists and sentences of all jobs (small ones together, large
        ones in pieces), then the lattices, one `expand_many` per distinct weights, a step per LM call
        of a level. Each job gets its `Scored`, or its error, from `deliver` as soon as it is ready; the
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

    def _steps(self, jobs: list[Job], deliver: Deliver) -> Iterator[None]:
        t0 = time.perf_counter()
        totals = [0, 0]  # tokens scored and computed, for the throughput metric
        live = []
        for job in jobs:
            w: EngineWork = job.payload
            if self._stop(job, "queued"):
                deliver(job, w.error)
                continue
            live.append(job)
        lattices = [job for job in live if job.payload.submit.lattices]

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
        w: EngineWork = job.payload
        if w.error is None and drop_expired(job, stage, self.metrics):
            w.error = DeadlineExceeded("the request's work was stopped: it was cancelled or its deadline passed")
        return w.error is not None

    def _answer(self, job: Job, t0: float, deliver: Deliver, totals: list[int]) -> None:
        w: EngineWork = job.payload
        if w.error is not None:
            deliver(job, w.error)
            return
        s = w.submit
        neural = None
        if self.models.neural is not None:
            neural = [np.concatenate(tok) if tok else np.zeros(0, dtype=np.float32) for tok in w.neural]
        totals[0] += s.tokens_total + w.lm_steps
        totals[1] += s.tokens_computed + w.lm_steps
        deliver(job, Scored(s.id, neural, list(w.lattices), batch_size=job.batch_size,
                            queue_s=job.t_start - job.t_submit, compute_s=time.perf_counter() - t0,
                            lattice_ratio=self.lattice_ratio))

    # ---- hypothesis lists --------------------------------------------------------------------------
    def _score_lists(self, jobs: list[Job], done: Callable[[Job], None]) -> Iterator[None]:
        """The jobs' hypothesis lists, the smallest requests first, a step per about `step_s` of predicted
        work: small lists share a scorer call; a list predicted to take longer than a step is scored in pieces
        of whole hypotheses (sharing their prefixes) that each fit one. `done(job)` once a job's lists are
        scored (or it failed or stopped). Without a neural LM there is nothing to do here."""
        jobs = sorted(jobs, key=lambda j: j.cost)
        units = []  # (job, list index, hypothesis indices of a piece or None for all, predicted seconds)
        if self.models.neural is not None:
            for job in jobs:
                if job.payload.error is None:
                    for k, it in enumerate(job.payload.submit.lists):
                        units += self._units(job, k, it)
        left = Counter(job for job, *_ in units)
        for job in jobs:
            if not left[job]:
                done(job)
        call_s, step_s = self.models.cost.call_s, self.models.step_s
        chunk, seconds = [], call_s  # whole lists share their call
        for n, unit in enumerate(units):
            chunk.append(unit)
            seconds += unit[3] - (call_s if unit[2] is None else 0.0)
            if seconds >= step_s or n == len(units) - 1:
                live = [u for u in chunk if not self._stop(u[0])]
                whole = [(job, k) for job, k, part, _ in live if part is None]
                if whole:
                    self._score_chunk(whole)
                for job, k, part, _ in live:
                    if part is not None:
                        self._score_part(job, k, part)
                for job, *_ in chunk:
                    left[job] -= 1
                    if left[job] == 0:
                        done(job)
                chunk, seconds = [], call_s
                yield

    def _units(self, job: Job, k: int, it: ListJob) -> list[tuple]:
        """List `k` of the job as one unit of work, or as pieces of whole hypotheses (sorted, so that hypotheses
        sharing a prefix stay together) of at most a step's worth of trie nodes each."""
        cost, step_s = self.models.cost, self.models.step_s
        if it.seconds <= step_s or len(it.lens) == 1:
            return [(job, k, None, it.seconds)]
        grain = cost.grain_nodes(it.depth, step_s)
        seqs = it.sequences
        pieces = [(group, size.total_nodes) for group, size in
                  sorted_groups(seqs, lambda size: size.total_nodes <= grain)]
        per_node = (it.seconds - len(pieces) * cost.call_s) / max(1, sum(n for _, n in pieces))
        job.payload.neural[k] = [None] * len(seqs)
        return [(job, k, np.array(p), cost.call_s + per_node * n) for p, n in pieces]

    def _score_part(self, job: Job, k: int, part: np.ndarray) -> None:
        """The neural LM scores of some of list `k`'s hypotheses."""
        w: EngineWork = job.payload
        seqs = w.submit.lists[k].sequences
        try:
            for j, t in zip(part.tolist(), self.models.neural.encoded_logprobs([[seqs[j] for j in part.tolist()]])[0]):
                w.neural[k][j] = t
        except Exception as e:
            w.error = _failure(e, w)

    def _score_chunk(self, pairs: list[tuple[Job, int]]) -> None:
        neural = self.models.neural
        lists = [job.payload.submit.lists[k] for job, k in pairs]
        try:
            trees = [it.tree for it in lists]  # sized by the front-end: the scorer need not size them again
            out = neural.encoded_logprobs([it.sequences for it in lists], None if None in trees else trees)
            for (job, k), tok in zip(pairs, out):
                job.payload.neural[k] = tok
        except Exception as e:
            # One request must not fail the others: score them one by one to find the culprit.
            if len({job for job, _ in pairs}) == 1:
                pairs[0][0].payload.error = _failure(e, pairs[0][0].payload)
                return
            log.warning("merged batch failed; scoring its requests one by one", exc_info=not _out_of_memory(e))
            by_job: dict[Job, list[int]] = defaultdict(list)
            for job, k in pairs:
                by_job[job].append(k)
            for job, ks in by_job.items():
                if self._stop(job):
                    continue
                w: EngineWork = job.payload
                try:
                    out = neural.encoded_logprobs([w.submit.lists[k].sequences for k in ks])
                    for k, tok in zip(ks, out):
                        w.neural[k] = tok
                except Exception as e:
                    w.error = _failure(e, w)

    # ---- lattices -----------------------------------------------------------------------------------
    def _expand_lattices(self, jobs: list[Job], done: Callable[[Job], None]) -> Iterator[None]:
        """The jobs' lattices, one expansion per distinct weights, a step per level; `done(job)`
        once all lattices of a job are expanded (or it failed or stopped)."""
        groups: dict[tuple, list[tuple[Job, int, LatticeJob]]] = defaultdict(list)
        for job in jobs:
            s = job.payload.submit
            for k, it in enumerate(s.lattices):
                groups[dataclasses.astuple(s.weights)].append((job, k, it))
        left = Counter(job for members in groups.values() for job, _, _ in members)

        def finished(job: Job) -> None:
            left[job] -= 1
            if left[job] == 0:
                done(job)

        for members in groups.values():
            yield from _LatticeGroup(self, members, finished).expand()


class _LatticeGroup:
    """Lattices of a batch that share their weights: one expansion, paused after every LM call of about
    `step_s`. When it fails, the lattices not yet done are expanded one at a time, with the same stops and
    pauses, to find the one that fails. `finished(job)` once per lattice, done, failed or stopped."""

    def __init__(self, worker: Worker, members: list[tuple[Job, int, LatticeJob]],
                 finished: Callable[[Job], None]):
        self.worker, self.members, self.finished = worker, members, finished
        self.accounted: set[int] = set()  # the lattices expanded
        self.spent = 0.0  # worker seconds

    def expand(self) -> Iterator[None]:
        try:
            yield from self._run(list(range(len(self.members))))
        except Exception as e:
            self.worker.models.forget_rescorer()
            rest = [i for i in range(len(self.members)) if i not in self.accounted]
            if len(rest) == 1:
                self._failed(rest[0], e)
                rest = []
            else:
                log.warning("merged lattice expansion failed; expanding the rest one by one",
                            exc_info=not _out_of_memory(e))
            for i in rest:
                if self._stop(i):
                    continue
                try:
                    yield from self._run([i])
                except Exception as e:
                    self.worker.models.forget_rescorer()
                    self._failed(i, e)
        bound = sum(it.seconds for i, (_, _, it) in enumerate(self.members) if i in self.accounted)
        if bound > 0 and self.spent > 0:  # learn what share of the bound this server's lattices take
            ratio = self.worker.lattice_ratio
            self.worker.lattice_ratio = min(1.0, max(0.01, 0.8 * ratio + 0.2 * self.spent / bound))
        for i, (job, _, _) in enumerate(self.members):  # failed or stopped: answered with their error
            if i not in self.accounted:
                self.finished(job)

    def _run(self, indices: list[int]) -> Iterator[None]:
        models = self.worker.models
        lattices = [self.members[i][2].lattice for i in indices]
        rescorer = models.rescorer(self.members[0][0].payload.submit.weights, sum(x.num_arcs for x in lattices))
        # as many at a time as the predicted peaks of the largest of them allow within max_request_bytes together
        # (a group holds lattices of every request under these weights; `make_work` plans each request alike)
        together = lattices_together(models.expand_config.lattices_per_batch(models.neural is not None),
                                     [self.members[i][2].nbytes for i in indices], models.s.max_request_bytes)
        t = time.perf_counter()
        starts = {}  # lattices said after a context (a session's or the request's): their LMs start after it
        for k, i in enumerate(indices):
            if self.members[i][2].context:
                starts[k] = rescorer.context_start(self.members[i][2].context)
        for out in rescorer.expand_many(lattices, on_error=lambda k, e: self._failed(indices[k], e),
                                        should_stop=lambda k: self._stop(indices[k]), pause=True, batch=together,
                                        starts=starts):
            if out is not None:
                self._take(indices[out[0]], out[1])
            self.spent += time.perf_counter() - t
            yield
            t = time.perf_counter()
        self.spent += time.perf_counter() - t

    def _failed(self, i: int, e: BaseException) -> None:
        job, k, it = self.members[i]
        w: EngineWork = job.payload
        if w.error is None:
            w.error = _failure(e, w, f"{it.field}.lattice")

    def _take(self, i: int, exp: ExpandedLattice) -> None:
        job, k, _ = self.members[i]
        w: EngineWork = job.payload
        w.lattices[k] = dataclasses.replace(exp, source=None)  # the front-end has the lattice it sent
        w.lm_steps += exp.stats.lm_rows
        self.worker.models.expanded(exp.stats.expanded_arcs)
        self.accounted.add(i)
        self.finished(job)

    def _stop(self, i: int) -> bool:  # between LM calls: a lattice of a failed or expired job is dropped
        return self.worker._stop(self.members[i][0])


def _as_service_error(e: BaseException, w: EngineWork, field: str | None = None) -> ServiceError:
    if isinstance(e, ServiceError):
        return e
    return ServiceError(str(e), field or w.submit.field)


def _failure(e: BaseException, w: EngineWork, field: str | None = None) -> BaseException:
    """What a job that raised `e` answers: the client's error (4xx), 503 when memory ran out (the
    worker goes on), else the exception itself (a bug: 500, logged)."""
    if isinstance(e, SmallstateError):
        return _as_service_error(e, w, field)
    if _out_of_memory(e):
        log.warning("a request ran out of memory: %s", str(e).split("\n")[0][:200])
        e.__traceback__ = None  # its frames hold what ran out of memory: let it go now
        error = Unavailable("the server has not enough memory for this request now: retry later, or send it in "
                            "smaller parts", retry_after=5)
        error.__suppress_context__ = True
        return error
    return e


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure (host or device), which a retry later or a smaller request may not meet."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))
