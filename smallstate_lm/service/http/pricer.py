"""Large request bodies priced in a second process (`Pricer`): a copy of the service forked once it is warmed
up, which decodes a body and prepares its work exactly as the routes do (`rescore_work` / `score_work`, with
the same early checks) and answers only whether the request is refused, and why, or what it is predicted to
take.

Under load the server's one interpreter is shared by the event loop, the worker's bookkeeping and every body
being prepared: a 2 MB request that is refused anyway took ~50 ms of it to prepare on an idle machine, and
several at once held back each other, the small requests and the worker (two thirds of the interpreter's time
in the abuse benchmark's mix went to preparing requests that were then refused). Priced here, such a request
costs the server the round trip of its bytes. A request that is let in is then prepared by the server as before:
its preparation is paid twice, in two processes, for work that takes the worker seconds anyway.

The copy is made with fork() at the end of the warm-up, when the worker is idle: the models, the calibrated cost
model and the settings are there without being loaded or sent again. It never runs the model: it prices with
arithmetic, the vocabulary and the n-gram's word list, on one thread (the parent's OpenMP threads are not in
the copy, so no parallel region may start there; a CUDA context is never touched). Linux only; anywhere else,
or when the copy fails or dies, requests are priced in the server as before.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, ContextManager

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ..decode import decode
from ..errors import ServiceError
from ..inputs import rescore_work, score_work
from ..model import Models
from ..settings import Settings
from .state import EarlyChecks, Service, request_deadline

log = logging.getLogger("smallstate_lm.service")

PRICE_BYTES = 64 * 1024  # bodies at least this large are priced in the copy: smaller ones cost less than its round trip
# how long a body waits for a copy while all price others: a body takes a copy 60-100 ms under load, and pricing it
# in the server instead (what the wait ends in) took 150-250 ms there
WAIT_S = 0.15
ANSWER_S = 10.0  # a copy that has not answered by then is taken to be stuck: stopped, and not asked again

Priced = tuple[float, float]  # a request let in: its predicted seconds, and of them its lattices' upper bound


class _Copy:
    """One forked copy and the server's end of its pipe. `others`: the server's ends of the copies forked before
    it, which it closes (or a copy would keep another's pipe open, which then never sees the server go)."""

    def __init__(self, ctx, models: Models, settings: Settings, others: list):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, [*others, self.conn], models, settings), daemon=True,
                                name="smallstate-pricer")
        self.proc.start()
        child.close()

    def ask(self, head: tuple, raw: bytes) -> Any:
        """The copy's answer; a copy that takes longer than ANSWER_S, reading the body or pricing it, is killed
        (the pipe then fails on both ends: no thread waits on it for good)."""
        watchdog = threading.Timer(ANSWER_S, self.proc.kill)
        watchdog.start()
        try:
            self.conn.send(head)
            self.conn.send_bytes(raw)
            if not self.conn.poll(ANSWER_S):
                raise TimeoutError(f"no answer in {ANSWER_S:g} s")
            return self.conn.recv()
        finally:
            watchdog.cancel()

    def close(self) -> None:
        self.conn.close()

    def stop(self) -> None:
        self.close()
        self.proc.join(1.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)


class Pricer:
    """`n` forked copies, each pricing one body at a time (`price`). A copy that fails is stopped and not used
    again."""

    def __init__(self, models: Models, settings: Settings, n: int):
        ctx = multiprocessing.get_context("fork")
        self.copies: list[_Copy] = []
        try:
            for _ in range(n):
                self.copies.append(_Copy(ctx, models, settings, [c.conn for c in self.copies]))
        except OSError:
            self.close()
            raise
        self._free: queue.Queue[_Copy] = queue.Queue()
        for c in self.copies:
            self._free.put(c)
        self._live = n
        self._failures = threading.Lock()  # copies fail on any thread-pool thread: one count, never a lost one

    @property
    def alive(self) -> bool:
        return self._live > 0

    def price(self, kind: str, raw: bytes, deadline: float, timeout: float, slice_s: float, backlog: float | None,
              held: Callable[[], ContextManager] = contextlib.nullcontext,
              timed: Callable[[str, float], None] = lambda stage, seconds: None) -> ServiceError | Priced | None:
        """The refusal the server's own preparation of `raw` (a `kind` request: "rescore" or "score") would end
        in, with its deadline at `deadline` (time.perf_counter) and the long work queued ahead `backlog`
        (`Service.long_backlog`); else its prediction (`Priced`); None when it could not be priced (a body not
        of the request's structure, every copy busy for WAIT_S or until the deadline, or the copy failed). `held()`
        is entered while a copy prices it; `timed(stage, seconds)` is told the wait for a free copy ("wait") and the
        copy's answer ("price"). Runs on a thread-pool thread to its end (a cancelled request's copy still comes
        back)."""
        t0 = time.perf_counter()
        try:
            copy = self._free.get(timeout=max(0.0, min(WAIT_S, deadline - time.perf_counter())))
        except queue.Empty:
            copy = None
        t1 = time.perf_counter()
        timed("wait", t1 - t0)
        if copy is None:
            return None
        try:
            with held():
                answer = copy.ask((kind, deadline - time.perf_counter(), timeout, slice_s, backlog), raw)
            timed("price", time.perf_counter() - t1)
        except Exception as e:  # a dead or stuck copy, a broken pipe, an answer that does not unpickle
            with self._failures:
                self._live -= 1
                left = f"{self._live} left" if self._live else "requests are priced in the server from now on"
            log.warning("a pricing process failed (%s: %s); %s", type(e).__name__, e, left)
            copy.stop()
            return None
        self._free.put(copy)
        return answer

    def close(self) -> None:
        self._live = 0
        for c in self.copies:  # every end first: a copy exits once its own is closed
            c.close()
        for c in self.copies:
            c.stop()


