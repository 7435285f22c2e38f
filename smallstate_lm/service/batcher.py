"""Dynamic batching: concurrent requests share forward passes on one worker thread.

Requests are queued on the event loop. A collector task takes the oldest request and
waits for company while other requests are already on their way in (`arriving()`:
received by the server, not yet queued), for at most `max_wait_s` after the oldest was
queued and until the queued cost reaches the token budget; then it hands everything
that fits the budget to ONE worker thread (a single-thread executor: the only thread
that touches the model and the GPU). A lone request is therefore not delayed, and
while the worker computes new requests queue up, so batches grow with the load. With
batching off each request is its own batch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .errors import Unavailable
from .metrics import Metrics

log = logging.getLogger("smallstate_lm.service")


class Job:
    """A unit of work: `payload` is what the work function computes, `cost` (tokens) counts
    against the batch budget; the batcher sets the timestamps (time.perf_counter seconds)
    and the size of the batch it joined."""

    def __init__(self, cost: int, payload: Any = None):
        self.cost = max(1, int(cost))
        self.payload = payload
        self.t_submit = 0.0
        self.t_start = 0.0
        self.batch_size = 0
        self.future: asyncio.Future | None = None


# work(jobs, deliver): computes every job and calls deliver(job, result or exception) for each, from the worker.
WorkFn = Callable[[list, Callable[[Job, Any], None]], None]


class Batcher:
    def __init__(self, work: WorkFn, *, batching: bool = True, max_batch_cost: int = 32768, max_wait_s: float = 0.005,
                 max_queue: int = 256, metrics: Metrics | None = None, arriving: Callable[[], int] | None = None):
        self.work = work
        self.arriving = arriving  # None: always wait max_wait_s for company
        self.batching = batching
        self.max_batch_cost = max_batch_cost
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._queued_cost = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="smallstate-worker")

    @property
    def depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._collect(), name="smallstate-batcher")

    async def call(self, fn: Callable, *args) -> Any:
        """Run `fn(*args)` on the worker thread (loading the model there, for instance)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def submit(self, job: Job) -> Any:
        """Queue `job` and wait for its result; raises what the worker delivered, or
        Unavailable when the queue is full or the service is stopping."""
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
        return await job.future

    def poke(self) -> None:
        """Re-check the waiting condition (a request on its way in was dropped)."""
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        """Refuse new jobs, finish the queued ones, stop the worker."""
        self._closing = True
        if self._task is not None:
            self._wake.set()
            await self._task
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    # ---- internals -------------------------------------------------------------------------
    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    async def _collect(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.batching:
                # The oldest job's deadline, not the batch's: after a long batch the queue is served at once.
                deadline = self._queue[0].t_submit + self.max_wait_s
                while (self._queued_cost < self.max_batch_cost and not self._closing
                       and (self.arriving is None or self.arriving() > 0)):
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        break
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), remaining)
                    except asyncio.TimeoutError:
                        break
                batch, cost = [], 0
                while self._queue and (not batch or cost + self._queue[0].cost <= self.max_batch_cost):
                    job = self._queue.popleft()
                    cost += job.cost
                    batch.append(job)
            else:
                batch = [self._queue.popleft()]
                cost = batch[0].cost
            self._queued_cost -= cost
            self._set_depth()
            t_start = time.perf_counter()
            for job in batch:
                job.t_start, job.batch_size = t_start, len(batch)
            try:
                await self._loop.run_in_executor(self._executor, self.work, batch, self._deliver)
            except Exception as e:  # a bug in the worker: fail this batch's requests, keep serving
                log.exception("batch of %d request(s) failed", len(batch))
                for job in batch:
                    self._resolve(job.future, e)
            if self.metrics is not None:
                self.metrics.observe_batch(len(batch), cost, time.perf_counter() - t_start)

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
