"""`smallstate-lm` command line: each command parses, calls one library function and
formats the result. Errors meant for users print as one line and exit with status 2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import ConfigError, SmallstateError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Small-state Transformer LMs for ASR rescoring.")

REPO_DATA = Path(__file__).resolve().parent.parent / "data"


def _parse_overrides(items: list[str]) -> dict:
    """`key=value` pairs; values parsed as JSON when they parse (ints, floats, bools, lists)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, val = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(val)
        except json.JSONDecodeError:
            out[key.strip()] = val
    return out


def _set_threads(n: int | None) -> None:
    if n is not None:
        if n < 1:
            raise ConfigError(f"--threads must be >= 1, got {n}")
        import torch

        torch.set_num_threads(n)


@app.command()
def train(
    train: Path = typer.Option(..., "--train", help="Training text, one sentence per line."),
    valid: Path = typer.Option(..., "--valid", help="Validation text for perplexity and early stopping."),
    out: Path = typer.Option(..., "--out", "-o", help="Run directory to create (or continue with --resume)."),
    preset: str = typer.Option("tiny", help="Model preset: 8L-3F, 8L-3F-sharedkv, 32L-1F, small, tiny."),
    set_: List[str] = typer.Option([], "--set", help="Model config override key=value, repeatable "
                                   "(e.g. --set shared_kv=true --set dropout=0.2)."),
    optimizer: str = typer.Option("adamw", help="adamw (warmup + cosine) or sgd (newbob)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: 1e-3 adamw, 1.0 sgd]."),
    warmup_steps: int = typer.Option(200),
    max_steps: Optional[int] = typer.Option(None, help="Total steps (the cosine schedule spans them)."),
    max_epochs: int = typer.Option(20),
    max_minutes: Optional[float] = typer.Option(None, help="Stop after this much training time."),
    stop_after: Optional[int] = typer.Option(None, help="Stop at this step, schedule unchanged (resume later)."),
    batch_tokens: int = typer.Option(4096, help="Padded tokens per batch."),
    max_len: int = typer.Option(128, help="Longer sentences are cut into pieces."),
    clip: float = typer.Option(1.0, help="Gradient-norm clipping; 0 disables."),
    valid_every: int = typer.Option(500),
    patience: int = typer.Option(5, help="Validations without improvement before stopping; 0 = never."),
    seed: int = typer.Option(1),
    min_count: int = typer.Option(1),
    max_vocab: Optional[int] = typer.Option(None),
    lowercase: bool = typer.Option(False),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last.pt."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
):
    """Train an LM on a text file."""
    _set_threads(threads)
    from .train import TrainConfig, remove_incomplete_run
    from .train import train as run_train

    tc = TrainConfig(
        train=str(train), valid=str(valid), out=str(out), preset=preset, overrides=_parse_overrides(set_),
        optimizer=optimizer, lr=lr, warmup_steps=warmup_steps, max_steps=max_steps, max_epochs=max_epochs,
        max_minutes=max_minutes, stop_after=stop_after, batch_tokens=batch_tokens, max_len=max_len,
        clip=clip, valid_every=valid_every, patience=patience, seed=seed, min_count=min_count,
        max_vocab=max_vocab, lowercase=lowercase, device=device, resume=resume, progress=not quiet,
    )
    existed = out.exists()
    try:
        summary = run_train(tc)
    except BaseException:
        if not existed:
            remove_incomplete_run(out)
        raise
    typer.echo(json.dumps(summary, indent=2))


@app.command("eval")
def eval_(
    model: Path = typer.Option(..., "--model", help="Run directory or checkpoint file."),
    text: Path = typer.Option(..., "--text", help="Text to score, one sentence per line."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    device: str = typer.Option("cpu"),
    batch_tokens: int = typer.Option(8192),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
):
    """Perplexity, speed, parameters and state size of a trained LM."""
    _set_threads(threads)
    from .evaluate import evaluate_file
    from .train import pick_device

    r = evaluate_file(model, text, str(pick_device(device)), batch_tokens)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    typer.echo(f"model            {r['model']} ({r['preset']}, {r['parameters']:,} parameters)")
    typer.echo(f"text             {r['text']}: {r['sentences']:,} sentences, {r['words']:,} words")
    typer.echo(f"perplexity       {r['perplexity']:.2f} over {r['tokens']:,} tokens")
    typer.echo(f"OOV words        {r['oov_words']:,} ({100 * r['oov_rate']:.2f}%)")
    typer.echo(f"convention       {r['convention']}")
    typer.echo(f"speed            {r['tokens_per_second']:,.0f} tokens/s on {r['device']}")
    typer.echo(f"state/position   {r['state_numel_per_position']:,} numbers, "
               f"{r['state_bytes_per_position']:,} bytes")


@app.command()
def demo(
    train: Path = typer.Option(REPO_DATA / "train.txt", "--train"),
    valid: Path = typer.Option(REPO_DATA / "valid.txt", "--valid"),
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o"),
    minutes: float = typer.Option(3.0, help="Training time budget."),
):
    """Train the `tiny` preset on the bundled text for a few minutes and report it."""
    import shutil

    from .evaluate import evaluate_file
    from .train import TrainConfig
    from .train import train as run_train

    if out.exists():
        shutil.rmtree(out)
    tc = TrainConfig(train=str(train), valid=str(valid), out=str(out), preset="tiny", max_minutes=minutes,
                     batch_tokens=4096, valid_every=200, patience=0, warmup_steps=100, lr=3e-3)
    s = run_train(tc)
    r = evaluate_file(out, valid)
    typer.echo("")
    typer.echo(f"demo: tiny preset, {s['steps']} steps in {s['elapsed_seconds'] / 60:.1f} min, "
               f"{r['parameters']:,} parameters")
    typer.echo(f"demo: validation perplexity {r['perplexity']:.2f} ({r['tokens']:,} tokens incl. </s>, "
               f"{100 * r['oov_rate']:.2f}% OOV words as <unk>)")
    typer.echo(f"demo: state per position {r['state_numel_per_position']:,} numbers = "
               f"{r['state_bytes_per_position']:,} bytes; model in {out}/model.pt")


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv)
    except SmallstateError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a bug of ours: still one line for the user, traceback on request
        if os.environ.get("SMALLSTATE_DEBUG"):
            raise
        print(f"error: internal error {type(e).__name__}: {e} (set SMALLSTATE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
