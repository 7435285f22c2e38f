"""Convolutional active-memory LMs (Dowdell & Zhang 2019).

The small-state Transformer's block with its self-attention sublayer replaced by an
active-memory mixer over the last k inputs (k = `conv_kernel`), or, with
`mix_attention`, with the mixer added to self-attention ("SA + conv"):
    x = x + Dropout(mixer(LN(x)) [+ SA(LN(x))]),   then `ff_per_layer` feed-forward sublayers.
Self-attention has no positional encoding, as in transformer.py.

Mixers (`mixer`), each a causal function of the last k inputs u[t-k+1 .. t] (d -> d):
- conv:            y = W * u, a full convolution; the k-1 positions before the first input are zeros.
- persistent_conv: the same, but those k-1 positions are trainable vectors, one set for the whole model.
- highway_conv:    y = g ⊙ (W * u) + (1 - g) ⊙ u,  g = hardsig(W_g * u + b_g).
- cgru:            the Neural GPU's convolutional GRU (Kaiser & Sutskever 2016, "Neural GPUs
                   learn algorithms") made causal: g = hardsig(W_g * u + b_g),
                   r = hardsig(W_r * u + b_r), c = tanh(W_c * (r ⊙ u) + b_c),
                   y = g ⊙ u + (1 - g) ⊙ c.
hardsig(z) = clip(1.2 sigmoid(z) - 0.1, 0, 1), the Neural GPU's saturating sigmoid.

The state keeps, per layer, the last k-1 mixer inputs (for cgru also the last k-1 values
of r ⊙ u that its candidate convolution reads): a fixed size however long the history.
With `mix_attention` it also keeps the attention keys and values of the whole history.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from ..state import LMState, append_right_aligned, cat_right_aligned, drop_empty_columns
from ..vocab import BOS_ID
from .base import FeedForward, PendingTokenLM, SelfAttention, causal_mask, embed_tokens, init_weights, residual_add
from .config import ModelConfig

# Calls at least this long run the convolution as F.conv1d, which is the faster kernel
# for long sequences on CPU; shorter ones (decoding steps, T = 1) as one matrix product
# over the unfolded windows, several times faster there.
CONV1D_MIN_T = 64


@dataclasses.dataclass(frozen=True)
class ActiveMemoryState(LMState):
    """Per-layer convolution windows, the optional attention memory, and the pending token.

    windows[l]: (B, k-1, d) the last k-1 inputs of layer l's mixer (its LayerNorm
    outputs), oldest first; before any input, the padding (zeros or the persistent
    vectors). gated[l]: cgru only, (B, k-1, d) the last k-1 values of r ⊙ u, which the
    candidate convolution reads; None for the other mixers. keys[l], values[l]:
    mix_attention only, (B, S, H, Dh) the attention memory of the history, right-aligned
    (each row's valid positions are a suffix of the time axis); values is None with
    shared_kv, both None without attention. mask: (B, S) bool, False at the left
    padding of shorter rows; None when every position is valid. last: (B,) the most
    recent token, not yet run through the model.

    Only keys/values grow with the history, so they alone are `memory_fields` (what
    `nbytes` counts); the windows are fixed per row and `total_nbytes` includes them.
    """

    windows: list[Tensor]
    gated: list[Tensor] | None
    keys: list[Tensor] | None
    values: list[Tensor] | None
    last: Tensor
    mask: Tensor | None = None

    memory_fields = ("keys", "values")

    @property
    def length(self) -> int:
        """Attention positions held (0 without attention)."""
        return 0 if self.keys is None else self.keys[0].shape[1]

    def _memory(self) -> list[Tensor]:
        return [*(self.keys or []), *(self.values or [])]

    def _with_memory(self, tensors: list[Tensor], mask: Tensor | None, **changes) -> ActiveMemoryState:
        n = len(self.keys)
        return dataclasses.replace(self, keys=tensors[:n], values=None if self.values is None else tensors[n:],
                                   mask=mask, **changes)

    @classmethod
    def cat(cls, states: list[ActiveMemoryState]) -> ActiveMemoryState:
        """Stack states along the batch; shorter attention histories are left-padded
        with masked positions. The windows have one shape for every state."""
        if len(states) == 1:
            return states[0]
        first = states[0]

        def stacked(get):
            vals = [get(st) for st in states]
            return None if vals[0] is None else [torch.cat(ts) for ts in zip(*vals)]

        changes = dict(windows=stacked(lambda st: st.windows), gated=stacked(lambda st: st.gated),
                       last=torch.cat([st.last for st in states]))
        if first.keys is None:
            return dataclasses.replace(first, **changes)
        tensors, mask = cat_right_aligned([(st._memory(), st.mask) for st in states])
        return first._with_memory(tensors, mask, **changes)

    def compact(self) -> ActiveMemoryState:
        """Cut the leading attention positions that are padding in every row (left
        after select() of short rows); the windows are already minimal."""
        if self.keys is None or self.mask is None:
            return self
        tensors, mask = drop_empty_columns(self._memory(), self.mask)
        return self._with_memory(tensors, mask)


def hard_sigmoid(z: Tensor) -> Tensor:
    """clip(1.2 sigmoid(z) - 0.1, 0, 1): reaches exactly 0 and 1, so a gate can close or open fully."""
    return (1.2 * torch.sigmoid(z) - 0.1).clamp(0.0, 1.0)


class CausalConv(nn.Module):
    """The parameters of a full d_in -> d_out convolution over time whose output at t
    reads the k inputs ending at t; the weight has nn.Conv1d's layout (d_out, d_in, k).
    `apply_convs` runs it, so that convolutions over the same inputs share one unfold."""

    def __init__(self, d_in: int, d_out: int, k: int, bias: bool, bias_init: float = 0.0):
        super().__init__()
        # std 0.02 / sqrt(k): the output scale of a 0.02-initialised linear layer of width d_in
        self.weight = nn.Parameter(torch.empty(d_out, d_in, k).normal_(0.0, 0.02 / math.sqrt(k)))
        self.bias = nn.Parameter(torch.full((d_out,), bias_init)) if bias else None

    @property
    def k(self) -> int:
        return self.weight.shape[2]


def apply_convs(full: Tensor, convs: list[CausalConv]) -> list[Tensor]:
    """Run several causal convolutions of one kernel width over the same inputs.

    full: (B, k-1+T, d_in), the k-1 inputs before this call followed by T new ones.
    Returns one (B, T, d_out) per conv; output t reads full[:, t : t+k].
    """
    B, L, d_in = full.shape
    k = convs[0].k
    T = L - (k - 1)
    if T >= CONV1D_MIN_T:
        xt = full.transpose(1, 2)  # (B, d_in, k-1+T)
        return [F.conv1d(xt, c.weight, c.bias).transpose(1, 2) for c in convs]  # each (B, T, d_out)
    # unfold gives (B, T, d_in, k); flattened, feature c*k + j matches weight[o, c, j]
    cols = full.unfold(1, k, 1).reshape(B, T, d_in * k)  # (B, T, d_in*k)
    # weight (d_out, d_in, k) viewed as (d_out, d_in*k); outputs each (B, T, d_out)
    return [F.linear(cols, c.weight.view(c.weight.shape[0], d_in * k), c.bias) for c in convs]


class ConvMixer(nn.Module):
    """y = W * u (conv and persistent_conv; they differ only in the initial window)."""

    n_streams = 1

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.conv = CausalConv(cfg.d_model, cfg.d_model, cfg.conv_kernel, cfg.bias)

    def forward(self, u: Tensor, past: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """u (B, T, d); past [(B, k-1, d) previous inputs]. Returns y (B, T, d) and the
        streams [(B, k-1+T, d) previous then new inputs] whose tails are the next windows."""
        full = torch.cat([past[0], u], 1)  # (B, k-1+T, d)
        return apply_convs(full, [self.conv])[0], [full]


class HighwayConvMixer(nn.Module):
    """y = g ⊙ (W * u) + (1 - g) ⊙ u with g = hardsig(W_g * u + b_g)."""

    n_streams = 1

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.conv = CausalConv(cfg.d_model, cfg.d_model, cfg.conv_kernel, cfg.bias)
        # the gate always has a bias: it sets the gate's resting opening
        self.gate = CausalConv(cfg.d_model, cfg.d_model, cfg.conv_kernel, bias=True)

    def forward(self, u: Tensor, past: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """As ConvMixer.forward."""
        full = torch.cat([past[0], u], 1)  # (B, k-1+T, d)
        c, g = apply_convs(full, [self.conv, self.gate])
        g = hard_sigmoid(g)
        return g * c + (1.0 - g) * u, [full]


class CGRUMixer(nn.Module):
    """The causal convolutional GRU: g = hardsig(W_g * u + b_g), r = hardsig(W_r * u + b_r),
    c = tanh(W_c * (r ⊙ u) + b_c), y = g ⊙ u + (1 - g) ⊙ c."""

    n_streams = 2

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, k = cfg.d_model, cfg.conv_kernel
        # Gate biases start at 1 as in the Neural GPU: both gates begin mostly open (0.78).
        self.update = CausalConv(d, d, k, bias=True, bias_init=1.0)
        self.reset = CausalConv(d, d, k, bias=True, bias_init=1.0)
        self.candidate = CausalConv(d, d, k, cfg.bias)

    def forward(self, u: Tensor, past: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """u (B, T, d); past [(B, k-1, d) previous inputs, (B, k-1, d) previous r ⊙ u].
        Returns y (B, T, d) and the streams [inputs, r ⊙ u], each (B, k-1+T, d)."""
        full = torch.cat([past[0], u], 1)  # (B, k-1+T, d)
        g, r = apply_convs(full, [self.update, self.reset])
        g = hard_sigmoid(g)
        gated = torch.cat([past[1], hard_sigmoid(r) * u], 1)  # (B, k-1+T, d)
        c = torch.tanh(apply_convs(gated, [self.candidate])[0])
        return g * u + (1.0 - g) * c, [full, gated]


MIXERS = {"conv": ConvMixer, "persistent_conv": ConvMixer, "highway_conv": HighwayConvMixer, "cgru": CGRUMixer}


class ActiveMemoryLayer(nn.Module):
    """The mixer (plus self-attention with mix_attention) followed by F feed-forward sublayers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mixer = MIXERS[cfg.mixer](cfg)
        self.attn = SelfAttention(cfg) if cfg.mix_attention else None
        self.drop = nn.Dropout(cfg.dropout)
        self.ffs = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.ff_per_layer))

    def forward(self, x, past, past_k, past_v, mask, causal):
        """x (B, T, d); past: the mixer's windows; past_k/v (B, H, S, Dh) or None without
        attention. Returns x (B, T, d), the mixer's streams and the extended keys/values."""
        u = self.norm(x)
        y, streams = self.mixer(u, past)
        k = v = None
        if self.attn is not None:
            a, k, v = self.attn(u, past_k, past_v, mask, causal)
            y = y + a
        x = residual_add(self.drop(y), x)
        for ff in self.ffs:
            x = ff(x)
        return x, streams, k, v


