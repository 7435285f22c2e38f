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
