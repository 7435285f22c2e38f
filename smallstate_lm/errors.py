"""Typed errors for users: each carries the file, line or field it is about.

The CLI prints them as one line and exits non-zero; the service maps them to 4xx.
"""

from __future__ import annotations


class SmallstateError(Exception):
    """Base class of every error meant for a user rather than a developer."""


class ConfigError(SmallstateError):
    """A model or training setting is unknown or out of range."""


class VocabularyError(SmallstateError):
    """A vocabulary file is malformed, or text and vocabulary do not match."""


class DataError(SmallstateError):
    """A text file is missing, empty or holds no usable words."""


class CheckpointError(SmallstateError):
    """A checkpoint is missing, corrupt, truncated or does not match its config."""


class WorkLimitError(SmallstateError):
    """Scoring a request would need more working memory than the configured cap
    (`NeuralScorer.max_work_bytes`) allows, even split into the smallest pieces."""


class ScoreError(SmallstateError):
    """A score came out NaN or infinite, so it can be neither ranked nor written as JSON."""
