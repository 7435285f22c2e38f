"""What a front-end's routes and middleware share (`Service`): settings, metrics, the models it prices and
prepares requests with, its line to the engine, readiness, and each request's deadline from its arrival to its
answer, with the early refusals a large request gets while it is prepared (the engine admits it for good)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import math
import os
import time

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from smallstate_lm.errors import SmallstateError

from ..admission import admit, check_backlog, check_lists
from ..board import Board
from ..errors import ClientGone, DeadlineExceeded, ServiceError, Unavailable
from ..messages import Refused, Scored, SessionCall
from ..metrics import Metrics
from ..model import Models
from ..sessions import scope_of
from ..settings import Settings
from .client import EngineClient
from .submit import engine_submit
from .work import Work

log = logging.getLogger("smallstate_lm.service")
ARRIVAL = "smallstate.arriving"  # scope key: the request is counted as on its way in (Service.receive)
T0 = "smallstate.t0"  # scope key: when the request arrived (time.perf_counter); its deadline counts from it
TIMEOUT_HEADER = "x-request-timeout"
SESSION_CALL_S = 5.0  # a session operation other than waiting for a turn is answered at once by the engine
LEASE_MARGIN_S = 2.0  # a turn outlives its request's deadline by this much, for the answer's way back


class Service:
    """What the routes share: settings, metrics, the models, the engine client and the readiness flags (ready once
    connected to the engine and loaded; draining after SIGTERM; failed when the model did not load) and, once
    shutting down, the time by which every request must be answered."""

    def __init__(self, settings: Settings, rundir: str, index: int, board: Board):
        self.settings = settings
        self.metrics = Metrics()
        self.models = Models(settings, self.metrics)
        self.board, self.index = board, index
        self.client = EngineClient(rundir, index, board, self._welcomed)
        # scoring requests received, and handed on (to the engine, or answered before that), so far: on the board,
        # where the engine's batcher sees who is on the way in (see ArrivalMiddleware); a restarted front-end
        # goes on from its predecessor's counts
        self._received, self._handed = board.counts(index)
        self.ready = False
        self.draining = False
        self.failed: str | None = None  # why the model may not serve, once known
        self.stop_at = math.inf  # once shutting down: when every request gets its answer (perf_counter seconds)
        self.stopping = asyncio.Event()
        self._leases = itertools.count(1)

    @property
    def arriving(self) -> int:
        """Scoring requests received, not yet handed on."""
        return self._received - self._handed

    def receive(self) -> None:
        self._received += 1
        self.board.set_counts(self.index, self._received, self._handed)

    @property
    def lattice_ratio(self) -> float:
        return self.client.welcome.lattice_ratio if self.client.welcome is not None else 0.1

    async def start(self) -> None:
        welcome = await self.client.connect()
        try:
            await run_in_threadpool(self.models.load, "cpu", welcome.cost, welcome.info)
        except SmallstateError as e:
            self.failed = str(e)
            log.error("refusing to become ready: the model failed to load: %s", e)
            return
        gc.freeze()  # the models and the app live as long as the process: out of the collector's way
        self.ready = True
        self.board.frontend_ready(self.index, True)
        self.metrics.ready.set(1)

    def _welcomed(self, welcome) -> None:
        """An engine (again, after a restart): its cost model and description from now on."""
        if self.ready:
            self.models.cost, self.models.info = welcome.cost, welcome.info

    def serving(self) -> bool:
        """Whether /readyz says ready: every process of the service is, and this one is not draining."""
        return self.ready and not self.draining and self.client.connected.is_set() and self.board.all_ready()

    async def stop(self) -> None:
        self.ready = False
        self.board.frontend_ready(self.index, False)
        self.metrics.ready.set(0)
        self.client.close()

    def set_draining(self) -> None:
        self.draining = True
        self.metrics.ready.set(0)

    def begin_shutdown(self, stop_at: float) -> None:
        """Every request in flight gets its answer by `stop_at` (perf_counter seconds): its result,
        or 503; new ones get 503 at once."""
        self.stop_at = stop_at
        self.stopping.set()

    def arrived(self, scope) -> None:
        """The request of `scope` stops counting as on its way in (once)."""
        if scope.pop(ARRIVAL, False):
            self._handed += 1
            self.board.set_counts(self.index, self._received, self._handed)

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

    async def submit(self, work: Work, request: Request, timeout: float) -> Scored:
        """Hand the request's work to the engine and wait for its answer until the request's deadline (its arrival
        + `timeout`) or the shutdown's; a deadline passed, a client gone or a shutdown stops its work there."""
        if not self.ready:
            raise self.unavailable()
        if self.stop_at < math.inf:
            raise Unavailable("the service is shutting down; retry on another replica", retry_after=1)
        deadline = request_deadline(request, timeout)
        remaining = deadline - time.perf_counter()
        field = "sentences" if work.kind == "score" else "utterances"
        # the engine's admission, asked first with the backlog on the board: a request refused anyway is not sent
        admit(work.seconds, work.lattice_seconds, remaining, timeout, field, self.settings.slice_ms / 1000,
              self.board.long_backlog(), self.lattice_ratio)
        msg = engine_submit(self.models, work, remaining, timeout)
        future = self.client.submit(msg)
        self.arrived(request.scope)  # once sent: the engine's batcher may stop waiting for it only then
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done = await self.wait_any({future, gone}, deadline)
        except asyncio.CancelledError:
            self.client.cancel(msg.id)
            raise
        finally:
            gone.cancel()
        if future in done:
            answer = future.result()  # Unavailable when the engine ended meanwhile
            if isinstance(answer, Refused):
                raise answer.error
            if self.client.welcome is not None:
                self.client.welcome.lattice_ratio = answer.lattice_ratio
            return answer
        self.client.cancel(msg.id)
        reason = "disconnect" if gone in done else "deadline" if time.perf_counter() >= deadline else "shutdown"
        self.metrics.cancelled.labels(reason).inc()
        if reason == "disconnect":
            raise ClientGone("the client closed the connection; its work was stopped")
        if reason == "shutdown":
            raise Unavailable("the service is shutting down; retry on another replica", retry_after=1)
        raise DeadlineExceeded(f"no answer within the request's deadline of {timeout:g} s (X-Request-Timeout, at "
                               f"most request_timeout_s); its work was stopped", limit=timeout)

    # ---- sessions (kept by the engine: `sessions.SessionStore`) --------------------------------------------
    async def session(self, op: str, request: Request, name: str, **fields) -> object:
        """A session operation for the client of `request` (its sessions are those of its API key); the engine's
        answer, or its error raised."""
        if not self.ready:
            raise self.unavailable()
        msg = SessionCall(0, op, session_scope(request), name, **fields)
        future = self.client.session(msg)
        done = await self.wait_any({future}, time.perf_counter() + SESSION_CALL_S)
        if future not in done:
            self.client.pending.pop(msg.id, None)
            raise Unavailable("the engine did not answer a session call in time; retry shortly", retry_after=1)
        reply = future.result()
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def acquire(self, request: Request, name: str, timeout: float) -> tuple[str, list[list[str]]]:
        """Wait for the session's turn of this request (arrival order at the engine) within its deadline: (its
        lease, the session's last transcripts). The turn is this request's until `release` or its deadline."""
        if not self.ready:
            raise self.unavailable()
        deadline = request_deadline(request, timeout)
        lease = f"{self.index}-{os.getpid()}-{next(self._leases)}"
        msg = SessionCall(0, "acquire", session_scope(request), name, lease=lease,
                          lease_s=max(0.0, deadline - time.perf_counter()) + LEASE_MARGIN_S)
        future = self.client.session(msg)
        try:
            done = await self.wait_any({future}, deadline)
        except asyncio.CancelledError:
            self.release(request, name, lease, None)
            raise
        if future not in done:
            self.client.pending.pop(msg.id, None)
            self.release(request, name, lease, None)
            raise DeadlineExceeded(f"the requests of session {name!r} before this one did not finish within its "
                                   f"deadline of {timeout:g} s", "session", limit=timeout)
        reply = future.result()
        if reply.error is not None:
            raise reply.error
        return lease, reply.value

    def release(self, request: Request, name: str, lease: str, said: list[str] | None) -> None:
        """The request of `lease` is done with the session: `said` (its transcript; None when it failed) is kept."""
        self.client.session(SessionCall(0, "release", session_scope(request), name, lease=lease, said=said))

    def early_checks(self, request: Request, timeout: float, field: str) -> EarlyChecks:
        """The checks a large request's preparation makes as it goes, with the worker's backlog as it is now."""
        return EarlyChecks(request_deadline(request, timeout), timeout, field, self.settings.slice_ms / 1000,
                           self.board.long_backlog())


