"""Perplexity through the state contract, and the `eval` report."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from .data import encode_sentences, eval_batches, perplexity
from .files import read_sentences
from .lms import load_neural
from .models import count_parameters
from .scoring.words import per_word
from .state import pad_batch
from .vocab import EncodeStats

CONVENTION = (
    "perplexity = exp(-sum log p / N), N = words + one </s> per sentence; each sentence is "
    "scored from <s>; OOV words are mapped to <unk> and counted (their <unk> probability is included); "
    "a subword LM's word is the sum of its pieces (perplexity_per_token: N = pieces + one </s> per sentence)"
)


def score_corpus(model: nn.Module, seqs: Sequence[Sequence[int]], batch_tokens: int = 8192,
                 device: torch.device | str | None = None) -> tuple[float, int]:
    """Sum of natural-log probabilities and token count over `seqs` (each `w.. </s>`)."""
    per_seq = token_logprobs(model, seqs, batch_tokens, device)
    return float(sum(float(a.sum()) for a in per_seq)), sum(a.size for a in per_seq)


@torch.no_grad()
def token_logprobs(model: nn.Module, seqs: Sequence[Sequence[int]], batch_tokens: int = 8192,
                   device: torch.device | str | None = None) -> list[np.ndarray]:
    """Natural-log p of every token of every sequence (each `w.. </s>`, scored from
    `<s>`), in the order of `seqs`: one float64 array per sequence."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    out: list[np.ndarray] = [np.zeros(0)] * len(seqs)
    try:
        for idx in eval_batches(range(len(seqs)), batch_tokens, key=lambda i: len(seqs[i])):
            batch = [seqs[i] for i in idx]
            tokens, lengths = pad_batch(batch, device)
            logp, _ = model.score(tokens, model.initial_state(len(batch), device), lengths)
            logp = logp.double().cpu().numpy()  # (B, T)
            for row, i in enumerate(idx):
                out[i] = logp[row, : len(seqs[i])]
    finally:
        model.train(was_training)
    return out


# interpolation weights tried by `interpolate`: the neural LM's share, 0 to 1
LAMBDAS = np.round(np.arange(0.0, 1.0001, 0.01), 2)


def interpolate(neural: np.ndarray, ngram: np.ndarray) -> dict:
    """Linear interpolation per token, log(lam * p_nn + (1 - lam) * p_ng), over the
    LAMBDAS grid. neural, ngram: (N,) natural-log p of the same tokens. Returns the best
    lam (the neural LM's weight), its perplexity and the curve."""
    if neural.shape != ngram.shape:
        raise ValueError(f"token counts differ: neural {neural.shape}, n-gram {ngram.shape}")
    lam = LAMBDAS[:, None]  # (K, 1)
    with np.errstate(divide="ignore"):
        mixed = np.logaddexp(np.log(lam) + neural[None], np.log1p(-lam) + ngram[None])  # (K, N)
    ppl = np.exp(-mixed.mean(1))  # (K,)
    best = int(np.argmin(ppl))
    return {"lambda": float(LAMBDAS[best]), "perplexity": float(ppl[best]),
            "curve": {f"{x:.2f}": float(p) for x, p in zip(LAMBDAS[::10], ppl[::10])}}


def with_context(seqs: Sequence[Sequence[int]], k: int, docs: Sequence[str] | None = None) -> list[list[int]]:
    """Each encoded sentence (`w.. </s>`) after the up to `k` sentences before it in the same document
    (`docs`: each sentence's document; None: one running text), the way a context-trained LM reads them."""
    out = []
    before: dict[str, list[int]] = {}  # each document's sentences so far (documents may interleave)
    for i, s in enumerate(seqs):
        mine = before.setdefault(docs[i] if docs is not None else "", [])
        out.append([t for j in mine[len(mine) - k:] if k > 0 for t in seqs[j]] + list(s))
        mine.append(i)
    return out


