"""What front-ends and the engine say to each other, and how it crosses between the processes.

A front-end sends prepared work (`Submit`: hypothesis lists as token-id arrays, prepared lattices as arrays) and
`Cancel`s; the engine answers each submit once, with `Scored` (per list its neural log-probs as one array, per
lattice its expanded graph as arrays) or `Refused` (an error for the client, decided from the engine's global view
of the work: admission, deadlines, shutdown). Never JSON.

A message crosses as zmq frames: a pickle of protocol 5, in which every array is its raw bytes (never walked
element by element), with each array of OUT_OF_BAND bytes or more as a frame of its own, not copied into the
pickle (`to_frames` / `from_frames`); on the way in those are views of the received frames (read-only). Why this
way and not another (shared memory, all out of band, all in band): docs/architecture.md, measured by
benchmarks/bench_messages.py.
"""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from smallstate_lm.rescoring.expand.expanded import ExpandedLattice
from smallstate_lm.rescoring.lattices.lattice import Lattice
from smallstate_lm.scoring.trie import TreeSize
from smallstate_lm.weights import Weights

from .cost import CostModel
from .errors import ServiceError

# Arrays at least this large cross as frames of their own (a 1.6 MB list: 4x faster than inside the pickle);
# smaller ones inside it, where their copy costs less than a frame's own handling (at 64 KiB a lattice's
# messages were 20% slower as frames; benchmarks/bench_messages.py).
OUT_OF_BAND = 2**20


def engine_address(rundir: str | Path) -> str:
    """Where the engine listens: a socket file in the service's run directory."""
    return f"ipc://{Path(rundir) / 'engine.sock'}"


def to_frames(msg: Any) -> list:
    """`msg` as zmq frames: the pickle, then each out-of-band buffer (arrays of OUT_OF_BAND bytes and more)."""
    buffers: list[memoryview] = []

    def place(buffer: pickle.PickleBuffer) -> bool:  # True: in band
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND:
            return True
        buffers.append(raw)
        return False

    head = pickle.dumps(msg, protocol=5, buffer_callback=place)
    return [head, *buffers]


def from_frames(frames: list) -> Any:
    """The message of `to_frames`' frames (bytes, or zmq Frames received without a copy)."""
    return pickle.loads(frames[0], buffers=frames[1:])


@dataclass
class Hello:
    """A front-end introduces itself (again after the engine restarted)."""

    frontend: int


@dataclass
class Welcome:
    """The engine's answer to `Hello`: what a front-end prices and describes requests with."""

    pid: int
    cost: CostModel  # calibrated on the engine's device
    info: dict  # /v1/models
    lattice_ratio: float


@dataclass
class ListJob:
    """One hypothesis list as the neural LM sees it (any context words first)."""

    tokens: np.ndarray  # (T,) int64: each hypothesis' word ids followed by </s>, end to end
    lens: np.ndarray  # (H,) int64: tokens per hypothesis (with </s>)
    seconds: float  # predicted by the cost model
    depth: int  # tokens of its longest hypothesis
    tree: TreeSize | None = None  # its trie's size, when prefixes are shared

    @functools.cached_property
    def sequences(self) -> list[list[int]]:
        """The hypotheses as the scorer takes them (worked out once, where they are scored)."""
        return [s.tolist() for s in np.split(self.tokens, np.cumsum(self.lens)[:-1])]


@dataclass
class LatticeJob:
    lattice: Lattice  # prepared
    field: str  # the request field it came from (for errors)
    seconds: float  # predicted: an upper bound
    nbytes: int  # predicted peak bytes
    context: list[list[str]] | None = None  # sentences said before it: its LMs start after them


@dataclass
class SessionCall:
    """A session operation (`sessions.SessionStore`): create (with `k`), describe, delete, acquire (with
    `lease_s`: the engine answers when it is this request's turn) or release (with `lease` and the chosen
    transcript `said`, None when the request failed). The engine answers each but release with a
    `SessionReply`."""

    id: int
    op: Literal["create", "describe", "delete", "acquire", "release"]
    scope: str
    name: str
    k: int = 1
    lease_s: float = 0.0
    lease: str = ""  # acquire, release: the request's lease id, unique to it
    said: list[str] | None = None


@dataclass
class SessionReply:
    id: int
    value: Any = None  # create/describe: the session's description; acquire: the context sentences
    error: BaseException | None = None


@dataclass
class Submit:
    """A request's work for the engine; `remaining` seconds of its deadline are left when it is sent."""

    id: int
    kind: Literal["rescore", "score"]
    weights: Weights
    lists: list[ListJob]
    lattices: list[LatticeJob]
    cost: int  # tokens: its share of a batch
    seconds: float  # predicted: lists plus the lattices' upper bound
    lattice_seconds: float
    tokens_total: int
    tokens_computed: int
    remaining: float
    timeout: float
    field: str  # the request's field for errors about it as a whole


@dataclass
class Cancel:
    """The request of `id` was given up (hang-up, deadline): its work stops."""

    id: int


@dataclass
class Scored:
    """A submit's answer. `neural`: per list, its hypotheses' token log-probs end to end (None without a neural
    LM); `lattices`: per lattice, its expansion (its `source` left out: the front-end has it) or, where it failed
    alone, the error for its field."""

    id: int
    neural: list[np.ndarray] | None
    lattices: list[ExpandedLattice | ServiceError] = field(default_factory=list)
    batch_size: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0
    lattice_ratio: float = 0.1


@dataclass
class Refused:
    id: int
    error: BaseException  # a ServiceError for the client, or a RuntimeError for a bug (500)


def portable(e: BaseException) -> BaseException:
    """`e` as it may cross: a client's error as it is (without its frames), anything else as a RuntimeError
    naming it (its traceback stays in the engine's log)."""
    if isinstance(e, ServiceError):
        e.__traceback__ = None
        e.__context__ = e.__cause__ = None
        return e
    return RuntimeError(f"{type(e).__name__}: {e}")
