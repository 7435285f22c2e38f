"""What every process of the service reads at a glance, without asking anyone: a small board of numbers in shared
memory (a file in the service's run directory, mapped by each process). The engine writes its pid, whether it is
ready and the long work it has queued; each front-end whether it is ready, and how many scoring requests it has
received and handed on (to the engine, or answered before that) so far. Each slot has one writer (the supervisor
settles a dead front-end's), and a float64 is written whole: no locks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .admission import long_backlog

ENGINE_PID, ENGINE_READY, LONG_BACKLOG, SHORT_BACKLOG, SLICE_S = range(5)
HEAD = 8  # slots before the front-ends' (ready, received, handed on)
PER = 3


class Board:
    def __init__(self, path: str | Path, frontends: int, create: bool = False):
        if create:
            np.zeros(HEAD + PER * frontends, dtype=np.float64).tofile(path)
        self.frontends = frontends
        self.a = np.memmap(path, dtype=np.float64, mode="r+", shape=(HEAD + PER * frontends,))

    # ---- the engine's slots ---------------------------------------------------------------------
    def engine(self, pid: int, ready: bool) -> None:
        self.a[ENGINE_PID] = pid
        self.a[ENGINE_READY] = 1.0 if ready else 0.0

    @property
    def engine_pid(self) -> int:
        return int(self.a[ENGINE_PID])

    @property
    def engine_ready(self) -> bool:
        return bool(self.a[ENGINE_READY])

    def backlog(self, long: float, short: float, slice_s: float) -> None:
        self.a[LONG_BACKLOG], self.a[SHORT_BACKLOG], self.a[SLICE_S] = long, short, slice_s

    def long_backlog(self) -> float | None:
        """The engine's long work queued and started, in worker seconds, while it is busy (what a long request
        queues behind); None while it is not (`admission.long_backlog`, from the engine's last numbers)."""
        return long_backlog(float(self.a[LONG_BACKLOG]), float(self.a[SHORT_BACKLOG]), float(self.a[SLICE_S]))

    # ---- the front-ends' slots ------------------------------------------------------------------
    def frontend_ready(self, i: int, ready: bool) -> None:
        self.a[HEAD + PER * i] = 1.0 if ready else 0.0

    def all_ready(self) -> bool:
        return bool(self.a[ENGINE_READY]) and all(self.a[HEAD : HEAD + PER * self.frontends : PER])

    def counts(self, i: int) -> tuple[int, int]:
        """Front-end `i`'s scoring requests received and handed on so far."""
        return int(self.a[HEAD + PER * i + 1]), int(self.a[HEAD + PER * i + 2])

    def set_counts(self, i: int, received: int, handed: int) -> None:
        self.a[HEAD + PER * i + 1], self.a[HEAD + PER * i + 2] = received, handed

    def settle(self, i: int) -> None:
        """A dead front-end's requests will never be handed on: none is on its way in any more."""
        self.a[HEAD + PER * i + 2] = self.a[HEAD + PER * i + 1]

    def received(self) -> int:
        """Scoring requests every front-end has received so far."""
        return int(self.a[HEAD + 1 : HEAD + PER * self.frontends : PER].sum())

    def handed(self) -> int:
        """Scoring requests every front-end has handed on (to the engine, or answered before that) so far."""
        return int(self.a[HEAD + 2 : HEAD + PER * self.frontends : PER].sum())
