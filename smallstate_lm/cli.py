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

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Small-state Transformer LMs for ASR rescoring.")

REPO_DATA = Path(__file__).resolve().parent.parent / "data"


def parse_overrides(items: list[str]) -> dict:
    """`key=value` pairs (`--set`); values parsed as JSON when they parse (ints, floats, bools, lists)."""
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
    preset: str = typer.Option("tiny", help="Model preset: 8L-3F, 8L-3F-sharedkv, 32L-1F, small, tiny, "
                               "xl-small, span-small, feedback-small, allatt-small, conv-small, pconv-small, "
                               "hconv-small, cgru-small, sa-conv-small, lstm-small, ..."),
    set_: List[str] = typer.Option([], "--set", help="Model config override key=value, repeatable "
                                   "(e.g. --set shared_kv=true --set dropout=0.2)."),
    optimizer: str = typer.Option("adamw", help="adamw (warmup + cosine) or sgd (newbob)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: 2e-3 adamw, 1.0 sgd]."),
    warmup_steps: int = typer.Option(100),
    max_steps: Optional[int] = typer.Option(None, help="Total steps (the cosine schedule spans them)."),
    max_tokens: Optional[int] = typer.Option(None, help="Stop after this many training tokens (words + </s>); "
                                             "the cosine schedule spans them."),
    max_epochs: int = typer.Option(20),
    max_minutes: Optional[float] = typer.Option(None, help="Stop after this much training time."),
    clock: str = typer.Option("wall", help="What --max-minutes measures: wall clock, or this process's cpu time."),
    stop_after: Optional[int] = typer.Option(None, help="Stop at this step, schedule unchanged (resume later)."),
    batch_tokens: int = typer.Option(512, help="Padded tokens per batch (about 32 sentences; raise it "
                                     "with --lr on GPUs)."),
    batch_sentences: Optional[int] = typer.Option(None, help="Random batches of this many sentences instead of "
                                                  "length buckets of --batch-tokens."),
    max_len: int = typer.Option(128, help="Longer sentences are cut into pieces."),
    clip: float = typer.Option(1.0, help="Gradient-norm clipping; 0 disables."),
    valid_every: int = typer.Option(500),
    valid_at_tokens: List[int] = typer.Option([], help="Also validate when training reaches this many "
                                              "tokens; repeatable."),
    eval_text: Optional[Path] = typer.Option(None, help="Also score this text at every validation (logged as "
                                             "eval_ppl in train_log.jsonl; never used to select or stop)."),
    patience: int = typer.Option(5, help="Validations without improvement before stopping; 0 = never."),
    seed: int = typer.Option(1),
    min_count: int = typer.Option(1),
    max_vocab: Optional[int] = typer.Option(None),
    lowercase: bool = typer.Option(False),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last.pt."),
    init_from: Optional[Path] = typer.Option(None, help="Start from this checkpoint's weights, vocabulary and "
                                             "config (a new run with a fresh optimizer and schedule)."),
    vocab_from: Optional[Path] = typer.Option(None, help="Use this run directory's (or vocab.txt's) vocabulary."),
    stream: bool = typer.Option(False, help="Train on running text: consecutive --max-len segments with the "
                                "state carried across (models with bounded state: xl-small, span-small, ...)."),
    precision: str = typer.Option("auto", help="Matmul precision under autocast: auto (bf16 on CUDA, fp32 on CPU), "
                                  "fp32, or bf16 (also on CPUs with bf16 units such as AMX; weights stay fp32)."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
):
    """Train an LM on a text file."""
    _set_threads(threads)
    from .train import TrainConfig, remove_incomplete_run
    from .train import train as run_train

    tc = TrainConfig(
        train=str(train), valid=str(valid), out=str(out), preset=preset, overrides=parse_overrides(set_),
        optimizer=optimizer, lr=lr, warmup_steps=warmup_steps, max_steps=max_steps, max_tokens=max_tokens,
        max_epochs=max_epochs, max_minutes=max_minutes, stop_after=stop_after, batch_tokens=batch_tokens,
        batch_sentences=batch_sentences,
        max_len=max_len, clip=clip, valid_every=valid_every, valid_at_tokens=list(valid_at_tokens),
        eval_text=str(eval_text) if eval_text else None, patience=patience, seed=seed, min_count=min_count,
        max_vocab=max_vocab, lowercase=lowercase, device=device, resume=resume, progress=not quiet,
        init_from=str(init_from) if init_from else None, vocab_from=str(vocab_from) if vocab_from else None,
        stream=stream, clock=clock, precision=precision,
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
    from .checkpoint import load_model
    from .device import pick_device
    from .ngram import NgramLM
    from .scoring import NeuralScorer

    if lm is None and ngram is None:
        raise ConfigError("give a neural LM (--lm DIR), an n-gram (--ngram FILE), or both")
    neural = None
    if lm is not None:
        dev = pick_device(device)
        loaded = load_model(lm, dev)
        neural = NeuralScorer(loaded.model, loaded.vocab, dev, batch_tokens, share)
    return neural, (NgramLM(ngram) if ngram is not None else None)


def _weights(path: Optional[Path], overrides: list[str], direct: dict | None = None):
    import dataclasses

    from .scoring import Weights

    w = Weights.load(path) if path else Weights()
    ov = {**parse_overrides(overrides), **{k: v for k, v in (direct or {}).items() if v is not None}}
    try:
        return dataclasses.replace(w, **ov)
    except TypeError as e:
        raise ConfigError(f"--set: {e}") from None


@app.command()
def rescore(
    inputs: List[Path] = typer.Argument(..., help="N-best files (.tsv or .jsonl)."),
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
    words: Optional[Path] = typer.Option(None, "--words", help="The decoder's words.txt (lattices)."),
    max_ngram_order: int = typer.Option(4, help="Lattices: merge histories sharing their last n-1 words."),
    exact: bool = typer.Option(False, help="Lattices: keep full histories (no merging)."),
    beam: float = typer.Option(12.0, help="Lattices: pruning beam on forward + best-completion cost."),
    max_per_state: int = typer.Option(64, help="Lattices: expanded states kept per lattice state."),
    max_states: int = typer.Option(200_000, help="Lattices: expanded states per lattice before pruning harder."),
    nbest: int = typer.Option(10, help="Lattices: distinct word sequences written to nbest.jsonl."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help="Lattices: rescore on a Ray cluster "
                                      "(needs ray[data]; see docs/ray.md): 'local' starts one on this machine; "
                                      "'auto', HOST:PORT or ray://HOST:PORT joins one."),
    ray_actors: Optional[int] = typer.Option(None, "--ray-actors", help="With --ray: most LM workers at once "
                                             "[default: one per GPU of the cluster, else one per CPU]."),
    quiet: bool = typer.Option(False),
):
    """Rescore n-best lists (.tsv, .jsonl) or lattices (.fst, .slf[.gz]): writes best.txt,
    nbest.jsonl, rescored lattices (lattices/) and, with --refs, wer.txt."""
    from .rescoring.nbest import read_nbest, read_text, write_nbest_jsonl, write_text
    from .rescoring.rescore import apply_weights, compute_components

    kinds = {_is_lattice(p) for p in inputs}
    if len(kinds) > 1:
        raise ConfigError("give either n-best files or lattice files, not both")
    direct = {"lm_weight": lm_weight, "ngram_weight": ngram_weight, "word_penalty": word_penalty,
              "mbr_scale": mbr_scale}
    w = _weights(weights, set_, direct)
    ref = read_text(refs) if refs else None
    if kinds == {True}:
        if w.mbr_scale > 0:
            typer.echo("note: mbr_scale applies to n-best lists; lattices are rescored by their best path",
                       err=True)
        _rescore_lattices(inputs, words, lm, ngram, w, ref, out, device, exact, max_ngram_order, beam,
                          max_per_state, max_states, nbest, quiet, ray, ray_actors)
        return
    if ray is not None:
        raise ConfigError("--ray rescores lattice files; n-best lists are rescored locally")
    utts = [u for p in inputs for u in read_nbest(p)]
    neural, ng = _scorers(lm, ngram, device, batch_tokens, not no_prefix_sharing)
    comps, stats = compute_components(utts, neural, ng, progress=not quiet)
    ranked = apply_weights(utts, comps, w)
    best = {u.utt: u.hyps[0].words for u in ranked}
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "best.txt", best)
    write_nbest_jsonl(out / "nbest.jsonl", ranked)
    summary = (f"{stats.utterances} utterances, {stats.hypotheses} hypotheses, {stats.tokens_total} tokens "
               f"({stats.tokens_computed} computed), OOV {100 * stats.oov_rate:.2f}%, {stats.seconds:.1f} s")
    if ref is not None:
        from .rescoring.wer import write_wer_report

        total, first = write_wer_report(out / "wer.txt", ref, best, {u.utt: u.hyps[0].words for u in utts})
        summary += f"; WER {100 * total.wer:.2f}% (first pass {100 * first.wer:.2f}%)"
    typer.echo(summary)


