"""`rescore` (n-best lists or lattices: `rescoring/runs/nbest_run.py`, `rescoring/runs/lattice_run.py`) and `wer`."""

from __future__ import annotations

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


def rescore(
    inputs: List[Path] = typer.Argument(..., help="N-best files or toolkit output directories (--nbest-format), "
                                        "or lattice files."),
    lm: Optional[Path] = typer.Option(None, "--lm", help="Neural LM run directory or checkpoint."),
    ngram: Optional[Path] = typer.Option(None, "--ngram", help="KenLM ARPA/binary."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="weights.json from `tune`."),
    set_: List[str] = typer.Option([], "--set", help="Weight override key=value, e.g. --set lm_weight=0.8."),
    lm_weight: Optional[float] = typer.Option(None, "--lm-weight", help="Override the neural LM weight."),
    ngram_weight: Optional[float] = typer.Option(None, "--ngram-weight", help="Override the n-gram weight."),
    word_penalty: Optional[float] = typer.Option(None, "--word-penalty", help="Override the per-word penalty."),
    mbr_scale: Optional[float] = typer.Option(None, "--mbr-scale", help="Override the MBR posterior scale "
                                              "(n-best lists: 0 = highest total; lattices with --decode mbr: 0 = "
                                              "--posterior-scale)."),
    decode: Optional[str] = typer.Option(None, "--decode", help="Lattices: viterbi (the best path) or mbr (the "
                                         "consensus: fewest expected word errors, rescoring/decode/consensus.py) "
                                         "[default: from --weights, else viterbi]."),
    posterior_scale: Optional[float] = typer.Option(None, "--posterior-scale", help="Lattices: scale of the "
                                                    "weighted total in the posteriors behind word confidences (and "
                                                    "--decode mbr's, unless --mbr-scale is set) [default: from "
                                                    "--weights, else 0.7]."),
    refs: Optional[Path] = typer.Option(None, "--refs", help="Reference text `utt w1 w2 ...` for WER."),
    out: Path = typer.Option(..., "-o", "--out", help="Output directory."),
    device: str = typer.Option("auto"),
    precision: str = PRECISION,
    path_choice: bool = PATH_CHOICE,
    batch_tokens: int = typer.Option(8192),
    no_prefix_sharing: bool = typer.Option(False, "--no-prefix-sharing",
                                           help="Score each hypothesis as its own padded row."),
    words: Optional[Path] = typer.Option(None, "--words", help="The decoder's words.txt (lattices; Kaldi n-best "
                                         "word ids)."),
    nbest_format: str = NBEST_FORMAT, manifest: Optional[Path] = MANIFEST, beam_size: Optional[int] = BEAM_SIZE,
    lm_costs: Optional[Path] = LM_COSTS, ac_costs: Optional[Path] = AC_COSTS, merge_duplicates: str = MERGE,
    max_ngram_order: int = typer.Option(4, help="Lattices: merge histories sharing their last n-1 words."),
    exact: bool = typer.Option(False, help="Lattices: full word histories, never merged; still pruned by --beam "
                               "and --max-per-state (give --beam inf --max-per-state 1000000 for no pruning on "
                               "small lattices; --max-states then bounds the work by pruning harder)."),
    beam: float = typer.Option(12.0, help="Lattices: pruning beam on forward + best-completion cost."),
    max_per_state: int = typer.Option(64, help="Lattices: expanded states kept per lattice state."),
    max_states: int = typer.Option(200_000, help="Lattices: expanded states per lattice before pruning harder."),
    nbest: int = typer.Option(10, min=0, help="Lattices: distinct word sequences written to nbest.jsonl (0: no "
                              "nbest.jsonl and no k-best search, only best.txt and the lattices)."),
    ctm: bool = typer.Option(False, "--ctm", help="Lattices: also write best.ctm (word times of the best path, from "
                             "Kaldi transition-ids or SLF node times; exact for word-aligned lattices: "
                             "lattice-align-words)."),
    frame_shift: float = typer.Option(0.01, help="Lattices, --ctm: seconds per frame (Kaldi's default)."),
    subsampling_factor: int = typer.Option(1, min=1, help="Lattices, --ctm: frames per transition-id (3 for chain "
                                           "models)."),
    archive_text: bool = typer.Option(False, "--archive-text", help="Kaldi archive inputs: write the rescored "
                                      "archives in text form (ark,t) instead of binary."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help="Lattices: rescore on a Ray cluster "
                                      "(needs ray[data]; see docs/ray.md): 'local' starts one on this machine; "
                                      "'auto', HOST:PORT or ray://HOST:PORT joins one."),
    ray_actors: Optional[int] = typer.Option(None, "--ray-actors", help="With --ray: most LM workers at once "
                                             "[default: one per GPU of the cluster, else one per CPU]."),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Lattices: worker processes on this machine (CPU; each "
                             "loads the LMs once): expansion is one core's work per process."),
    utt2doc: Optional[Path] = UTT2DOC,
    context_utts: Optional[int] = typer.Option(None, "--context-utts", min=0, help="With --utt2doc: previous "
                                               "utterances of the document read before each one [default: from "
                                               "--weights (tune --utt2doc), else 1]."),
    ngram_context: bool = NGRAM_CONTEXT,
    quiet: bool = typer.Option(False),
):
    """Rescore n-best lists (.tsv, .jsonl, ESPnet, NeMo, Kaldi) or lattices (.fst, .slf[.gz], Kaldi
    archives, k2 .pt): writes best.txt,
    nbest.jsonl, rescored lattices (lattices/) and, with --refs, wer.txt; lattices also give word confidences
    (nbest.jsonl, best.ctm)."""
    from ..files import check_output_dir
    from ..rescoring.nbest.lists import read_text
    from ..rescoring.runs.lattice_run import classify_inputs

    check_output_dir(out, ConfigError)
    check_precision(precision)
    sources, lattices = classify_inputs(inputs)
    direct = {"lm_weight": lm_weight, "ngram_weight": ngram_weight, "word_penalty": word_penalty,
              "mbr_scale": mbr_scale, "decode": decode, "posterior_scale": posterior_scale}
    w = load_weights(weights, set_, direct)
    context = context_plan(utt2doc, context_utts, weights, ngram_context)
    ref = read_text(refs) if refs else None
    if lattices and nbest_format == "auto":
        from ..rescoring.expand.rescorer import ExpandConfig
        from ..rescoring.runs.lattice_files import CtmOptions, RunOptions
        from ..rescoring.runs.lattice_run import LatticeRun

        if w.mbr_scale > 0 and w.decode == "viterbi":
            note("mbr_scale applies to n-best lists and to lattices with --decode mbr; these are decoded by their "
                 "best path")
        expand = ExpandConfig(max_ngram_order=None if exact else max_ngram_order, beam=beam,
                              max_per_state=max_per_state, max_states=max_states, first_pass=refs is not None)
        outputs = RunOptions(nbest, ctm=CtmOptions(frame_shift, subsampling_factor) if ctm else None,
                             archive_text=archive_text)
        _rescore_lattices(sources, LatticeRun(words, lm, ngram, w, expand, outputs, device, jobs, ray, ray_actors,
                                              progress=not quiet, precision=precision, context=context), out, ref)
        return
    if ray is not None:
        raise ConfigError("--ray rescores lattice files; n-best lists are rescored locally")
    if w.decode != "viterbi":
        note("decode applies to lattices; n-best lists are ranked by total, or by minimum Bayes risk with "
             "--mbr-scale")
    from ..rescoring.nbest.formats import ImportOptions
    from ..rescoring.runs.nbest_run import NBestScoring, rescore_nbest_files

    opts = ImportOptions(nbest_format, manifest, beam_size, words, lm_costs, ac_costs, merge_duplicates)
    scoring = NBestScoring(lm, ngram, device, batch_tokens, not no_prefix_sharing, progress=not quiet,
                           precision=precision, choose_paths=path_choice)
    typer.echo(rescore_nbest_files(inputs, opts, scoring, w, out, ref, note, context).line())


