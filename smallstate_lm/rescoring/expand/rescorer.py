"""Lattice rescoring by history-merged expansion: `build_rescorer` and the `LatticeRescorer` it builds.

An expanded state is (lattice state, LM history key): the last n-1 words with `max_ngram_order=n`
(histories sharing them merge, the best one kept, as in Kaldi's pruned RNNLM rescoring), or the whole word
history when exact. Lattice states are visited level by level in topological order (a level holds states
with no arc between them), and every LM step a level needs, one per (expanded state, word), goes through
the neural LM in one batched `score` call, its parent states gathered with `select()`. Every arc of the
expanded graph keeps its score components, so a sweep of weights re-runs only the searches over that graph.

Where each part lives: the result (`expanded.py`), per-lattice preparation (`prepare.py`), the level engine
(`frontier.py`), the interned ids and n-gram answers (`lm_cache.py`), the graph searches (`lattices/graph.py`); this
module holds the rescorer, its LM calls and the schedule that feeds lattices through the engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import ConfigError, SmallstateError
from ...ngram import NgramLM
from ...subword import WordTable
from ...vocab import Vocabulary
from ...weights import Weights
from ..lattices.lattice import Lattice
from .expanded import ExpandedLattice, ExpandStats
from .frontier import Frontier, LevelBudget, Paths, Queries, Run, Scores
from .lm_cache import LmCache
from .prepare import LatticeJob, prepare_group

# ExpandedLattice and ExpandStats are imported from here by the drivers
__all__ = ["ExpandConfig", "ExpandStats", "ExpandedLattice", "LatticeRescorer", "build_rescorer"]


@dataclass(frozen=True)
class LmStart:
    """Where a lattice's paths start instead of `<s>`: the neural LM's state after a context (one row; None:
    `<s>`), how many positions that state holds beyond `<s>`, and the n-gram's state (None: `<s>`)."""

    neural: object = None
    positions: int = 0
    ngram: object = None


@dataclass
class ExpandConfig:
    max_ngram_order: int | None = 4  # None: exact histories
    beam: float = 12.0  # cost units of the combined score, against the level's best estimate
    max_per_state: int = 64  # expanded states kept per lattice state
    max_states: int = 200_000  # per lattice; beyond it pruning tightens (and says so)
    # lattices expanded together, so that one LM call and one set of array operations serve all their
    # levels; None: 16 with a neural LM (its states are held for all of them), 256 with the n-gram alone
    batch_lattices: int | None = None
    # neural LM state bytes one level of one lattice may create (its LM steps x their history's positions x
    # bytes per position); beyond it the level keeps only its best states (and says it pruned harder), so
    # a lattice built wide (thousands of words after every history) cannot take all of a server's memory.
    # None: no bound
    max_level_bytes: int | None = None
    # each lattice's own best path (the decoder's transcript) found while preparing it, for the first pass's
    # WER beside the rescored one; a run without references does without
    first_pass: bool = True

    def __post_init__(self):
        if self.max_ngram_order is not None and self.max_ngram_order < 1:
            raise ConfigError(f"max_ngram_order must be >= 1, got {self.max_ngram_order}")
        if self.beam <= 0 or self.max_per_state < 1 or self.max_states < 1 or (self.batch_lattices or 1) < 1 \
                or (self.max_level_bytes or 1) < 1:
            raise ConfigError("beam, max_per_state, max_states, batch_lattices and max_level_bytes must be positive")

    def lattices_per_batch(self, neural: bool) -> int:
        return self.batch_lattices or (16 if neural else 256)


