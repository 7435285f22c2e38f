"""`smallstate-lm` command line: each command parses, calls one library function and
formats the result. Errors meant for users print as one line and exit with status 2."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, List, Literal, Optional, Union, get_args, get_origin, get_type_hints

import typer

from .errors import ConfigError, SmallstateError
from .train_config import DistillConfig, TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Small-state Transformer LMs for ASR rescoring.")

REPO_DATA = Path(__file__).resolve().parent.parent / "data"


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


def _set_threads(n: int | None) -> None:
    if n is not None:
        if n < 1:
            raise ConfigError(f"--threads must be >= 1, got {n}")
        import torch

        torch.set_num_threads(n)


def _option_type(hint, path: bool):
    """The type Typer parses an option into, for a config field of type `hint`."""
    if get_origin(hint) in (Union, types.UnionType):  # `X | None`
        return Optional[_option_type(next(a for a in get_args(hint) if a is not type(None)), path)]
    if path:
        return Path
    if get_origin(hint) is Literal:
        return str  # the library checks the value, in one message naming the choices
    if get_origin(hint) is list:
        return List[get_args(hint)[0]]
    return List[str] if hint is dict else hint  # a dict is given as repeated key=value (parse_overrides)


def _options(cls, changes: dict[str, dict] | None = None) -> dict[str, inspect.Parameter]:
    """The Typer options of the fields of config dataclass `cls` made with `option()`, by
    field name, in field order. `changes` replaces some of a field's option settings
    (default, help, flags) for one command."""
    hints = get_type_hints(cls)
    params = {}
    for f in dataclasses.fields(cls):
        if "cli" not in f.metadata:
            continue
        spec = {**f.metadata["cli"], **(changes or {}).get(f.name, {})}
        default = spec.get("default", f.default_factory() if f.default_factory is not dataclasses.MISSING
                           else f.default)
        if spec["negated"]:
            name, kind, default = spec["negated"], bool, not default
        else:
            name, kind = f.name, _option_type(hints[f.name], spec["path"])
            default = [] if isinstance(default, dict) else default  # a dict: no --set pairs by default
        params[f.name] = inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, typer.Option(*spec["flags"],
                                                                                          help=spec["help"])],
            default=inspect.Parameter.empty if default is dataclasses.MISSING else default)
    return params


def _config(cls, values: dict):
    """An instance of config dataclass `cls` from the values of its options (`_options`);
    fields without a value keep their defaults."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("cli")
        if spec is None or (spec["negated"] or f.name) not in values:
            continue
        value = values[spec["negated"] or f.name]
        if spec["negated"]:
            value = not value
        elif hints[f.name] is dict:
            value = parse_overrides(value)
        elif isinstance(value, (list, tuple)):
            value = list(value)
        elif spec["path"] and value is not None:
            value = str(value)
        kwargs[f.name] = value
    return cls(**kwargs)


_THREADS = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
    Optional[int], typer.Option(help="CPU threads for PyTorch [default: all cores].")])


def _signature(params: Iterable[inspect.Parameter]) -> Callable:
    """Give a command that takes `**options` the signature Typer reads its options from."""
    def wrap(fn: Callable) -> Callable:
        fn.__signature__ = inspect.Signature([*params, _THREADS])
        return fn

    return wrap


def _train_into(out: Path, run: Callable[[], dict]) -> None:
    """Print the summary of `run()`, a training into `out`; after a failure, leave no
    directory there that looks like a run unless one was there before."""
    from .train import remove_incomplete_run

    existed = out.exists()
    try:
        summary = run()
    except BaseException:
        if not existed:
            remove_incomplete_run(out)
        raise
    typer.echo(json.dumps(summary, indent=2))


@app.command()
@_signature(_options(TrainConfig).values())
def train(**options):
    """Train an LM on a text file."""
    _set_threads(options.pop("threads"))
    from .train import train as run_train

    tc = _config(TrainConfig, options)
    _train_into(Path(tc.out), lambda: run_train(tc))


