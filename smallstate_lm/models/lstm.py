"""The LSTM LM: the recurrent baseline and the student of distillation.

Embedding (embed_dim) -> projection to d_model when the widths differ -> `n_layers`
stacked LSTM layers of width d_model (dropout between them) -> OutputLayer, which
projects back to embed_dim and ties the softmax to the embedding.

The state is the recurrent (h, c) of every layer after `<s>` and the history: a
fixed 2 x n_layers x d_model numbers per row, whatever the history length. Unlike
the Transformer there is no pending token: `initial_state` runs `<s>` (one step of
one row, shared by every row), and the top layer's h in the state predicts the next
token, so `score` runs each of its tokens exactly once.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..state import LMState, check_tokens, length_mask
from ..vocab import BOS_ID
from .base import LanguageModel, embed_tokens, init_weights, input_embedding
from .config import ModelConfig
from .output import OutputLayer


@dataclasses.dataclass(frozen=True)
class LSTMState(LMState):
    """h, c: (B, n_layers, d_model), batch first so that `select` and `cat` work on
    dim 0 like every other state; h[:, -1] is the top layer's output after the last
    token, the features that predict the next one. Fixed size: the base class
    `cat`/`assemble`/`compact` apply, and nothing is per-position memory."""

    h: Tensor
    c: Tensor

    memory_fields = ()


class LSTMLM(LanguageModel):
    """The LSTM LM (see the module doc): a fixed-size state (`state_numel_fixed`),
    `log_probs_all` for distillation, no tree attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed, self.embed_proj = input_embedding(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.lstm = nn.LSTM(cfg.d_model, cfg.d_model, num_layers=cfg.n_layers, bias=cfg.bias, batch_first=True,
                            dropout=cfg.dropout if cfg.n_layers > 1 else 0.0)
        self.output = OutputLayer(cfg, self.embed)
        # Linear and embedding weights as in the Transformer; the LSTM keeps PyTorch's
        # uniform(+-1/sqrt(d)) initialisation, which suits its gates.
        self.apply(init_weights)

    # The state keeps no history positions at all, so stream training may carry it.
    max_history = 0

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return 0

    def state_numel_fixed(self) -> int:
        """Numbers per row: h and c of every layer."""
        return 2 * self.cfg.n_layers * self.cfg.d_model

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> LSTMState:
        """The state after `<s>`: one LSTM step of a single row, expanded to the batch
        (with gradients when they are enabled, so training learns the start state; in
        training mode the rows then share that step's dropout mask)."""
        p = next(self.parameters())
        device = p.device if device is None else torch.device(device)
        bos = torch.full((1, 1), BOS_ID, dtype=torch.long, device=p.device)
        _, (h, c) = self.lstm(self._inputs(bos))  # (L, 1, d) each
        h = h.transpose(0, 1).expand(batch_size, -1, -1).contiguous().to(device)  # (B, L, d)
        c = c.transpose(0, 1).expand(batch_size, -1, -1).contiguous().to(device)  # (B, L, d)
        return LSTMState(h=h, c=c)

    def score(self, tokens: Tensor, state: LSTMState, lengths: Tensor | None = None) -> tuple[Tensor, LSTMState]:
        """Target log-probs of `tokens` given the history in `state`.

        tokens: (B, T) LongTensor. lengths: optional (B,), row b holds lengths[b] real
        tokens followed by padding (any id; 0 allowed); padded positions get log-prob
        0 and do not enter the returned state. Returns logp (B, T), natural log,
        logp[b, t] = log p(tokens[b, t] | <s>, history, tokens[b, :t]), and the state
        after each row's real tokens. Only target log-probs are computed.
        """
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros((B, 0), dtype=torch.float32), state
        feats, new_state = self._run(tokens, state, lengths)
        if lengths is None:
            logp = self.output.target_logprob(feats.reshape(B * T, -1), tokens.reshape(B * T)).view(B, T)  # (B, T)
            return logp, new_state
        # Only real positions go through the output layer: padding would cost a vocabulary row each.
        real = length_mask(lengths, T)  # (B, T)
        logp = torch.zeros(B, T, dtype=torch.float32, device=tokens.device)
        logp = logp.masked_scatter(real, self.output.target_logprob(feats[real], tokens[real]).float())
        return logp, new_state

    def step(self, tokens: Tensor, state: LSTMState, lengths: Tensor | None = None) -> tuple[Tensor, LSTMState]:
        """Consume `tokens` (B, T), T >= 0, and return the (B, V) natural-log
        distribution of the token after each row's last real token, plus the state
        after the tokens (the same state `score` would return)."""
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        if tokens.shape[1] > 0:
            _, state = self._run(tokens, state, lengths)
        return self.output.log_probs(state.h[:, -1]), state

    def log_probs_all(
        self, tokens: Tensor, state: LSTMState, lengths: Tensor | None = None
    ) -> tuple[Tensor, LSTMState]:
        """The whole next-token distribution at every position (distillation).

        tokens: (B, T); lengths: optional (B,) as in `score`. Returns logp (B, T, V),
        natural log, logp[b, t] = log p(. | <s>, history, tokens[b, :t]), so that
        logp[b, t, tokens[b, t]] is `score`'s value; positions at or after lengths[b]
        hold 0. Also returns the state after each row's real tokens.
        """
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        B, T = tokens.shape
        V = self.cfg.vocab_size
        if T == 0:
            return torch.zeros(B, 0, V, device=tokens.device), state
        feats, new_state = self._run(tokens, state, lengths)
        if lengths is None:
            return self.output.log_probs(feats.reshape(B * T, -1)).view(B, T, V), new_state  # (B, T, V)
        # Only real positions go through the output layer; index_copy rather than a
        # masked scatter, whose backward (a masked select over (B, T, V)) costs far more.
        idx = length_mask(lengths, T).view(-1).nonzero(as_tuple=True)[0]  # (N,) flat real positions
        real_logp = self.output.log_probs(feats.reshape(B * T, -1).index_select(0, idx)).float()  # (N, V)
        logp = real_logp.new_zeros(B * T, V).index_copy(0, idx, real_logp).view(B, T, V)  # (B, T, V)
        return logp, new_state

    # ---- internals -----------------------------------------------------------------
    def _inputs(self, tokens: Tensor) -> Tensor:
        """(B, T) ids -> (B, T, d_model) LSTM inputs."""
        x = embed_tokens(self, tokens)
        return self.drop(x)

    def _run(self, tokens: Tensor, state: LSTMState, lengths: Tensor | None) -> tuple[Tensor, LSTMState]:
        """Run tokens (B, T), T >= 1, through the LSTM from `state`.

        Returns the features that predict each token (B, T, d_model), dropout applied:
        position 0 from the state's top h, position t from the output after token
        t-1; and the state after each row's real tokens (rows with lengths 0 keep
        theirs). Padded positions of the features hold arbitrary values.
        """
        B, T = tokens.shape
        h0 = state.h.transpose(0, 1).contiguous()  # (L, B, d)
        c0 = state.c.transpose(0, 1).contiguous()  # (L, B, d)
        x = self._inputs(tokens)  # (B, T, d)
        if lengths is None:
            out, (h, c) = self.lstm(x, (h0, c0))  # out (B, T, d); h, c (L, B, d)
            new_h, new_c = h.transpose(0, 1), c.transpose(0, 1)  # (B, L, d)
        else:
            # Rows without tokens keep their state and are left out of the run.
            rows = (lengths > 0).nonzero(as_tuple=True)[0]  # (B',)
            if rows.numel() == 0:
                return self.drop(state.h[:, -1:].expand(B, T, -1)), state
            every = rows.numel() == B
            if not every:
                x, h0, c0 = x[rows], h0[:, rows], c0[:, rows]
            out, (h, c) = self._lstm_ragged(x, h0, c0, lengths if every else lengths[rows])
            new_h, new_c = h.transpose(0, 1), c.transpose(0, 1)  # (B', L, d)
            if not every:
                out = out.new_zeros(B, T, out.shape[2]).index_copy(0, rows, out)  # (B, T, d)
                new_h = state.h.index_copy(0, rows, new_h)  # (B, L, d)
                new_c = state.c.index_copy(0, rows, new_c)  # (B, L, d)
        feats = torch.cat([state.h[:, -1:], out[:, : T - 1]], 1)  # (B, T, d)
        return self.drop(feats), LSTMState(h=new_h, c=new_c)

    def _lstm_ragged(self, x: Tensor, h0: Tensor, c0: Tensor, lengths: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The LSTM over rows of different lengths, each stopping after its own last
        input. x (B, T, d), h0/c0 (L, B, d), lengths (B,) in [1, T]. Returns out
        (B, T, d), 0 past each row's length, and h, c (L, B, d) after each row's last input.

        The prefix every row shares runs as one plain sequence; only the ragged tail is
        packed. On CPU a packed sequence costs about twice as much per token, because
        the input projections are then made step by step rather than in one matmul, and
        length-bucketed batches have short tails.
        """
        B, T, d = x.shape
        lo, hi = int(lengths.min()), int(lengths.max())
        out, (h, c) = self.lstm(x[:, :lo], (h0, c0))  # (B, lo, d); h, c (L, B, d)
        if hi > lo:
            rest = lengths - lo  # (B,)
            tail = (rest > 0).nonzero(as_tuple=True)[0]  # (B2,) rows that go on
            packed = pack_padded_sequence(x[tail, lo:hi], rest[tail].cpu(), batch_first=True, enforce_sorted=False)
            out_p, (h2, c2) = self.lstm(packed, (h[:, tail], c[:, tail]))  # h2, c2 (L, B2, d)
            out2, _ = pad_packed_sequence(out_p, batch_first=True, total_length=hi - lo)  # (B2, hi-lo, d)
            out = torch.cat([out, out.new_zeros(B, hi - lo, d).index_copy(0, tail, out2)], 1)  # (B, hi, d)
            h, c = h.index_copy(1, tail, h2), c.index_copy(1, tail, c2)  # (L, B, d)
        if hi < T:
            out = torch.cat([out, out.new_zeros(B, T - hi, d)], 1)  # (B, T, d)
        return out, (h, c)