class LatticeRescorer:
    """Expands lattices with a neural LM and/or an n-gram under given weights.

    `expand_many` advances up to `cfg.batch_lattices` lattices together, level by
    level, so each LM call carries the steps of all of them: one lattice level alone
    holds too few steps to keep a CPU's caches or a GPU busy.

    History keys and n-gram states are interned as integers for the rescorer's life, and
    KenLM is asked once per (n-gram state, word): lattices of one run share their words.
    """

    def __init__(self, weights: Weights, model=None, vocab: Vocabulary | None = None, ngram: NgramLM | None = None,
                 config: ExpandConfig | None = None, device="cpu"):
        if model is None and ngram is None:
            raise ConfigError("lattice rescoring needs a neural LM, an n-gram, or both")
        if model is not None and vocab is None:
            raise ConfigError("a neural LM needs its vocabulary")
        self.w, self.model, self.vocab, self.ngram = weights, model, vocab, ngram
        # A subword LM's tokens for words are rows of a table of their pieces: an arc feeds its word whole.
        self.words = WordTable(vocab) if vocab is not None and vocab.subword else None
        self.cfg = config or ExpandConfig()
        self.device = device
        self.state_bytes = (0, 0)  # LM state bytes per position and per row
        if model is not None:  # an n-gram-only run never imports torch
            import torch

            self.device = torch.device(device)
            size = next(model.parameters()).element_size()
            self.state_bytes = (model.state_numel_per_position() * size, model.state_numel_fixed() * size)
        self.lm_calls = 0
        # rows of one LM call at a step (None: a level in one call); with `pause`, expand_many yields
        # between the calls of a level, so a server can bound the time between two of its checks
        self.rows_per_call: Callable[[int], int] | None = None
        self.cache = LmCache(ngram, self.cfg.max_ngram_order)

    def with_weights(self, w: Weights) -> LatticeRescorer:
        """This rescorer under other weights, sharing its cache: no weight enters the interned words, history
        keys, n-gram states or KenLM's answers, while the weights are read all along an expansion, so each
        caller whose weights differ (the service's batches, which take turns) expands with its own copy."""
        other = copy.copy(self)
        other.w = w
        return other

    def level_budget(self) -> LevelBudget | None:
        """The bound on a level's new neural LM state (None: no neural LM, or no bound)."""
        if self.model is None or self.cfg.max_level_bytes is None:
            return None
        return LevelBudget(self.cfg.max_level_bytes, *self.state_bytes)

    def context_start(self, sentences, ngram_context: bool = False) -> LmStart | None:
        """The start of a lattice said after `sentences` (oldest first; see `scoring.context`): the neural LM's
        state after them; the n-gram's too with `ngram_context` (else it starts at `<s>`). None: no context."""
        if not sentences:
            return None
        from ...scoring.context import context_tokens, neural_start, ngram_start

        tokens = context_tokens(self.vocab, sentences) if self.model is not None else []
        return LmStart(neural_start(self.model, tokens, self.device) if tokens else None, len(tokens),
                       ngram_start(self.ngram, sentences) if ngram_context and self.ngram is not None else None)

    def expand(self, lat: Lattice, start: LmStart | None = None) -> ExpandedLattice:
        return next(iter(self.expand_many([lat], starts={0: start} if start is not None else None)))[1]

    def expand_many(self, lats, on_error=None, should_stop=None, pause: bool = False, batch: int | None = None,
                    starts=None):
        """Yield (index, ExpandedLattice) as lattices finish (not in input order).
        `lats` may be an iterable of Lattice or of callables returning one; a
        SmallstateError from preparing one is passed to `on_error(index, error)`
        (raised when no handler is given) and that lattice is skipped.

        `should_stop(index) -> bool` is asked before a lattice starts and between levels:
        True drops it (nothing is yielded for it) and frees its states, so a server stops
        the work of a request that was cancelled or timed out. With `pause`, None is also
        yielded after every level and between the LM calls of a level (`rows_per_call`): a caller
        may stop there, do other work, and resume; a lattice stopped between two calls of a level
        has no more rows computed. `batch`: at most this many lattices in flight (default
        `cfg.lattices_per_batch`), e.g. fewer where their LM states would not fit in memory together.
        `starts`: {index: LmStart} for lattices said after a context (`context_start`); the others start at
        `<s>`."""
        yield from _Schedule(self, lats, on_error, should_stop, pause, batch, starts).results()

    def _lm_call(self, obj: np.ndarray, row: np.ndarray, tok: np.ndarray, objs: dict[int, object],
                 new_obj: int) -> np.ndarray:
        """One batched LM step for rows of the lattices' level: log-probs per row, the new state stored as
        `new_obj`."""
        import torch

        with torch.no_grad():
            if self.words is None:
                tokens = torch.as_tensor(tok, dtype=torch.long, device=self.device)[:, None]
                logp, new_state = self.model.score(tokens, self._gather(obj, row, objs))
                logp = logp[:, 0]
            else:  # each row its word's pieces, the state after the last of them
                pieces, counts = self.words.rows(tok.tolist())
                logp, new_state = self.model.score(torch.tensor(pieces, dtype=torch.long, device=self.device),
                                                   self._gather(obj, row, objs),
                                                   torch.tensor(counts, dtype=torch.long, device=self.device))
                logp = logp.double().sum(1)
            objs[new_obj] = new_state.compact()
        self.lm_calls += 1
        return logp.double().cpu().numpy()

    def _gather(self, obj: np.ndarray, row: np.ndarray, objs: dict[int, object]):
        """One state with row i = row[i] of state object obj[i]."""
        import torch

        uniq, first = np.unique(obj, return_index=True)
        uniq = uniq[np.argsort(first)]  # pieces in order of first use
        if len(uniq) == 1 and np.array_equal(row, np.arange(objs[int(uniq[0])].batch_size)):
            return objs[int(uniq[0])]
        pieces = []
        for o in uniq.tolist():
            at = np.flatnonzero(obj == o)
            pieces.append((objs[o], torch.as_tensor(row[at], device=self.device),
                           torch.as_tensor(at, device=self.device)))
        return type(pieces[0][0]).assemble(pieces, len(obj)).compact()


