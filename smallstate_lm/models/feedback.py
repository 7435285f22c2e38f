"""Placeholder: replaced by the real model family."""

from torch import nn

from ..errors import ConfigError


class FeedbackLM(nn.Module):
    def __init__(self, cfg):
        raise ConfigError("arch feedback is not available yet")
