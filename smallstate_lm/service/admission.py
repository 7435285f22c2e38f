"""The admission rules, shared by the engine (which admits each request against the backlog it alone sees) and
the front-ends (which refuse a large request early, as they prepare it, with the backlog the engine last put on
the board): a request is refused before any work when its answer cannot come in time."""

from __future__ import annotations

import math

from .errors import CostLimitError, Unavailable

# A request is admitted when its predicted seconds times this fit in what is left of its deadline: the worker
# turns to newer requests between its steps, so a long request gets less than all of it.
HEADROOM = 1.5
# A long request waits for the long work ahead of it and its own work times this: its class gets every other slice
# while small requests flow (2), and the predictions of lattices are rough (2).
LONG_WAIT = 4.0


def check_lists(lists: float, remaining: float, timeout: float, field: str) -> None:
    """413 for hypothesis lists predicted to take `lists` seconds when `remaining` seconds are left of the
    request's deadline of `timeout`: they must fit with room for the requests that share the worker."""
    if lists * HEADROOM > remaining:
        raise CostLimitError(f"the request's hypothesis lists would take about {lists:.1f} s on this server "
                             f"(predicted by its cost model), more than its deadline allows ({remaining:.1f} s "
                             f"left of {timeout:g} s, of which the worker shares a part with other requests)",
                             field, timeout)


def check_backlog(backlog: float | None, own: float, remaining: float, what: str | None = None) -> None:
    """503 when the long work queued ahead (`backlog`; None: the worker is not busy) and a long request's own `own`
    seconds (`what`, in words), x LONG_WAIT, take more than the `remaining` seconds of its deadline."""
    if backlog is not None and (backlog + own) * LONG_WAIT > remaining:
        what = what or f"this request about {own:.1f} s"
        raise Unavailable(f"overloaded: the work queued ahead needs about {backlog:.1f} s and {what}, more than its "
                          f"deadline allows ({remaining:.1f} s left); retry later",
                          retry_after=max(1, math.ceil(backlog)))


def long_backlog(long: float, small: float, slice_s: float) -> float | None:
    """The long work (`long` worker seconds queued and started) a long request queues behind while the worker is
    busy (either class's work passes one slice); None while it is not (a long request is let in)."""
    return long if long > slice_s or small > slice_s else None


def expected_seconds(seconds: float, lattice_seconds: float, lattice_ratio: float) -> float:
    """What the worker is expected to spend on work predicted to take `seconds`, `lattice_seconds` of them its
    lattices' upper bound: hypothesis lists as predicted, lattices at the share of their upper bound that this
    server's lattices have taken so far (`lattice_ratio`)."""
    return seconds - lattice_seconds + lattice_ratio * lattice_seconds


def admit(seconds: float, lattice_seconds: float, remaining: float, timeout: float, field: str, slice_s: float,
          backlog: float | None, lattice_ratio: float) -> None:
    """The refusals of a request predicted to take `seconds` (`lattice_seconds` of them its lattices' upper bound)
    with `remaining` seconds of its deadline of `timeout` left, behind `backlog` (`check_backlog`): 413 when its
    lists alone cannot meet the deadline, 503 when a long request would wait too long behind the long work. The
    engine decides with its own backlog; a front-end asks first with the one on the board, so that a request
    refused anyway is not sent."""
    check_lists(seconds - lattice_seconds, remaining, timeout, field)
    if seconds > slice_s:
        check_backlog(backlog, expected_seconds(seconds, lattice_seconds, lattice_ratio), remaining)