class ActiveMemoryLM(PendingTokenLM):
    """Active-memory LM (arch "active_memory"): see the module doc. Its state has a
    fixed part (`state_numel_fixed`, the convolution windows)."""

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        if cfg.arch != "active_memory":
            raise ConfigError(f"ActiveMemoryLM builds arch 'active_memory', got {cfg.arch!r}")
        super().__init__(cfg, ActiveMemoryLayer)
        self.apply(init_weights)
        # persistent_conv: the k-1 vectors that precede the first input of every layer
        # (one parameter for the whole model), small so training starts near zero padding
        self.padding = nn.Parameter(torch.empty(cfg.conv_kernel - 1, cfg.d_model).normal_(0.0, 0.02)) \
            if cfg.mixer == "persistent_conv" else None

    @property
    def max_history(self) -> int | None:
        """History positions a state keeps: k-1 inputs per layer, or unbounded with attention."""
        return None if self.cfg.mix_attention else self.cfg.conv_kernel - 1

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        """Attention keys (and values unless shared_kv) per history position; 0 without attention."""
        if not self.cfg.mix_attention:
            return 0
        return self.cfg.n_layers * self.cfg.d_model * (1 if self.cfg.shared_kv else 2)

    def state_numel_fixed(self) -> int:
        """Numbers per row that do not grow with the history: the k-1 windows of every layer."""
        streams = self.layers[0].mixer.n_streams
        return self.cfg.n_layers * streams * (self.cfg.conv_kernel - 1) * self.cfg.d_model

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> ActiveMemoryState:
        """The state after `<s>`: windows holding the padding, no attention memory, `<s>`
        pending. No model compute."""
        dtype, device = self.state_placement(device)
        cfg = self.cfg
        shape = (batch_size, cfg.conv_kernel - 1, cfg.d_model)
        if self.padding is not None:
            windows = [self.padding.to(device)[None].expand(shape) for _ in self.layers]  # each (B, k-1, d)
        else:
            windows = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        # r ⊙ u of a zero input is zero whatever r is
        gated = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers] \
            if cfg.mixer == "cgru" else None
        keys = values = None
        if cfg.mix_attention:
            H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
            kv_shape = (batch_size, 0, H, Dh)
            keys = [torch.empty(kv_shape, dtype=dtype, device=device) for _ in self.layers]
            values = None if cfg.shared_kv else [torch.empty(kv_shape, dtype=dtype, device=device)
                                                 for _ in self.layers]
        return ActiveMemoryState(windows=windows, gated=gated, keys=keys, values=values,
                                 last=torch.full((batch_size,), BOS_ID, dtype=torch.long, device=device))

    # ---- internals -----------------------------------------------------------------
    def _run(self, tokens: Tensor, state: ActiveMemoryState, lengths: Tensor | None, include_last: bool):
        """Run the pending token and tokens[:, :-1] (plus tokens[:, -1] when
        include_last) through the model; returns hidden (B, T or T+1, d) and the state
        after the T inputs that precede each row's targets (only its real ones)."""
        B, T = tokens.shape
        dev = tokens.device
        k1 = self.cfg.conv_kernel - 1
        run = self.pending_inputs(tokens, state.last, lengths, include_last)  # (B, n_run)
        n_run = run.shape[1]
        # Row b's new window: the k-1 stream columns that end after its n_new[b] real
        # inputs (padding comes after them, so it never enters; the extra column of
        # `step` is read out only).
        n_new = lengths if lengths is not None else torch.full((B,), T, dtype=torch.long, device=dev)
        cols = (n_new[:, None] + torch.arange(k1, device=dev)[None, :])[:, :, None]  # (B, k-1, 1)
        cols = cols.expand(B, k1, self.cfg.d_model)  # (B, k-1, d)

        S = state.length
        mask, causal = causal_mask(state.mask, S, n_run, dev) if self.cfg.mix_attention else (None, False)

        x = embed_tokens(self, run)
        x = self.drop(x)  # (B, n_run, d)
        windows, gated, new_kv = [], [], []
        for i, layer in enumerate(self.layers):
            past = [state.windows[i]] if state.gated is None else [state.windows[i], state.gated[i]]
            past_k = past_v = None
            if state.keys is not None:
                past_k = state.keys[i].transpose(1, 2)  # (B, H, S, Dh)
                past_v = None if state.values is None else state.values[i].transpose(1, 2)  # (B, H, S, Dh)
            x, streams, k, v = layer(x, past, past_k, past_v, mask, causal)
            windows.append(streams[0].gather(1, cols))
            if state.gated is not None:
                gated.append(streams[1].gather(1, cols))
            if k is not None:
                # (B, H, S+n_run, Dh) -> (B, S+T, H, Dh): the extra column of `step` is not kept
                new_kv.append((k[:, :, : S + T].transpose(1, 2),
                               None if v is None else v[:, :, : S + T].transpose(1, 2)))
        h = self.norm(x)

        new_state = ActiveMemoryState(windows=windows, gated=gated if state.gated is not None else None,
                                      keys=None, values=None, last=self.next_pending(tokens, state.last, lengths))
        if state.keys is not None:
            new_state = self._extend_memory(new_state, state, new_kv, lengths)
        return h, new_state

    @staticmethod
    def _extend_memory(new_state: ActiveMemoryState, state: ActiveMemoryState,
                       new_kv: list[tuple[Tensor, Tensor | None]], lengths: Tensor | None) -> ActiveMemoryState:
        """Attach the attention memory: new_kv holds per layer the cache extended by T
        columns, (B, S+T, H, Dh) each; only each row's real columns stay, right-aligned."""
        keys = [k for k, _ in new_kv]
        values = None if state.values is None else [v for _, v in new_kv]
        if state.mask is None and lengths is None:
            # every column is real: the extended caches are the memory as they are
            return dataclasses.replace(new_state, keys=keys, values=values, mask=None)
        S = state.length
        old = state._memory()
        new = [t[:, S:] for t in [*keys, *(values or [])]]  # each (B, T, H, Dh)
        tensors, mask = append_right_aligned(old, state.mask, new, lengths)
        n = len(keys)
        return dataclasses.replace(new_state, keys=tensors[:n], values=None if values is None else tensors[n:],
                                   mask=mask)
