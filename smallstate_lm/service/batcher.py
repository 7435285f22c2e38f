"""Dynamic batching: concurrent requests share forward passes on one worker thread, in slices.

Requests are queued on the event loop. A collector task takes the oldest request and
waits for company while other requests are already on their way in (`arriving()`:
received by the server, not yet queued), for at most `max_wait_s` after the oldest was
queued and until the queued cost reaches the token budget; then it hands everything
that fits the budget to ONE worker thread (a single-thread executor: the only thread
that touches the model and the GPU). A lone request is therefore not delayed, and
while the worker computes new requests queue up, so batches grow with the load. With
batching off each request is its own batch.

The work of a batch is an iterator of steps (a piece of hypothesis lists, one LM call of
a lattice level, each sized to about a slice by the cost model). The worker runs a batch
for at most `slice_s` at a time. When the batch holds a job expected to take longer than a
slice, requests queued meanwhile are turned to as soon as its current step ends, before it
resumes: a long lattice holds a small request for one step, not for its whole expansion. A
batch of small requests runs a few slices before newer ones get every other slice, so that
requests arriving meanwhile gather into one batch. Started batches run oldest first, those of
small requests and those holding a long job by turns. A
job whose request was cancelled or whose deadline passed is dropped from the queue, and the
work function stops its work at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from .errors import Unavailable
from .metrics import Metrics

log = logging.getLogger("smallstate_lm.service")


class Job:
    """A unit of work: `payload` is what the work function computes, `cost` (tokens) counts
    against the batch budget, `deadline` (time.perf_counter seconds) is when its answer is
    no longer wanted, `seconds` the worker time it is expected to take; the batcher sets the
    timestamps and the size of the batch it joined."""

    def __init__(self, cost: int, payload: Any = None, deadline: float = math.inf, seconds: float = 0.0):
        self.cost = max(1, int(cost))
        self.seconds = seconds  # the worker time it is expected to take
        self.payload = payload
        self.deadline = deadline
        self.cancelled = False  # the request gave up (client gone, deadline, shutdown)
        self.started = False  # taken off the queue by the worker
        self.dropped = False  # its work was stopped part-way (counted once)
        self.t_submit = 0.0
        self.t_start = 0.0
        self.batch_size = 0
        self.future: asyncio.Future | None = None

    def expired(self) -> bool:
        """Its answer is no longer wanted: read by the worker between steps."""
        return self.cancelled or time.perf_counter() >= self.deadline


def drop_expired(job: Job, stage: str, metrics: Metrics | None) -> bool:
    """Whether `job` expired; the first time, counts its work as cancelled at `stage` (queued: never
    started; running: stopped part-way)."""
    if not job.expired():
        return False
    if metrics is not None and not job.dropped:
        metrics.work_cancelled.labels(stage).inc()
    job.dropped = True
    return True


# work(jobs, deliver): the batch's steps; calls deliver(job, result or exception) for each job, from the worker,
# as soon as its answer is ready.
WorkFn = Callable[[list, Callable[[Job, Any], None]], Iterator[Any]]


class _Batch:
    """A batch the worker has started: its jobs, its remaining steps and its worker time so far."""

    def __init__(self, jobs: list[Job], steps: Iterator[Any], cost: int, slice_s: float):
        self.jobs, self.steps, self.cost = jobs, steps, cost
        self.t_start = time.perf_counter()
        self.seconds = 0.0
        self.long = any(j.seconds > slice_s for j in jobs)  # a job of it is expected to need several slices
        self.slice_s = slice_s

    def remaining(self) -> float:
        """Expected worker seconds left: its live jobs' expected seconds less what it has had."""
        return max(0.0, sum(j.seconds for j in self.jobs if not j.expired()) - self.seconds)

    def yields(self) -> bool:
        """Whether newer requests get every other slice: while it holds a long job, or once it has had
        SHARE_AFTER slices. A batch of small requests runs on before that, so that the requests arriving
        meanwhile gather into one batch (each forward pass reads all the weights: a pass of many
        requests costs little more than a pass of one)."""
        return self.long or self.seconds >= SHARE_AFTER * self.slice_s


# slices a batch of small requests gets before newer requests share the worker with it
SHARE_AFTER = 4


