"""Model registry: one plain dict from `ModelConfig.arch` to the class that builds it."""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from .active_memory import ActiveMemoryLM
from .adaptive_span import AdaptiveSpanLM
from .all_attention import AllAttentionLM
from .config import PRESETS, ModelConfig, get_preset
from .feedback import FeedbackLM
from .lstm import LSTMLM
from .transformer import TransformerLM, TransformerState
from .transformer_xl import TransformerXLLM

MODELS: dict[str, type[nn.Module]] = {
    "transformer": TransformerLM,
    "transformer_xl": TransformerXLLM,
    "adaptive_span": AdaptiveSpanLM,
    "feedback": FeedbackLM,
    "all_attention": AllAttentionLM,
    "active_memory": ActiveMemoryLM,
    "lstm": LSTMLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build an untrained model from its config (`cfg.vocab_size` must be set)."""
    if cfg.arch not in MODELS:
        raise ConfigError(f"unknown arch {cfg.arch!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[cfg.arch](cfg)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


__all__ = ["MODELS", "PRESETS", "ModelConfig", "TransformerLM", "TransformerState", "build_model",
           "count_parameters", "get_preset"]
