"""The Feedback Transformer LM (Fan et al. 2020, "Addressing some limitations of
Transformers with feedback memory").

Every layer of step t attends to one shared memory of the *past* steps instead of
the previous layer's outputs. The memory entry of step t is

    m_t = sum_{l=0..L} softmax(w)_l * x_t^l

a learned convex combination of all layers' outputs at step t (l = 0 is the embedding
output), so the top layers of earlier steps feed the bottom layers of later ones.
m_t is built only after every layer of step t ran, so step t never reads its own
entry; to give the first step something to attend to, each layer also attends to one
extra key/value projected from its own (normalised) input x_t^{l-1}.

Keys and values are projections of LayerNorm(m_t): with `feedback_shared_kv` one
projection serves every layer (2 × d_model numbers per position), otherwise each
layer has its own (2 × n_layers × d_model). The state stores the projected keys and
values, so scoring a token costs O(history), not O(history × d²). No positional
encoding: order comes from the recurrence and causality. `mem_len > 0` keeps only the
last mem_len entries (a sliding window, the same whether a sequence is scored in one
call or many); 0 keeps all of them.

Training is sequential over time within a sequence (step t needs every layer of the
steps before it), vectorised over the batch. The keys and values of one call live in
one preallocated buffer written in place step by step; small autograd functions
(`_Write`, `_Attend`, `_Export`) carry the gradient through that buffer, which plain
autograd rejects (every write would invalidate the views read by earlier steps). The
weights applied at every step get their gradient in one product over all steps
(`_Deferred`) rather than one thin product and one accumulation per step. The output
layer runs once over all steps at the end. Attention probabilities get no dropout
(the sublayer outputs do).
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
    cat_right_aligned,
    drop_empty_columns,
    keep_last,
    length_mask,
    own_storage,
    right_align,
)
from ..vocab import BOS_ID
from .base import FeedForward, PendingTokenLM, embed_tokens, init_weights, residual_add
from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class FeedbackState(LMState):
    """The projected feedback memory of the history, plus the pending token.

    keys, values: (B, S, G, d_model) for the S steps already run, right-aligned (each
    row's history is a suffix of the time axis); G = 1 with shared K/V, else n_layers
    (one projection per layer). last: (B,) the most recent token, not yet run (its
    output predicts the next token, so running it waits until that token is known).
    mask: (B, S) bool, False at left padding; None when every position is valid.
    """

    keys: Tensor
    values: Tensor
    last: Tensor
    mask: Tensor | None = None

    memory_fields = ("keys", "values")

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    @classmethod
    def cat(cls, states: list[FeedbackState]) -> FeedbackState:
        """Stack states along the batch; shorter histories are left-padded (masked)."""
        if len(states) == 1:
            return states[0]
        (keys, values), mask = cat_right_aligned([([st.keys, st.values], st.mask) for st in states])
        return cls(keys=keys, values=values, last=torch.cat([st.last for st in states]), mask=mask)

    def compact(self) -> FeedbackState:
        """Cut the leading columns that are padding in every row."""
        (keys, values), mask = drop_empty_columns([self.keys, self.values], self.mask)
        return dataclasses.replace(self, keys=keys, values=values, mask=mask)


# ---- the in-place K/V buffer and its gradient -----------------------------------------


class _Tape:
    """The keys and values of one call, (G, 2, B, H, N, Dh) with time at dim 4, and
    the gradient w.r.t. them, filled by `_Attend.backward` and read by `_Write.backward`.

    Every reader takes the latest `link` (a scalar output of the last `_Write`) as an
    input. Autograd runs a node's backward only after every consumer of its output,
    so `_Write` of column c runs its backward after every `_Attend` that could read c:
    the gradient of column c is complete by then.
    """

    def __init__(self, buf: Tensor):
        self.buf = buf
        self.grad: Tensor | None = None
        self.tracked = False  # some column was written from a tensor that needs a gradient

    def grad_buf(self) -> Tensor:
        if self.grad is None:
            self.grad = torch.zeros_like(self.buf)
        return self.grad


class _Write(torch.autograd.Function):
    """buf[..., col:col+n, :] = kv in place; returns a fresh link (scalar zero)."""

    @staticmethod
    def forward(ctx, kv: Tensor, link: Tensor | None, tape: _Tape, col: int) -> Tensor:
        n = kv.shape[4]
        tape.buf[:, :, :, :, col : col + n].copy_(kv)
        ctx.tape, ctx.col, ctx.n, ctx.has_link, ctx.dtype = tape, col, n, link is not None, kv.dtype
        return kv.new_zeros(())

    @staticmethod
    def backward(ctx, g_link: Tensor):
        tape, col, n = ctx.tape, ctx.col, ctx.n
        g_kv = None if tape.grad is None else tape.grad[:, :, :, :, col : col + n].to(ctx.dtype, copy=True)
        return g_kv, (g_link if ctx.has_link else None), None, None


@dataclasses.dataclass(frozen=True)
class _Window:
    """Where one step attends: buffer columns [lo, hi) of group g on `tape`, with an additive bias
    (B, 1, hi-lo) of 0 / -inf or None, and the scores' scale. No gradient flows into any of it."""

    tape: _Tape
    g: int
    lo: int
    hi: int
    bias: Tensor | None
    scale: float


class _Attend(torch.autograd.Function):
    """One query per row and head over a window of the buffer plus one extra key/value of its own.

    q, k_self, v_self: (B, H, Dh). Returns (B, H, Dh). Attention probabilities are kept for the
    backward (B, H, n+1).
    """

    @staticmethod
    def forward(ctx, q, k_self, v_self, link, win: _Window):
        tape, g, lo, hi, bias, scale = win.tape, win.g, win.lo, win.hi, win.bias, win.scale
        n = hi - lo
        keys = tape.buf[g, 0, :, :, lo:hi]  # (B, H, n, Dh)
        vals = tape.buf[g, 1, :, :, lo:hi]  # (B, H, n, Dh)
        # in the buffer's precision, whatever autocast made of the projections
        in_dtypes = (q.dtype, k_self.dtype, v_self.dtype)
        q, k_self, v_self = (t.to(keys.dtype) for t in (q, k_self, v_self))
        s_mem = torch.matmul(keys, q.unsqueeze(-1)).squeeze(-1).mul_(scale)  # (B, H, n)
        if bias is not None:
            s_mem = s_mem.add_(bias)
        s_self = (q * k_self).sum(-1, keepdim=True).mul_(scale)  # (B, H, 1)
        p = torch.softmax(torch.cat([s_mem, s_self], -1), dim=-1)  # (B, H, n+1)
        out = torch.matmul(p[..., None, :n], vals).squeeze(-2).addcmul_(p[..., n:], v_self)  # (B, H, Dh)
        ctx.save_for_backward(q, k_self, v_self, p)
        ctx.in_dtypes = in_dtypes
        ctx.tape, ctx.g, ctx.lo, ctx.hi, ctx.scale, ctx.has_link = tape, g, lo, hi, scale, link is not None
        return out

    @staticmethod
    def backward(ctx, g_out: Tensor):
        q, k_self, v_self, p = ctx.saved_tensors
        tape, g, lo, hi, scale = ctx.tape, ctx.g, ctx.lo, ctx.hi, ctx.scale
        g_out = g_out.to(q.dtype)
        n = hi - lo
        keys = tape.buf[g, 0, :, :, lo:hi]  # (B, H, n, Dh)
        vals = tape.buf[g, 1, :, :, lo:hi]  # (B, H, n, Dh)
        dp = torch.cat([torch.matmul(vals, g_out.unsqueeze(-1)).squeeze(-1),  # (B, H, n)
                        (v_self * g_out).sum(-1, keepdim=True)], -1)  # (B, H, n+1)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale  # softmax backward, (B, H, n+1)
        ds_mem, ds_self = ds[..., :n], ds[..., n:]
        g_q = torch.matmul(ds_mem.unsqueeze(-2), keys).squeeze(-2).addcmul_(ds_self, k_self)  # (B, H, Dh)
        g_k_self = ds_self * q
        g_v_self = p[..., n:] * g_out
        if tape.tracked and n:
            grad = tape.grad_buf()
            # outer products accumulated straight into the buffer's gradient, (B, H, n, Dh)
            grad[g, 0, :, :, lo:hi].addcmul_(ds_mem.unsqueeze(-1), q.unsqueeze(-2))
            grad[g, 1, :, :, lo:hi].addcmul_(p[..., :n].unsqueeze(-1), g_out.unsqueeze(-2))
        g_link = torch.zeros((), dtype=q.dtype, device=q.device) if ctx.has_link else None
        g_q, g_k_self, g_v_self = (gt.to(dt) for gt, dt in zip((g_q, g_k_self, g_v_self), ctx.in_dtypes))
        return g_q, g_k_self, g_v_self, g_link, None


class _Export(torch.autograd.Function):
    """The buffer's columns [0, N) as state tensors keys, values: (B, N, G, d)."""

    @staticmethod
    def forward(ctx, link: Tensor, tape: _Tape):
        ctx.tape = tape
        return _export(tape.buf)

    @staticmethod
    def backward(ctx, g_keys: Tensor, g_values: Tensor):
        grad = ctx.tape.grad_buf()
        G, _, B, H, N, Dh = grad.shape
        for i, gt in enumerate((g_keys, g_values)):
            if gt is not None:
                grad[:, i] += gt.reshape(B, N, G, H, Dh).permute(2, 0, 3, 1, 4)  # (G, B, H, N, Dh)
        return torch.zeros((), dtype=grad.dtype, device=grad.device), None


def _export(buf: Tensor) -> tuple[Tensor, Tensor]:
    G, _, B, H, N, Dh = buf.shape
    out = buf.permute(1, 2, 4, 0, 3, 5).clone(memory_format=torch.contiguous_format)  # (2, B, N, G, H, Dh)
    out = out.view(2, B, N, G, H * Dh)  # (2, B, N, G, d)
    return out[0], out[1]


class _Deferred:
    """A weight applied once per step: `x @ weight.T` for each step's (B, in) input,
    with the weight's gradient computed in one (out, N) @ (N, in) product over all
    steps' rows at the end of the backward, instead of one thin product and one
    full-size accumulation per step."""

    def __init__(self, weight: Tensor):
        self.inputs: list[Tensor] = []  # per step (B, in); never modified in place afterwards
        self.grads: dict[int, Tensor] = {}  # step index -> (B, out)
        self.proxy = _DeferredWeight.apply(weight, self)

    def __call__(self, x: Tensor) -> Tensor:
        return _StepMatmul.apply(x, self.proxy, self)


class _DeferredWeight(torch.autograd.Function):
    """The weight itself; its backward runs after every step that used it."""

    @staticmethod
    def forward(ctx, weight: Tensor, acc: _Deferred) -> Tensor:
        ctx.acc, ctx.dtype = acc, weight.dtype
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, _unused: Tensor):
        acc = ctx.acc
        if not acc.grads:
            return None, None
        steps = sorted(acc.grads)
        g = torch.cat([acc.grads[i] for i in steps])  # (N, out)
        x = torch.cat([acc.inputs[i].to(g.dtype) for i in steps])  # (N, in)
        acc.grads.clear()
        return (g.t() @ x).to(ctx.dtype), None  # (out, in)


