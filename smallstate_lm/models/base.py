"""What the model families share: weight init, the input embedding, the feed-forward
sublayer, causal self-attention, the pre-LayerNorm block, and the base classes that
give every model the state contract (`smallstate_lm.state.StatefulLM`).

`LanguageModel` declares the optional capabilities with their "absent" defaults, so a
caller tests `model.score_tree is not None` instead of probing with hasattr.
`PendingTokenLM` is the decoder skeleton of every family except the LSTM: embedding,
layers, final LayerNorm and output layer, with `score`, `step` and `log_probs_all`
built on a family's `_run`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..state import LMState, check_tokens, length_mask
from .config import ModelConfig
from .output import OutputLayer

# ---- weights and embeddings ------------------------------------------------------------


def init_weights(m: nn.Module) -> None:
    """N(0, 0.02) for linear and embedding weights (a linear layer's own `init_std`
    where it sets one), zero biases; for `model.apply`."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, getattr(m, "init_std", 0.02))
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 0.02)


def input_embedding(cfg: ModelConfig) -> tuple[nn.Embedding, nn.Linear | None]:
    """The token embedding (embed_dim wide, tied to the output layer when configured) and
    its projection to d_model, None when the two widths agree."""
    embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
    proj = nn.Linear(cfg.embed_dim, cfg.d_model, bias=False) if cfg.embed_dim != cfg.d_model else None
    if proj is not None and cfg.embed_scale:
        # Norm-preserving start (read by `init_weights`): the 0.02 of every other matrix
        # would shrink the scaled embeddings again by 0.02 * sqrt(embed_dim).
        proj.init_std = cfg.embed_dim ** -0.5
    return embed, proj


def embed_tokens(model: nn.Module, tokens: Tensor) -> Tensor:
    """(B, T) ids -> (B, T, d_model) through `model.embed` and `model.embed_proj`, before dropout."""
    x = model.embed(tokens)
    if model.cfg.embed_scale:
        x = x * math.sqrt(model.cfg.embed_dim)
    return x if model.embed_proj is None else model.embed_proj(x)


# ---- sublayers ---------------------------------------------------------------------------


def residual_add(y: Tensor, x: Tensor) -> Tensor:
    """x + y, in place on y (a fresh sublayer output, saving an allocation) when the dtypes
    agree. Under bf16 autocast y is bf16 while the residual stream x is float32: adding in
    place would demote the stream to bf16 for every later layer."""
    return y.add_(x) if y.dtype == x.dtype else x + y


class FeedForward(nn.Module):
    """Pre-LayerNorm ReLU feed-forward sublayer with its residual: (B, ..., d) -> (B, ..., d)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, overwrite: bool = False) -> Tensor:
        """overwrite: x is the caller's own intermediate, free to be overwritten with the result."""
        # In place on fresh outputs: saves two (B, T, d_ff)-sized allocations per sublayer.
        h = self.drop(F.relu(self.fc1(self.norm(x)), inplace=True))
        w = self.fc2.weight
        if (overwrite and not torch.is_grad_enabled() and self.fc2.bias is None and not self.drop.p * self.training
                and x.is_contiguous() and x.dtype == h.dtype == w.dtype):
            # The residual enters the matmul as its accumulator (beta=1): one pass and one
            # multithreaded region fewer than fc2 then add_, which counts where other work
            # shares the cores (each region waits for its slowest thread). Not under autograd:
            # LayerNorm saved x for its backward.
            x2 = x.view(-1, x.shape[-1])
            torch.addmm(x2, h.view(-1, h.shape[-1]), w.t(), out=x2)
            return x
        return residual_add(self.drop(self.fc2(h)), x)


