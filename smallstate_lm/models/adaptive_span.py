"""Adaptive-span Transformer LM (Sukhbaatar et al. 2019, "Adaptive Attention Span in
Transformers").

Every head learns how far back it looks: a span z in [0, S] (S = `span_max`) and a
soft mask over the distance x from the query (0 = the query's own position),

    m_z(x) = clamp((R + z - x) / R, 0, 1),    R = `span_ramp`,

multiplies that head's attention weights after the softmax, which are then
renormalised; positions at distance >= S are never attended. A span loss
`span_loss * sum(z)` pushes spans down, so the state (per-layer keys and values of
the history) only needs the last max(ceil(z)) + R positions: the cache shrinks as
the spans do. Keys carry learned relative position embeddings for distances
0..S-1, added to the keys in the dot product as in the paper.

Histories are right-aligned (state.py): the newest cached key sits right before the
first query of the next call in every row, so distances are exact in padded batches.

This module also holds what the all-attention model reuses: the span mask, the
relative-position/span bias of the context logits, the state and the LM shell.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..state import (
    LMState,
    cat_right_aligned,
    drop_empty_columns,
    keep_last,
    length_mask,
    own_storage,
    right_align,
)
from ..vocab import BOS_ID
from .base import AttentionProjections, Block, PendingTokenLM, embed_tokens, extend, init_weights, split_heads
from .config import ModelConfig

# ---- the span mask ---------------------------------------------------------------------


class AdaptiveSpanMask(nn.Module):
    """Per-head soft span mask m_z(x) = clamp((R + z - x) / R, 0, 1), zero at x >= S.

    The span z of each head is stored as a fraction of S in `span` (a parameter in
    [0, 1], kept there by `clamp_`), so z = S * span, in positions.
    """

    def __init__(self, n_heads: int, max_span: int, ramp: int, init: float):
        super().__init__()
        if max_span < 1 or ramp < 1:
            raise ConfigError(f"adaptive span needs span_max >= 1 and span_ramp >= 1, got {max_span}, {ramp}")
        if not 0.0 <= init <= 1.0:
            raise ConfigError(f"span_init must lie in [0, 1], got {init}")
        self.max_span = max_span
        self.ramp = ramp
        self.span = nn.Parameter(torch.full((n_heads,), float(init)))

    def spans(self) -> Tensor:
        """(H,) the spans z in positions, in [0, S]."""
        # Clamped here too, so a step that overshoots before `clamp_` runs cannot
        # mask out a query's own position (m(0) < 1 needs z < 0).
        return self.span.clamp(0.0, 1.0) * self.max_span

    def forward(self, distance: Tensor) -> Tensor:
        """distance: long tensor of any shape, values >= 0 (0 = the query itself).
        Returns (H, *distance.shape) mask values in [0, 1]."""
        z = self.spans().view(-1, *([1] * distance.dim()))  # (H, 1, ...)
        m = ((self.ramp + z - distance.to(z.dtype)[None]) / self.ramp).clamp(0.0, 1.0)
        return m.masked_fill(distance[None] >= self.max_span, 0.0)

    def log_mask(self, distance: Tensor) -> Tensor:
        """log m (H, *distance.shape), -inf where m = 0. Adding it to the logits before
        the softmax equals multiplying the softmax weights by m and renormalising:
        softmax(s + log m)_j = m_j e^{s_j} / sum_k m_k e^{s_k}, with exact zeros and no
        epsilon in the denominator."""
        m = self(distance)
        # clamp_min: log's gradient stays finite (no 0/0) where the branch is discarded
        return torch.where(m > 0, m.clamp_min(torch.finfo(m.dtype).tiny).log(), float("-inf"))

    def max_history(self) -> int:
        """Positions any head can still see: min(S, ceil(max z) + R). Every weight at a
        larger distance is exactly zero."""
        z = torch.ceil(self.spans().detach().max())
        return min(self.max_span, int(z) + self.ramp)

    def loss(self) -> Tensor:
        """Sum of the spans z over heads, in positions (scalar)."""
        return self.spans().sum()

    @torch.no_grad()
    def clamp_(self) -> None:
        self.span.clamp_(0.0, 1.0)


# ---- attention geometry shared by every layer of one call ----------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where each query of a call may look.

    dist: (n, K) long, distance from query i (the i-th run input) to key column c of
    the cache-plus-new keys: i + S_cached - c; negative for future keys. allowed:
    (B or 1, 1, n, K) bool: causal, within `max_span` when there is one, and the key
    is not padding.
    """

    dist: Tensor
    allowed: Tensor

    @staticmethod
    def build(n: int, cached: int, cache_mask: Tensor | None, max_span: int | None,
              device: torch.device) -> Geometry:
        """n run inputs after `cached` right-aligned cached positions; cache_mask
        (B, cached) bool or None when every cached position is valid."""
        dist = torch.arange(n, device=device)[:, None] + cached - torch.arange(cached + n, device=device)[None, :]
        allowed = dist >= 0
        if max_span is not None:
            allowed &= dist < max_span
        allowed = allowed[None, None]  # (1, 1, n, K)
        if cache_mask is not None:
            key_valid = torch.cat([cache_mask, cache_mask.new_ones(cache_mask.shape[0], n)], 1)  # (B, K)
            allowed = allowed & key_valid[:, None, None, :]  # (B, 1, n, K)
        return Geometry(dist=dist, allowed=allowed)