def _rescore_lattices(sources, run, out: Path, ref) -> None:
    """Run, report each lattice that failed as it fails, then the summary; exit 2 when any failed."""
    from ..rescoring.runs.lattice_run import rescore_lattice_run

    errors = []

    def on_error(path, msg):
        errors.append(msg)
        typer.echo(f"error: {msg} (skipped)", err=True)

    summary = rescore_lattice_run(sources, run, out, ref, on_error)
    typer.echo(summary.line())
    if errors and not summary.lattices:
        typer.echo(f"error: none of the {len(errors)} lattice files could be rescored; nothing written to {out}",
                   err=True)
    if errors:
        raise typer.Exit(code=2)


def wer(
    ref: Path = typer.Option(..., "--ref", help="Reference text `utt w1 w2 ...`."),
    hyp: Path = typer.Option(..., "--hyp", help="Hypothesis text, same format."),
):
    """Corpus WER with substitutions, deletions and insertions."""
    from ..rescoring.decode.wer import corpus_wer
    from ..rescoring.nbest.lists import read_text

    total, _ = corpus_wer(read_text(ref), read_text(hyp))
    typer.echo(f"%WER {100 * total.wer:.2f} [ {total.errors} / {total.ref_words}, {total.ins} ins, "
               f"{total.dels} del, {total.sub} sub ]")
