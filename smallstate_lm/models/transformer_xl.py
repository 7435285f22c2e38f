"""Placeholder: replaced by the real model family."""

from torch import nn

from ..errors import ConfigError


class TransformerXLLM(nn.Module):
    def __init__(self, cfg):
        raise ConfigError("arch transformer_xl is not available yet")
