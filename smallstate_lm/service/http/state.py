"""What the routes and middleware share (`Service`): settings, metrics, the models, the worker and
its batcher, readiness, and each request's deadline from its arrival to its answer, with the
admission that refuses, before any work, a request whose answer cannot come in time."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from smallstate_lm.errors import SmallstateError

from ..batcher import Batcher, BatchLimits, Job
from ..errors import ClientGone, CostLimitError, DeadlineExceeded, ServiceError, Unavailable
from ..memory import release_memory, rss_bytes
from ..metrics import Metrics
from ..model import Models
from ..results import Result
from ..settings import Settings
from ..work import Work, warmup_work
from ..worker import Worker

log = logging.getLogger("smallstate_lm.service")
ARRIVAL = "smallstate.arriving"  # scope key: the request is counted in Service.arriving
T0 = "smallstate.t0"  # scope key: when the request arrived (time.perf_counter); its deadline counts from it
TIMEOUT_HEADER = "x-request-timeout"
# A request is admitted when its predicted seconds times this fit in what is left of its deadline: the worker
# turns to newer requests between its steps, so a long request gets less than all of it.
HEADROOM = 1.5
# A long request waits for the long work ahead of it and its own work times this: its class gets every other slice
# while small requests flow (2), and the predictions of lattices are rough (2).
LONG_WAIT = 4.0
# Freed memory goes back to the OS when the worker goes idle with the process this much larger than after
# warm-up: the allocator keeps what a burst freed otherwise.
RELEASE_GROWTH = 64 * 2**20


class Service:
    """What the routes share: settings, metrics, the models, the worker and its batcher, the
    readiness flags (ready after load + warm-up; draining after SIGTERM; failed when the model
    did not load or failed its self-check) and, once shutting down, the time by which every
    request must be answered."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.models = Models(settings, self.metrics)
        self.worker = Worker(self.models, self.metrics)
        self.arriving = 0  # scoring requests received, not yet queued (see ArrivalMiddleware)
        limits = BatchLimits(batching=settings.batching, max_batch_cost=settings.max_batch_tokens,
                             max_wait_s=settings.max_wait_ms / 1000, max_queue=settings.max_queue,
                             slice_s=settings.slice_ms / 1000)
        self.batcher = Batcher(self.worker.run_batch, limits, metrics=self.metrics,
                               arriving=(lambda: self.arriving) if settings.wait_for_arrivals else None,
                               on_idle=self._idle)
        self.ready = False
        self.draining = False
        self.failed: str | None = None  # why the model may not serve, once known
        self.stop_at = math.inf  # once shutting down: when every request gets its answer (perf_counter seconds)
        self.stopping = asyncio.Event()
        self.rss_base = 0  # the process's size after warm-up
        self.pricer = None  # the pricing process (http/pricer.py), once warmed up, where there is one
        self._releasing = False

    async def start(self) -> None:
        t0 = time.perf_counter()
        try:
            # The worker thread loads the model: it is the thread that will use it (and the GPU).
            await self.batcher.call(self.models.load)
        except SmallstateError as e:  # a bad checkpoint, or finite weights whose scores are not (self-check)
            self.failed = str(e)
            log.error("refusing to become ready: the model failed to load or its self-check: %s", e)
            return
        jobs = [Job(w.cost, w) for w in await run_in_threadpool(warmup_work, self.models)]

        def answered(job, result) -> None:
            if isinstance(result, BaseException):  # e.g. an n-gram-only server without the warm-up words
                log.info("warm-up request answered: %s", result)

        await self.batcher.run_now(jobs, answered)  # straight to the worker: no batching wait
        await run_in_threadpool(release_memory)
        # What is alive now (model, vocabulary, n-gram, the app) lives as long as the process: out of the cyclic
        # collector's generations, a full collection scans requests' objects only, not a 100+ ms walk of the
        # whole heap in whichever thread (the event loop's too) happens to trigger it.
        gc.freeze()
        self.rss_base = rss_bytes()
        self.batcher.start()
        self.ready = True
        self.metrics.ready.set(1)
        log.info("model loaded and warmed up in %.1f s on %s", time.perf_counter() - t0, self.models.device)

    async def stop(self) -> None:
        self.ready = False
        self.metrics.ready.set(0)
        await self.batcher.close()

    def set_draining(self) -> None:
        self.draining = True
        self.metrics.ready.set(0)

    def begin_shutdown(self, stop_at: float) -> None:
        """Every request in flight gets its answer by `stop_at` (perf_counter seconds): its result,
        or 503; new ones get 503 at once."""
        self.stop_at = stop_at
        self.stopping.set()
        self.batcher.begin_shutdown(stop_at)

    def _idle(self, cost: int) -> None:
        """The worker has nothing to do: when the work since it was last idle left the process well above its
        size after warm-up (a large lattice's states, a long list's activations), the memory goes back."""
        if rss_bytes() > self.rss_base + RELEASE_GROWTH:
            self.release_memory()

    def release_memory(self) -> None:
        """Hand freed memory back to the OS (one at a time), on the worker's thread: it exists already, where
        a new thread may not be had when memory is short, which is when this matters most."""
        if self._releasing:
            return
        self._releasing = True

        def done(_) -> None:
            self._releasing = False

        self.batcher.aside(release_memory).add_done_callback(done)

    def arrived(self, scope) -> None:
        """The request of `scope` stops counting as on its way in (once)."""
        if scope.pop(ARRIVAL, False):
            self.arriving -= 1

    def unavailable(self) -> Unavailable:
        """Why a scoring request cannot be served before the service is ready."""
        return Unavailable("the model failed its start-up check" if self.failed else "the model is still loading",
                           retry_after=2)

    def timeout(self, request: Request) -> float:
        """The request's time budget in seconds: X-Request-Timeout, at most request_timeout_s."""
        limit = self.settings.request_timeout_s
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return limit
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise ServiceError(f"X-Request-Timeout must be a positive number of seconds, got {raw[:40]!r}",
                               f"headers.{TIMEOUT_HEADER}")
        return min(value, limit)

    async def wait_any(self, waiters: set, deadline: float) -> set:
        """The done ones of `waiters`; empty when `deadline` (perf_counter seconds) or, once
        shutting down, the stop time passes first."""
        while True:
            done = {w for w in waiters if w.done()}
            remaining = min(deadline, self.stop_at) - time.perf_counter()
            if done or remaining <= 0:
                return done
            # a shutdown that begins meanwhile brings the deadline forward
            stopping = set() if self.stopping.is_set() else {asyncio.ensure_future(self.stopping.wait())}
            try:
                await asyncio.wait(waiters | stopping, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in stopping:
                    task.cancel()

    async def submit(self, work: Work, request: Request, timeout: float) -> Result:
        """Queue the request's work and wait for its result until its deadline (its arrival +
        `timeout`) or the shutdown's; a deadline passed, a client gone or a shutdown stops its work."""
        if not self.ready:
            raise self.unavailable()
        deadline = request_deadline(request, timeout)
        # its class by what it may take (a lattice's upper bound), its place in the backlog by what it should take
        job = Job(work.cost, work, deadline=min(deadline, self.stop_at),
                  seconds=self.worker.expected_seconds(work.seconds, work.lattice_seconds),
                  long=work.seconds > self.batcher.slice_s)
        self._admit(work, deadline - time.perf_counter(), timeout)
        self.arrived(request.scope)  # no await between this and queueing: the collector sees one or the other
        future = self.batcher.submit(job)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done = await self.wait_any({future, gone}, deadline)
        except asyncio.CancelledError:
            self.batcher.cancel(job)
            raise
        finally:
            gone.cancel()
        if future in done:
            return future.result()
        self.batcher.cancel(job)
        reason = "disconnect" if gone in done else "deadline" if time.perf_counter() >= deadline else "shutdown"
        self.metrics.cancelled.labels(reason).inc()
        if reason == "disconnect":
            raise ClientGone("the client closed the connection; its work was stopped")
        if reason == "shutdown":
            raise Unavailable("the service is shutting down; retry on another replica", retry_after=1)
        raise DeadlineExceeded(f"no answer within the request's deadline of {timeout:g} s (X-Request-Timeout, at "
                               f"most request_timeout_s); its work was stopped", limit=timeout)

    def _admit(self, work: Work, remaining: float, timeout: float) -> None:
        """Refuse at once, before any work, a request whose answer cannot come in time: alone (413) or
        behind the work already queued (503 with Retry-After). Hypothesis lists are predicted closely and
        must fit in their deadline with room for the other requests that share the worker (HEADROOM);
        lattices only have an upper bound, and count as the share of it that this server's lattices
        took so far. A request of one slice is always let in (small requests never wait for long ones),
        and so is a long one on an idle worker: its own estimate is checked above, as far as it is
        reliable."""
        check_lists(work.seconds - work.lattice_seconds, remaining, timeout,
                    "sentences" if work.kind == "score" else "utterances")
        self.check_backlog(work.seconds, work.lattice_seconds, remaining)

    def check_backlog(self, seconds: float, lattice_seconds: float, remaining: float) -> None:
        """503 for a long request (predicted to take `seconds`, `lattice_seconds` of them its lattices' upper bound:
        more than one slice) when the long work queued ahead and its own expected seconds, x LONG_WAIT, would take
        it past what is left of its deadline (`remaining`), while the worker is busy."""
        if seconds > self.batcher.slice_s:
            own = self.worker.expected_seconds(seconds, lattice_seconds)
            behind(self.long_backlog(), own, remaining, f"this request about {own:.1f} s")

    def long_backlog(self) -> float | None:
        """The long requests' backlog in worker seconds while the worker is busy (what a long request queues
        behind), None while it is not (a long request is let in). Read on the event loop only."""
        backlog = self.batcher.backlog(long=True)
        slice_s = self.batcher.slice_s
        return backlog if backlog > slice_s or self.batcher.backlog(long=False) > slice_s else None

    def early_checks(self, request: Request, timeout: float, field: str) -> EarlyChecks:
        """The checks a large request's preparation makes as it goes, with the worker's backlog as it is now."""
        return EarlyChecks(request_deadline(request, timeout), timeout, field, self.batcher.slice_s,
                           self.long_backlog())


def request_deadline(request: Request, timeout: float) -> float:
    """When a request's answer is due (time.perf_counter): `timeout` seconds after its first byte arrived."""
    return request.scope.get(T0, time.perf_counter()) + timeout


def behind(backlog: float | None, own: float, remaining: float, what: str) -> None:
    """503 when the long work queued ahead (`backlog`; None: the worker is not busy) and a long request's own `own`
    seconds (`what`, in words), x LONG_WAIT, take more than the `remaining` seconds of its deadline."""
    if backlog is not None and (backlog + own) * LONG_WAIT > remaining:
        raise Unavailable(f"overloaded: the work queued ahead needs about {backlog:.1f} s and {what}, more than its "
                          f"deadline allows ({remaining:.1f} s left); retry later",
                          retry_after=max(1, math.ceil(backlog)))


class EarlyChecks:
    """What a large request's preparation (on any thread) checks before the bulk of its work, so that a request
    refused anyway costs a fraction of its preparation: its hypothesis lists against its deadline (`lists`, with
    what they are predicted to take), and, while the worker is busy with long work, any part of it that is
    already longer than one slice against the backlog (`so_far`, with a floor of what it will be predicted to
    take): the same refusals as `Service._admit`'s, made with what is known so far."""

    def __init__(self, deadline: float, timeout: float, field: str, slice_s: float, backlog: float | None):
        self.deadline, self.timeout, self.field = deadline, timeout, field
        self.slice_s, self.backlog = slice_s, backlog

    def lists(self, seconds: float) -> None:
        check_lists(seconds, self.deadline - time.perf_counter(), self.timeout, self.field)

    def so_far(self, seconds: float) -> None:
        """503 when the request needs at least `seconds` (a floor of its prediction), more than one slice, and
        the long work queued ahead already fills what its deadline allows."""
        if seconds > self.slice_s:  # its own part counted as 0: it may be mostly lattices' upper bound
            behind(self.backlog, 0.0, self.deadline - time.perf_counter(), f"this request at least {seconds:.1f} s")


def check_lists(lists: float, remaining: float, timeout: float, field: str) -> None:
    """413 for hypothesis lists predicted to take `lists` seconds when `remaining` seconds are left of the
    request's deadline of `timeout`: they must fit with room for the requests that share the worker."""
    if lists * HEADROOM > remaining:
        raise CostLimitError(f"the request's hypothesis lists would take about {lists:.1f} s on this server "
                             f"(predicted by its cost model), more than its deadline allows ({remaining:.1f} s "
                             f"left of {timeout:g} s, of which the worker shares a part with other requests)",
                             field, timeout)


async def _disconnected(receive) -> None:
    """Returns once the client has closed the connection (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a stray message: never spin
