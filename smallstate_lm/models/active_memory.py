"""Placeholder: replaced by the real model family."""

from torch import nn

from ..errors import ConfigError


class ActiveMemoryLM(nn.Module):
    def __init__(self, cfg):
        raise ConfigError("arch active_memory is not available yet")