@app.command("eval")
def eval_(
    model: Path = typer.Option(..., "--model", help="Run directory or checkpoint file."),
    text: Path = typer.Option(..., "--text", help="Text to score, one sentence per line."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    ngram: Optional[Path] = typer.Option(None, "--ngram", help="Also a KenLM n-gram: its perplexity on the same "
                                         "tokens and the linear interpolation of both with the best weight."),
    device: str = typer.Option("cpu"),
    batch_tokens: int = typer.Option(8192),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
):
    """Perplexity, speed, parameters and state size of a trained LM."""
    _set_threads(threads)
    from .device import pick_device
    from .evaluate import evaluate_file

    r = evaluate_file(model, text, str(pick_device(device)), batch_tokens, ngram)
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
    if r["state_numel_fixed"]:
        typer.echo(f"state/row        {r['state_numel_fixed']:,} numbers that do not grow with the history")
    for key, value in r["model_report"].items():
        typer.echo(f"{key:<16} {value}")
    mix = r["interpolation"]
    if mix:
        typer.echo(f"n-gram           {mix['ngram']}: perplexity {mix['ngram_perplexity']:.2f} on the same tokens")
        typer.echo(f"interpolated     perplexity {mix['perplexity']:.2f} with lam {mix['lambda']:.2f} "
                   f"(lam * p_neural + (1 - lam) * p_ngram per token; rescore --set interpolation=linear "
                   f"--set lam={mix['lambda']:.2f})")


@app.command()
def export(
    model: Path = typer.Option(..., "--model", help="Run directory or checkpoint file."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the release copy (model.pt, vocab.txt)."),
    fp32: bool = typer.Option(False, help="Keep float32 weights [default: fp16, half the size]."),
):
    """A small release copy of a trained LM: weights (fp16), config and vocabulary only,
    loadable wherever a run directory is (eval, rescore, serve)."""
    from .checkpoint import export_model

    path = export_model(model, out, half=not fp32)
    typer.echo(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")


REPO_LATTICES = Path(__file__).resolve().parent.parent / "lattices"


REPO_MODEL = Path(__file__).resolve().parent.parent / "models" / "bible-small"


@app.command()
def demo(
    model: Path = typer.Option(REPO_MODEL, "--model", help="The neural LM (the shipped model by default)."),
    train: Path = typer.Option(REPO_DATA / "train.txt", "--train", help="Text for the demo's 4-gram."),
    lattices: Path = typer.Option(REPO_LATTICES, "--lattices",
                                  help="Directory of *.lat.fst, words.txt, ref.txt and the tuned weights."),
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o"),
):
    """Rescore the bundled lattices with a KenLM 4-gram alone and with the shipped neural
    LM + the 4-gram, and print the WER of the first pass and of both."""
    from .checkpoint import load_model
    from .models import count_parameters
    from .ngram import build_ngram

    lm = load_model(model)  # before any work: a missing or bad model fails with its path
    typer.echo(f"demo: neural LM {model} ({lm.config.name}, {count_parameters(lm.model):,} parameters, "
               f"{lm.model.state_numel_per_position():,} state numbers/position)")
    del lm
    ngram_bin = out / "lm4.bin"
    if not ngram_bin.exists():
        typer.echo(f"demo: building a 4-gram on {train} (lmplz, cached in {ngram_bin})")
        build_ngram(train, 4, out / "lm4.arpa", ngram_bin)
    fsts = sorted(lattices.glob("*.fst"))
    if not fsts:
        raise ConfigError(f"{lattices}: no *.fst lattices to rescore")
    refs = lattices / "ref.txt"
    rescore_cmd = typer.main.get_command(app)
    results = {}
    for name, lm_args, weights in (("n-gram alone", [], "weights-ngram.json"),
                                   ("neural + n-gram", ["--lm", str(model)], "weights.json")):
        dest = out / ("rescored-ngram" if not lm_args else "rescored")
        argv = ["rescore", *map(str, fsts), "--words", str(lattices / "words.txt"), *lm_args,
                "--ngram", str(ngram_bin), "--refs", str(refs), "-o", str(dest), "--quiet"]
        if (lattices / weights).exists():
            argv += ["--weights", str(lattices / weights)]
        typer.echo("demo: smallstate-lm " + " ".join(argv))
        rescore_cmd.main(args=argv, standalone_mode=False)
        lines = (dest / "wer.txt").read_text().splitlines()
        results[name] = lines[0].split()[1]
        results["first pass"] = lines[1].split()[-1]
    typer.echo(f"demo: {len(fsts)} lattices, WER:")
    for name in ("first pass", "n-gram alone", "neural + n-gram"):
        typer.echo(f"  {name:<16} {results[name]}%")
    typer.echo(f"demo: outputs in {out / 'rescored'} (best.txt, nbest.jsonl, wer.txt, lattices/)")


ngram_app = typer.Typer(no_args_is_help=True, help="KenLM n-gram models: build and evaluate.")
app.add_typer(ngram_app, name="ngram")


@ngram_app.command("train")
def ngram_train(
    text: Path = typer.Option(..., "--text", help="Training text, one sentence per line."),
    order: int = typer.Option(4, "--order"),
    out: Path = typer.Option(..., "-o", "--out", help="ARPA file to write."),
    binary: Optional[Path] = typer.Option(None, "--binary", help="Also write a KenLM binary (faster to load)."),
    prune: Optional[str] = typer.Option(None, "--prune", help='Count thresholds per order, e.g. "0 0 1".'),
    memory: str = typer.Option("10%", help="lmplz sort memory (-S)."),
):
    """Estimate an n-gram with lmplz (and build_binary)."""
    from .ngram import build_ngram

    thresholds = None
    if prune:
        try:
            thresholds = [int(x) for x in prune.replace(",", " ").split()]
        except ValueError:
            raise ConfigError(f"--prune expects integers, got {prune!r}") from None
    typer.echo(json.dumps(build_ngram(text, order, out, binary, thresholds, memory), indent=2))


@ngram_app.command("eval")
def ngram_eval(
    ngram: Path = typer.Option(..., "--ngram", help="ARPA or KenLM binary file."),
    text: Path = typer.Option(..., "--text"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Perplexity of an n-gram (words + </s>, OOVs as <unk>: the same convention as `eval`)."""
    from .ngram import evaluate_ngram

    r = evaluate_ngram(ngram, text)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
    else:
        typer.echo(f"{r['ngram']} ({r['order']}-gram) on {r['text']}: perplexity {r['perplexity']:.2f} over "
                   f"{r['tokens']:,} tokens, {r['oov_words']:,} OOV words ({100 * r['oov_rate']:.2f}%)")


def _scorers(lm: Optional[Path], ngram: Optional[Path], device: str, batch_tokens: int, share: bool = True):
    from .lms import load_lms
    from .scoring import NeuralScorer

    loaded, ng = load_lms(lm, ngram, device)
    if loaded is None:
        return None, ng
    dev = next(loaded.model.parameters()).device
    return NeuralScorer(loaded.model, loaded.vocab, dev, batch_tokens, share), ng


def _lattice_rescorer(lm, ngram, w, device, cfg):
    from .lms import load_lms
    from .rescoring.lattice_expand import build_rescorer

    loaded, ng = load_lms(lm, ngram, device)
    return build_rescorer(w, loaded, ng, cfg)


def _symbols(words: Optional[Path], lattices):
    """The decoder's symbol table (--words), or None where no lattice input needs one; `lattices` are resolved
    (`_resolve`), so no file is looked at again."""
    from .rescoring.lattice import SymbolTable

    if words is not None:
        return SymbolTable.read(words)
    for source in lattices:
        fmt = source.format
        if fmt is not None and fmt.needs_symbols:
            raise ConfigError(f"{source}: {fmt.description} lattices need the decoder's symbol table: --words "
                              "words.txt")
    return None


def _resolve(inputs: list[Path]) -> list:
    """Each input's format, decided once (`lattice_formats.resolve_input`: by rspecifier, name or first bytes);
    every later step asks the resolved input. Format None: not a lattice input (an n-best list, a missing file)."""
    from .rescoring.lattice_formats import resolve_input

    return [resolve_input(p) for p in inputs]


def _weights(path: Optional[Path], overrides: list[str], direct: dict | None = None):
    import dataclasses

    from .weights import Weights

    w = Weights.load(path) if path else Weights()
    ov = {**parse_overrides(overrides), **{k: v for k, v in (direct or {}).items() if v is not None}}
    try:
        return dataclasses.replace(w, **ov)
    except TypeError as e:
        raise ConfigError(f"--set: {e}") from None


# Options of the n-best inputs, shared by rescore and tune (rescoring/nbest_import.py, docs/nbest-inputs.md).
_NBEST_FORMAT = typer.Option("auto", "--nbest-format", help="N-best inputs: auto (by content and layout), tsv, "
                             "jsonl, json, espnet (inference dir), nemo (beam-search candidates TSV), kaldi "
                             "(nbest-to-linear archives): docs/nbest-inputs.md.")
_MANIFEST = typer.Option(None, "--manifest", help="NeMo: the manifest the candidates were decoded from (ids).")
_BEAM_SIZE = typer.Option(None, "--beam-size", help="NeMo: candidates per utterance [default: from the file name, "
                          "else lines / manifest rows].")
_LM_COSTS = typer.Option(None, "--lm-costs", help="Kaldi n-best: the LM-cost archive [default: lmwt.withlm "
                         "beside the word archive].")
_AC_COSTS = typer.Option(None, "--ac-costs", help="Kaldi n-best: the acoustic-cost archive [default: acwt beside "
                         "the word archive].")
_MERGE = typer.Option("logsumexp", "--merge-duplicates", help="N-best hypotheses with the same words: logsumexp "
                      "(sum their probabilities) or max (keep the best).")


@app.command()
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
                                              "(n-best lists; 0 = highest total)."),
    refs: Optional[Path] = typer.Option(None, "--refs", help="Reference text `utt w1 w2 ...` for WER."),
    out: Path = typer.Option(..., "-o", "--out", help="Output directory."),
    device: str = typer.Option("auto"),
    batch_tokens: int = typer.Option(8192),
    no_prefix_sharing: bool = typer.Option(False, "--no-prefix-sharing",
                                           help="Score each hypothesis as its own padded row."),
    words: Optional[Path] = typer.Option(None, "--words", help="The decoder's words.txt (lattices; Kaldi n-best "
                                         "word ids)."),
    nbest_format: str = _NBEST_FORMAT, manifest: Optional[Path] = _MANIFEST, beam_size: Optional[int] = _BEAM_SIZE,
    lm_costs: Optional[Path] = _LM_COSTS, ac_costs: Optional[Path] = _AC_COSTS, merge_duplicates: str = _MERGE,
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
    quiet: bool = typer.Option(False),
):
    """Rescore n-best lists (.tsv, .jsonl, ESPnet, NeMo, Kaldi) or lattices (.fst, .slf[.gz]): writes best.txt,
    nbest.jsonl, rescored lattices (lattices/) and, with --refs, wer.txt."""
    from .files import check_output_dir
    from .rescoring.nbest_import import ImportOptions
    from .rescoring.nbest_io import read_text

    check_output_dir(out, ConfigError)
    # a directory or a missing file has no kind: among lattices it is reported and skipped like any unreadable
    # lattice (a missing lat.2.gz beside lat.1.gz is a lattice input that is not there, not an n-best list)
    sources = _resolve(inputs)
    kinds = {s.format is not None for p, s in zip(inputs, sources) if p.is_file() or s.format is not None}
    if len(kinds) > 1:
        raise ConfigError("give either n-best files or lattice files, not both")
    direct = {"lm_weight": lm_weight, "ngram_weight": ngram_weight, "word_penalty": word_penalty,
              "mbr_scale": mbr_scale}
    w = _weights(weights, set_, direct)
    ref = read_text(refs) if refs else None
    if kinds == {True} and nbest_format == "auto":
        if w.mbr_scale > 0:
            typer.echo("note: mbr_scale applies to n-best lists; lattices are rescored by their best path",
                       err=True)
        from .rescoring.lattice_files import CtmOptions

        _rescore_lattices(sources, words, lm, ngram, w, ref, out, device, exact, max_ngram_order, beam,
                          max_per_state, max_states, nbest, quiet, ray, ray_actors,
                          CtmOptions(frame_shift, subsampling_factor) if ctm else None, archive_text, jobs)
        return
    if ray is not None:
        raise ConfigError("--ray rescores lattice files; n-best lists are rescored locally")
    opts = ImportOptions(nbest_format, manifest, beam_size, words, lm_costs, ac_costs, merge_duplicates)
    _rescore_nbest(inputs, opts, lm, ngram, w, ref, out, device, batch_tokens, not no_prefix_sharing, quiet)


def _rescore_nbest(inputs, opts, lm, ngram, w, ref, out, device, batch_tokens, share, quiet):
    from .rescoring.nbest import apply_weights, compute_components
    from .rescoring.nbest_import import read_nbest_inputs
    from .rescoring.nbest_io import write_nbest_jsonl, write_text

    utts, _ = read_nbest_inputs(inputs, opts, lambda m: typer.echo(f"note: {m}", err=True))
    neural, ng = _scorers(lm, ngram, device, batch_tokens, share)
    comps, stats = compute_components(utts, neural, ng, progress=not quiet)
    ranked = apply_weights(utts, comps, w)
    best = {u.utt: u.hyps[0].words for u in ranked}
    write_nbest_jsonl(out / "nbest.jsonl", ranked)  # first: it refuses non-finite scores, before best.txt exists
    write_text(out / "best.txt", best)
    summary = (f"{stats.utterances} utterances, {stats.hypotheses} hypotheses, {stats.tokens_total} tokens "
               f"({stats.tokens_computed} computed), OOV {100 * stats.oov_rate:.2f}%, {stats.seconds:.1f} s")
    if ref is not None:
        from .rescoring.wer import write_wer_report

        total, first = write_wer_report(out / "wer.txt", ref, best, {u.utt: u.hyps[0].words for u in utts})
        summary += f"; WER {100 * total.wer:.2f}% (first pass {100 * first.wer:.2f}%)"
    typer.echo(summary)


def _rescore_lattices(inputs, words, lm, ngram, w, ref, out, device, exact, max_ngram_order, beam, max_per_state,
                      max_states, nbest, quiet, ray=None, ray_actors=None, ctm=None, archive_text=False, jobs=1):
    from .rescoring.lattice_expand import ExpandConfig
    from .rescoring.lattice_files import RunOptions, rescore_lattice_files

    symbols = _symbols(words, inputs)
    cfg = ExpandConfig(max_ngram_order=None if exact else max_ngram_order, beam=beam, max_per_state=max_per_state,
                       max_states=max_states)
    errors = []

    def on_error(path, msg):
        errors.append(msg)
        typer.echo(f"error: {msg} (skipped)", err=True)

    if jobs > 1 or ray is not None:  # workers load the models themselves, from absolute paths
        from .rescoring.jobs import RescoreJob

        job = RescoreJob(*(str(p.resolve()) if p else None for p in (words, lm, ngram)), weights=w, config=cfg,
                         nbest=nbest)
    if jobs > 1 and ray is None:
        from .rescoring.local_pool import rescore_lattice_files_pool

        if device not in ("auto", "cpu"):
            raise ConfigError(f"--jobs runs CPU workers; with --device {device} use one process per GPU (or --ray)")
        summary = rescore_lattice_files_pool(inputs, job, jobs, out, ref, not quiet, on_error, ctm, archive_text,
                                             symbols)
    elif ray is not None:
        from .rescoring.ray_runner import rescore_lattice_files_ray

        if ctm is not None or any(s.many for s in inputs):
            raise ConfigError("--ray rescores single lattice files (.fst, SLF) without --ctm; rescore Kaldi "
                              "archives and write CTMs without --ray")
        summary = rescore_lattice_files_ray(inputs, job, out, ref, ray, device, ray_actors, progress=not quiet,
                                            on_error=on_error)
    else:
        rescorer = _lattice_rescorer(lm, ngram, w, device, cfg)
        summary = rescore_lattice_files(inputs, symbols, rescorer, out, ref,
                                        RunOptions(nbest, ctm=ctm, archive_text=archive_text), progress=not quiet,
                                        on_error=on_error)
    typer.echo(summary.line())
    if errors and not summary.lattices:
        typer.echo(f"error: none of the {len(errors)} lattice files could be rescored; nothing written to {out}",
                   err=True)
    if errors:
        raise typer.Exit(code=2)


@app.command()
def tune(
    inputs: Optional[List[Path]] = typer.Argument(None, help="Dev lattices (.fst, .slf[.gz]) or n-best files or "
                                                  "toolkit output directories (--nbest-format)."),
    nbest: List[Path] = typer.Option([], "--nbest", help="Dev n-best file or directory (repeatable)."),
    words: Optional[Path] = typer.Option(None, "--words", help="The decoder's words.txt (OpenFST lattices; Kaldi "
                                         "n-best word ids)."),
    nbest_format: str = _NBEST_FORMAT, manifest: Optional[Path] = _MANIFEST, beam_size: Optional[int] = _BEAM_SIZE,
    lm_costs: Optional[Path] = _LM_COSTS, ac_costs: Optional[Path] = _AC_COSTS, merge_duplicates: str = _MERGE,
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
    device: str = typer.Option("auto"),
    batch_tokens: int = typer.Option(8192),
    quiet: bool = typer.Option(False),
):
    """Tune interpolation weights on a dev set and write the best to a JSON file."""
    import dataclasses

    from .rescoring.nbest import compute_components
    from .rescoring.nbest_import import ImportOptions, read_nbest_inputs
    from .rescoring.nbest_io import read_text
    from .rescoring.tune import DEFAULT_GRID, LAM_GRID, plot_surface, surface_text
    from .rescoring.tune import tune as run_tune

    base = _weights(weights, set_)
    if interpolation is not None:
        base = dataclasses.replace(base, interpolation=interpolation)
    keys = [k.strip() for k in search.split(",") if k.strip()]
    if lm is None:
        keys = [k for k in keys if k != "lm_weight"]
        base = dataclasses.replace(base, lm_weight=0.0)
    if ngram is None:
        keys = [k for k in keys if k != "ngram_weight"]
        base = dataclasses.replace(base, ngram_weight=0.0)
    grid = {k: DEFAULT_GRID.get(k, LAM_GRID if k == "lam" else [round(x * 0.1, 3) for x in range(0, 21)])
            for k in keys}
    inputs = list(inputs or [])
    lattices, others = _split_lattices(inputs) if nbest_format == "auto" else ([], inputs)
    nbest = list(nbest) + others
    if bool(nbest) == bool(lattices):
        raise ConfigError("give dev n-best lists or dev lattices to tune on, one of the two")
    if lattices:
        if mbr:
            raise ConfigError("--mbr tunes the choice among n-best hypotheses; lattices are rescored by their "
                              "best path, so tune them without it")
        _tune_lattices(lattices, words, refs, lm, ngram, base, grid, out, device, exact, max_ngram_order, quiet)
        return
    utts, _ = read_nbest_inputs(nbest, ImportOptions(nbest_format, manifest, beam_size, words, lm_costs, ac_costs,
                                                     merge_duplicates), lambda m: typer.echo(f"note: {m}", err=True))
    ref = read_text(refs)
    neural, ng = _scorers(lm, ngram, device, batch_tokens)
    comps, _ = compute_components(utts, neural, ng, progress=not quiet)
    r = run_tune(utts, comps, ref, base, grid, mbr=mbr)
    typer.echo(surface_text(r))
    if r.mbr_errors is not None:
        typer.echo("WER% vs mbr_scale (other weights before the MBR pass): " + "  ".join(
            f"{m:g}:{100 * e / r.ref_words:.2f}" for m, e in r.mbr_errors))
    typer.echo(f"first-pass WER {100 * r.baseline_errors / r.ref_words:.2f}%  oracle WER "
               f"{100 * r.oracle_errors / r.ref_words:.2f}%  tuned WER {100 * r.wer:.2f}% "
               f"({len(utts)} utterances, {r.ref_words} reference words)")
    r.weights.save(out, {"dev_wer": r.wer, "dev_utterances": len(utts), "dev_first_pass_wer":
                         r.baseline_errors / r.ref_words})
    typer.echo(f"weights -> {out}: " + json.dumps(dataclasses.asdict(r.weights)))
    if plot is not None:
        typer.echo(f"plot -> {plot}" if plot_surface(r, str(plot)) else "no plot: matplotlib is not installed")


def _split_lattices(inputs: list[Path]) -> tuple[list, list[Path]]:
    """(the lattice inputs, resolved; the other inputs). A missing file among lattices is a lattice that is not
    there (reported as such), not an n-best list."""
    sources = _resolve(inputs)
    some = any(s.format is not None for s in sources)
    picked = [s.format is not None or (some and not p.exists()) for p, s in zip(inputs, sources)]
    return [s for s, yes in zip(sources, picked) if yes], [p for p, yes in zip(inputs, picked) if not yes]


def _tune_lattices(lattices, words, refs, lm, ngram, base, grid, out, device, exact, max_ngram_order, quiet):
    import dataclasses

    from tqdm import tqdm

    from .rescoring.lattice_expand import ExpandConfig
    from .rescoring.lattice_io import lattice_inputs
    from .rescoring.nbest_io import read_text
    from .rescoring.tune import surface_text, tune_lattices

    symbols = _symbols(words, lattices)
    cfg = ExpandConfig(max_ngram_order=None if exact else max_ngram_order)
    rescorer = _lattice_rescorer(lm, ngram, base, device, cfg)
    lats = [item.load() for item in lattice_inputs(lattices, symbols)]  # a dev set: read whole, errors stop it
    expanded = [e for _, e in tqdm(rescorer.expand_many(lats), total=len(lats), disable=quiet, desc="expand")]
    r = tune_lattices(expanded, read_text(refs), base, grid)
    typer.echo(surface_text(r))
    typer.echo(f"first-pass WER {100 * r.baseline_errors / r.ref_words:.2f}%  tuned WER {100 * r.wer:.2f}% "
               f"({len(lats)} lattices, {r.ref_words} reference words)")
    r.weights.save(out, {"dev_wer": r.wer, "dev_utterances": len(lats),
                         "dev_first_pass_wer": r.baseline_errors / r.ref_words})
    typer.echo(f"weights -> {out}: " + json.dumps(dataclasses.asdict(r.weights)))


@app.command()
def wer(
    ref: Path = typer.Option(..., "--ref", help="Reference text `utt w1 w2 ...`."),
    hyp: Path = typer.Option(..., "--hyp", help="Hypothesis text, same format."),
):
    """Corpus WER with substitutions, deletions and insertions."""
    from .rescoring.nbest_io import read_text
    from .rescoring.wer import corpus_wer

    total, _ = corpus_wer(read_text(ref), read_text(hyp))
    typer.echo(f"%WER {100 * total.wer:.2f} [ {total.errors} / {total.ref_words}, {total.ins} ins, "
               f"{total.dels} del, {total.sub} sub ]")


@app.command()
def serve(
    lm: Optional[Path] = typer.Option(None, "--lm", help="Neural LM run directory or checkpoint (env SMALLSTATE_LM)."),
    ngram: Optional[Path] = typer.Option(None, "--ngram", help="KenLM ARPA/binary (env SMALLSTATE_NGRAM)."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Default weights.json (env SMALLSTATE_WEIGHTS)."),
    host: Optional[str] = typer.Option(None, "--host", help="Bind address (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, "--port", help="TCP port (default 8000)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N (default auto)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for PyTorch (default: all cores)."),
    batching: Optional[bool] = typer.Option(None, "--batching/--no-batching", help="Dynamic batching (default on)."),
    set_: List[str] = typer.Option([], "--set", help="Any other setting key=value, e.g. --set max_wait_ms=10 "
                                   "(see docs/service.md; env SMALLSTATE_<KEY> works too)."),
):
    """Serve rescoring over HTTP (FastAPI + uvicorn): POST /rescore, /score; GET /healthz, /readyz, /metrics."""
    from .service import Settings
    from .service import serve as run_server

    options = {"lm": str(lm) if lm else None, "ngram": str(ngram) if ngram else None,
               "weights": str(weights) if weights else None, "host": host, "port": port, "device": device,
               "threads": threads, "batching": batching}
    settings = Settings.from_env(assignments=set_, **options)
    if settings.lm is not None:
        from .checkpoint import load_model

        # The app loads the model in its lifespan, where a bad file becomes a uvicorn traceback: load and
        # self-check it here first (on the CPU, then dropped) so that it is one line and exit status 2.
        load_model(settings.lm)
    run_server(settings)


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
                    "teacher_cache", "max_minutes", "clock", "max_steps", "lr", "warmup_steps", "batch_tokens",
                    "valid_every", "patience", "seed", "overrides", "device", "progress")
_DISTILL_PARAMS = {**_options(TrainConfig, _STUDENT), **_options(DistillConfig)}


@app.command()
@_signature(_DISTILL_PARAMS[name] for name in _DISTILL_OPTIONS)
def distill(**options):
    """Distill a student LM (e.g. an LSTM) from a trained teacher, in the teacher's vocabulary."""
    _set_threads(options.pop("threads"))
    from .distill import distill as run_distill

    tc = _config(TrainConfig, options)
    dc = _config(DistillConfig, options)
    _train_into(Path(tc.out), lambda: run_distill(tc, dc))


@app.command()
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
    _set_threads(threads)
    from .tasks import TaskConfig, format_summary, run_task

    tc = TaskConfig(task=task, preset=model, overrides=parse_overrides(set_),
                    minutes=1.0 if minutes is None and steps is None else minutes, steps=steps, batch=batch,
                    seed=seed, max_length=max_length, eval_every=eval_every, lr=lr, device=device,
                    progress=not quiet)
    r = run_task(tc)
    typer.echo(format_summary(r), err=True)
    typer.echo(json.dumps(r))


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
