"""What several commands share: `--set key=value` parsing, the weights of `--weights`/`--set`, `--threads`,
notes on stderr, and the options of n-best inputs (rescore and tune read them alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import ConfigError


def parse_overrides(items: list[str]) -> dict:
    """`key=value` pairs (`--set`); values parsed as JSON when they parse (ints, floats, bools, lists),
    with Python's spellings True, False and None taken as JSON's."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, val = item.split("=", 1)
        val = {"True": "true", "False": "false", "None": "null"}.get(val.strip(), val)
        try:
            out[key.strip()] = json.loads(val)
        except json.JSONDecodeError:
            out[key.strip()] = val
    return out


def set_threads(n: int | None) -> None:
    if n is not None:
        if n < 1:
            raise ConfigError(f"--threads must be >= 1, got {n}")
        import torch

        torch.set_num_threads(n)


def load_weights(path: Optional[Path], overrides: list[str], direct: dict | None = None):
    """The weights of `--weights` (else the defaults) with `--set` pairs and the options that name one weight
    (`direct`, None where not given) applied over them."""
    import dataclasses

    from ..weights import Weights

    w = Weights.load(path) if path else Weights()
    ov = {**parse_overrides(overrides), **{k: v for k, v in (direct or {}).items() if v is not None}}
    try:
        return dataclasses.replace(w, **ov)
    except TypeError as e:
        raise ConfigError(f"--set: {e}") from None


def note(message: str) -> None:
    typer.echo(f"note: {message}", err=True)


PRECISION = typer.Option("fp32", "--precision", help="Neural LM weights and state: fp32, bf16 or fp16 (the "
                         "softmax and log-probs stay float32; bf16/fp16 pay on GPUs and CPUs with matrix units).")


PATH_CHOICE = typer.Option(True, "--path-choice/--no-path-choice", help="N-best lists on CUDA: time tree "
                           "attention and padded rows first and score each batch the faster way (they agree to float "
                           "rounding); --no-path-choice always shares prefixes, for numbers that do not depend on a "
                           "timing.")


def check_precision(precision: str) -> None:
    """Refuse an unknown precision before any model loads (torch is not imported for it)."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--precision must be fp32, bf16 or fp16, got {precision!r}")


# Options of the n-best inputs, shared by rescore and tune (rescoring/nbest/formats.py, docs/nbest-inputs.md).
NBEST_FORMAT = typer.Option("auto", "--nbest-format", help="N-best inputs: auto (by content and layout), tsv, "
                            "jsonl, json, espnet (inference dir), nemo (beam-search candidates TSV), kaldi "
                            "(nbest-to-linear archives): docs/nbest-inputs.md.")
MANIFEST = typer.Option(None, "--manifest", help="NeMo: the manifest the candidates were decoded from (ids).")
BEAM_SIZE = typer.Option(None, "--beam-size", help="NeMo: candidates per utterance [default: from the file name, "
                         "else lines / manifest rows].")
LM_COSTS = typer.Option(None, "--lm-costs", help="Kaldi n-best: the LM-cost archive [default: lmwt.withlm "
                        "beside the word archive].")
AC_COSTS = typer.Option(None, "--ac-costs", help="Kaldi n-best: the acoustic-cost archive [default: acwt beside "
                        "the word archive].")
MERGE = typer.Option("logsumexp", "--merge-duplicates", help="N-best hypotheses with the same words: logsumexp "
                     "(sum their probabilities) or max (keep the best).")


# Context across utterances (rescoring/runs/context_run.py), shared by rescore and tune.
UTT2DOC = typer.Option(None, "--utt2doc", help="`utterance document` per line in spoken order (as Kaldi's "
                       "utt2spk): rescore each document's utterances in that order, each after the transcripts "
                       "chosen for the previous ones (--context-utts).")
NGRAM_CONTEXT = typer.Option(False, "--ngram-context", help="With --utt2doc: the n-gram reads the context's words "
                             "too [default: it starts at <s>; the neural LM reads the context].")


def context_plan(utt2doc: Optional[Path], utts: Optional[int], weights: Optional[Path], ngram_context: bool):
    """The `ContextPlan` of --utt2doc (None without it): K from --context-utts, else from a weights file made by
    `tune --utt2doc`, else 1."""
    if utt2doc is None:
        if utts is not None or ngram_context:
            raise ConfigError("--context-utts and --ngram-context need --utt2doc (which utterances follow which)")
        return None
    from ..rescoring.runs.context_run import ContextPlan, context_utts_of

    if utts is None:
        utts = context_utts_of(weights)
    return ContextPlan.read(utt2doc, 1 if utts is None else utts, ngram_context)