def session_scope(request: Request) -> str:
    """The scope of a request's sessions: its API key (the middleware has checked it already)."""
    return scope_of(request.headers.get("authorization"))


def request_deadline(request: Request, timeout: float) -> float:
    """When a request's answer is due (time.perf_counter): `timeout` seconds after its first byte arrived."""
    return request.scope.get(T0, time.perf_counter()) + timeout


class EarlyChecks:
    """What a large request's preparation (on any thread) checks before the bulk of its work, so that a request
    refused anyway costs a fraction of its preparation: its hypothesis lists against its deadline (`lists`, with
    what they are predicted to take), and, while the worker is busy with long work, any part of it that is
    already longer than one slice against the backlog (`so_far`, with a floor of what it will be predicted to
    take): the same refusals as the engine's admission makes, with what is known so far."""

    def __init__(self, deadline: float, timeout: float, field: str, slice_s: float, backlog: float | None):
        self.deadline, self.timeout, self.field = deadline, timeout, field
        self.slice_s, self.backlog = slice_s, backlog

    def lists(self, seconds: float) -> None:
        check_lists(seconds, self.deadline - time.perf_counter(), self.timeout, self.field)

    def so_far(self, seconds: float) -> None:
        """503 when the request needs at least `seconds` (a floor of its prediction), more than one slice, and
        the long work queued ahead already fills what its deadline allows."""
        if seconds > self.slice_s:  # its own part counted as 0: it may be mostly lattices' upper bound
            check_backlog(self.backlog, 0.0, self.deadline - time.perf_counter(),
                          f"this request at least {seconds:.1f} s")


async def _disconnected(receive) -> None:
    """Returns once the client has closed the connection (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a stray message: never spin
