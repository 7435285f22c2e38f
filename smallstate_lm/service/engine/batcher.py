"""Dynamic batching: concurrent requests share forward passes on one worker thread, in slices.

Requests are queued on the event loop. A collector task takes the oldest request and
waits for company while the requests already on their way in when it started waiting
(`arrivals`: received by a front-end, not yet handed on) come in, for at most `max_wait_s` after the oldest was
queued and until the queued cost reaches the token budget; then it hands everything
that fits the budget to ONE worker thread (a single-thread executor: the only thread
that touches the model and the GPU). A lone request is therefore not delayed, and
while the worker computes new requests queue up, so batches grow with the load. With
batching off each request is its own batch.

The work of a batch is an iterator of steps (a piece of hypothesis lists, one LM call of
a lattice level, each sized to about a slice by the cost model). Requests are of two
classes: small (expected to fit in a slice) and long; a batch holds one class only. The
worker gives the classes slices by turns when both have work, and within a class runs the
oldest started batch to its end before it takes a new one from the queue: small requests
arriving meanwhile gather into one batch, a long request waits for the long ones before it
and never for the small ones, nor they for it. A slice of a long batch ends after its
current step when a small request is queued; a small batch that has run for LONG_AFTER
slices and twice its expected time counts as long from then on. A job whose request was cancelled or whose
deadline passed is dropped from the queue, and the work function stops its work at the
next step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from ..errors import Unavailable
from ..metrics import Metrics

log = logging.getLogger("smallstate_lm.service")


class Job:
    """A unit of work: `payload` is what the work function computes, `cost` (tokens) counts
    against the batch budget, `deadline` (time.perf_counter seconds) is when its answer is
    no longer wanted, `seconds` the worker time it is expected to take; the batcher sets the
    timestamps and the size of the batch it joined."""

    def __init__(self, cost: int, payload: Any = None, deadline: float = math.inf, seconds: float = 0.0,
                 long: bool | None = None):
        self.cost = max(1, int(cost))
        self.seconds = seconds  # the worker time it is expected to take
        self.long = long  # its class; None: long when `seconds` is more than a slice
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


class Arrivals(Protocol):
    """Requests on their way in, counted where they arrive: received so far, and handed on (queued here, or
    answered before that) so far."""

    def received(self) -> int: ...

    def handed(self) -> int: ...


# work(jobs, deliver): the batch's steps; calls deliver(job, result or exception) for each job, from the worker,
# as soon as its answer is ready.
WorkFn = Callable[[list, Callable[[Job, Any], None]], Iterator[Any]]


class _Batch:
    """A batch the worker has started: its jobs, its remaining steps, its worker time so far, and its class
    (`long`: its jobs are expected to need several slices)."""

    def __init__(self, jobs: list[Job], steps: Iterator[Any], cost: int, long: bool):
        self.jobs, self.steps, self.cost, self.long = jobs, steps, cost, long
        self.expected = sum(j.seconds for j in jobs)
        self.t_start = time.perf_counter()
        self.seconds = 0.0

    def remaining(self) -> float:
        """Expected worker seconds left: its live jobs' expected seconds less what it has had."""
        return max(0.0, sum(j.seconds for j in self.jobs if not j.expired()) - self.seconds)


# slices after which a batch of small jobs that has taken twice its expected time counts as long
LONG_AFTER = 4


ARRIVALS_S = 0.001  # how often the requests on their way in are counted again while a batch waits for company


def _advance(steps: Iterator[Any], budget_s: float, waiting: Callable[[], bool] = lambda: False) -> bool:
    """Run steps for about `budget_s` seconds (on the worker thread), or until `waiting()` says new work is
    queued; True when none are left."""
    end = time.perf_counter() + budget_s
    for _ in steps:
        if time.perf_counter() >= end or waiting():
            return False
    return True


@dataclass(frozen=True)
class BatchLimits:
    """How batches are formed and run (the settings of the same names, in seconds here)."""

    batching: bool = True  # False: every job is a batch of its own
    max_batch_cost: int = 32768  # tokens of one batch
    max_wait_s: float = 0.005  # longest wait of the oldest queued job for company
    max_queue: int = 256  # jobs waiting; beyond it, Unavailable
    slice_s: float = 0.05  # worker time a batch gets before the worker turns to other work


