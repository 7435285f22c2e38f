"""The small-state Transformer LM (Irie et al. 2020).

`n_layers` pre-LayerNorm self-attention layers, each followed by `ff_per_layer`
feed-forward sublayers with their own LayerNorm and residual; no positional
encoding (the causal mask alone orders the tokens). With `shared_kv` one projection
gives both keys and values, so the state stores keys only: n_layers × d_model
numbers per position instead of twice that.

`pos="rotary"` adds rotary position embeddings (RoPE) to queries and keys. Keys are
cached already rotated, so the state needs no new field: the position of the next
token of a row is the number of valid positions in its cache. Attention then depends
only on the distance between query and key, which keeps every cache operation that
reorders or pads positions (compact, cat, assemble) and tree attention (positions =
depth in the trie) exact.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..state import LMState, length_mask
from ..vocab import BOS_ID
from .base import Block, PendingTokenLM, SelfAttention, causal_mask, embed_tokens, init_weights, rotary_tables
from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TransformerState(LMState):
    """Per-layer attention memory of the history, plus the pending token.

    keys[l], values[l]: (B, H, S, Dh) for the S positions already run through the
    model; `values` is None with shared_kv. last: (B,) the most recent token, not yet
    run through the model (its output predicts the next token, so running it is
    deferred until that token is known). mask: (B, S) bool, False at positions that
    were padding in a call with `lengths`; None when every position is valid.
    """

    keys: list[Tensor]
    values: list[Tensor] | None
    last: Tensor
    mask: Tensor | None = None

    memory_fields = ("keys", "values")

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def cat(cls, states: list["TransformerState"]) -> "TransformerState":
        """Stack states along the batch; shorter histories are padded with masked
        positions, so rows of different lengths can share one forward pass."""
        if len(states) == 1:
            return states[0]
        S = max(st.length for st in states)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[2] == S else F.pad(t, (0, 0, 0, S - t.shape[2]))

        def mask_of(st: "TransformerState") -> torch.Tensor:
            B, dev = st.last.shape[0], st.last.device
            m = st.mask if st.mask is not None else torch.ones(B, st.length, dtype=torch.bool, device=dev)
            return F.pad(m, (0, S - st.length), value=False)

        n_layers = len(states[0].keys)
        keys = [torch.cat([padded(st.keys[i]) for st in states]) for i in range(n_layers)]
        values = None if states[0].values is None else [
            torch.cat([padded(st.values[i]) for st in states]) for i in range(n_layers)]
        mask = torch.cat([mask_of(st) for st in states])
        return cls(keys=keys, values=values, last=torch.cat([st.last for st in states]),
                   mask=None if bool(mask.all()) else mask)

    @classmethod
    def assemble(cls, pieces: list[tuple["TransformerState", torch.Tensor, torch.Tensor]],
                 n_rows: int) -> "TransformerState":
        """Row dst[i] of the result = row src[i] of that piece's state, for each
        (state, src, dst) piece: one copy per layer, however many states the rows come
        from (select + cat + reorder would copy every history three times)."""
        first = pieces[0][0]
        S = max(st.length for st, _, _ in pieces)
        B, H, _, Dh = n_rows, first.keys[0].shape[1], first.keys[0].shape[2], first.keys[0].shape[3]
        dev, dtype = first.last.device, first.keys[0].dtype

        def build(get):
            out = []
            for i in range(len(first.keys)):
                t = torch.zeros(B, H, S, Dh, dtype=dtype, device=dev)
                for st, src, dst in pieces:
                    t[dst, :, : st.length] = get(st)[i].index_select(0, src)
                out.append(t)
            return out

        keys = build(lambda st: st.keys)
        values = None if first.values is None else build(lambda st: st.values)
        last = torch.empty(B, dtype=torch.long, device=dev)
        mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
        for st, src, dst in pieces:
            last[dst] = st.last.index_select(0, src)
            m = st.mask.index_select(0, src) if st.mask is not None else torch.ones(
                len(src), st.length, dtype=torch.bool, device=dev)
            mask[dst, : st.length] = m
        return cls(keys=keys, values=values, last=last, mask=None if bool(mask.all()) else mask)

    def compact(self) -> "TransformerState":
        """Move each row's valid positions to the front and cut the common padding.
        Exact for this model: attention over the cached keys does not depend on their
        order (rotary positions, if any, are baked into the cached keys)."""
        if self.mask is None:
            return self
        counts = self.mask.sum(1)  # (B,)
        s_new = int(counts.max()) if counts.numel() else 0
        if s_new == self.length:
            return self
        order = torch.argsort((~self.mask).to(torch.int8), dim=1, stable=True)[:, :s_new]  # (B, S_new)
        B, H, _, Dh = self.keys[0].shape
        idx = order[:, None, :, None].expand(B, H, s_new, Dh)

        def gather(ts):
            return None if ts is None else [t.gather(2, idx) for t in ts]

        new_mask = torch.arange(s_new, device=counts.device)[None, :] < counts[:, None]
        return TransformerState(keys=gather(self.keys), values=gather(self.values), last=self.last,
                                mask=None if bool(new_mask.all()) else new_mask)


def make_layer(cfg: ModelConfig) -> Block:
    """One self-attention sublayer followed by `ff_per_layer` feed-forward sublayers."""
    return Block(cfg, SelfAttention(cfg))


class TransformerLM(PendingTokenLM):
    """The small-state Transformer (see the module doc); the only family with tree
    attention (`score_tree`)."""

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        super().__init__(cfg, make_layer)
        self.apply(init_weights)

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return self.cfg.n_layers * self.cfg.d_model * (1 if self.cfg.shared_kv else 2)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> TransformerState:
        """The state after `<s>`: nothing cached yet, `<s>` pending. No compute."""
        dtype, device = self.state_placement(device)
        H, Dh = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        shape = (batch_size, H, 0, Dh)
        return TransformerState(
            keys=[torch.empty(shape, dtype=dtype, device=device) for _ in self.layers],
            values=None if self.cfg.shared_kv else [torch.empty(shape, dtype=dtype, device=device)
                                                    for _ in self.layers],
            last=torch.full((batch_size,), BOS_ID, dtype=torch.long, device=device),
        )

    def score_tree(self, tokens: Tensor, parents: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Score a prefix trie in one pass ("tree attention"): every node attends to
        itself and its ancestors only, which is exact here because the model has no
        positional encoding, or rotary positions taken from each node's depth.

        tokens: (B, N) the nodes of each row's trie, parents before children.
        parents: (B, N) index of each node's parent in the same row, -1 for nodes
        that follow `<s>` directly. lengths: optional (B,) number of real nodes.
        Returns (B, N) natural-log p(node token | <s>, ancestors); 0 at padding.
        """
        if tokens.shape != parents.shape or tokens.dim() != 2:
            raise ValueError(f"tokens and parents must both be (B, N), got {tuple(tokens.shape)}, "
                             f"{tuple(parents.shape)}")
        B, N = tokens.shape
        dev = tokens.device
        if lengths is None:
            lengths = torch.full((B,), N, dtype=torch.long, device=dev)
        real = length_mask(lengths, N)  # (B, N)
        tokens = tokens.masked_fill(~real, 0)
        par = torch.where(real, parents, -1) + 1  # (B, N) parent position in the input; 0 = <s>
        if bool((par > torch.arange(1, N + 1, device=dev)[None]).any()):
            raise ValueError("every parent must come before its child in the row")
        inputs = torch.cat([torch.full((B, 1), BOS_ID, dtype=torch.long, device=dev), tokens], 1)  # (B, N+1)
        # ancestor-or-self mask, built by walking every node up to <s> (depth steps)
        up = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), par], 1)  # (B, N+1) parent of each position
        mask = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=dev)
        cur = torch.arange(N + 1, device=dev).expand(B, N + 1).clone()  # (B, N+1)
        for _ in range(N + 1):
            mask.scatter_(2, cur[:, :, None], True)
            if not bool(cur.any()):
                break
            cur = up.gather(1, cur)
        x = embed_tokens(self, inputs)
        x = self.drop(x)  # (B, N+1, d)
        attn_mask = mask[:, None]  # (B, 1, N+1, N+1)
        H, Dh = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        # a node's position is its depth: <s> at 0, as in a sequence scored from the start
        rope = rotary_tables(mask.sum(-1) - 1, Dh) if self.cfg.pos == "rotary" else None
        empty = torch.empty(B, H, 0, Dh, dtype=x.dtype, device=dev)
        for layer in self.layers:
            x, _, _ = layer(x, empty, None if self.cfg.shared_kv else empty, attn_mask, False, rope)
        h = self.norm(x)  # (B, N+1, d)
        # Only real nodes go through the output layer: padding would cost a full vocabulary row each.
        b_idx, n_idx = real.nonzero(as_tuple=True)  # (R,), (R,)
        h_par = h[b_idx, par[b_idx, n_idx]]  # (R, d) output at each real node's parent
        logp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        logp[b_idx, n_idx] = self.output.target_logprob(h_par, tokens[b_idx, n_idx])
        return logp

    # ---- internals -----------------------------------------------------------------
    def _run(self, tokens, state: TransformerState, lengths, include_last: bool):
        """Run the pending token and tokens[:, :-1] (plus tokens[:, -1] when
        include_last) through the model; returns hidden (B, T or T+1, d) and the new
        state, whose cache holds only the T inputs that precede each new target."""
        B, T = tokens.shape
        run = self.pending_inputs(tokens, state.last, lengths, include_last)  # (B, n_run)
        n_run = run.shape[1]
        # Row b's inputs are valid up to lengths[b] (exclusive); the extra last column
        # of `step` is only read out, never cached.
        n_cache = T
        valid_new = length_mask(lengths, n_cache) if lengths is not None else None  # (B, T)

        S = state.length
        mask, causal = causal_mask(state.mask, S, n_run, tokens.device)

        x = embed_tokens(self, run)
        x = self.drop(x)  # (B, n_run, d)
        rope = None
        if self.cfg.pos == "rotary":
            done = (torch.full((B,), S, device=tokens.device) if state.mask is None
                    else state.mask.sum(1))  # (B,) positions already run per row
            positions = done[:, None] + torch.arange(n_run, device=tokens.device)[None]  # (B, n_run)
            rope = rotary_tables(positions, self.cfg.d_model // self.cfg.n_heads)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            past_v = None if state.values is None else state.values[i]
            x, k, v = layer(x, state.keys[i], past_v, mask, causal, rope)
            keys.append(k[:, :, : S + n_cache])
            if v is not None:
                values.append(v[:, :, : S + n_cache])
        h = self.norm(x)

        if lengths is None:
            new_mask = None if state.mask is None else torch.cat(
                [state.mask, torch.ones(B, n_cache, dtype=torch.bool, device=tokens.device)], 1)
        else:
            hist = state.mask if state.mask is not None else torch.ones(B, S, dtype=torch.bool, device=tokens.device)
            new_mask = torch.cat([hist, valid_new], 1)
        new_state = TransformerState(keys=keys, values=None if state.values is None else values,
                                     last=self.next_pending(tokens, state.last, lengths), mask=new_mask)
        return h, new_state

