"""Placeholder: replaced by the real model family."""

from torch import nn

from ..errors import ConfigError


class AdaptiveSpanLM(nn.Module):
    def __init__(self, cfg):
        raise ConfigError("arch adaptive_span is not available yet")
