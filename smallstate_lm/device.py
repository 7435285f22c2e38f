"""Device selection, shared by training, evaluation, rescoring and the service."""

from __future__ import annotations

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
