"""Placeholder: replaced by the real model family."""

from torch import nn

from ..errors import ConfigError


class LSTMLM(nn.Module):
    def __init__(self, cfg):
        raise ConfigError("arch lstm is not available yet")
