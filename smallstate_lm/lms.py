"""The LMs a command, a worker or the service names by path, loaded: the neural LM (torch is imported
only for one, so an n-gram-only run starts in a tenth of the time) and the KenLM n-gram."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

    from .checkpoint import LoadedModel
    from .ngram import NgramLM


HF_PREFIX = "hf:"  # --lm hf:DIR: a Hugging Face causal LM directory (smallstate_lm.hf)


def is_hf(spec: str | Path | None) -> bool:
    """Whether an --lm value names a Hugging Face model directory (`hf:DIR`) rather than a run of ours."""
    return spec is not None and str(spec).startswith(HF_PREFIX)


def load_neural(spec: str | Path, device: "str | torch.device" = "cpu", precision: str = "fp32") -> "LoadedModel":
    """A neural LM by what `--lm` says: a run directory or checkpoint of ours, or `hf:DIR`."""
    if is_hf(spec):
        from .hf import load_hf

        return load_hf(str(spec)[len(HF_PREFIX):], device, precision, spec=str(spec))
    from .checkpoint import load_model

    return load_model(spec, device, precision=precision)


def load_lms(lm: str | Path | None, ngram: str | Path | None, device: "str | torch.device" = "auto",
             required: bool = True, precision: str = "fp32") -> tuple["LoadedModel | None", "NgramLM | None"]:
    """(the neural LM on `device` in `precision` or None, the n-gram or None). `required`: at least one
    must be named.
    The neural LM is checked on its device as it loads (a bad checkpoint fails here, naming its path)."""
    from .ngram import NgramLM

    if required and lm is None and ngram is None:
        raise ConfigError("give a neural LM (--lm DIR), an n-gram (--ngram FILE), or both")
    loaded = None
    if lm is not None:
        from .device import pick_device

        loaded = load_neural(lm, pick_device(device) if isinstance(device, str) else device, precision=precision)
    return loaded, (NgramLM(ngram) if ngram is not None else None)