class _Schedule:
    """One `expand_many` call: lattices join the run while fewer than a batch are in flight (at the step
    the run has reached), every step expands one level of each of them through the frontier, and
    a lattice leaves, its result yielded, after its last level. Neural LM states live in numbered objects
    (`objs`, one per LM call) for as long as a waiting path points into them."""

    def __init__(self, r: LatticeRescorer, lats, on_error, should_stop, pause: bool, batch: int | None = None,
                 starts=None):
        self.r, self.on_error, self.should_stop, self.pause = r, on_error, should_stop, pause
        self.starts = starts or {}
        self.source = iter(enumerate(lats))
        self.batch = batch or r.cfg.lattices_per_batch(r.model is not None)
        self.run = Run()
        self.active: list[LatticeJob] = []
        self.frontier: Frontier | None = None
        self.objs: dict[int, object] = {}
        self.next_obj = 0
        if r.model is not None:
            self.objs[0] = r.model.initial_state(1, r.device)  # the <s> history every lattice starts from
            self.next_obj = 1

    def results(self):
        step = 0
        while True:
            self._fill(step)
            if not self.active:
                return
            if self.frontier is None:
                self.frontier = Frontier(self.active, self.run, self.r.w, self.r.level_budget())
            q = self.frontier.prepare(step, self.r.cfg.max_states)
            nn, new_at, halted = yield from self._neural(step, q)
            self.frontier.count_level(q.per_lattice, nn is not None, sum(o.nbytes for o in self.objs.values()))
            self.frontier.finish(step, self._scores(q, nn, new_at))
            yield from self._leave(step, halted)
            step += 1
            if self.r.model is not None:
                refs_live = {0} | self.run.state_refs()
                for k in list(self.objs):
                    if k not in refs_live:
                        del self.objs[k]
            if self.pause:
                yield None

    def _fill(self, step: int) -> None:
        """Lattices join until a batch is in flight or the input ends; the frontier is rebuilt around them."""
        joined: list[LatticeJob] = []
        while len(self.active) + len(joined) < self.batch:
            taken = self._take(self.batch - len(self.active) - len(joined))
            if not taken:
                break
            joined += self._join(taken, step)
        if joined:
            if self.frontier is not None:
                self.frontier.sync()
            self.active += joined
            self.frontier = None

    def _take(self, n: int) -> list[LatticeJob]:
        """Up to n lattices from the input, those that are not stopped and prepare without error."""
        cfg, out = self.r.cfg, []
        for i, item in self.source if n > 0 else ():
            if self.should_stop is None or not self.should_stop(i):
                try:
                    out.append(LatticeJob(item() if callable(item) else item, i, cfg.max_per_state, cfg.beam))
                except SmallstateError as e:
                    if self.on_error is None:
                        raise
                    self.on_error(i, e)
            if len(out) == n:
                break
        return out

    def _join(self, jobs: list[LatticeJob], step: int) -> list[LatticeJob]:
        """Start lattices at `step`: their arrays, and a path at each start state. A lattice whose arrays
        cannot be made (a SmallstateError) goes to `on_error(index, error)` (raised without one) and is
        left out; the others start."""
        r = self.r
        try:
            prepare_group(jobs, r.w, r.vocab, r.cache, r.cfg.first_pass, r.words)
        except SmallstateError as e:
            if len(jobs) > 1:  # one at a time, to find which
                return [x for one in jobs for x in self._join([one], step)]
            if self.on_error is None:
                raise
            self.on_error(jobs[0].run, e)
            return []
        for x in jobs:
            ng = r.cache.initial_ngram_state()
            obj = 0 if r.model is not None else -1
            given = self.starts.get(x.run)
            if given is not None and given.neural is not None and r.model is not None:
                obj, self.next_obj = self.next_obj, self.next_obj + 1  # freed with the last path that reads it
                self.objs[obj] = given.neural
                x.context_positions = given.positions
            if given is not None and given.ngram is not None and r.ngram is not None:
                ng = r.cache.ngram_state_id(given.ngram)
            x.start_step, x.first_arrival = step, self.run.n_arrivals
            start = Paths(*(np.array([v], dtype=np.int64) for v in (x.run, 0, 0, obj, 0 if obj >= 0 else -1, ng)),
                          arrival=self.run.arrivals(1), cost=np.zeros(1))
            self.run.add(step + int(x.prep.level[0]), start)
        return jobs

    def _neural(self, step: int, q: Queries):
        """The neural LM's log-probs of the level's steps, in calls of `rows_per_call` rows (pausing between
        them), and where each step's new state is: (log-probs, (state object, row)) or (None, None) without a
        neural LM; and the lattices stopped meanwhile, whose rows were not computed."""
        r, halted = self.r, set()
        if r.model is None or not len(q.token):
            return None, None, halted
        lp = np.zeros(len(q.token))
        new_at = (np.full(len(q.token), -1, dtype=np.int64), np.full(len(q.token), -1, dtype=np.int64))
        rows = max(1, r.rows_per_call(step)) if r.rows_per_call is not None else len(q.token)
        for a in range(0, len(q.token), rows):
            part = np.arange(a, min(a + rows, len(q.token)))
            if a > 0 and self.pause:  # a wide level is not one unstoppable call
                yield None
                if self.should_stop is not None:
                    halted |= {x.run for x in self.active if x.run not in halted and self.should_stop(x.run)}
            if halted:
                part = part[~np.isin(q.run[part], list(halted))]
                if not len(part):
                    continue
            lp[part] = r._lm_call(q.obj[part], q.row[part], q.token[part], self.objs, self.next_obj)
            new_at[0][part], new_at[1][part] = self.next_obj, np.arange(len(part))
            self.next_obj += 1
        return lp, new_at, halted

    def _scores(self, q: Queries, nn: np.ndarray | None, new_at) -> Scores:
        """The level's answers: the neural ones computed, the n-gram's and the history keys looked up."""
        n = len(q.token)
        ng, ng_next = self.r.cache.ngram_steps(q.ng, q.gword)
        key_next = self.r.cache.child_keys(q.key, q.word, q.gword)
        obj, row = new_at if new_at is not None else (np.full(n, -1, dtype=np.int64),) * 2
        return Scores(nn=nn if nn is not None else np.zeros(n), ng=ng, ng_next=ng_next, key_next=key_next,
                      obj=obj, row=row)

    def _leave(self, step: int, halted: set[int]):
        """Lattices whose last level this was leave, their results yielded (a SmallstateError goes to
        `on_error`); stopped ones leave with nothing. The frontier keeps their slots (their rows are
        skipped) until the next lattice joins."""
        f = self.frontier
        done = np.flatnonzero((f.last_step == step) & f.alive & ~np.isin(f.runs, list(halted)))
        stopped = ([x for x in self.active if x.run in halted or (x.last_step > step and self.should_stop(x.run))]
                   if self.should_stop is not None else [])
        if not len(done) and not stopped:
            return
        f.retire(done, [x.run for x in stopped])
        for k in done.tolist():
            x = f.jobs[k]
            try:
                yield x.run, self.run.result(x, self.r.w.am_scale)
            except SmallstateError as e:
                if self.on_error is None:
                    raise
                self.on_error(x.run, e)
        gone = {f.jobs[k].run for k in done.tolist()} | {x.run for x in stopped}
        self.active = [x for x in self.active if x.run not in gone]
        self.run.forget_before(min((x.start_step for x in self.active), default=step + 1),
                               min((x.first_arrival for x in self.active), default=self.run.n_arrivals))


def build_rescorer(weights: Weights, lm=None, ngram: NgramLM | None = None, config: ExpandConfig | None = None,
                   device=None) -> LatticeRescorer:
    """The one way every front end (CLI, Ray workers, the service) builds a lattice rescorer.

    `lm` is a loaded neural LM (`checkpoint.load_model`'s result: model + vocabulary) or None;
    `ngram` a KenLM model or None; `device` defaults to where the LM's weights are.
    """
    if lm is None:
        return LatticeRescorer(weights, None, None, ngram, config, device or "cpu")
    if device is None:
        device = next(lm.model.parameters()).device
    return LatticeRescorer(weights, lm.model, lm.vocab, ngram, config, device)
