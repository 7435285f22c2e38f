"""Perplexity through the state contract, and the `eval` report."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
from torch import nn

from .checkpoint import load_model
from .data import encode_sentences, eval_batches, pad_batch, perplexity, read_sentences
from .models import count_parameters
from .vocab import EncodeStats

CONVENTION = (
    "perplexity = exp(-sum log p / N), N = words + one </s> per sentence; each sentence is "
    "scored from <s>; OOV words are mapped to <unk> and counted (their <unk> probability is included)"
)


@torch.no_grad()
def score_corpus(model: nn.Module, seqs: Sequence[Sequence[int]], batch_tokens: int = 8192,
                 device: torch.device | str | None = None) -> tuple[float, int]:
    """Sum of natural-log probabilities and token count over `seqs` (each `w.. </s>`)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    total, n = 0.0, 0
    try:
        for batch in eval_batches(seqs, batch_tokens):
            tokens, lengths = pad_batch(batch, device)
            logp, _ = model.score(tokens, model.initial_state(len(batch), device), lengths)
            total += float(logp.double().sum())
            n += int(lengths.sum())
    finally:
        model.train(was_training)
    return total, n


def evaluate_file(model_path: str | os.PathLike, text: str | os.PathLike, device: str = "cpu",
                  batch_tokens: int = 8192) -> dict:
    """Everything `smallstate-lm eval` reports, as a JSON-able dict."""
    lm = load_model(model_path, device)
    sentences = read_sentences(text)
    stats = EncodeStats()
    seqs = encode_sentences(sentences, lm.vocab, stats)
    t0 = time.perf_counter()
    logprob, n = score_corpus(lm.model, seqs, batch_tokens, device)
    seconds = time.perf_counter() - t0
    numel = lm.model.state_numel_per_position()
    elem = next(lm.model.parameters()).element_size()
    return {
        "model": str(lm.path),
        "preset": lm.config.name,
        "text": str(text),
        "perplexity": perplexity(logprob, n),
        "logprob_sum_ln": logprob,
        "tokens": n,
        "sentences": len(seqs),
        "words": stats.words,
        "oov_words": stats.oov,
        "oov_rate": stats.oov_rate,
        "convention": CONVENTION,
        "tokens_per_second": n / seconds if seconds > 0 else float("inf"),
        "seconds": seconds,
        "parameters": count_parameters(lm.model),
        "vocab_size": len(lm.vocab),
        "state_numel_per_position": numel,
        "state_bytes_per_position": numel * elem,
        "state_numel_fixed": lm.model.state_numel_fixed() if hasattr(lm.model, "state_numel_fixed") else 0,
        "device": str(device),
        # model-specific facts, e.g. the learned attention spans per layer
        "model_report": lm.model.report() if hasattr(lm.model, "report") else {},
    }