class SpanBias(nn.Module):
    """Relative position embeddings (distances 0..S-1, shared by the heads of a layer)
    and the adaptive span mask, as one additive bias on the context logits:

        bias[b, h, i, c] = q[b, h, i] . p[dist(i, c)] / sqrt(Dh) + log m_z_h(dist(i, c)),

    so logits = (q . (k + p)) / sqrt(Dh) + log m, as in the paper.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dh = cfg.d_model // cfg.n_heads
        self.max_span = cfg.span_max
        self.pos = nn.Parameter(torch.empty(cfg.span_max, dh).normal_(0.0, 0.02))
        self.mask = AdaptiveSpanMask(cfg.n_heads, cfg.span_max, cfg.span_ramp, cfg.span_init)

    def forward(self, q: Tensor, geo: Geometry) -> Tensor:
        """q (B, H, n, Dh) -> bias (B, H, n, K); arbitrary (finite or -inf) where
        `geo.allowed` is False."""
        B, H, n, dh = q.shape
        K = geo.dist.shape[1]
        P = min(self.max_span, K)  # no allowed distance reaches K
        table = q @ self.pos[:P].t()  # (B, H, n, P)
        table = table.mul_(1.0 / math.sqrt(dh)).add_(self.mask.log_mask(torch.arange(P, device=q.device))[:, None])
        idx = geo.dist.clamp(0, P - 1)  # (n, K)
        return table.gather(3, idx.expand(B, H, n, K))  # (B, H, n, K)


# ---- the state -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpanState(LMState):
    """Per-layer keys and values of the history, right-aligned, plus the pending token.

    keys[l], values[l]: (B, S, d_model) for the S positions already run through the
    model, each row's history a suffix of the time axis. last: (B,) the most recent
    token, not yet run (its output predicts the next token, so running it waits
    until that token is known). mask: (B, S) bool, False at left padding; None when
    every column is valid in every row.
    """

    keys: list[Tensor]
    values: list[Tensor]
    last: Tensor
    mask: Tensor | None = None

    memory_fields = ("keys", "values")

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]

    @classmethod
    def cat(cls, states: list[SpanState]) -> SpanState:
        """Stack states along the batch; shorter histories get left padding."""
        if len(states) == 1:
            return states[0]
        n_layers = len(states[0].keys)
        tensors, mask = cat_right_aligned([(st.keys + st.values, st.mask) for st in states])
        return cls(keys=tensors[:n_layers], values=tensors[n_layers:],
                   last=torch.cat([st.last for st in states]), mask=mask)

    def compact(self) -> SpanState:
        """Cut the leading columns that are padding in every row."""
        n_layers = len(self.keys)
        tensors, mask = drop_empty_columns(self.keys + self.values, self.mask)
        return dataclasses.replace(self, keys=tensors[:n_layers], values=tensors[n_layers:], mask=mask)


# ---- the LM shell shared with all-attention ------------------------------------------


class CachedAttentionLM(PendingTokenLM):
    """Embedding, a stack of layers that cache per-layer keys and values, final
    LayerNorm and output layer; implements the state contract over `SpanState`.

    Each layer is called as layer(x (B, n, d), past_k (B, S, d), past_v (B, S, d),
    geo) and returns (x, keys (B, S+n, d), values (B, S+n, d)): the cache extended by
    the n run inputs. Subclasses set `state_cls`, `_max_span` (None: no distance
    cap) and override `_span_cap` when the history they need is bounded.
    """

    state_cls: type[SpanState] = SpanState

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[ModelConfig], nn.Module], max_span: int | None):
        cfg.validate()
        if cfg.shared_kv:
            raise ConfigError(f"arch {cfg.arch} stores separate keys and values; set shared_kv=False")
        super().__init__(cfg, make_layer)
        self._max_span = max_span
        # False keeps the whole history in the state (results are identical, since
        # every weight beyond the cap is exactly zero; used to check that claim)
        self.trim_cache = True
        self.apply(init_weights)

    # ---- spans: hooks the trainer and `eval` call --------------------------------------
    def span_masks(self) -> list[AdaptiveSpanMask]:
        return [m for m in self.modules() if isinstance(m, AdaptiveSpanMask)]

    def _span_cap(self) -> int | None:
        """Most cached positions any query can still see; None when unbounded."""
        masks = self.span_masks()
        return max(m.max_history() for m in masks) if masks else None

    @property
    def max_history(self) -> int | None:
        """Most history positions a state keeps (None: unbounded)."""
        return self._span_cap() if self.trim_cache else None

    def aux_loss(self) -> Tensor:
        """span_loss * (sum of the spans z over every head and layer, in positions)."""
        masks = self.span_masks()
        if not masks:
            return self.norm.weight.new_zeros(())
        return self.cfg.span_loss * torch.stack([m.loss() for m in masks]).sum()

    def after_step(self) -> None:
        """Keep span parameters in [0, 1] after each optimizer step."""
        for m in self.span_masks():
            m.clamp_()

    def report(self) -> dict:
        """Learned spans per layer (per head, in positions) and the history they need."""
        out: dict = {}
        for i, m in enumerate(self.span_masks()):
            out[f"spans L{i}"] = [round(float(z), 1) for z in m.spans().detach().cpu()]
        if out:
            out["max_history"] = self._span_cap()
        return out

    # ---- the state contract -------------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return 2 * self.cfg.n_layers * self.cfg.d_model

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> SpanState:
        """The state after `<s>`: nothing cached yet, `<s>` pending. No compute."""
        dtype, device = self.state_placement(device)
        shape = (batch_size, 0, self.cfg.d_model)
        return self.state_cls(
            keys=[torch.empty(shape, dtype=dtype, device=device) for _ in self.layers],
            values=[torch.empty(shape, dtype=dtype, device=device) for _ in self.layers],
            last=torch.full((batch_size,), BOS_ID, dtype=torch.long, device=device),
        )

    # ---- internals -----------------------------------------------------------------
    def _run(self, tokens: Tensor, state: SpanState, lengths: Tensor | None, include_last: bool):
        """Run the pending token and tokens[:, :-1] (plus tokens[:, -1] when
        include_last); returns hidden (B, T or T+1, d) and the new state, whose cache
        gains the T inputs that precede each new target, trimmed to `max_history`."""
        B, T = tokens.shape
        dev = tokens.device
        run = self.pending_inputs(tokens, state.last, lengths, include_last)  # (B, n)
        S = state.length
        geo = Geometry.build(run.shape[1], S, state.mask, self._max_span, dev)

        x = embed_tokens(self, run)
        x = self.drop(x)  # (B, n, d)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, state.keys[i], state.values[i], geo)
            # the extra input `step` reads out is not part of the history
            keys.append(k[:, : S + T])
            values.append(v[:, : S + T])
        h = self.norm(x)

        tensors, mask = keys + values, None
        if state.mask is not None or lengths is not None:
            old = state.mask if state.mask is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
            new = length_mask(lengths, T) if lengths is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
            tensors, mask = right_align(tensors, torch.cat([old, new], 1))
        cap = self.max_history
        if cap is not None:
            tensors, mask = keep_last(tensors, mask, cap)
        tensors, mask = drop_empty_columns(tensors, mask)
        # a trimmed view would keep the whole untrimmed buffer alive
        tensors = [own_storage(t) for t in tensors]

        L = len(self.layers)
        last = self.next_pending(tokens, state.last, lengths)
        return h, self.state_cls(keys=tensors[:L], values=tensors[L:], last=last, mask=mask)


# ---- the adaptive-span model -------------------------------------------------------------


class SpanAttention(AttentionProjections):
    """Multi-head self-attention with relative position embeddings and a learned
    span per head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.bias = SpanBias(cfg)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def weights(self, q: Tensor, k: Tensor, geo: Geometry) -> Tensor:
        """q (B, H, n, Dh), k (B, H, K, Dh) -> attention weights (B, H, n, K), each
        query's row summing to 1 (span mask applied and renormalised)."""
        logits = (q @ k.transpose(2, 3)).mul_(1.0 / math.sqrt(q.shape[-1]))  # (B, H, n, K)
        logits = logits.add_(self.bias(q, geo)).masked_fill_(~geo.allowed, float("-inf"))
        return logits.softmax(-1)

    def forward(self, x: Tensor, past_k: Tensor, past_v: Tensor, geo: Geometry) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, n, d); past_k/v (B, S, d). Returns output (B, n, d) and the extended
        keys/values (B, S+n, d)."""
        B, n, d = x.shape
        k_all = extend(past_k, self.k(x))  # (B, S+n, d)
        v_all = extend(past_v, self.v(x))  # (B, S+n, d)
        q = split_heads(self.q(x), self.h)  # (B, H, n, Dh)
        w = self.attn_drop(self.weights(q, split_heads(k_all, self.h), geo))  # (B, H, n, K)
        y = w @ split_heads(v_all, self.h)  # (B, H, n, Dh)
        return self.o(y.transpose(1, 2).reshape(B, n, d)), k_all, v_all  # (B, n, d)


def span_layer(cfg: ModelConfig) -> Block:
    """Pre-LayerNorm span attention followed by `ff_per_layer` feed-forward sublayers."""
    return Block(cfg, SpanAttention(cfg))


class AdaptiveSpanLM(CachedAttentionLM):
    """Transformer LM whose heads learn their attention spans (see the module doc).

    Hooks for the trainer: `aux_loss()` (the span loss), `after_step()` (clamps the
    spans), `report()` (learned spans per layer), `max_history` (cache length kept,
    shrinking with the spans). Set `trim_cache = False` to keep the whole history.
    """

    def __init__(self, cfg: ModelConfig):
        if cfg.arch != "adaptive_span":
            raise ConfigError(f"AdaptiveSpanLM builds arch 'adaptive_span', got {cfg.arch!r}")
        cfg.validate()
        super().__init__(cfg, span_layer, max_span=cfg.span_max)
