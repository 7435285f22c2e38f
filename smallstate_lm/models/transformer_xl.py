"""Transformer-XL (Dai et al. 2019): relative positional attention with segment-level
recurrence, in the small-state Transformer's pre-LayerNorm block.

Attention score of query i and key j, per head, scaled by 1/sqrt(d_head):

    (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j}

R is the sinusoidal embedding of the relative distance (0 = the same position), W_r
a per-layer projection, u and v two learned biases per head shared by all layers.

The state keeps, per layer, the hidden states entering that layer (its inputs) for
the last `mem_len` positions; keys and values of those positions are recomputed from
them on every call, so a state holds n_layers x d_model numbers per position.

Attention window: every query attends to itself and at most `mem_len` previous
positions (a sliding window), both inside one call and across calls, so any split
of a sequence into calls gives the same log-probs. The paper differs only in that
the early queries of a segment see the whole memory plus the segment's earlier
positions, i.e. slightly more than `mem_len` positions back, which would make the
result depend on where segments start.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from ..state import (
    LMState,
    append_right_aligned,
    cat_right_aligned,
    drop_empty_columns,
    keep_last,
)
from ..vocab import BOS_ID
from .base import Block, PendingTokenLM, embed_tokens, init_weights
from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TransformerXLState(LMState):
    """Per-layer memories of the layer inputs, plus the pending token.

    mems[l]: (B, S, d_model) the hidden states that entered layer l at the last S
    positions already run through the model, S <= mem_len; right-aligned, so each
    row's history is a suffix of the time axis and the newest position sits in the
    last column. mask: (B, S) bool, False at left padding of rows with a shorter
    history; None when every column is valid. last: (B,) the most recent token, not
    yet run through the model (its output predicts the next token).
    """

    mems: list[Tensor]
    last: Tensor
    mask: Tensor | None = None

    memory_fields = ("mems",)

    @property
    def length(self) -> int:
        return self.mems[0].shape[1]

    @classmethod
    def cat(cls, states: list[TransformerXLState]) -> TransformerXLState:
        """Stack states along the batch; shorter histories are left-padded and masked."""
        if len(states) == 1:
            return states[0]
        mems, mask = cat_right_aligned([(st.mems, st.mask) for st in states])
        return cls(mems=mems, last=torch.cat([st.last for st in states]), mask=mask)

    def compact(self) -> TransformerXLState:
        """Cut the leading columns that are padding in every row (after select())."""
        mems, mask = drop_empty_columns(self.mems, self.mask)
        if mems[0].shape[1] == self.length and mask is self.mask:
            return self
        return TransformerXLState(mems=mems, last=self.last, mask=mask)


def rel_shift(x: Tensor) -> Tensor:
    """Turn scores against relative positions into scores against key positions.

    x: (..., T, K) where query i sits at key position K - T + i and column r of x
    belongs to relative distance K - 1 - r (distances K-1 .. 0). Returns (..., T, K)
    with out[..., i, j] = x[..., i, j + T - 1 - i], i.e. the entry for distance
    (K - T + i) - j, wherever that distance is >= 0; entries with j after the query
    (negative distance) hold unrelated values and must be masked by the caller.

    The trick (Dai et al. 2019, appendix B): pad one zero column in front, read the
    buffer as K + 1 rows of T, drop the first row, and read it back as T rows of K;
    each row ends up shifted left by T - 1 - i without any gather.
    """
    *lead, T, K = x.shape
    x = F.pad(x, (1, 0))  # (..., T, K+1)
    x = x.view(*lead, K + 1, T)  # (..., K+1, T): the same buffer, read in rows of T
    return x[..., 1:, :].reshape(*lead, T, K)  # (..., T, K)


def sinusoid(distances: Tensor, d: int) -> Tensor:
    """(K,) float distances -> (K, d) sinusoidal embeddings [sin | cos] (d even)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=distances.device, dtype=torch.float32) / d))
    angles = distances.float()[:, None] * inv_freq[None, :]  # (K, d/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class RelativeAttention(nn.Module):
    """Multi-head attention with Transformer-XL relative positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h = cfg.n_heads
        self.dh = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.w_r = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, h: Tensor, n_query: int, pos: Tensor, allowed: Tensor, u: Tensor, v: Tensor) -> Tensor:
        """h: (B, K, d) normalised inputs of the memory and the current positions; the
        last `n_query` of them are the queries. pos: (K, d) embeddings of distances
        K-1 .. 0. allowed: bool, broadcastable to (B, H, n_query, K), True where query
        i may attend to key j (it must hold at j = its own position). u, v: (H, Dh).
        Returns (B, n_query, d)."""
        B, K, d = h.shape
        T = n_query
        q = self.q(h[:, K - T:]).view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k(h).view(B, K, self.h, self.dh).transpose(1, 2)  # (B, H, K, Dh)
        val = self.v(h).view(B, K, self.h, self.dh).transpose(1, 2)  # (B, H, K, Dh)
        r = self.w_r(pos).view(K, self.h, self.dh).permute(1, 2, 0)  # (H, Dh, K)
        pos_scores = rel_shift(torch.matmul(q + v[None, :, None], r))  # (B, H, T, K)
        # The positional term enters as an additive mask, so the content term and the
        # softmax run in the fused kernel; the 1/sqrt(Dh) scale it applies to the
        # content term is applied here to the positional term.
        bias = (pos_scores * (1.0 / math.sqrt(self.dh))).masked_fill(~allowed, float("-inf"))
        y = F.scaled_dot_product_attention(
            q + u[None, :, None], k, val, attn_mask=bias, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, Dh)
        return self.o(y.transpose(1, 2).reshape(B, T, d))  # (B, T, d)


class Layer(Block):
    """One relative attention sublayer over memory + current positions, followed by F
    feed-forward sublayers (pre-LayerNorm, residual)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, RelativeAttention(cfg))

    def forward(self, x: Tensor, mem: Tensor, pos: Tensor, allowed: Tensor, u: Tensor, v: Tensor) -> Tensor:
        """x: (B, T, d) inputs of the current positions; mem: (B, S, d) inputs of the
        memory positions. Returns (B, T, d)."""
        T = x.shape[1]
        h = self.norm(x if mem.shape[1] == 0 else torch.cat([mem, x], 1))  # (B, S+T, d)
        return self.residual(self.attn(h, T, pos, allowed, u, v), x)


