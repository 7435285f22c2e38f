"""All-attention LM (Sukhbaatar et al. 2019, "Augmenting Self-attention with
Persistent Memory").

The layers are attention only (`ff_per_layer` must be 0): each head attends over
its context keys/values concatenated with `n_persistent` learned key/value vectors
(the persistent memory), with one joint softmax over context and persistent slots.
The persistent vectors take over the feed-forward sublayer's role: a query that
matches no context still reads a learned, input-independent transformation.

Persistent vectors are reparameterised as in the paper: k = sqrt(Dh) * k' and
v = sqrt(N) * v' with k' ~ N(0, 1/Dh) and v' ~ N(0, 1/N) at initialisation
(Dh = head width, N = n_persistent), so both start at unit scale per coordinate.

With `span_max > 0` the context part (never the persistent slots) gets relative
position embeddings and a learned adaptive span per head (adaptive_span.py), and the
state is trimmed to the longest span. With `span_max == 0` there is no positional
encoding: the causal mask alone orders the tokens, and the history is unbounded.

The state holds per-layer context keys and values (right-aligned); the persistent
vectors are parameters, not state.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .adaptive_span import CachedAttentionLM, Geometry, SpanBias, SpanState
from .base import AttentionProjections, Block, extend, split_heads
from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class AllAttentionState(SpanState):
    """Per-layer context keys and values (B, S, d_model), right-aligned, the pending
    token and the padding mask; see SpanState."""


class AllAttention(AttentionProjections):
    """Self-attention over context + persistent key/value slots, one joint softmax."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_persistent = cfg.n_persistent
        # k' ~ N(0, 1/Dh), v' ~ N(0, 1/N); used scaled by sqrt(Dh) and sqrt(N) (`persistent`)
        self.pk = nn.Parameter(torch.randn(cfg.n_heads, cfg.n_persistent, self.dh) / math.sqrt(self.dh))
        self.pv = nn.Parameter(torch.randn(cfg.n_heads, cfg.n_persistent, self.dh) / math.sqrt(cfg.n_persistent))
        self.bias = SpanBias(cfg) if cfg.span_max else None
        self.attn_drop = nn.Dropout(cfg.dropout)

    def persistent(self) -> tuple[Tensor, Tensor]:
        """The persistent keys and values actually attended, each (H, N, Dh)."""
        return self.pk * math.sqrt(self.dh), self.pv * math.sqrt(self.n_persistent)

    def weights(self, q: Tensor, k: Tensor, geo: Geometry) -> Tensor:
        """q (B, H, n, Dh), context keys k (B, H, K, Dh), K >= 0 -> attention weights
        (B, H, n, K + N): context slots first, then the N persistent slots; each row
        sums to 1 (one softmax over both; the span mask, if any, renormalised jointly)."""
        B, H, n, dh = q.shape
        K = k.shape[2]
        pk, _ = self.persistent()
        keys = torch.cat([k, pk.expand(B, H, -1, dh)], 2)  # (B, H, K+N, Dh)
        logits = (q @ keys.transpose(2, 3)).mul_(1.0 / math.sqrt(dh))  # (B, H, n, K+N)
        if K:
            ctx = logits[..., :K]  # (B, H, n, K) view: the persistent slots are never masked
            if self.bias is not None:
                ctx.add_(self.bias(q, geo))
            ctx.masked_fill_(~geo.allowed, float("-inf"))
        return logits.softmax(-1)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, geo: Geometry) -> Tensor:
        """q (B, H, n, Dh); context k, v (B, H, K, Dh) -> (B, H, n, Dh)."""
        B, H, _, dh = q.shape
        w = self.attn_drop(self.weights(q, k, geo))  # (B, H, n, K+N)
        _, pv = self.persistent()
        return w @ torch.cat([v, pv.expand(B, H, -1, dh)], 2)  # (B, H, n, Dh)

    def forward(self, x: Tensor, past_k: Tensor, past_v: Tensor, geo: Geometry) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, n, d); past_k/v (B, S, d). Returns output (B, n, d) and the extended
        context keys/values (B, S+n, d)."""
        B, n, d = x.shape
        k_all = extend(past_k, self.k(x))  # (B, S+n, d)
        v_all = extend(past_v, self.v(x))  # (B, S+n, d)
        q = split_heads(self.q(x), self.h)  # (B, H, n, Dh)
        y = self.attend(q, split_heads(k_all, self.h), split_heads(v_all, self.h), geo)  # (B, H, n, Dh)
        return self.o(y.transpose(1, 2).reshape(B, n, d)), k_all, v_all  # (B, n, d)


def all_attention_layer(cfg: ModelConfig) -> Block:
    """Pre-LayerNorm all-attention sublayer with a residual; no feed-forward
    (`ff_per_layer` is 0)."""
    return Block(cfg, AllAttention(cfg))


class AllAttentionLM(CachedAttentionLM):
    """Attention-only LM with persistent memory (see the module doc).

    With `span_max > 0`: hooks `aux_loss()`, `after_step()`, `report()` act on the
    spans and `max_history` is bounded; with `span_max == 0` they are no-ops and the
    history is unbounded.
    """

    state_cls = AllAttentionState

    def __init__(self, cfg: ModelConfig):
        if cfg.arch != "all_attention":
            raise ConfigError(f"AllAttentionLM builds arch 'all_attention', got {cfg.arch!r}")
        cfg.validate()
        if cfg.ff_per_layer != 0:
            raise ConfigError(f"all_attention layers have no feed-forward sublayers; set ff_per_layer=0 "
                              f"(got {cfg.ff_per_layer})")
        super().__init__(cfg, all_attention_layer, max_span=cfg.span_max or None)
