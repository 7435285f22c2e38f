"""`tasks`: a fresh model trained on an algorithmic task with a length curriculum."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from .common import parse_overrides, set_threads


def tasks(
    task: str = typer.Option(..., "--task", help="copy, reverse, sort, not, remember, addition or multiply."),
    model: str = typer.Option(..., "--model", help="Model preset (tiny, small, conv-small, sa-conv-small, ...)."),
    set_: List[str] = typer.Option([], "--set", help="Model config override key=value, repeatable "
                                   "(e.g. --set d_model=64 --set dropout=0)."),
    minutes: Optional[float] = typer.Option(None, help="Wall-clock budget [default: 1 unless --steps is given]."),
    steps: Optional[int] = typer.Option(None, help="Training-step budget (with --minutes, whichever ends first)."),
    batch: int = typer.Option(32, help="Training examples per step."),
    seed: int = typer.Option(1),
    max_length: int = typer.Option(64, help="Stop once this length is solved."),
    eval_every: int = typer.Option(50, help="Steps between held-out checks of the current length."),
    lr: float = typer.Option(3e-3, help="AdamW peak learning rate (100 warmup steps, then constant)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N or auto."),
    quiet: bool = typer.Option(False, help="No progress bar."),
):
    """Train a fresh model on an algorithmic task with a length curriculum (start at 5, grow by 1
    after a perfect held-out batch). Prints one JSON line on stdout and a summary on stderr."""
    set_threads(threads)
    from ..tasks import TaskConfig, format_summary, run_task

    tc = TaskConfig(task=task, preset=model, overrides=parse_overrides(set_),
                    minutes=1.0 if minutes is None and steps is None else minutes, steps=steps, batch=batch,
                    seed=seed, max_length=max_length, eval_every=eval_every, lr=lr, device=device,
                    progress=not quiet)
    r = run_task(tc)
    typer.echo(format_summary(r), err=True)
    typer.echo(json.dumps(r))