class TransformerXLLM(PendingTokenLM):
    """Transformer-XL LM under the state contract (see the module docstring).

    The most recent token is kept pending in the state and run only when the next
    token is scored, so `initial_state` costs nothing and a state never holds an
    output it does not need.
    """

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        if cfg.arch != "transformer_xl":
            raise ConfigError(f"TransformerXLLM needs arch 'transformer_xl', got {cfg.arch!r}")
        if cfg.d_model % 2:
            raise ConfigError(f"transformer_xl needs an even d_model for sinusoidal positions, got {cfg.d_model}")
        super().__init__(cfg, Layer)
        dh = cfg.d_model // cfg.n_heads
        # Shared by every layer, as in the paper.
        self.u = nn.Parameter(torch.empty(cfg.n_heads, dh).normal_(0.0, 0.02))
        self.v = nn.Parameter(torch.empty(cfg.n_heads, dh).normal_(0.0, 0.02))
        self.apply(init_weights)

    @property
    def max_history(self) -> int:
        """Most history positions a state keeps."""
        return self.cfg.mem_len

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return self.cfg.n_layers * self.cfg.d_model

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> TransformerXLState:
        """The state after `<s>`: no memory yet, `<s>` pending. No compute."""
        dtype, device = self.state_placement(device)
        shape = (batch_size, 0, self.cfg.d_model)
        return TransformerXLState(
            mems=[torch.empty(shape, dtype=dtype, device=device) for _ in self.layers],
            last=torch.full((batch_size,), BOS_ID, dtype=torch.long, device=device),
        )

    # ---- internals -----------------------------------------------------------------
    def _run(self, tokens: Tensor, state: TransformerXLState, lengths: Tensor | None, include_last: bool):
        """Run the pending token and tokens[:, :-1] (plus tokens[:, -1] when
        include_last) through the model; returns hidden (B, T or T+1, d) and the new
        state, whose memories gain the layer inputs of the T positions that precede
        each new target (each row's real ones only), capped at mem_len."""
        B, T = tokens.shape
        run = self.pending_inputs(tokens, state.last, lengths, include_last)  # (B, n_run)
        n_run = run.shape[1]
        S = state.length
        dev = tokens.device

        # Key j (memory columns first) sits at distance (S + i) - j from query i.
        # Padded queries (beyond a row's length) see only earlier keys and themselves:
        # their outputs are finite and never read, and real queries never see them.
        dist = (torch.arange(n_run, device=dev)[:, None] + S) - torch.arange(S + n_run, device=dev)[None, :]
        allowed = (dist >= 0) & (dist <= self.cfg.mem_len)  # (n_run, S+n_run)
        if state.mask is not None:
            key_valid = torch.cat([state.mask, torch.ones(B, n_run, dtype=torch.bool, device=dev)], 1)  # (B, S+n_run)
            allowed = (allowed[None] & key_valid[:, None, :])[:, None]  # (B, 1, n_run, S+n_run)
        distances = torch.arange(S + n_run - 1, -1, -1, device=dev)  # key order: oldest first
        pos = sinusoid(distances, self.cfg.d_model).to(self.u.dtype)  # (S+n_run, d)

        x = embed_tokens(self, run)
        x = self.drop(x)  # (B, n_run, d)
        layer_inputs = []
        for i, layer in enumerate(self.layers):
            layer_inputs.append(x[:, :T])
            x = layer(x, state.mems[i], pos, allowed, self.u, self.v)
        h = self.norm(x)

        mems, mask = append_right_aligned(state.mems, state.mask, layer_inputs, lengths)
        if mems[0].shape[1] > self.cfg.mem_len:
            mems, mask = keep_last(mems, mask, self.cfg.mem_len)
            # A copy, so the state does not pin the whole concatenated buffer.
            mems = [m.clone(memory_format=torch.contiguous_format) for m in mems]
            if mask is not None and bool(mask.all()):
                mask = None

        return h, TransformerXLState(mems=mems, last=self.next_pending(tokens, state.last, lengths), mask=mask)
