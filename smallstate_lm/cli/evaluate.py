"""`eval` (a trained LM's perplexity, speed and state size) and `export` (its small release copy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .common import PRECISION, check_precision, set_threads


def eval_(
    model: Path = typer.Option(..., "--model", help="Run directory or checkpoint file."),
    text: Path = typer.Option(..., "--text", help="Text to score, one sentence per line."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    ngram: Optional[Path] = typer.Option(None, "--ngram", help="Also a KenLM n-gram: its perplexity on the same "
                                         "tokens and the linear interpolation of both with the best weight."),
    device: str = typer.Option("cpu"),
    precision: str = PRECISION,
    batch_tokens: int = typer.Option(8192),
    context_sentences: int = typer.Option(0, "--context-sentences", help="Read every sentence after the K "
                                          "sentences before it in the text (lines in reading order), as an LM "
                                          "trained with --context-sentences does; 0 = each from <s>."),
    utt2doc: Optional[Path] = typer.Option(None, "--utt2doc", help="With --context-sentences: each line's "
                                           "document ('utterance document' per line, in the text's order); "
                                           "context never crosses a document."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
):
    """Perplexity, speed, parameters and state size of a trained LM."""
    check_precision(precision)
    set_threads(threads)
    from ..device import pick_device
    from ..evaluate import evaluate_file

    r = evaluate_file(model, text, str(pick_device(device)), batch_tokens, ngram, precision, context_sentences,
                      utt2doc)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    typer.echo(f"model            {r['model']} ({r['preset']}, {r['parameters']:,} parameters)")
    typer.echo(f"text             {r['text']}: {r['sentences']:,} sentences, {r['words']:,} words")
    typer.echo(f"perplexity       {r['perplexity']:.2f} per word ({r['words'] + r['sentences']:,} words and </s>)"
               + (f", each after the {context_sentences} sentences before it" if context_sentences else ""))
    if r["tokens"] != r["words"] + r["sentences"]:
        typer.echo(f"per token        {r['perplexity_per_token']:.2f} over {r['tokens']:,} tokens "
                   f"(tokenizer {r['tokenizer']})")
    typer.echo(f"OOV words        {r['oov_words']:,} ({100 * r['oov_rate']:.2f}%)")
    typer.echo(f"convention       {r['convention']}")
    typer.echo(f"speed            {r['tokens_per_second']:,.0f} tokens/s on {r['device']} in {r['precision']}")
    typer.echo(f"state/position   {r['state_numel_per_position']:,} numbers, "
               f"{r['state_bytes_per_position']:,} bytes")
    if r["state_numel_fixed"]:
        typer.echo(f"state/row        {r['state_numel_fixed']:,} numbers that do not grow with the history")
    for key, value in r["model_report"].items():
        typer.echo(f"{key:<16} {value}")
    mix = r["interpolation"]
    if mix:
        typer.echo(f"n-gram           {mix['ngram']}: perplexity {mix['ngram_perplexity']:.2f} on the same words")
        typer.echo(f"interpolated     perplexity {mix['perplexity']:.2f} with lam {mix['lambda']:.2f} "
                   f"(lam * p_neural + (1 - lam) * p_ngram per word; rescore --set interpolation=linear "
                   f"--set lam={mix['lambda']:.2f})")


def export(
    model: Path = typer.Option(..., "--model", help="Run directory or checkpoint file."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the release copy (model.pt, vocab.txt)."),
    fp32: bool = typer.Option(False, help="Keep float32 weights [default: fp16, half the size]."),
):
    """A small release copy of a trained LM: weights (fp16), config and vocabulary only,
    loadable wherever a run directory is (eval, rescore, serve)."""
    from ..checkpoint import export_model

    path = export_model(model, out, half=not fp32)
    typer.echo(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
