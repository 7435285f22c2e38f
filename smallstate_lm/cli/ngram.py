"""`ngram train` and `ngram eval`: KenLM n-grams built with lmplz and measured on text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="KenLM n-gram models: build and evaluate.")


@app.command("train")
def ngram_train(
    text: Path = typer.Option(..., "--text", help="Training text, one sentence per line."),
    order: int = typer.Option(4, "--order"),
    out: Path = typer.Option(..., "-o", "--out", help="ARPA file to write."),
    binary: Optional[Path] = typer.Option(None, "--binary", help="Also write a KenLM binary (faster to load)."),
    prune: Optional[str] = typer.Option(None, "--prune", help='Count thresholds per order, e.g. "0 0 1".'),
    memory: str = typer.Option("10%", help="lmplz sort memory (-S)."),
):
    """Estimate an n-gram with lmplz (and build_binary)."""
    from ..ngram import build_ngram

    thresholds = None
    if prune:
        try:
            thresholds = [int(x) for x in prune.replace(",", " ").split()]
        except ValueError:
            raise ConfigError(f"--prune expects integers, got {prune!r}") from None
    typer.echo(json.dumps(build_ngram(text, order, out, binary, thresholds, memory), indent=2))


@app.command("eval")
def ngram_eval(
    ngram: Path = typer.Option(..., "--ngram", help="ARPA or KenLM binary file."),
    text: Path = typer.Option(..., "--text"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Perplexity of an n-gram (words + </s>, OOVs as <unk>: the same convention as `eval`)."""
    from ..ngram import evaluate_ngram

    r = evaluate_ngram(ngram, text)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
    else:
        typer.echo(f"{r['ngram']} ({r['order']}-gram) on {r['text']}: perplexity {r['perplexity']:.2f} over "
                   f"{r['tokens']:,} tokens, {r['oov_words']:,} OOV words ({100 * r['oov_rate']:.2f}%)")
