"""Device selection, shared by training, evaluation, rescoring and the service."""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .errors import ConfigError


def pick_device(name: str) -> torch.device:
    """"auto" is CUDA when available, else the CPU; an explicit CUDA device without CUDA
    is a ConfigError rather than a late failure on the first tensor."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


# Inference precisions: the weights (and so the LM state) are cast to this dtype after loading;
# the output normaliser and every returned log-prob stay float32 (output.py casts the logits).
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_dtype(precision: str) -> torch.dtype:
    """The dtype of an inference precision name (fp32, bf16, fp16); anything else is a ConfigError."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}") from None


def settle_attention_backend(device: torch.device, dtype: torch.dtype) -> None:
    """Keep scaled-dot-product attention off cuDNN for reduced-precision inference on CUDA. Scoring's
    shapes change with every call (rows of a lattice level, history lengths, trie sizes) and cuDNN
    attention builds a graph per new shape: on an H100 it cost 8.6 ms of host time per lattice step in
    bf16 (1.5 s of 1.8 s for three lattices) against microseconds for the memory-efficient kernel that
    float32 gets. Process-wide, as the switch is; training keeps torch's choice."""
    if device.type == "cuda" and dtype != torch.float32:
        torch.backends.cuda.enable_cudnn_sdp(False)


def fastest_seconds(*fns: Callable[[], object], rounds: int = 5) -> list[float]:
    """The fastest of `rounds` runs of each of `fns` (after one warm-up run each), taken in turns: a moment of
    load on a shared machine (another process, a page fault, the OS) inflates a run, never shortens one, and
    taking turns keeps it from landing on one measurement only; a slope or per-call term from two inflated
    points could be off by 100x. Each fn must wait for its device's work (ours copy results to the host)."""
    for fn in fns:
        fn()  # kernels, caches and the allocator warm
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best