def _advance(steps: Iterator[Any], budget_s: float, waiting: Callable[[], bool] = lambda: False) -> bool:
    """Run steps for about `budget_s` seconds (on the worker thread), or until `waiting()` says new work is
    queued; True when none are left."""
    end = time.perf_counter() + budget_s
    for _ in steps:
        if time.perf_counter() >= end or waiting():
            return False
    return True


class Batcher:
    def __init__(self, work: WorkFn, *, batching: bool = True, max_batch_cost: int = 32768, max_wait_s: float = 0.005,
                 max_queue: int = 256, slice_s: float = 0.05, metrics: Metrics | None = None,
                 arriving: Callable[[], int] | None = None, on_idle: Callable[[int], None] | None = None):
        self.work = work
        self.on_idle = on_idle  # called with the cost of the batches finished since the worker was last idle
        self._cost_since_idle = 0
        self.arriving = arriving  # None: always wait max_wait_s for company
        self.batching = batching
        self.max_batch_cost = max_batch_cost
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.slice_s = slice_s
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._queued_cost = 0
        self._running: collections.deque[_Batch] = collections.deque()  # started, not finished
        self._current: _Batch | None = None  # the one on the worker now
        self._oldest_turn = False  # whether the next started batch to run is a long one (see _next)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="smallstate-worker")

    @property
    def depth(self) -> int:
        return len(self._queue)

    def backlog(self) -> float:
        """Expected worker seconds of the queued jobs and what is left of the started batches': what a
        job that needs more than one slice may wait for."""
        queued = sum(j.seconds for j in self._queue)
        started = [*self._running, *([self._current] if self._current is not None else [])]
        return queued + sum(b.remaining() for b in started)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._collect(), name="smallstate-batcher")

    async def call(self, fn: Callable, *args) -> Any:
        """Run `fn(*args)` on the worker thread (loading the model there, for instance)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def aside(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn()` on the worker thread between slices (housekeeping that must not need a thread of its own)."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def run_now(self, jobs: list[Job], deliver: Callable[[Job, Any], None]) -> None:
        """Run a batch to its end on the worker, past the queue (the warm-up)."""
        await self.call(lambda: _advance(self.work(jobs, deliver), math.inf))

    def submit(self, job: Job) -> asyncio.Future:
        """Queue `job`; the future gets what the worker delivers. Raises Unavailable when
        the queue is full or the service is stopping."""
        if self._task is None or self._closing:
            raise Unavailable("the service is shutting down; retry on another replica", retry_after=1)
        if len(self._queue) >= self.max_queue:
            raise Unavailable(f"overloaded: {len(self._queue)} requests are waiting (max_queue); retry later",
                              retry_after=1)
        job.future = self._loop.create_future()
        job.t_submit = time.perf_counter()
        self._queue.append(job)
        self._queued_cost += job.cost
        self._set_depth()
        self._wake.set()
        return job.future

    def cancel(self, job: Job) -> None:
        """The request gave up: drop the job if it is still queued; the worker stops its work
        at its next step otherwise."""
        job.cancelled = True
        if job.future is not None and not job.future.done():
            job.future.cancel()  # a result delivered later is dropped, not left unretrieved
        if not job.started and job in self._queue:
            self._queue.remove(job)
            self._queued_cost -= job.cost
            self._set_depth()
            drop_expired(job, "queued", self.metrics)
            self._wake.set()

    def begin_shutdown(self, stop_at: float) -> None:
        """Refuse new jobs; every job queued or running gets `stop_at` as its latest deadline."""
        self._closing = True
        current = [self._current] if self._current is not None else []
        for job in [*self._queue, *(j for b in [*self._running, *current] for j in b.jobs)]:
            job.deadline = min(job.deadline, stop_at)
        if self._wake is not None:
            self._wake.set()

    def poke(self) -> None:
        """Re-check the waiting condition (a request on its way in was dropped)."""
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        """Refuse new jobs, finish the queued and started ones (or drop them past their deadline), stop the worker."""
        self._closing = True
        if self._task is not None:
            self._wake.set()
            await self._task
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        except RuntimeError:  # no thread to wait in (a memory limit): the worker is idle by now anyway
            self._executor.shutdown(wait=False)

    # ---- internals -------------------------------------------------------------------------
    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    async def _collect(self) -> None:
        new_first = True  # when both wait: alternate new batches and started ones
        while True:
            if not self._queue and not self._running:
                if self._closing:
                    return
                if self._cost_since_idle and self.on_idle is not None:
                    try:
                        self.on_idle(self._cost_since_idle)
                    except Exception:  # housekeeping must never stop the collector
                        log.exception("idle callback failed")
                self._cost_since_idle = 0
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._turn(new_first)
            new_first = not new_first

    async def _turn(self, new_first: bool) -> None:
        """One slice of a new batch or of the started one expected to finish first (sharing the worker
        evenly among all of them would make every long request late); new ones get every other slice
        once that one yields (`_Batch.yields`), so a small request waits for at most one step of a long
        job, or a few slices of small ones. A function of its own
        so that nothing of a finished batch (its requests, results) stays referenced while the
        collector waits."""
        if self._queue and (not self._running or (new_first and self._next().yields())):
            if self.batching and not self._running:  # nothing to do meanwhile: wait for company
                await self._wait_for_company()
            batch = self._take()
            if not batch:
                return
            run = _Batch(batch, iter(self.work(batch, self._deliver)), sum(j.cost for j in batch), self.slice_s)
            if not await self._step(run):
                self._running.append(run)
        else:
            run = self._next()
            self._oldest_turn = not self._oldest_turn
            self._running.remove(run)
            if not await self._step(run):
                self._running.appendleft(run)

    def _next(self) -> _Batch:
        """The started batch to run next, oldest first within each class, the classes by turns: batches of
        small requests, and batches holding a long job (expected to need several slices). A batch of small
        requests that did not finish in its first slice waits behind neither the long jobs nor newer small
        batches; a long job is not starved by a stream of small ones (it gets every other of these turns)."""
        long = [b for b in self._running if b.long]
        small = [b for b in self._running if not b.long]
        pick = long if (self._oldest_turn and long) or not small else small
        return min(pick, key=lambda b: b.t_start)

    async def _wait_for_company(self) -> None:
        # The oldest job's deadline, not the batch's: after a long batch the queue is served at once.
        deadline = self._queue[0].t_submit + self.max_wait_s
        while (self._queue and self._queued_cost < self.max_batch_cost and not self._closing
               and (self.arriving is None or self.arriving() > 0)):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[Job]:
        """The oldest jobs of one class within the batch budget (one without batching): small ones (expected
        to fit in a slice) when any is queued, else long ones; the others stay queued in order. A batch never
        mixes the two, so small requests are not tied to a long job's turns. Expired jobs are dropped."""
        small = any(j.seconds <= self.slice_s for j in self._queue)
        batch, cost, keep = [], 0, []
        while self._queue:
            job = self._queue.popleft()
            if (job.seconds <= self.slice_s) != small or (batch and not self.batching) \
                    or (batch and cost + job.cost > self.max_batch_cost):
                keep.append(job)
                if batch and (not self.batching or cost + job.cost > self.max_batch_cost):
                    break
                continue
            self._queued_cost -= job.cost
            job.started = True
            if drop_expired(job, "queued", self.metrics):
                continue
            cost += job.cost
            batch.append(job)
        self._queue.extendleft(reversed(keep))
        self._set_depth()
        t_start = time.perf_counter()
        for job in batch:
            job.t_start, job.batch_size = t_start, len(batch)
        return batch

    async def _step(self, run: _Batch) -> bool:
        """One slice of `run` on the worker; whether it is finished."""
        t0 = time.perf_counter()
        self._current = run
        try:
            # a request queued meanwhile is turned to after the current step of a long batch, not after its
            # whole slice; short batches keep their slice, so that requests queued meanwhile batch together
            done = await self._loop.run_in_executor(self._executor, _advance, run.steps, self.slice_s,
                                                    (lambda: bool(self._queue)) if run.long else (lambda: False))
        except Exception as e:  # a bug in the worker: fail this batch's requests, keep serving
            log.exception("batch of %d request(s) failed", len(run.jobs))
            for job in run.jobs:
                self._resolve(job.future, e)
            done = True
        finally:
            self._current = None
        run.seconds += time.perf_counter() - t0
        if done:
            self._cost_since_idle += run.cost
            if self.metrics is not None:
                self.metrics.observe_batch(len(run.jobs), run.cost, run.seconds)
        return done

    def _deliver(self, job: Job, result: Any) -> None:
        """Called by the worker thread for each job as soon as its result is ready."""
        self._loop.call_soon_threadsafe(self._resolve, job.future, result)

    @staticmethod
    def _resolve(future: asyncio.Future | None, result: Any) -> None:
        if future is None or future.done():  # the request was cancelled meanwhile
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