class _StepMatmul(torch.autograd.Function):
    """x (B, in) @ weight.T; the weight's gradient is left to `_DeferredWeight`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, acc: _Deferred) -> Tensor:
        ctx.acc, ctx.step, ctx.x_dtype = acc, len(acc.inputs), x.dtype
        acc.inputs.append(x)
        ctx.save_for_backward(weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, g: Tensor):
        (weight,) = ctx.saved_tensors
        ctx.acc.grads[ctx.step] = g
        # under autocast g may be narrower than the weight and x: each gradient in its input's dtype
        return (g @ weight.to(g.dtype)).to(ctx.x_dtype), None, None


def _step_linear(weight: Tensor, bias: Tensor | None, defer: bool):
    """(B, in) -> (B, out) linear map for one step at a time; `defer` when training."""
    if not defer:
        return lambda x: F.linear(x, weight, bias)
    mm = _Deferred(weight)
    return mm if bias is None else (lambda x: mm(x) + bias)


# ---- the model -------------------------------------------------------------------------


class FeedbackLayer(nn.Module):
    """One step of one layer: pre-LayerNorm attention over the feedback memory (plus
    the layer's own input), then `ff_per_layer` feed-forward sublayers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h = cfg.n_heads
        self.dh = cfg.d_model // cfg.n_heads
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.ffs = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.ff_per_layer))

    def step_maps(self, kv_weight: Tensor, kv_bias: Tensor | None, defer: bool) -> dict:
        """The linear maps of one call: this layer's query projection stacked on the K/V
        projection it shares with the memory (so a layer input's own key/value comes
        from the same projection as the memory's), the output projection and the
        feed-forward layers. kv_weight (2d, d): keys then values."""
        w_qkv = torch.cat([self.q.weight, kv_weight])  # (3d, d)
        b_qkv = None if kv_bias is None else torch.cat([self.q.bias, kv_bias])  # (3d,)
        return {
            "qkv": _step_linear(w_qkv, b_qkv, defer),
            "o": _step_linear(self.o.weight, self.o.bias, defer),
            "ff": [(_step_linear(ff.fc1.weight, ff.fc1.bias, defer), _step_linear(ff.fc2.weight, ff.fc2.bias, defer))
                   for ff in self.ffs],
        }

    def forward(self, x: Tensor, maps: dict, attend) -> Tensor:
        """x (B, d) the layer input at one step; maps: from `step_maps`; attend:
        (q, k_self, v_self) each (B, H, Dh) -> (B, H, Dh). Returns (B, d)."""
        B, d = x.shape
        qkv = maps["qkv"](self.norm(x)).view(B, 3, self.h, self.dh)  # (B, 3, H, Dh)
        a = attend(qkv[:, 0], qkv[:, 1], qkv[:, 2])  # (B, H, Dh)
        x = residual_add(self.drop(maps["o"](a.reshape(B, d))), x)  # (B, d)
        for ff, (fc1, fc2) in zip(self.ffs, maps["ff"]):
            h = ff.drop(F.relu(fc1(ff.norm(x)), inplace=True))  # (B, d_ff)
            x = residual_add(ff.drop(fc2(h)), x)
        return x