class Block(nn.Module):
    """A pre-LayerNorm sublayer `attn` with dropout and residual, then `ff_per_layer`
    feed-forward sublayers. `forward(x, *args)` calls attn(LN(x), *args), which returns
    (output (B, T, d), *cache), and returns (x (B, T, d), *cache)."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = attn
        self.drop = nn.Dropout(cfg.dropout)
        self.ffs = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.ff_per_layer))

    def forward(self, x: Tensor, *args) -> tuple[Tensor, ...]:
        a, *cache = self.attn(self.norm(x), *args)
        return self.residual(a, x), *cache

    def residual(self, a: Tensor, x: Tensor) -> Tensor:
        """x + Dropout(a), then the feed-forward sublayers; (B, T, d)."""
        x = residual_add(self.drop(a), x)  # a new tensor, never the caller's x
        for ff in self.ffs:
            x = ff(x, overwrite=True)
        return x


# ---- self-attention ----------------------------------------------------------------------


def split_heads(t: Tensor, n_heads: int) -> Tensor:
    """(B, S, d) -> (B, H, S, Dh)."""
    B, S, d = t.shape
    return t.view(B, S, n_heads, d // n_heads).transpose(1, 2)  # (B, H, S, Dh)


def extend(past: Tensor, new: Tensor, dim: int = 1) -> Tensor:
    """Append `new` to the cache `past` along the time axis `dim`; with nothing cached,
    keep `new` as is (no copy)."""
    return new if past.shape[dim] == 0 else torch.cat([past, new], dim)


def rotary_tables(positions: Tensor, dh: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """positions (B, T) integer -> (cos, sin), each (B, 1, T, dh) float32, for `apply_rotary`.
    The first half of `sin` is negated: that sign of the rotation then costs nothing per call
    of `apply_rotary` (tables are made once per forward, applied twice per layer)."""
    inv_freq = base ** (-torch.arange(0, dh, 2, device=positions.device, dtype=torch.float32) / dh)  # (dh/2,)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # (B, 1, T, dh/2)
    sin = angles.sin()
    return torch.cat([angles, angles], -1).cos(), torch.cat([-sin, sin], -1)


def rotary_table(n: int, dh: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """`rotary_tables` of the positions 0..n-1: (cos, sin), each (n, dh), to be indexed by
    position. Rows at few distinct positions (the same position in every row of a batch, trie
    depths) then cost one gather each instead of their own sin and cos; and a position's
    angles do not depend on which other positions share the call."""
    cos, sin = rotary_tables(torch.arange(n, device=device)[None], dh)
    return cos[0, 0], sin[0, 0]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of x (B, H, T, dh) pairwise by the angles of (cos, sin) from
    `rotary_tables`: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    # Three kernels (cat, mul, addcmul) instead of five (neg, cat, mul, mul, add): these are
    # short memory-bound passes, and where other work shares the cores each multithreaded
    # one waits for the slower thread.
    swapped = torch.cat([x[..., half:], x[..., :half]], -1)  # (B, H, T, dh)
    return torch.addcmul(x.float() * cos, swapped.float(), sin).to(x.dtype)


def causal_mask(cache_mask: Tensor | None, S: int, n: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """Where n new queries after S cached positions may attend (True), for
    `SelfAttention`: causal among the new positions, padding of the cache excluded.
    cache_mask: (B, S) bool, False at padding, or None. Returns (mask, is_causal):
    mask (B, 1, n, S+n), (n, S+n) or None."""
    if cache_mask is not None and not bool(cache_mask.all()):
        key_valid = torch.cat([cache_mask, cache_mask.new_ones(cache_mask.shape[0], n)], 1)  # (B, S+n)
        q_pos = torch.arange(n, device=device)[:, None] + S  # (n, 1)
        k_pos = torch.arange(S + n, device=device)[None, :]  # (1, S+n)
        return ((k_pos <= q_pos)[None] & key_valid[:, None, :])[:, None], False  # (B, 1, n, S+n)
    if n <= 1:
        return None, False
    if S == 0:
        return None, True
    q_pos = torch.arange(n, device=device)[:, None] + S  # (n, 1)
    return torch.arange(S + n, device=device)[None, :] <= q_pos, False  # (n, S+n)


class AttentionProjections(nn.Module):
    """The query, key, value and output projections (d_model -> d_model) of
    multi-head attention with `h` heads of width `dh`; `v` is None when `values` is
    False (the keys serve as values)."""

    def __init__(self, cfg: ModelConfig, values: bool = True):
        super().__init__()
        self.h = cfg.n_heads
        self.dh = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias) if values else None
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)


class SelfAttention(AttentionProjections):
    """Multi-head self-attention over cached plus new keys/values; with shared_kv one
    projection gives both, and only keys are returned for the cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, values=not cfg.shared_kv)
        self.shared_kv = cfg.shared_kv
        self.dropout = cfg.dropout

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor | None, mask: Tensor | None, causal: bool,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """x (B, T, d); past_k/v (B, H, S, Dh); mask, causal: from `causal_mask`; rope:
        optional (cos, sin), each (B or 1, 1, T, Dh), for the new positions. Returns output
        (B, T, d) and the extended keys/values (B, H, S+T, Dh), values None with shared_kv."""
        B, T, d = x.shape
        q = split_heads(self.q(x), self.h)  # (B, H, T, Dh)
        k_new = split_heads(self.k(x), self.h)  # (B, H, T, Dh)
        if rope is not None:
            q, k_new = apply_rotary(q, *rope), apply_rotary(k_new, *rope)
        k = extend(past_k, k_new, 2)  # (B, H, S+T, Dh)
        if self.shared_kv:
            v, new_v = k, None
        else:
            v = extend(past_v, split_heads(self.v(x), self.h), 2)  # (B, H, S+T, Dh)
            new_v = v
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, Dh)
        return self.o(y.transpose(1, 2).reshape(B, T, d)), k, new_v  # (B, T, d)


