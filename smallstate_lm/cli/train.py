"""`train` and `distill`: their options are the fields of `TrainConfig` and `DistillConfig` (`config_options`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import typer

from ..train_config import DistillConfig, TrainConfig
from .common import set_threads
from .config_options import config, options, signature


def _train_into(out: Path, run: Callable[[], dict]) -> None:
    """Print the summary of `run()`, a training into `out`; after a failure, leave no
    directory there that looks like a run unless one was there before."""
    from ..train import remove_incomplete_run

    existed = out.exists()
    try:
        summary = run()
    except BaseException:
        if not existed:
            remove_incomplete_run(out)
        raise
    typer.echo(json.dumps(summary, indent=2))


@signature(options(TrainConfig).values())
def train(**values):
    """Train an LM on a text file."""
    set_threads(values.pop("threads"))
    from ..train import train as run_train

    tc = config(TrainConfig, values)
    _train_into(Path(tc.out), lambda: run_train(tc))


# Where distill's student options differ from train's: the rest are train's, as they are.
_STUDENT = {
    "preset": {"flags": ("--student-preset",), "default": "lstm-small", "help": "Student preset (lstm-small, ...)."},
    "out": {"help": "Run directory for the student."},
    "overrides": {"help": "Student config override key=value, repeatable."},
    "lr": {"help": "Peak learning rate [default: 2e-3]."},
    "warmup_steps": {"default": 200},
    "batch_tokens": {"default": 4096, "help": "Padded tokens per batch."},
}
# distill's options (fields of TrainConfig and DistillConfig), in the order its help lists them
_DISTILL_OPTIONS = ("teacher", "preset", "train", "valid", "out", "lam", "temperature", "top_k", "sampled",
                    "teacher_cache", "max_minutes", "clock", "max_steps", "max_epochs", "lr", "warmup_steps",
                    "batch_tokens", "valid_every", "patience", "seed", "overrides", "device", "progress")
_DISTILL_PARAMS = {**options(TrainConfig, _STUDENT), **options(DistillConfig)}


@signature(_DISTILL_PARAMS[name] for name in _DISTILL_OPTIONS)
def distill(**values):
    """Distill a student LM (e.g. an LSTM) from a trained teacher, in the teacher's vocabulary."""
    set_threads(values.pop("threads"))
    from ..distill import distill as run_distill

    tc = config(TrainConfig, values)
    dc = config(DistillConfig, values)
    _train_into(Path(tc.out), lambda: run_distill(tc, dc))
