"""Placeholder: replaced by the real model family."""

from torch import nn

from ..errors import ConfigError


class AllAttentionLM(nn.Module):
    def __init__(self, cfg):
        raise ConfigError("arch all_attention is not available yet")