class FeedbackLM(PendingTokenLM):
    """Feedback-memory LM (arch "feedback"): see the module docstring. Hooks for the
    trainer and `eval`: `max_history` (mem_len or None) and `report()` (the learned
    layer weights of the memory)."""

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        if cfg.shared_kv:
            raise ConfigError("arch feedback stores separate keys and values; set shared_kv=False "
                              "(feedback_shared_kv=True already shares one K/V projection across layers)")
        super().__init__(cfg, FeedbackLayer)
        self.apply(init_weights)

    def add_memory(self, cfg: ModelConfig) -> None:
        """The memory's layer weights, LayerNorm and K/V projection."""
        self.groups = 1 if cfg.feedback_shared_kv else cfg.n_layers  # K/V projections of the memory
        # logits of the layer weights w (embedding output first); zeros = a plain average
        self.memory_logits = nn.Parameter(torch.zeros(cfg.n_layers + 1))
        self.memory_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        # group g's keys then values: output rows [2d·g, 2d·g + d) and [2d·g + d, 2d·(g+1))
        self.memory_kv = nn.Linear(cfg.d_model, 2 * self.groups * cfg.d_model, bias=cfg.bias)

    @property
    def max_history(self) -> int | None:
        """Most memory entries a state keeps: mem_len, or None (unbounded)."""
        return self.cfg.mem_len or None

    def memory_weights(self) -> Tensor:
        """(n_layers + 1,) softmax(w): the weight of each layer's output in a memory
        entry, the embedding output first. Sums to 1."""
        return torch.softmax(self.memory_logits, dim=0)

    def report(self) -> dict:
        return {"memory_weights": [round(float(w), 4) for w in self.memory_weights().detach()]}

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return 2 * self.groups * self.cfg.d_model

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> FeedbackState:
        """The state after `<s>`: an empty memory, `<s>` pending. No compute."""
        dtype, device = self.state_placement(device)
        shape = (batch_size, 0, self.groups, self.cfg.d_model)
        return FeedbackState(
            keys=torch.empty(shape, dtype=dtype, device=device),
            values=torch.empty(shape, dtype=dtype, device=device),
            last=torch.full((batch_size,), BOS_ID, dtype=torch.long, device=device),
        )

    # ---- internals -----------------------------------------------------------------
    def _run(self, tokens: Tensor, state: FeedbackState, lengths: Tensor | None, include_last: bool):
        """Run the pending token and tokens[:, :-1] (plus tokens[:, -1] when
        include_last) step by step; returns the final hidden states (B, T or T+1, d)
        and the new state, whose memory gains one entry per target token."""
        cfg = self.cfg
        B, T = tokens.shape
        G, H, d = self.groups, cfg.n_heads, cfg.d_model
        Dh = d // H
        run = self.pending_inputs(tokens, state.last, lengths, include_last)  # (B, n_run)
        n_run = run.shape[1]

        x0 = embed_tokens(self, run)
        x0 = self.drop(x0)  # (B, n_run, d)

        S = state.length  # history columns
        grad_on = torch.is_grad_enabled()
        tape, link, bias = self._tape(state, T, tokens.device, grad_on)

        defer = grad_on and self.memory_kv.weight.requires_grad
        kv_w, kv_b = self.memory_kv.weight, self.memory_kv.bias
        maps = []
        for i, layer in enumerate(self.layers):
            rows = slice(0, 2 * d) if G == 1 else slice(2 * d * i, 2 * d * (i + 1))
            maps.append(layer.step_maps(kv_w[rows], None if kv_b is None else kv_b[rows], defer))
        memory_kv = _step_linear(kv_w, kv_b, defer)

        mix = self.memory_weights()  # (L+1,)
        scale = 1.0 / math.sqrt(Dh)
        W = cfg.mem_len
        # unbind, not x0[:, t]: its backward stacks the steps' gradients once instead of
        # scattering each into a zero (B, n_run, d) tensor
        steps_in = x0.unbind(1)  # n_run x (B, d)
        tops = []
        for t in range(n_run):
            hi = S + t  # memory entries of the steps before this one
            lo = max(0, hi - W) if W else 0
            step_bias = None if bias is None else bias[:, :, lo:hi]
            x = steps_in[t]  # (B, d)
            outs = [x]
            for i, layer in enumerate(self.layers):
                g = 0 if G == 1 else i

                def attend(q, k, v, link=link, win=_Window(tape, g, lo, hi, step_bias, scale)):
                    return _Attend.apply(q, k, v, link, win)

                x = layer(x, maps[i], attend)
                outs.append(x)
            tops.append(x)
            if t < T:  # the extra step of `step` is only read out, never remembered
                m = torch.matmul(mix, torch.stack(outs).view(len(outs), B * d)).view(B, d)  # (B, d)
                kv = memory_kv(self.memory_norm(m)).view(B, G, 2, H, Dh)  # (B, G, 2, H, Dh)
                link = self._write(tape, kv.permute(1, 2, 0, 3, 4).unsqueeze(4), hi, link, grad_on)  # (G,2,B,H,1,Dh)
        h = self.norm(torch.stack(tops, 1))  # (B, n_run, d)
        return h, self._new_state(tape, link, tokens, state, lengths)

    def _tape(self, state: FeedbackState, T: int, dev: torch.device,
              grad_on: bool) -> tuple[_Tape, Tensor | None, Tensor | None]:
        """A buffer for the state's memory and T new entries, the memory written into it, and the additive
        bias (B, 1, N) of its padded columns (None without padding)."""
        B, S = state.last.shape[0], state.length
        G, H, d = self.groups, self.cfg.n_heads, self.cfg.d_model
        Dh, N = d // H, S + T
        # the parameters' precision even under autocast: attention scores and the stored
        # memory keep full precision
        tape = _Tape(torch.empty(G, 2, B, H, N, Dh, dtype=self.memory_kv.weight.dtype, device=dev))
        link = None
        if S:
            hist = torch.stack([state.keys, state.values])  # (2, B, S, G, d)
            hist = hist.view(2, B, S, G, H, Dh).permute(3, 0, 1, 4, 2, 5)  # (G, 2, B, H, S, Dh)
            link = self._write(tape, hist, 0, link, grad_on)
        bias = None
        if state.mask is not None:
            valid = torch.cat([state.mask, torch.ones(B, T, dtype=torch.bool, device=dev)], 1)  # (B, N)
            bias = torch.zeros(B, 1, N, dtype=tape.buf.dtype, device=dev).masked_fill_(~valid[:, None], float("-inf"))
        return tape, link, bias

    def _new_state(self, tape: _Tape, link: Tensor | None, tokens: Tensor, state: FeedbackState,
                   lengths: Tensor | None) -> FeedbackState:
        """The memory written on `tape` as the next state: right-aligned, capped at mem_len."""
        B, T = tokens.shape
        S, W = state.length, self.cfg.mem_len
        if link is not None:
            keys, values = _Export.apply(link, tape)
        else:
            keys, values = _export(tape.buf)
        ones = torch.ones(B, T if lengths is None else S, dtype=torch.bool, device=tokens.device)
        if lengths is None:
            mask = None if state.mask is None else torch.cat([state.mask, ones], 1)  # (B, N)
        else:
            hist_valid = state.mask if state.mask is not None else ones
            mask = torch.cat([hist_valid, length_mask(lengths, T)], 1)  # (B, N)
        tensors = [keys, values]
        if mask is not None:
            tensors, mask = right_align(tensors, mask)
            tensors, mask = drop_empty_columns(tensors, mask)
        if W:
            tensors, mask = keep_last(tensors, mask, W)
        if mask is not None and bool(mask.all()):
            mask = None
        return FeedbackState(keys=own_storage(tensors[0]), values=own_storage(tensors[1]),
                             last=self.next_pending(tokens, state.last, lengths), mask=mask)

    @staticmethod
    def _write(tape: _Tape, kv: Tensor, col: int, link: Tensor | None, grad_on: bool) -> Tensor | None:
        """Write kv (G, 2, B, H, n, Dh) at columns [col, col+n); returns the new link."""
        if grad_on and kv.requires_grad:
            tape.tracked = True
            return _Write.apply(kv, link, tape, col)
        tape.buf[:, :, :, :, col : col + kv.shape[4]].copy_(kv)
        return link