def tree_inputs(tokens: Tensor, parents: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A `score_tree` call's arguments checked and laid out as one input row per trie, `<s>` at position 0 and
    node i at i + 1: (tokens with padding as 0, each node's parent's position (0 = `<s>`), the real nodes' mask,
    lengths), each (B, N) but lengths (B,). ValueError unless tokens and parents are (B, N) and every parent comes
    before its child."""
    if tokens.shape != parents.shape or tokens.dim() != 2:
        raise ValueError(f"tokens and parents must both be (B, N), got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}")
    B, N = tokens.shape
    dev = tokens.device
    if lengths is None:
        lengths = torch.full((B,), N, dtype=torch.long, device=dev)
    real = length_mask(lengths, N)
    par = torch.where(real, parents, -1) + 1
    if bool(((par < 0) | (par > torch.arange(N, device=dev)[None])).any()):
        raise ValueError("every parent must come before its child in the row")
    return tokens.masked_fill(~real, 0), par, real, lengths


# ---- the models ----------------------------------------------------------------------------


class LanguageModel(nn.Module):
    """Base of every model: the optional members of `StatefulLM` with their defaults
    (the capability is absent). A family overrides the ones it has; see `StatefulLM`
    for what each means."""

    cfg: ModelConfig
    score_tree: Callable[..., Tensor] | None = None
    # Present with score_tree: its plan and working memory for a batch of tries, before any work.
    tree_plan: Callable[..., Any] | None = None
    max_tree_nodes: int | None = None
    max_positions: int | None = None
    log_probs_all: Callable[..., tuple[Tensor, LMState]] | None = None
    aux_loss: Callable[[], Tensor] | None = None
    after_step: Callable[[], None] | None = None
    max_history: int | None = None

    def state_numel_fixed(self) -> int:
        """Numbers per row of the state that do not grow with the history: none."""
        return 0

    def report(self) -> dict:
        """Learned facts worth printing after training or `eval`: none."""
        return {}

    def state_placement(self, device: torch.device | str | None) -> tuple[torch.dtype, torch.device]:
        """The parameters' dtype, and `device` (default: the parameters' device), for a
        new state."""
        p = next(self.parameters())
        return p.dtype, p.device if device is None else torch.device(device)


class PendingTokenLM(LanguageModel):
    """The decoder skeleton: embedding (+ projection to d_model), dropout, `n_layers`
    layers, final LayerNorm and output layer; and `score`, `step`, `log_probs_all` for
    the pending-token design: the state holds the history already run plus the last
    token, not yet run (its output predicts the next token, so running it waits until
    that token is known).

    A subclass provides
    `_run(tokens, state, lengths, include_last) -> (hidden (B, T or T+1, d), new state)`,
    which runs the pending token and tokens[:, :-1] (plus tokens[:, -1] when
    include_last; see `pending_inputs`) and returns the state after each row's real
    tokens. It applies `init_weights` itself once its own parameters exist, so the
    seeded initialisation follows the order of construction.
    """

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[ModelConfig], nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.embed, self.embed_proj = input_embedding(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(make_layer(cfg) for _ in range(cfg.n_layers))
        self.add_memory(cfg)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.output = OutputLayer(cfg, self.embed)

    def add_memory(self, cfg: ModelConfig) -> None:
        """Modules that sit between the layers and the final LayerNorm (none here); a
        hook so that a family's parameters keep their place in the seeded init."""

    def score(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]:
        """Target log-probs of `tokens` given the history in `state`.

        tokens: (B, T) LongTensor. lengths: optional (B,) — row b holds
        lengths[b] real tokens followed by padding (any id); padded positions get
        log-prob 0 and do not enter the returned state. Returns logp (B, T), natural
        log, logp[b, t] = log p(tokens[b, t] | <s>, history, tokens[b, :t]); and the
        state after each row's real tokens. End a sentence with `</s>` to score it
        whole. Only target log-probs are computed (chunked; no (B, T, V) tensor).
        """
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros((B, 0), dtype=torch.float32), state
        h, new_state = self._run(tokens, state, lengths, include_last=False)
        logp = self.output.target_logprob(h.reshape(B * T, -1), tokens.reshape(B * T)).view(B, T)  # (B, T)
        if lengths is not None:
            logp = logp.masked_fill(~length_mask(lengths, T), 0.0)
        return logp, new_state

    def step(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]:
        """Consume `tokens` (B, T), T >= 0, and return the (B, V) natural-log
        distribution of the token after each row's last real token, plus the state
        after the tokens (the same state `score` would return)."""
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        h, new_state = self._run(tokens, state, lengths, include_last=True)
        B, T1 = h.shape[0], h.shape[1]
        idx = (lengths if lengths is not None else torch.full((B,), T1 - 1, device=h.device))  # (B,)
        h_last = h[torch.arange(B, device=h.device), idx]  # (B, d)
        return self.output.log_probs(h_last), new_state

    def log_probs_all(
        self, tokens: Tensor, state: LMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LMState]:
        """The whole next-token distribution at every position (distillation).

        tokens: (B, T); lengths: optional (B,) as in `score`. Returns logp (B, T, V),
        natural log, logp[b, t] = log p(. | <s>, history, tokens[b, :t]) (so
        logp[b, t, tokens[b, t]] is `score`'s value; 0 at padded positions), and the
        state after each row's real tokens.
        """
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        B, T = tokens.shape
        if T == 0:
            return torch.zeros(B, 0, self.cfg.vocab_size, device=tokens.device), state
        h, new_state = self._run(tokens, state, lengths, include_last=False)
        logp = self.output.log_probs(h.reshape(B * T, -1)).view(B, T, -1)  # (B, T, V)
        if lengths is not None:
            logp = logp.masked_fill(~length_mask(lengths, T)[:, :, None], 0.0)
        return logp, new_state

    @staticmethod
    def pending_inputs(tokens: Tensor, last: Tensor, lengths: Tensor | None, include_last: bool) -> Tensor:
        """What a pending-token model runs: the pending token `last` (B,), then
        tokens[:, :-1] of tokens (B, T), plus tokens[:, -1] when include_last (`step` reads
        that extra output out, never caches it). Padding (beyond lengths[b] + 1) becomes
        id 0. Returns (B, T) or (B, T+1)."""
        T = tokens.shape[1]
        inputs = torch.cat([last[:, None], tokens], dim=1)  # (B, T+1)
        if lengths is not None:
            inputs = inputs.masked_fill(~length_mask(lengths + 1, T + 1), 0)
        return inputs if include_last else inputs[:, :T]

    @staticmethod
    def next_pending(tokens: Tensor, last: Tensor, lengths: Tensor | None) -> Tensor:
        """The pending token after a call: each row's last real token of tokens (B, T), or
        its old pending token `last` (B,) when it had none. Returns (B,)."""
        if lengths is None:
            return tokens[:, -1] if tokens.shape[1] > 0 else last
        picked = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
        return torch.where(lengths > 0, picked, last)
