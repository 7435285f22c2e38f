"""A front-end's line to the engine (`EngineClient`): submits and cancels over a zmq DEALER socket, each answer
matched to its request, and the engine's end noticed at once: the front-end holds a pidfd of the engine's
process, which becomes readable the moment it exits. Then every request waiting on it is answered 503 with
Retry-After (none hangs), and the client reconnects to the engine the supervisor starts in its place."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Callable

import zmq

from ..board import Board
from ..errors import Unavailable
from ..messages import Cancel, Hello, SessionCall, Submit, Welcome, engine_address, from_frames, to_frames
from ..wire import Wire

log = logging.getLogger("smallstate_lm.service")
POLL_S = 0.02  # how often the board is read while the engine is not there
HELLO_S = 5.0  # an engine that does not answer a hello in this long is taken to be going


class EngineClient:
    def __init__(self, rundir: str, index: int, board: Board, on_welcome: Callable[[Welcome], None] = lambda w: None):
        self.address, self.index, self.board = engine_address(rundir), index, board
        self.on_welcome = on_welcome  # told each engine's welcome (a new engine calibrated its cost model anew)
        self.ctx = zmq.Context()
        self.wire: Wire | None = None
        self._hello: asyncio.Future | None = None  # the welcome awaited from a new engine
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.welcome: Welcome | None = None
        self.connected = asyncio.Event()
        self._pidfd: int | None = None
        self._lost_pid = 0
        self._reconnect: asyncio.Task | None = None
        self._generation = 0
        self.closed = False

    async def connect(self) -> Welcome:
        """Wait until an engine is ready on the board, then say hello; its welcome (cost model, description)."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            pid = self.board.engine_pid
            if not self.board.engine_ready or pid in (0, self._lost_pid):
                await asyncio.sleep(POLL_S)
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone already: the supervisor will start another
                self._lost_pid = pid
                continue
            self._generation += 1
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"fe{self.index}-{os.getpid()}-{self._generation}".encode())
            sock.connect(self.address)
            self._hello = hello = loop.create_future()
            wire = Wire(sock, self._receive)
            wire.send(to_frames(Hello(self.index)))
            try:
                welcome = await asyncio.wait_for(hello, HELLO_S)
            except asyncio.TimeoutError:  # starting or going: the board says which when it is read again
                wire.close()
                os.close(pidfd)
                continue
            self.wire, self._pidfd, self.welcome = wire, pidfd, welcome
            self.on_welcome(welcome)
            loop.add_reader(pidfd, self._lost, pid)
            self.connected.set()
            return welcome
        raise Unavailable("the service is shutting down", retry_after=1)

    def submit(self, msg: Submit) -> asyncio.Future:
        """Send `msg` (its id is set here); the future gets the engine's answer (`Scored` or `Refused`), or
        Unavailable when the engine ends first."""
        if not self.connected.is_set():
            raise Unavailable("the engine is restarting (the model is being loaded again); retry shortly",
                              retry_after=2)
        msg.id = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[msg.id] = future
        self.wire.send(to_frames(msg))
        return future

    def session(self, msg: SessionCall) -> asyncio.Future | None:
        """Send a session operation (its id is set here); the future gets the engine's `SessionReply`, or
        Unavailable when the engine ends first. A release is not answered: None."""
        if not self.connected.is_set():
            if msg.op == "release":
                return None  # the engine that held the lease is gone, and its sessions with it
            raise Unavailable("the engine is restarting (the model is being loaded again); retry shortly",
                              retry_after=2)
        msg.id = next(self.ids)
        future = None
        if msg.op != "release":
            future = asyncio.get_running_loop().create_future()
            self.pending[msg.id] = future
        self.wire.send(to_frames(msg))
        return future

    def cancel(self, id: int) -> None:
        """The request `id` was given up: the engine stops its work (nothing to stop when it answered already)."""
        if self.pending.pop(id, None) is not None and self.connected.is_set():
            self.wire.send(to_frames(Cancel(id)))

    def _receive(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = from_frames([f.buffer for f in frames])
        except Exception:
            log.exception("front-end: an answer of the engine that does not unpickle was dropped")
            return
        if isinstance(msg, Welcome):
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)
            return
        future = self.pending.pop(getattr(msg, "id", -1), None)
        if future is not None and not future.done():
            future.set_result(msg)

    def _lost(self, pid: int) -> None:
        """The engine exited: every request waiting on it is answered now, and a new engine is awaited."""
        self._disconnect()
        self._lost_pid = pid
        error = Unavailable("the engine stopped while this request was in it; the service is restarting it: retry "
                            "shortly", retry_after=2)
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        if not self.closed:
            log.warning("front-end %d: the engine (pid %d) ended; %d requests answered 503; waiting for the next",
                        self.index, pid, len(pending))
            self._reconnect = asyncio.ensure_future(self._again())

    async def _again(self) -> None:
        try:
            await self.connect()
            log.info("front-end %d: connected to the new engine (pid %d)", self.index, self.welcome.pid)
        except Unavailable:
            pass

    def _disconnect(self) -> None:
        self.connected.clear()
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self.wire is not None:
            self.wire.close()
            self.wire = None

    def close(self) -> None:
        self.closed = True
        if self._reconnect is not None:
            self._reconnect.cancel()
        self._disconnect()
        for future in self.pending.values():
            if not future.done():
                future.set_exception(Unavailable("the service is shutting down; retry on another replica"))
        self.pending.clear()
        self.ctx.term()