async def refuse_if_priced_out(svc: Service, kind: str, raw: bytes, request: Request, timeout: float) -> None:
    """Raise the refusal the pricing process found for the large body `raw` of a `kind` request ("rescore" or
    "score"), or the 503 that the long work queued ahead gives its prediction (`Service.check_backlog`), before the
    server prepares any of it. Nothing for small bodies, without a pricer, or for a body it could not price."""
    pricer = svc.pricer
    if pricer is None or not pricer.alive or len(raw) < PRICE_BYTES:
        return
    deadline = request_deadline(request, timeout)
    # on a CPU the model's steps and the pricing share the cores: the worker waits between two steps meanwhile
    held = functools.partial(svc.batcher.held, svc.models.device.type == "cpu")
    answer = await run_in_threadpool(pricer.price, kind, raw, deadline, timeout, svc.batcher.slice_s,
                                     svc.long_backlog(), held, svc.metrics.observe_pricing)
    if answer is None:
        svc.metrics.priced.labels("unpriced").inc()
        return
    if isinstance(answer, ServiceError):
        svc.metrics.priced.labels("refused").inc()
        raise answer
    try:
        svc.check_backlog(*answer, deadline - time.perf_counter())  # as `Service._admit` will
    except ServiceError:
        svc.metrics.priced.labels("refused").inc()
        raise
    svc.metrics.priced.labels("let_in").inc()


def start_pricer(models: Models, settings: Settings) -> Pricer | None:
    """A pricer for the warmed-up `models`, or None where there is none (not Linux, or fork failed)."""
    if not sys.platform.startswith("linux") or settings.pricers < 1:
        return None
    try:
        return Pricer(models, settings, settings.pricers)
    except OSError as e:
        log.warning("no pricing process (%s); requests are priced in the server", e)
        return None


def _serve(conn, server_ends: list, models: Models, settings: Settings) -> None:
    """The copy's loop: a request's head and body in, its price out, until the server closes the pipe."""
    import torch

    torch.set_num_threads(1)  # first: the server's OpenMP threads are not in the copy
    for end in server_ends:  # or this copy would hold its own pipe (or another's) open and never see the server go
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C or a SIGTERM is the server's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # the server's event loop's: not this process's to write to
    # A body's objects are built in one go and freed in one go: collections while it is priced walk its growing
    # objects again and again (a 2 MB list request's pricing went from ~70 to ~100 ms at the median, 170 ms at the
    # tail). One collection after each answer frees the cycles that an error's traceback makes.
    gc.disable()
    while True:
        try:
            kind, remaining, timeout, slice_s, backlog = conn.recv()
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        early = EarlyChecks(time.perf_counter() + remaining, timeout, "utterances", slice_s, backlog)
        answer = _price(kind, raw, models, settings, early)
        try:
            conn.send(answer)
        except (EOFError, OSError):
            os._exit(0)
        except Exception:  # an answer that does not pickle: unpriced
            conn.send(None)
        del raw, answer
        gc.collect()


def _price(kind: str, raw: bytes, models: Models, settings: Settings, early: EarlyChecks) -> Any:
    # the words' own checks are the server's, for a body it lets in: one over a limit is refused whatever its words
    body = decode("RescoreRequest" if kind == "rescore" else "ScoreRequest", raw, words=False)
    if body is None:
        return None  # not of the request's structure: the server words the error
    try:
        work = (rescore_work(body, models, settings, early, priced_only=True) if kind == "rescore"
                else score_work(body, models, settings))
    except ServiceError as e:
        return e
    except Exception:  # whatever else goes wrong is the server's own preparation's to report
        return None
    return (work.seconds, work.lattice_seconds)