class Batcher:
    def __init__(self, work: WorkFn, limits: BatchLimits = BatchLimits(), metrics: Metrics | None = None,
                 arrivals: Arrivals | None = None, on_idle: Callable[[int], None] | None = None):
        self.work = work
        self.on_idle = on_idle  # called with the cost of the batches finished since the worker was last idle
        self._cost_since_idle = 0
        self.arrivals = arrivals  # None: always wait max_wait_s for company
        self.batching = limits.batching
        self.max_batch_cost = limits.max_batch_cost
        self.max_wait_s = limits.max_wait_s
        self.max_queue = limits.max_queue
        self.slice_s = limits.slice_s
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._queued_cost = 0
        self._running: collections.deque[_Batch] = collections.deque()  # started, not finished
        self._current: _Batch | None = None  # the one on the worker now
        self._long_turn = False  # whether the next turn is the long requests' (when both have work)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="smallstate-worker")

    @property
    def depth(self) -> int:
        return len(self._queue)

    def backlog(self, long: bool = True) -> float:
        """Expected worker seconds of the queued jobs of a class (long or small) and what is left of its
        started batches: what a new job of that class may wait for."""
        queued = sum(j.seconds for j in self._queue if self._is_long(j) == long)
        started = [*self._running, *([self._current] if self._current is not None else [])]
        return queued + sum(b.remaining() for b in started if b.long == long)

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
            await self._turn()

    async def _turn(self) -> None:
        """One slice of work of one class, the classes by turns when both have work: small requests (each
        expected to fit in a slice) and long ones. Within a class, the oldest started batch runs, else a new
        one is taken from the queue: new small requests gather while an older small batch runs, and a long
        request waits for the long ones before it, never for the small ones, nor they for it. A function of
        its own so that nothing of a finished batch (its requests, results) stays referenced while the
        collector waits."""
        ready = [long for long in ((True, False) if self._long_turn else (False, True)) if self._has_work(long)]
        if not ready:
            return
        long = ready[0]
        self._long_turn = not long
        started = [b for b in self._running if b.long == long]
        if started:
            run = min(started, key=lambda b: b.t_start)
            self._running.remove(run)
        else:
            if self.batching and not self._running:  # nothing to do meanwhile: wait for company
                await self._wait_for_company()
            batch = self._take(long)
            if not batch:
                return
            run = _Batch(batch, iter(self.work(batch, self._deliver)), sum(j.cost for j in batch), long)
        if not await self._step(run):
            self._running.append(run)

    def _has_work(self, long: bool) -> bool:
        return any(b.long == long for b in self._running) or any(self._is_long(j) == long for j in self._queue)

    def _is_long(self, job: Job) -> bool:
        return job.long if job.long is not None else job.seconds > self.slice_s

    async def _wait_for_company(self) -> None:
        # The oldest job's deadline, not the batch's: after a long batch the queue is served at once.
        deadline = self._queue[0].t_submit + self.max_wait_s
        # the requests on their way in now: later ones do not hold this batch back
        mark = self.arrivals.received() if self.arrivals is not None else None
        while (self._queue and self._queued_cost < self.max_batch_cost and not self._closing
               and (mark is None or self.arrivals.handed() < mark)):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.clear()
            try:  # the arrivals are counted in other processes, which cannot wake this one: read them again soon
                await asyncio.wait_for(self._wake.wait(), min(remaining, ARRIVALS_S))
            except asyncio.TimeoutError:
                pass

    def _take(self, long: bool) -> list[Job]:
        """The oldest queued jobs of one class (`long` or small) within the batch budget (one without
        batching); the others stay queued in order. Expired jobs are dropped."""
        batch, cost, keep = [], 0, []
        while self._queue:
            job = self._queue.popleft()
            if self._is_long(job) != long:
                keep.append(job)
                continue
            if batch and (not self.batching or cost + job.cost > self.max_batch_cost):
                keep.append(job)
                break
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
            # a small request queued meanwhile is turned to after the current step of a long batch, not after
            # its whole slice
            waiting = (lambda: any(not self._is_long(j) for j in self._queue)) if run.long else (lambda: False)
            done = await self._loop.run_in_executor(self._executor, _advance, run.steps, self.slice_s, waiting)
        except Exception as e:  # a bug in the worker: fail this batch's requests, keep serving
            log.exception("batch of %d request(s) failed", len(run.jobs))
            for job in run.jobs:
                self._resolve(job.future, e)
            done = True
        finally:
            self._current = None
        run.seconds += time.perf_counter() - t0
        if not run.long and run.seconds > max(LONG_AFTER * self.slice_s, 2 * run.expected):
            run.long = True  # it was expected small (a lattice's expectation is a guess): it is not
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
