"""Output layers: full softmax (optionally tied to the input embedding) or adaptive
softmax, with target-only log-prob scoring that never holds a (N, V) log-softmax for
all rows at once outside training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig

# Logits computed at once when scoring without gradients: 2^23 floats (32 MB). The
# normaliser reads them row by row (one fused kernel), so the chunk need not fit a cache;
# fewer chunks mean fewer matmul calls, which is what a CPU shared with other work charges
# for (bench_nbest's padded path with a busy process beside it: 13% faster than 16 MB chunks,
# the same without one; AMD EPYC, 2 cores).
LOGIT_BUDGET = 1 << 23


class OutputLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, embedding: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        self.proj = (
            nn.Linear(cfg.d_model, cfg.embed_dim, bias=False) if cfg.embed_dim != cfg.d_model else None
        )
        if cfg.softmax == "adaptive":
            self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(
                cfg.embed_dim, cfg.vocab_size, cutoffs=list(cfg.adaptive_cutoffs), div_value=4.0
            )
            self.weight = None
            self.bias = None
        else:
            self.adaptive = None
            self.weight = embedding.weight if cfg.tie_embeddings else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.embed_dim).normal_(0.0, 0.02)
            )
            self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def _features(self, h: Tensor) -> Tensor:
        return self.proj(h) if self.proj is not None else h

    def target_logprob(self, h: Tensor, targets: Tensor) -> Tensor:
        """h (N, d_model), targets (N,) -> (N,) natural-log p(target)."""
        x = self._features(h)
        if self.adaptive is not None:
            return self.adaptive(x, targets).output
        if torch.is_grad_enabled():
            return -F.cross_entropy(F.linear(x, self.weight, self.bias).float(), targets, reduction="none")
        # The bias rides along as an extra input column, so the matmul writes finished
        # logits (no separate pass broadcasting the bias into a (rows, V) buffer).
        w_aug = self._augmented()  # (V, E+1)
        x_aug = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)  # (N, E+1)
        rows = max(1, LOGIT_BUDGET // self.weight.shape[0])
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for i in range(0, x.shape[0], rows):
            logits = (x_aug[i : i + rows] @ w_aug.t()).float()  # (n, V), a fresh buffer of ours
            # One fused kernel, not amax, sub_, exp_ and sum: each of those is a pass over the
            # chunk and a multithreaded region, and on a CPU shared with other work every region
            # waits for its slowest thread (bench_nbest with one busy process beside it: 22% of
            # the output layer's time). In place (the kernel writes each element from that same
            # element once the row's max and sum are known): a (rows, V) buffer stays the
            # largest thing scoring touches.
            torch.log_softmax(logits, 1, out=logits)
            out[i : i + rows] = logits.gather(1, targets[i : i + rows, None])[:, 0]
        return out

    def _augmented(self) -> Tensor:
        """[weight | bias], kept while the weights are the same tensors, unchanged: building it copies the
        whole output matrix, which costs more than a small scoring call's own work."""
        key = (self.weight.data_ptr(), self.weight._version, self.bias.data_ptr(), self.bias._version,
               self.weight.dtype, self.weight.device)
        if getattr(self, "_aug_key", None) != key:
            with torch.no_grad():
                self._aug = torch.cat([self.weight, self.bias[:, None]], 1)
            self._aug_key = key
        return self._aug

    def log_probs(self, h: Tensor) -> Tensor:
        """h (N, d_model) -> (N, V) natural-log next-token distribution."""
        x = self._features(h)
        if self.adaptive is not None:
            return self.adaptive.log_prob(x)
        return F.log_softmax(F.linear(x, self.weight, self.bias).float(), dim=-1)
