"""The state contract shared by every LM (DESIGN §3).

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
from collections.abc import Callable
from typing import Protocol, runtime_checkable

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
    """What every language model in the project provides."""

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> LMState: ...

    def score(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]: ...

    def step(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]: ...

    def state_numel_per_position(self) -> int: ...


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
