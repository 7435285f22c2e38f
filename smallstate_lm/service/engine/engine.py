"""The engine: the one process that owns the model(s) on the device, the one queue and the admission of every
front-end's work, the batcher and the worker. Front-ends connect to its ROUTER socket (ipc, in the service's run
directory) and send prepared work (`messages.Submit`); the engine admits it against the backlog it alone sees
(predicted seconds against what is left of the request's deadline), queues it, and answers each submit once
(`Scored` or `Refused`). What every front-end reads without asking (readiness, the backlog for early refusals)
it writes on the board."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import zmq

from smallstate_lm.device import pick_device
from smallstate_lm.errors import SmallstateError
from smallstate_lm.rescoring.formats.lattice_io import read_fst_text
from smallstate_lm.rescoring.lattices.lattice import SymbolTable

from ..admission import admit, long_backlog
from ..board import Board
from ..errors import ServiceError, Unavailable
from ..memory import release_memory, rss_bytes
from ..messages import (
    Cancel,
    Hello,
    LatticeJob,
    ListJob,
    Refused,
    SessionCall,
    SessionReply,
    Submit,
    Welcome,
    engine_address,
    from_frames,
    portable,
    to_frames,
)
from ..metrics import Metrics
from ..model import Models
from ..sessions import SessionStore
from ..settings import Settings
from ..wire import Wire
from .batcher import Batcher, BatchLimits, Job
from .worker import EngineWork, Worker

log = logging.getLogger("smallstate_lm.service")
# Freed memory goes back to the OS when the worker goes idle with the process this much larger than after
# warm-up: the allocator keeps what a burst freed otherwise.
RELEASE_GROWTH = 64 * 2**20
ENGINE_NICE = 10
BOARD_S = 0.005  # how often the backlog on the board is brought up to date
SESSION_SWEEP_S = 0.5  # how often leases past their deadline are taken back and idle sessions dropped
FAILED = "engine.failed"  # in the run directory: why the model was refused (read by the supervisor)


class Engine:
    def __init__(self, settings: Settings, rundir: str | Path, board: Board):
        self.s, self.rundir, self.board = settings, Path(rundir), board
        self.metrics = Metrics()
        self.models = Models(settings, self.metrics)
        self.worker = Worker(self.models, self.metrics)
        limits = BatchLimits(batching=settings.batching, max_batch_cost=settings.max_batch_tokens,
                             max_wait_s=settings.max_wait_ms / 1000, max_queue=settings.max_queue,
                             slice_s=settings.slice_ms / 1000)
        self.batcher = Batcher(self.worker.run_batch, limits, metrics=self.metrics,
                               arrivals=board if settings.wait_for_arrivals else None, on_idle=self._idle)
        self.jobs: dict[tuple[bytes, int], Job] = {}  # (front-end socket, request id) -> its job, until answered
        self.sessions = SessionStore(settings.max_sessions, settings.session_ttl_s, settings.max_context_utts)
        self.stop_at = math.inf
        self.rss_base = 0
        self._releasing = False
        self._wire: Wire | None = None

    async def run(self) -> int:
        """Load, warm up, serve until SIGTERM, then finish or stop every job by the grace time. Returns the exit
        status: 0, or 3 when the model failed to load or its self-check (the reason in the run directory)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        t0 = time.perf_counter()
        try:
            if pick_device(self.s.device).type == "cpu":
                # On a CPU the model and the front-ends share the cores: a request's own work (its refusal, a small
                # answer) goes first, the model takes what is left; on a GPU the engine only feeds the device.
                # Before any thread starts: Linux gives each thread its own niceness, inherited by those it starts.
                os.nice(ENGINE_NICE)
            # The worker thread loads the model: it is the thread that will use it (and the GPU).
            await self.batcher.call(self.models.load)
        except SmallstateError as e:  # a bad checkpoint, or finite weights whose scores are not (self-check)
            (self.rundir / FAILED).write_text(str(e))  # the supervisor says it, once
            return 3
        await self._warm_up()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(engine_address(self.rundir))
        self._wire = Wire(sock, self._receive)
        self.batcher.start()
        self.board.engine(os.getpid(), True)
        self.metrics.ready.set(1)
        log.info("engine: model loaded and warmed up in %.1f s on %s", time.perf_counter() - t0, self.models.device)
        publish = asyncio.ensure_future(self._publish())
        sweep = asyncio.ensure_future(self._sweep_sessions())
        await stop.wait()
        sweep.cancel()
        self.board.engine(os.getpid(), False)
        self.metrics.ready.set(0)
        self.stop_at = time.perf_counter() + max(0.0, self.s.graceful_timeout_s - 0.5)
        self.batcher.begin_shutdown(self.stop_at)
        await self.batcher.close()  # every job answered: its result, or stopped at the grace time
        publish.cancel()
        self._wire.close()
        ctx.term()
        return 0

    async def _warm_up(self) -> None:
        """A sentence and a two-word lattice: the first real request then finds every code path (kernels,
        allocator, KenLM pages) warm."""
        models = self.models
        words = (models.loaded.vocab.sample_words()[:5] if models.loaded is not None else []) or ["the", "of", "and"]
        lists = []
        if models.neural is not None:
            ids = np.array(models.neural.encode(words), dtype=np.int64)
            lists = [ListJob(ids, np.array([len(ids)]), 0.0, len(ids))]
        fst = f"0 1 {words[0]} {words[0]} 1.0,1.0\n1 2 {words[1]} {words[1]} 1.0,1.0\n2 0.0,0.0\n"
        lat = read_fst_text(fst, SymbolTable.from_words(list(words[:2])), name="warmup").prepare()
        submit = Submit(0, "rescore", models.weights, lists, [LatticeJob(lat, "utterances[0]", 0.0, 0)], cost=8,
                        seconds=0.0, lattice_seconds=0.0, tokens_total=0, tokens_computed=0, remaining=math.inf,
                        timeout=math.inf, field="utterances")

        def answered(job, result) -> None:
            if isinstance(result, BaseException):  # e.g. an n-gram-only server without the warm-up words
                log.info("warm-up request answered: %s", result)

        await self.batcher.run_now([Job(8, EngineWork(submit))], answered)
        await asyncio.get_running_loop().run_in_executor(None, release_memory)
        # What is alive now (model, vocabulary, n-gram) lives as long as the process: out of the cyclic
        # collector's generations, a full collection scans requests' objects only.
        gc.freeze()
        self.rss_base = rss_bytes()

    # ---- messages -------------------------------------------------------------------------------
    def _receive(self, frames: list[zmq.Frame]) -> None:
        who = frames[0].bytes
        try:
            msg = from_frames([f.buffer for f in frames[1:]])
        except Exception:  # a front-end of another version, or a torn message: never the engine's end
            log.exception("engine: a message that does not unpickle was dropped")
            return
        if isinstance(msg, Submit):
            self._submit(who, msg)
        elif isinstance(msg, Cancel):
            job = self.jobs.pop((who, msg.id), None)
            if job is not None:
                self.batcher.cancel(job)
        elif isinstance(msg, Hello):
            self._hello(who, msg)
        elif isinstance(msg, SessionCall):
            self._session(who, msg)

    def _session(self, who: bytes, msg: SessionCall) -> None:
        """A session operation, answered at once (acquire: when it is this request's turn)."""
        store = self.sessions
        try:
            if msg.op == "create":
                value = store.create(msg.scope, msg.name, msg.k)
            elif msg.op == "describe":
                value = store.describe(msg.scope, msg.name)
            elif msg.op == "delete":
                value = store.delete(msg.scope, msg.name)
            elif msg.op == "release":
                store.release(msg.scope, msg.name, msg.lease, msg.said)
                return
            else:
                def reply(context, error) -> None:
                    self._send(who, SessionReply(msg.id, context, portable(error) if error is not None else None))

                store.acquire(msg.scope, msg.name, msg.lease, msg.lease_s, reply)
                return
        except ServiceError as e:
            self._send(who, SessionReply(msg.id, None, portable(e)))
            return
        self._send(who, SessionReply(msg.id, value))

    async def _sweep_sessions(self) -> None:
        while True:
            await asyncio.sleep(SESSION_SWEEP_S)
            self.sessions.sweep()

    def _send(self, who: bytes, msg) -> None:
        if self._wire is not None:
            self._wire.send([who, *to_frames(msg)])

    def _hello(self, who: bytes, msg: Hello) -> None:
        # a front-end that was restarted: the work its predecessor left here is nobody's any more
        prefix = f"fe{msg.frontend}-".encode()
        for key in [k for k in self.jobs if k[0].startswith(prefix) and k[0] != who]:
            self.batcher.cancel(self.jobs.pop(key))
        self._send(who, Welcome(os.getpid(), self.models.cost, self.models.info, self.worker.lattice_ratio))

    def _submit(self, who: bytes, msg: Submit) -> None:
        try:
            if self.stop_at < math.inf:
                raise Unavailable("the service is shutting down; retry on another replica", retry_after=1)
            slice_s = self.batcher.slice_s
            backlog = long_backlog(self.batcher.backlog(long=True), self.batcher.backlog(long=False), slice_s)
            admit(msg.seconds, msg.lattice_seconds, msg.remaining, msg.timeout, msg.field, slice_s, backlog,
                  self.worker.lattice_ratio)
            deadline = time.perf_counter() + msg.remaining
            # its class by what it may take (a lattice's upper bound), its place in the backlog by what it should
            job = Job(msg.cost, EngineWork(msg), deadline=min(deadline, self.stop_at),
                      seconds=self.worker.expected_seconds(msg.seconds, msg.lattice_seconds),
                      long=msg.seconds > slice_s)
            future = self.batcher.submit(job)
        except ServiceError as e:
            self._send(who, Refused(msg.id, portable(e)))
            return
        self.jobs[(who, msg.id)] = job
        future.add_done_callback(lambda f: self._answer(who, msg.id, f))

    def _answer(self, who: bytes, id: int, future: asyncio.Future) -> None:
        self.jobs.pop((who, id), None)
        if future.cancelled():  # the front-end gave it up: it waits for no answer
            return
        result = future.exception() or future.result()  # the batcher delivers an error as the future's exception
        if isinstance(result, BaseException):
            if not isinstance(result, ServiceError):
                log.error("engine: a request failed", exc_info=result)
            result = Refused(id, portable(result))
        self._send(who, result)

    # ---- the board ------------------------------------------------------------------------------
    async def _publish(self) -> None:
        while True:
            self.board.backlog(self.batcher.backlog(long=True), self.batcher.backlog(long=False),
                               self.batcher.slice_s)
            await asyncio.sleep(BOARD_S)

    # ---- memory ---------------------------------------------------------------------------------
    def _idle(self, cost: int) -> None:
        """The worker has nothing to do: when the work since it was last idle left the process well above its
        size after warm-up (a large lattice's states, a long list's activations), the memory goes back, on the
        worker's thread (it exists already, where a new one may not be had when memory is short)."""
        if rss_bytes() <= self.rss_base + RELEASE_GROWTH or self._releasing:
            return
        self._releasing = True

        def done(_) -> None:
            self._releasing = False

        self.batcher.aside(release_memory).add_done_callback(done)
