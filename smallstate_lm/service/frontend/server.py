"""Running a front-end's app under uvicorn (`run_frontend`), on a socket of its own in the service's port's
SO_REUSEPORT group (made here, not by uvicorn from an inherited fd, which it takes for a Unix socket: the event
loop then never sets TCP_NODELAY on a connection, and Nagle's algorithm held each small response ~40 ms against
the client's delayed ACK under load), with what uvicorn lacks: a deadline on every request's head, a start-up that fails
cleanly when the model is refused, a drain period after SIGTERM and a shutdown in which every request in flight
is answered."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import signal
import threading
import time

import uvicorn
from uvicorn.lifespan.on import LifespanOn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ..board import Board
from ..memory import tune_allocator
from ..metrics import Metrics
from ..settings import Settings
from ..supervisor import listening_socket
from .app import create_app
from .errors import error_body
from .state import Service

log = logging.getLogger("smallstate_lm.service")


def run_frontend(settings: Settings, rundir: str, index: int, board: Board) -> int:
    """Serve front-end `index` on the service's port (a socket of its own in the port's SO_REUSEPORT group) until
    SIGTERM: /readyz turns 503 for `drain_seconds`,
    then the listener closes, in-flight requests finish or get 503 within `graceful_timeout_s`. Returns the exit
    status: 0, or 3 when its models failed to load."""
    tune_allocator()
    _read_bodies_whole(settings.max_body_bytes)
    app = create_app(settings, rundir, index, board)
    svc: Service = app.state.service
    sock = listening_socket(settings.host, settings.port)
    config = uvicorn.Config(app, log_level=settings.log_level, lifespan="on",
                            timeout_graceful_shutdown=settings.graceful_timeout_s,
                            http=_timed_head_protocol(settings.header_timeout_s, svc.metrics))
    config.load()
    config.lifespan_class = _refusing_lifespan(svc)
    server = _Server(config, svc, settings.drain_seconds)
    # uvicorn re-raises the signal it handled once it is done; for SIGTERM that would kill the process
    # after a clean shutdown, so the handler it restores is a no-op.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit after a failed start-up
        if svc.failed is None:
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 3 if svc.failed is not None else 0


def _read_bodies_whole(limit: int) -> None:
    """uvicorn stops reading a request's body every 64 KiB until the app asks for more; ours reads each body
    whole before anything else (BodyLimitMiddleware), so each stop only costs turns of the event loop, which a
    loaded loop hands out slowly (a 2 MB body took up to 100 ms to arrive under load on 2 cores, ~30 ms
    without them). Reading on up to the body limit keeps what a connection may buffer as it was."""
    for name in ("httptools_impl", "h11_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:  # httptools is optional
            continue
        if hasattr(module, "HIGH_WATER_LIMIT"):
            module.HIGH_WATER_LIMIT = max(module.HIGH_WATER_LIMIT, limit)


def _timed_head_protocol(timeout_s: float, metrics: Metrics) -> type:
    """uvicorn's HTTP protocol with a deadline on every request's head: a connection whose head has
    not arrived `timeout_s` after its first byte (or after it opened) gets 408 and is closed.
    uvicorn times out idle keep-alive connections, but not a head sent slowly or stalled half-way."""
    text = json.dumps(error_body(f"the request head did not arrive within {timeout_s:g} s (header_timeout_s)",
                                 "request_timeout")).encode()
    reply = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n%s" % (len(text), text))

    class TimedHead(AutoHTTPProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._reading_head():
                if self._head_timer is None:  # the first bytes of the next request on this connection
                    self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _reading_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._reading_head() and not self.transport.is_closing():
                metrics.header_timeouts.inc()
                self.transport.write(reply)
                self.transport.close()

    return TimedHead


def _refusing_lifespan(svc: Service) -> type:
    """uvicorn's lifespan, failing the start-up when the service refused to become ready: uvicorn
    then opens no port and exits; the log holds our one line, not a traceback."""

    class RefusingLifespan(LifespanOn):
        async def send(self, message) -> None:
            if message["type"] == "lifespan.startup.complete" and svc.failed is not None:
                message = {"type": "lifespan.startup.failed", "message": ""}
            await super().send(message)

        async def startup(self) -> None:
            await super().startup()
            if self.startup_failed and svc.failed is not None:  # let the app's lifespan end: the worker stops
                await self.receive_queue.put({"type": "lifespan.shutdown"})
                await self.shutdown_event.wait()

    return RefusingLifespan


class _Server(uvicorn.Server):
    """uvicorn's server with a drain period and a bounded shutdown: the first SIGTERM marks the
    service as draining (readiness probes fail, requests are still served) and only after
    `drain_seconds` starts uvicorn's graceful shutdown, in which every request in flight is
    answered (its result or 503) a little before uvicorn's own timeout would cancel it (a 500)."""

    def __init__(self, config, svc: Service, drain_seconds: float):
        super().__init__(config)
        self.svc, self.drain_seconds = svc, drain_seconds

    def handle_exit(self, sig, frame) -> None:
        first = not self.svc.draining
        self.svc.set_draining()
        if first and sig == signal.SIGTERM and self.drain_seconds > 0:
            log.info("SIGTERM: draining for %.1f s, then shutting down", self.drain_seconds)
            timer = threading.Timer(self.drain_seconds, super().handle_exit, (sig, None))
            timer.daemon = True
            timer.start()
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown or 0.0
        # The margin leaves time to send the answers before uvicorn's timeout.
        self.svc.begin_shutdown(time.perf_counter() + max(0.0, grace - min(0.5, grace / 4)))
        await super().shutdown(sockets)
