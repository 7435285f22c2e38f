"""The state contract shared by every LM.

    state = lm.initial_state(batch_size, device)   # the state after `<s>`
    logp, state = lm.score(tokens, state)          # (B, T) natural-log target log-probs
    dist, state = lm.step(tokens, state)           # (B, V) next-token log-probs after the tokens
    state.select(index)                            # gather rows (beams, lattices, tries)
    state.nbytes, lm.state_numel_per_position()

A state is a value: a model never keeps history in module buffers, and `score`
never modifies the state passed in.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class LMState:
    """Base class: a frozen dataclass whose fields are tensors (or lists of them) with
    the batch as their first dimension, or None.

    Subclasses declare which fields are per-position memory (`memory_fields`): those
    are what `nbytes` counts. Per-row bookkeeping (the pending token, a validity mask)
    is not per-position model memory and is reported by `total_nbytes` only.
    """

    memory_fields = ()

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> LMState:
        """Apply `fn` to every tensor field (lists of tensors element-wise)."""
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = fn(v)
            elif isinstance(v, (list, tuple)) and v and isinstance(v[0], Tensor):
                changes[f.name] = type(v)(fn(t) for t in v)
        return dataclasses.replace(self, **changes)

    def select(self, index: Tensor | list[int]) -> LMState:
        """Rows `index` of the batch, in that order; repeats allowed (branching)."""
        first = self._tensors()[0]
        index = torch.as_tensor(index, dtype=torch.long, device=first.device)
        if index.dim() != 1:
            raise ValueError(f"select() takes a 1-D index, got shape {tuple(index.shape)}")
        return self.map_tensors(lambda t: t.index_select(0, index))

    @classmethod
    def cat(cls, states: list[LMState]) -> LMState:
        """Stack states along the batch. This default needs every tensor to have the
        same shape beyond the batch (fixed-size states such as (h, c)); states whose
        history length varies override it."""
        if len(states) == 1:
            return states[0]
        first = states[0]
        changes = {}
        for f in dataclasses.fields(first):
            vals = [getattr(st, f.name) for st in states]
            if isinstance(vals[0], Tensor):
                changes[f.name] = torch.cat(vals)
            elif isinstance(vals[0], (list, tuple)) and vals[0] and isinstance(vals[0][0], Tensor):
                changes[f.name] = type(vals[0])(torch.cat(ts) for ts in zip(*vals))
        return dataclasses.replace(first, **changes)

    @classmethod
    def assemble(cls, pieces: list[tuple[LMState, Tensor, Tensor]], n_rows: int) -> LMState:
        """Row dst[i] of the result = row src[i] of that piece's state, for each
        (state, src, dst) piece; every destination row in [0, n_rows) is filled once."""
        dst = torch.cat([d for _, _, d in pieces])
        if dst.numel() != n_rows or bool((torch.sort(dst).values != torch.arange(n_rows, device=dst.device)).any()):
            raise ValueError(f"assemble() destinations must cover rows 0..{n_rows - 1} exactly once")
        stacked = cls.cat([st.select(src) for st, src, _ in pieces])
        return stacked.select(torch.argsort(dst))

    def compact(self) -> LMState:
        """The same state with padding that no row needs removed; identity by default."""
        return self

    def detach(self) -> LMState:
        """Cut the autograd graph (carried states in stream training)."""
        return self.map_tensors(lambda t: t.detach())

    def to(self, device: torch.device | str) -> LMState:
        return self.map_tensors(lambda t: t.to(device))

    @property
    def batch_size(self) -> int:
        return self._tensors()[0].shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the per-position memory (what grows with the history)."""
        return sum(_nbytes(getattr(self, name)) for name in self.memory_fields)

    @property
    def total_nbytes(self) -> int:
        """Bytes of every tensor the state holds, bookkeeping included."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[Tensor]:
        out: list[Tensor] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(t for t in v if isinstance(t, Tensor))
        return out


def _nbytes(v) -> int:
    if v is None:
        return 0
    if isinstance(v, Tensor):
        return v.numel() * v.element_size()
    return sum(_nbytes(t) for t in v)


@runtime_checkable
class StatefulLM(Protocol):
    """What every language model in the project provides (the contract above); every class in
    `smallstate_lm.models.MODELS` satisfies it.

    Required: `cfg`, `initial_state`, `score`, `step`, `state_numel_per_position`.
    Optional capabilities are members too, never missing attributes: a model without
    one holds None (or the neutral default: `state_numel_fixed() == 0`,
    `report() == {}`), so callers test `model.score_tree is not None`, never hasattr.
    `models.base.LanguageModel` carries those defaults. Scores are natural logs.
    """

    #: The model's `ModelConfig` (architecture, sizes, vocabulary size).
    cfg: Any

    #: Tree attention, or None: score_tree(tokens (B, N), parents (B, N), lengths (B,) | None)
    #: -> (B, N) log p(node token | <s>, its ancestors) for every node of a prefix trie in
    #: one pass; parents[b, i] < i is a node's parent in its row, -1 right after `<s>`;
    #: 0 at padding. Equals `score` along each root-to-node path. `max_work_bytes=` bounds its
    #: working memory (blocks of queries over an ancestor table instead of an N x N mask);
    #: `plan=` the tree_plan of the batch when the caller has it.
    score_tree: Callable[..., Tensor] | None

    #: Present with score_tree: tree_plan(n_rows, max_nodes, total_nodes, max_depth, path_len,
    #: max_work_bytes) -> the plan (one pass or blocked) and its working bytes, before any work.
    tree_plan: Callable[..., Any] | None

    #: With score_tree, or None: the most nodes one row of score_tree should hold (its attention is dense in the
    #: nodes, so bigger tries run faster as sub-tries); None = no limit beyond the working-memory cap.
    max_tree_nodes: int | None

    #: Most positions a sequence may take, `<s>` included (a Hugging Face LM's learned or trained positions),
    #: or None: no limit. Past it `score` raises WorkLimitError.
    max_positions: int | None

    #: Full distributions, or None: log_probs_all(tokens (B, T), state, lengths | None)
    #: -> (logp (B, T, V), state after the tokens), logp[b, t] = log p(. | history,
    #: tokens[b, :t]); 0 at padding. What distillation needs of a teacher and a student.
    log_probs_all: Callable[..., tuple[Tensor, LMState]] | None

    #: Most history positions a state keeps after any call: None = unbounded (the state
    #: grows with the history), 0 = a fixed-size state. Stream training needs it bounded.
    max_history: int | None

    #: Training regulariser, or None: aux_loss() -> scalar tensor added to the
    #: per-token loss (e.g. the adaptive-span penalty).
    aux_loss: Callable[[], Tensor] | None

    #: Hook, or None: after_step() runs after every optimizer step (e.g. clamps
    #: parameters back into their range).
    after_step: Callable[[], None] | None

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> LMState:
        """The state after `<s>` for `batch_size` rows, on `device` (default: the model's)."""
        ...

    def score(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]:
        """tokens (B, T) -> (logp (B, T), state after each row's first lengths[b] tokens);
        logp[b, t] = log p(tokens[b, t] | history, tokens[b, :t]), 0 at padding."""
        ...

    def step(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]:
        """tokens (B, T), T >= 0 -> (log p(. | history, tokens) (B, V), the state `score`
        would return)."""
        ...

    def state_numel_per_position(self) -> int:
        """Numbers the state holds per row and history position (what grows)."""
        ...

    def state_numel_fixed(self) -> int:
        """Numbers per row that do not grow with the history (0: none)."""
        ...

    def report(self) -> dict:
        """Learned facts worth printing after training or `eval` ({}: none)."""
        ...


def check_tokens(tokens: Tensor, state: LMState, vocab_size: int, lengths: Tensor | None) -> Tensor | None:
    """Validate `score`/`step` arguments; returns `lengths` as a long tensor or None
    when every row is full length."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a LongTensor, got {tokens.dtype}")
    B, T = tokens.shape
    if B != state.batch_size:
        raise ValueError(f"tokens have batch {B} but the state has batch {state.batch_size}")
    if lengths is not None:
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=tokens.device)
        if lengths.shape != (B,):
            raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
        if bool((lengths < 0).any()) or bool((lengths > T).any()):
            raise ValueError(f"lengths must lie in [0, {T}]")
        if bool((lengths == T).all()):
            lengths = None
    valid = tokens if lengths is None else tokens.masked_fill(~length_mask(lengths, T), 0)
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(valid.min())}, {int(valid.max())}]")
    return lengths


def length_mask(lengths: Tensor, T: int) -> Tensor:
    """(B,) lengths -> (B, T) bool, True where t < length."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


# ---- right-aligned caches ------------------------------------------------------------
# Models whose attention depends on distance (relative positions, spans) keep each row's
# cached history as a suffix of the time axis: padding only on the left. The newest key
# then always sits right before the current query, so distances are exact for every row
# of a padded batch. Time is dim 1 of every cached tensor: (B, S, ...).


def own_storage(t: Tensor) -> Tensor:
    """`t`, copied when it is a view into a larger buffer: a state that keeps a trimmed
    view would keep the whole untrimmed buffer alive, far beyond what `nbytes` reports."""
    return t if t.untyped_storage().nbytes() <= t.numel() * t.element_size() else t.clone()


def left_pad_time(t: Tensor, S: int, value: float = 0.0) -> Tensor:
    """(B, s, ...) -> (B, S, ...) with S - s columns of `value` in front."""
    extra = S - t.shape[1]
    if extra == 0:
        return t
    pad = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
    return torch.cat([pad, t], 1)


def right_align(tensors: list[Tensor], mask: Tensor) -> tuple[list[Tensor], Tensor]:
    """Move each row's valid columns (mask True) to the end of the time axis, keeping
    their order. tensors: each (B, S, ...); mask: (B, S) bool. Returns the reordered
    tensors and mask."""
    if bool(mask.all()):
        return tensors, mask
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # (B, S): invalid first, then valid in order
    out = []
    for t in tensors:
        idx = order.view(*order.shape, *([1] * (t.dim() - 2))).expand_as(t)
        out.append(t.gather(1, idx))
    return out, mask.gather(1, order)


def keep_last(tensors: list[Tensor], mask: Tensor | None, n: int) -> tuple[list[Tensor], Tensor | None]:
    """The last `n` columns of right-aligned caches (a memory cap or a span)."""
    if tensors and tensors[0].shape[1] > n:
        tensors = [t[:, t.shape[1] - n:] for t in tensors]
        mask = None if mask is None else mask[:, mask.shape[1] - n:]
    return tensors, mask


def drop_empty_columns(tensors: list[Tensor], mask: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
    """Cut the leading columns that are padding in every row of right-aligned caches."""
    if mask is None:
        return tensors, None
    if bool(mask.all()):
        return tensors, None
    n = int(mask.sum(1).max()) if mask.numel() else 0
    tensors, mask = keep_last(tensors, mask, n)
    return tensors, (None if bool(mask.all()) else mask)


def cat_right_aligned(parts: list[tuple[list[Tensor], Tensor | None]]) -> tuple[list[Tensor], Tensor | None]:
    """Stack right-aligned caches along the batch, left-padding shorter histories.
    parts: per state, (its cached tensors (B_i, S_i, ...), its mask (B_i, S_i) or None)."""
    S = max(ts[0].shape[1] for ts, _ in parts)
    n = len(parts[0][0])
    tensors = [torch.cat([left_pad_time(ts[i], S) for ts, _ in parts]) for i in range(n)]
    masks = []
    for ts, m in parts:
        B, s = ts[0].shape[0], ts[0].shape[1]
        m = m if m is not None else torch.ones(B, s, dtype=torch.bool, device=ts[0].device)
        masks.append(left_pad_time(m, S, False))
    mask = torch.cat(masks)
    return tensors, (None if bool(mask.all()) else mask)


def append_right_aligned(old: list[Tensor], old_mask: Tensor | None, new: list[Tensor],
                         lengths: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
    """Append T new columns per row (only the first lengths[b] of row b are real) to
    right-aligned caches and re-align. old: (B, S, ...), new: (B, T, ...)."""
    tensors = [torch.cat([o, n], 1) for o, n in zip(old, new)]
    if old_mask is None and lengths is None:
        return tensors, None
    B, S, T = new[0].shape[0], old[0].shape[1], new[0].shape[1]
    dev = new[0].device
    om = old_mask if old_mask is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
    nm = length_mask(lengths, T) if lengths is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
    tensors, mask = right_align(tensors, torch.cat([om, nm], 1))
    return drop_empty_columns(tensors, mask)


def pad_batch(seqs: Sequence[Sequence[int]], device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """-> tokens (B, T_max) padded with 0, lengths (B,). Filled through one numpy mask, not a tensor copy per
    row: a batch of a thousand hypotheses costs a few hundred microseconds, not ten milliseconds."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    T = int(lengths.max()) if len(seqs) else 0
    tokens = np.zeros((len(seqs), T), dtype=np.int64)
    tokens[np.arange(T)[None, :] < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(tokens).to(device), torch.from_numpy(lengths).to(device)