def _is_lattice(p: Path) -> bool:
    return p.name.endswith(".fst") or ".slf" in p.name


def _rescore_lattices(inputs, words, lm, ngram, w, ref, out, device, exact, max_ngram_order, beam, max_per_state,
                      max_states, nbest, quiet, ray=None, ray_actors=None):
    from .rescoring.expand import ExpandConfig, LatticeRescorer
    from .rescoring.lattice import SymbolTable
    from .rescoring.run import rescore_lattice_files

    if words is None:
        if any(p.name.endswith(".fst") for p in inputs):
            raise ConfigError("OpenFST lattices need the decoder's symbol table: --words words.txt")
        symbols = None
    else:
        symbols = SymbolTable.read(words)
    cfg = ExpandConfig(max_ngram_order=None if exact else max_ngram_order, beam=beam, max_per_state=max_per_state,
                       max_states=max_states)
    errors = []

    def on_error(path, msg):
        errors.append(msg)
        typer.echo(f"error: {msg} (skipped)", err=True)

    if ray is not None:
        from .rescoring.distributed import RescoreJob, rescore_lattice_files_ray

        job = RescoreJob(*(str(p.resolve()) if p else None for p in (words, lm, ngram)), weights=w, config=cfg,
                         nbest=nbest)
        summary = rescore_lattice_files_ray(inputs, job, out, ref, ray, device, ray_actors, progress=not quiet,
                                            on_error=on_error)
    else:
        neural, ng = _scorers(lm, ngram, device, 8192)
        rescorer = LatticeRescorer(w, neural.model if neural else None, neural.vocab if neural else None, ng, cfg,
                                   neural.device if neural else "cpu")
        summary = rescore_lattice_files(inputs, symbols, rescorer, out, ref, nbest, progress=not quiet,
                                        on_error=on_error)
    typer.echo(summary.line())
    if errors:
        raise typer.Exit(code=2)


