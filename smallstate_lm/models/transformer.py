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
from torch import Tensor, nn

from ..state import LMState, check_tokens, length_mask
from ..vocab import BOS_ID
from .config import ModelConfig
from .output import OutputLayer, embed_tokens, input_embedding


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


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h = cfg.n_heads
        self.dh = cfg.d_model // cfg.n_heads
        self.shared_kv = cfg.shared_kv
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = None if cfg.shared_kv else nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor | None, mask: Tensor | None, causal: bool,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """x (B, T, d); past_k/v (B, H, S, Dh); rope: optional (cos, sin), each
        (B, 1, T, Dh), for the new positions. Returns output (B, T, d) and the
        extended keys/values (B, H, S+T, Dh)."""
        B, T, d = x.shape
        q = self.q(x).view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)
        k_new = self.k(x).view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)
        if rope is not None:
            q, k_new = apply_rotary(q, *rope), apply_rotary(k_new, *rope)
        k = _extend(past_k, k_new)  # (B, H, S+T, Dh)
        if self.shared_kv:
            v, new_v = k, None
        else:
            v = _extend(past_v, self.v(x).view(B, T, self.h, self.dh).transpose(1, 2))  # (B, H, S+T, Dh)
            new_v = v
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, Dh)
        return self.o(y.transpose(1, 2).reshape(B, T, d)), k, new_v


def residual_add(y: Tensor, x: Tensor) -> Tensor:
    """x + y, in place on y (a fresh sublayer output, saving an allocation) when the dtypes
    agree. Under bf16 autocast y is bf16 while the residual stream x is float32: adding in
    place would demote the stream to bf16 for every later layer."""
    return y.add_(x) if y.dtype == x.dtype else x + y


def rotary_tables(positions: Tensor, dh: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """positions (B, T) integer -> (cos, sin), each (B, 1, T, dh) float32, for `apply_rotary`."""
    inv_freq = base ** (-torch.arange(0, dh, 2, device=positions.device, dtype=torch.float32) / dh)  # (dh/2,)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # (B, 1, T, dh/2)
    angles = torch.cat([angles, angles], -1)  # (B, 1, T, dh)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of x (B, H, T, dh) pairwise by the angles of (cos, sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)  # (B, H, T, dh)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _extend(past: Tensor, new: Tensor) -> Tensor:
    """Append along time; with nothing cached, keep `new` as is (no copy)."""
    return new if past.shape[2] == 0 else torch.cat([past, new], dim=2)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        # In place on fresh outputs: saves two (B, T, d_ff)-sized allocations per sublayer.
        h = self.drop(F.relu(self.fc1(self.norm(x)), inplace=True))
        return residual_add(self.drop(self.fc2(h)), x)


class Layer(nn.Module):
    """One attention sublayer followed by F feed-forward sublayers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.ffs = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.ff_per_layer))

    def forward(self, x, past_k, past_v, mask, causal, rope=None):
        a, k, v = self.attn(self.norm(x), past_k, past_v, mask, causal, rope)
        x = residual_add(self.drop(a), x)
        for ff in self.ffs:
            x = ff(x)
        return x, k, v


class PendingTokenLM(nn.Module):
    """`score`, `step` and `log_probs_all` for models built on the pending-token design:
    the state holds the history already run plus the last token, not yet run. A
    subclass provides `cfg`, `output` (an OutputLayer) and
    `_run(tokens, state, lengths, include_last) -> (hidden (B, T or T+1, d), new state)`,
    which runs the pending token and tokens[:, :-1] (plus tokens[:, -1] when
    include_last) and returns the state after each row's real tokens.
    """

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


class TransformerLM(PendingTokenLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed, self.embed_proj = input_embedding(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.output = OutputLayer(cfg, self.embed)
        self.apply(_init_weights)

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return self.cfg.n_layers * self.cfg.d_model * (1 if self.cfg.shared_kv else 2)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> TransformerState:
        """The state after `<s>`: nothing cached yet, `<s>` pending. No compute."""
        p = next(self.parameters())
        device = p.device if device is None else torch.device(device)
        H, Dh = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        shape = (batch_size, H, 0, Dh)
        return TransformerState(
            keys=[torch.empty(shape, dtype=p.dtype, device=device) for _ in self.layers],
            values=None if self.cfg.shared_kv else [torch.empty(shape, dtype=p.dtype, device=device)
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
        inputs = torch.cat([state.last[:, None], tokens], dim=1)  # (B, T+1)
        if lengths is not None:
            inputs = inputs.masked_fill(~length_mask(lengths + 1, T + 1), 0)
        run = inputs if include_last else inputs[:, :T]
        n_run = run.shape[1]
        # Row b's inputs are valid up to lengths[b] (exclusive); the extra last column
        # of `step` is only read out, never cached.
        n_cache = T
        valid_new = length_mask(lengths, n_cache) if lengths is not None else None  # (B, T)

        S = state.length
        mask, causal = None, False
        hist_valid = state.mask
        if hist_valid is not None and not bool(hist_valid.all()):
            key_valid = torch.cat([hist_valid, torch.ones(B, n_run, dtype=torch.bool, device=tokens.device)], 1)
            q_pos = torch.arange(n_run, device=tokens.device)[:, None] + S  # (n_run, 1)
            k_pos = torch.arange(S + n_run, device=tokens.device)[None, :]  # (1, S+n_run)
            mask = (k_pos <= q_pos)[None] & key_valid[:, None, :]  # (B, n_run, S+n_run)
            mask = mask[:, None]  # (B, 1, n_run, S+n_run)
        elif n_run > 1:
            if S == 0:
                causal = True
            else:
                q_pos = torch.arange(n_run, device=tokens.device)[:, None] + S
                mask = torch.arange(S + n_run, device=tokens.device)[None, :] <= q_pos  # (n_run, S+n_run)

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
            new_last = tokens[:, -1] if T > 0 else state.last
            new_mask = None if state.mask is None else torch.cat(
                [state.mask, torch.ones(B, n_cache, dtype=torch.bool, device=tokens.device)], 1)
        else:
            picked = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
            new_last = torch.where(lengths > 0, picked, state.last)
            hist = state.mask if state.mask is not None else torch.ones(B, S, dtype=torch.bool, device=tokens.device)
            new_mask = torch.cat([hist, valid_new], 1)
        new_state = TransformerState(
            keys=keys, values=None if state.values is None else values, last=new_last, mask=new_mask
        )
        return h, new_state


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, getattr(m, "init_std", 0.02))
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 0.02)
