"""`tune`: interpolation weights searched on dev n-best lists or dev lattices (`rescoring/runs/tune_run.py`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import ConfigError
from .common import (
    AC_COSTS,
    BEAM_SIZE,
    LM_COSTS,
    MANIFEST,
    MERGE,
    NBEST_FORMAT,
    NGRAM_CONTEXT,
    PATH_CHOICE,
    PRECISION,
    UTT2DOC,
    check_precision,
    context_plan,
    load_weights,
    note,
)


def tune(
    inputs: Optional[List[Path]] = typer.Argument(None, help="Dev lattices (.fst, .slf[.gz]) or n-best files or "
                                                  "toolkit output directories (--nbest-format)."),
    nbest: List[Path] = typer.Option([], "--nbest", help="Dev n-best file or directory (repeatable)."),
    words: Optional[Path] = typer.Option(None, "--words", help="The decoder's words.txt (OpenFST lattices; Kaldi "
                                         "n-best word ids)."),
    nbest_format: str = NBEST_FORMAT,
    manifest: Optional[Path] = MANIFEST,
    beam_size: Optional[int] = BEAM_SIZE,
    lm_costs: Optional[Path] = LM_COSTS,
    ac_costs: Optional[Path] = AC_COSTS,
    merge_duplicates: str = MERGE,
    max_ngram_order: int = typer.Option(4, help="Lattices: history merging order."),
    exact: bool = typer.Option(False, help="Lattices: full word histories, never merged (still beam-pruned: "
                               "see rescore --help)."),
    refs: Path = typer.Option(..., "--refs", help="Dev references `utt w1 w2 ...`."),
    lm: Optional[Path] = typer.Option(None, "--lm"),
    ngram: Optional[Path] = typer.Option(None, "--ngram"),
    out: Path = typer.Option(..., "-o", "--out", help="weights.json to write."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Starting weights (fixed ones kept)."),
    set_: List[str] = typer.Option([], "--set", help="Fixed weight key=value, e.g. --set am_scale=0.105."),
    search: str = typer.Option("lm_weight,ngram_weight,word_penalty", help="Comma-separated weights to tune."),
    interpolation: Optional[str] = typer.Option(None, help="loglinear or linear (then lam is tuned too) "
                                                "[default: from --weights/--set, else loglinear]."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of WER against lm_weight (needs matplotlib)."),
    mbr: bool = typer.Option(False, "--mbr", help="N-best lists: also tune mbr_scale, the posterior scale of "
                             "minimum-Bayes-risk selection (0 keeps the highest total)."),
    decode: Optional[str] = typer.Option(None, "--decode", help="Lattices: the decodes to choose among, viterbi, "
                                         "mbr or viterbi,mbr (MBR kept only where it makes fewer dev errors); the "
                                         "posterior scale is chosen with it [default: viterbi]."),
    device: str = typer.Option("auto"),
    precision: str = PRECISION,
    path_choice: bool = PATH_CHOICE,
    batch_tokens: int = typer.Option(8192),
    utt2doc: Optional[Path] = UTT2DOC,
    context_utts: Optional[str] = typer.Option(None, "--context-utts", help="With --utt2doc: the numbers of "
                                               "previous utterances to try as context, after the weights are tuned "
                                               "without it; the one with the fewest dev errors (or 0) goes into the "
                                               "weights file [default: 1,2,4]."),
    ngram_context: bool = NGRAM_CONTEXT,
    quiet: bool = typer.Option(False),
):
    """Tune interpolation weights on a dev set and write the best to a JSON file (lattices: also the decode and
    the posterior scale of word confidences; with --utt2doc, also how many previous utterances to read)."""
    from ..rescoring.runs.lattice_run import split_lattice_inputs
    from ..rescoring.runs.tune import plot_surface, surface_text
    from ..rescoring.runs.tune_run import tune_search

    check_precision(precision)
    if utt2doc is None and context_utts is not None:
        raise ConfigError("--context-utts needs --utt2doc (which utterances follow which)")
    candidates = _context_candidates(context_utts or "1,2,4")
    context = context_plan(utt2doc, None, None, ngram_context)
    base = load_weights(weights, set_)
    if interpolation is not None:
        base = dataclasses.replace(base, interpolation=interpolation)
    keys = [k.strip() for k in search.split(",") if k.strip()]
    plan = tune_search(keys, base, lm is not None, ngram is not None, mbr)
    inputs = list(inputs or [])
    lattices, others = split_lattice_inputs(inputs) if nbest_format == "auto" else ([], inputs)
    nbest = list(nbest) + others
    if bool(nbest) == bool(lattices):
        raise ConfigError("give dev n-best lists or dev lattices to tune on, one of the two")
    if lattices:
        if mbr:
            raise ConfigError("--mbr tunes the choice among n-best hypotheses; for lattices choose the consensus "
                              "decode with --decode viterbi,mbr")
        from ..rescoring.expand.rescorer import ExpandConfig
        from ..rescoring.runs.lattice_run import LatticeRun
        from ..rescoring.runs.tune_decode import parse_decodes
        from ..rescoring.runs.tune_run import tune_lattice_files

        plan = dataclasses.replace(plan, decodes=parse_decodes(decode or "viterbi"))
        run = LatticeRun(words, lm, ngram, expand=ExpandConfig(max_ngram_order=None if exact else max_ngram_order),
                         device=device, progress=not quiet, precision=precision)
        r, n, choice = tune_lattice_files(lattices, run, refs, plan,
                                          (context, candidates) if context is not None else None)
        typer.echo(surface_text(r))
        for line in r.decode_choice.lines(r.ref_words) if r.decode_choice is not None else []:
            typer.echo(line)
        typer.echo(f"first-pass WER {100 * r.baseline_errors / r.ref_words:.2f}%  tuned WER {100 * r.wer:.2f}% "
                   f"with {r.weights.decode} decoding, posterior scale {r.weights.posterior_scale:g} "
                   f"({n} lattices, {r.ref_words} reference words)")
        _save(r, n, out, _context_report(choice))
        return
    if decode is not None:
        raise ConfigError("--decode chooses how lattices are decoded; n-best lists choose by minimum Bayes risk "
                          "with --mbr")
    from ..rescoring.nbest.formats import ImportOptions
    from ..rescoring.runs.nbest_run import NBestScoring
    from ..rescoring.runs.tune_run import tune_nbest_files

    opts = ImportOptions(nbest_format, manifest, beam_size, words, lm_costs, ac_costs, merge_duplicates)
    scoring = NBestScoring(lm, ngram, device, batch_tokens, progress=not quiet, precision=precision,
                           choose_paths=path_choice)
    r, n, choice = tune_nbest_files(nbest, opts, scoring, refs, plan, note,
                                    (context, candidates) if context is not None else None)
    typer.echo(surface_text(r))
    if r.mbr_errors is not None:
        typer.echo("WER% vs mbr_scale (other weights before the MBR pass): " + "  ".join(
            f"{m:g}:{100 * e / r.ref_words:.2f}" for m, e in r.mbr_errors))
    typer.echo(f"first-pass WER {100 * r.baseline_errors / r.ref_words:.2f}%  oracle WER "
               f"{100 * r.oracle_errors / r.ref_words:.2f}%  tuned WER {100 * r.wer:.2f}% "
               f"({n} utterances, {r.ref_words} reference words)")
    _save(r, n, out, _context_report(choice))
    if plot is not None:
        typer.echo(f"plot -> {plot}" if plot_surface(r, str(plot)) else "no plot: matplotlib is not installed")


def _context_candidates(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--context-utts expects numbers like 1,2,4, got {text!r}") from None
    if not ks or min(ks) < 0:
        raise ConfigError(f"--context-utts expects numbers >= 0 like 1,2,4, got {text!r}")
    return ks


def _context_report(choice) -> dict:
    """Print the context search and give what the weights file keeps of it (nothing without one)."""
    from ..rescoring.runs.context_run import CONTEXT_KEY

    if choice is None:
        return {}
    typer.echo(choice.line())
    k = choice.chosen
    typer.echo(f"context: {k} previous utterance{'s' if k != 1 else ''} (dev WER "
               f"{100 * choice.errors[k] / choice.ref_words:.2f}%, without context "
               f"{100 * choice.errors[0] / choice.ref_words:.2f}%)")
    return {CONTEXT_KEY: k, "dev_wer_by_context_utts": {str(a): e / choice.ref_words
                                                       for a, e in sorted(choice.errors.items())}}


def _save(r, dev_inputs: int, out: Path, more: dict | None = None) -> None:
    extra = {"dev_wer": r.wer, "dev_utterances": dev_inputs, "dev_first_pass_wer": r.baseline_errors / r.ref_words,
             **(more or {})}
    if r.decode_choice is not None:  # how well the dev confidences fit, at the chosen decode and scale
        extra["dev_confidence_nce"] = r.decode_choice.nce
    r.weights.save(out, extra)
    typer.echo(f"weights -> {out}: " + json.dumps(dataclasses.asdict(r.weights)))