@app.command()
def tune(
    inputs: Optional[List[Path]] = typer.Argument(None, help="Dev lattices (.fst, .slf[.gz]) or n-best files."),
    nbest: List[Path] = typer.Option([], "--nbest", help="Dev n-best file (repeatable)."),
    words: Optional[Path] = typer.Option(None, "--words", help="The decoder's words.txt (OpenFST lattices)."),
    max_ngram_order: int = typer.Option(4, help="Lattices: history merging order."),
    exact: bool = typer.Option(False, help="Lattices: exact histories."),
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

    from .rescoring.nbest import read_nbest, read_text
    from .rescoring.rescore import compute_components
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
    lattices = [p for p in inputs if _is_lattice(p)]
    nbest = list(nbest) + [p for p in inputs if not _is_lattice(p)]
    if bool(nbest) == bool(lattices):
        raise ConfigError("give dev n-best lists or dev lattices to tune on, one of the two")
    if lattices:
        if mbr:
            raise ConfigError("--mbr tunes the choice among n-best hypotheses; lattices are rescored by their "
                              "best path, so tune them without it")
        _tune_lattices(lattices, words, refs, lm, ngram, base, grid, out, device, exact, max_ngram_order, quiet)
        return
    utts = [u for p in nbest for u in read_nbest(p)]
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


def _tune_lattices(lattices, words, refs, lm, ngram, base, grid, out, device, exact, max_ngram_order, quiet):
    import dataclasses

    from tqdm import tqdm

    from .rescoring.expand import ExpandConfig, LatticeRescorer
    from .rescoring.lattice import SymbolTable
    from .rescoring.nbest import read_text
    from .rescoring.run import read_lattice
    from .rescoring.tune import surface_text, tune_lattices

    if words is None and any(p.name.endswith(".fst") for p in lattices):
        raise ConfigError("OpenFST lattices need the decoder's symbol table: --words words.txt")
    symbols = SymbolTable.read(words) if words else None
    neural, ng = _scorers(lm, ngram, device, 8192)
    rescorer = LatticeRescorer(base, neural.model if neural else None, neural.vocab if neural else None, ng,
                               ExpandConfig(max_ngram_order=None if exact else max_ngram_order),
                               neural.device if neural else "cpu")
    lats = [read_lattice(p, symbols) for p in lattices]
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
    from .rescoring.nbest import read_text
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
    from server.app import serve as run_server
    from server.settings import Settings

    options = {"lm": str(lm) if lm else None, "ngram": str(ngram) if ngram else None,
               "weights": str(weights) if weights else None, "host": host, "port": port, "device": device,
               "threads": threads, "batching": batching}
    run_server(Settings.from_env(assignments=set_, **options))


@app.command()
def distill(
    teacher: Path = typer.Option(..., "--teacher", help="The teacher's run directory or checkpoint."),
    student_preset: str = typer.Option("lstm-small", "--student-preset", help="Student preset (lstm-small, ...)."),
    train: Path = typer.Option(..., "--train", help="Training text, one sentence per line."),
    valid: Path = typer.Option(..., "--valid", help="Validation text for perplexity and early stopping."),
    out: Path = typer.Option(..., "--out", "-o", help="Run directory for the student."),
    lam: float = typer.Option(0.5, "--lambda", help="Weight of the teacher term: (1-λ)·CE(labels) + λ·T²·CE(teacher)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Softens both distributions (KD term scaled by T²)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Teacher's k most probable tokens per position, "
                                        "renormalised [default: the full distribution; 64 with --teacher-cache]."),
    sampled: Optional[int] = typer.Option(None, "--sampled", help="Instead, N tokens sampled from the teacher per "
                                          "position, importance-weighted."),
    teacher_cache: Optional[Path] = typer.Option(None, "--teacher-cache", help="File of the teacher's top-k (or "
                                                 "sampled) targets: made on the first run, read by later ones."),
    max_minutes: Optional[float] = typer.Option(None, help="Stop after this much training time."),
    clock: str = typer.Option("wall", help="What --max-minutes measures: wall clock, or this process's cpu time."),
    max_steps: Optional[int] = typer.Option(None, help="Total steps (the cosine schedule spans them)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: 1e-3]."),
    warmup_steps: int = typer.Option(200),
    batch_tokens: int = typer.Option(4096, help="Padded tokens per batch."),
    valid_every: int = typer.Option(500),
    patience: int = typer.Option(5, help="Validations without improvement before stopping; 0 = never."),
    seed: int = typer.Option(1),
    set_: List[str] = typer.Option([], "--set", help="Student config override key=value, repeatable."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for PyTorch [default: all cores]."),
):
    """Distill a student LM (e.g. an LSTM) from a trained teacher, in the teacher's vocabulary."""
    _set_threads(threads)
    from .distill import DistillConfig
    from .distill import distill as run_distill
    from .train import TrainConfig, remove_incomplete_run

    tc = TrainConfig(train=str(train), valid=str(valid), out=str(out), preset=student_preset,
                     overrides=parse_overrides(set_), lr=lr, max_steps=max_steps, max_minutes=max_minutes,
                     batch_tokens=batch_tokens, valid_every=valid_every, seed=seed, device=device, progress=not quiet,
                     clock=clock, warmup_steps=warmup_steps, patience=patience)
    dc = DistillConfig(teacher=str(teacher), lam=lam, temperature=temperature, top_k=top_k, sampled=sampled,
                       teacher_cache=str(teacher_cache) if teacher_cache else None)
    existed = out.exists()
    try:
        summary = run_distill(tc, dc)
    except BaseException:
        if not existed:
            remove_incomplete_run(out)
        raise
    typer.echo(json.dumps(summary, indent=2))


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