def read_docs(path: str | os.PathLike, n: int) -> list[str]:
    """The document of each of a text's `n` lines, from an utt2doc file (`utterance document` per line, in the
    text's order)."""
    from .errors import DataError
    from .files import read_utt2doc

    docs = [doc for _, doc in read_utt2doc(path, DataError)]
    if len(docs) != n:
        raise DataError(f"{path}: {len(docs)} utterances for a text of {n} sentences; expected one per line")
    return docs


def evaluate_file(model_path: str | os.PathLike, text: str | os.PathLike, device: str = "cpu",
                  batch_tokens: int = 8192, ngram: str | os.PathLike | None = None, precision: str = "fp32",
                  context_sentences: int = 0, utt2doc: str | os.PathLike | None = None) -> dict:
    """Everything `smallstate-lm eval` reports, as a JSON-able dict. With `ngram` (a
    KenLM file), also the n-gram's perplexity on the same tokens and the linear
    interpolation of the two with the best weight. `context_sentences` K > 0: every sentence is read after
    the K before it in the text (within its document of `utt2doc`), their log-probs not counted."""
    if context_sentences < 0:
        from .errors import ConfigError

        raise ConfigError(f"context sentences must be >= 0, got {context_sentences}")
    if utt2doc is not None and not context_sentences:
        from .errors import ConfigError

        raise ConfigError("--utt2doc says where context may not cross: give it with --context-sentences K")
    lm = load_neural(model_path, device, precision=precision)
    sentences = read_sentences(text)
    docs = read_docs(utt2doc, len(sentences)) if utt2doc is not None else None
    stats = EncodeStats()
    seqs = encode_sentences(sentences, lm.vocab, stats)
    t0 = time.perf_counter()
    if context_sentences:
        full = token_logprobs(lm.model, with_context(seqs, context_sentences, docs), batch_tokens, device)
        per_seq = [lp[len(lp) - len(s):] for lp, s in zip(full, seqs)]
    else:
        per_seq = token_logprobs(lm.model, seqs, batch_tokens, device)
    seconds = time.perf_counter() - t0
    n = sum(a.size for a in per_seq)
    # per word (a subword LM's pieces summed): what the n-gram and the rescorer see
    neural = np.concatenate(per_word(lm.vocab, sentences, per_seq)) if per_seq else np.zeros(0)
    logprob, n_words = float(neural.sum()), int(neural.size)
    mix = None
    if ngram is not None:
        from .ngram import NgramLM

        ng = NgramLM(ngram)
        ng_lp = np.concatenate([ng.token_logprobs(s) for s in sentences]) if sentences else np.zeros(0)
        mix = {"ngram": str(ngram), "ngram_perplexity": math.exp(-ng_lp.mean()) if n else float("nan"),
               **interpolate(neural, ng_lp)}
    numel = lm.model.state_numel_per_position()
    elem = next(lm.model.parameters()).element_size()
    return {
        "model": str(lm.path),
        "preset": lm.config.name,
        "text": str(text),
        "perplexity": perplexity(logprob, n_words),
        "perplexity_per_token": perplexity(logprob, n),
        "logprob_sum_ln": logprob,
        "tokens": n,
        "tokenizer": lm.vocab.spec,
        "sentences": len(seqs),
        "words": stats.words,
        "oov_words": stats.oov,
        "oov_rate": stats.oov_rate,
        "convention": CONVENTION if not context_sentences else CONVENTION.replace(
            "each sentence is scored from <s>", f"each sentence is scored after the {context_sentences} before it "
            "in its document (their log-probs not counted)"),
        "tokens_per_second": n / seconds if seconds > 0 else float("inf"),
        "seconds": seconds,
        "parameters": count_parameters(lm.model),
        "vocab_size": len(lm.vocab),
        "state_numel_per_position": numel,
        "state_bytes_per_position": numel * elem,
        "state_numel_fixed": lm.model.state_numel_fixed(),
        "device": str(device),
        "precision": precision,
        "context_sentences": context_sentences,
        # model-specific facts, e.g. the learned attention spans per layer
        "model_report": lm.model.report(),
        "interpolation": mix,
    }
