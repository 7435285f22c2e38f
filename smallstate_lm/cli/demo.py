"""`demo`: the bundled lattices rescored with a 4-gram alone and with the shipped neural LM + the 4-gram.

Its inputs are files of the repository (models/, data/, lattices/), not of the package: they are looked for
when the command runs, in the checkout the package lives in, else in the current directory, so that an
installed package finds them from a checkout's root and says what is missing anywhere else."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import ConfigError

# an installed package lives in site-packages, where these are not: then a checkout in the current directory
_MODEL, _TRAIN, _LATTICES = "models/bible-small", "data/train.txt", "lattices"


def _package_checkout() -> Path:
    return Path(__file__).resolve().parents[2]


def _bundled(relative: str) -> Path:
    """`relative` in the checkout the package lives in, else in the current directory."""
    for root in (_package_checkout(), Path.cwd()):
        if (root / relative).exists():
            return root / relative
    raise ConfigError(f"the demo needs a checkout of the repository (or the --model, --train and --lattices "
                      f"options): {relative} is neither beside the package nor in {Path.cwd()}")


def demo(
    model: Optional[Path] = typer.Option(None, "--model", show_default=f"{_MODEL} of the checkout",
                                         help="The neural LM (the shipped model by default)."),
    train: Optional[Path] = typer.Option(None, "--train", show_default=f"{_TRAIN} of the checkout",
                                         help="Text for the demo's 4-gram."),
    lattices: Optional[Path] = typer.Option(None, "--lattices", show_default=f"{_LATTICES}/ of the checkout",
                                            help="Directory of *.lat.fst, words.txt, ref.txt and the tuned "
                                            "weights."),
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o"),
):
    """Rescore the bundled lattices with a KenLM 4-gram alone and with the shipped neural
    LM + the 4-gram, and print the WER of the first pass and of both."""
    model = model or _bundled(_MODEL)
    train = train or _bundled(_TRAIN)
    lattices = lattices or _bundled(_LATTICES)
    ngram_bin = _prepare(model, train, out)
    fsts = sorted(lattices.glob("*.fst"))
    if not fsts:
        raise ConfigError(f"{lattices}: no *.fst lattices to rescore")
    results = {}
    for name, lm_args, weights in (("n-gram alone", [], "weights-ngram.json"),
                                   ("neural + n-gram", ["--lm", str(model)], "weights.json")):
        dest = out / ("rescored-ngram" if not lm_args else "rescored")
        argv = ["rescore", *map(str, fsts), "--words", str(lattices / "words.txt"), *lm_args,
                "--ngram", str(ngram_bin), "--refs", str(lattices / "ref.txt"), "-o", str(dest), "--quiet"]
        if (lattices / weights).exists():
            argv += ["--weights", str(lattices / weights)]
        typer.echo("demo: smallstate-lm " + " ".join(argv))
        _rescore_command().main(args=argv[1:], standalone_mode=False)
        lines = (dest / "wer.txt").read_text().splitlines()
        results[name] = lines[0].split()[1]
        results["first pass"] = lines[1].split()[-1]
    typer.echo(f"demo: {len(fsts)} lattices, WER:")
    for name in ("first pass", "n-gram alone", "neural + n-gram"):
        typer.echo(f"  {name:<16} {results[name]}%")
    typer.echo(f"demo: outputs in {out / 'rescored'} (best.txt, nbest.jsonl, wer.txt, lattices/)")


def _prepare(model: Path, train: Path, out: Path) -> Path:
    """Check the neural LM (before any work: a missing or bad model fails with its path) and build the demo's
    4-gram once; its KenLM binary."""
    from ..checkpoint import load_model
    from ..models import count_parameters
    from ..ngram import build_ngram

    lm = load_model(model)
    typer.echo(f"demo: neural LM {model} ({lm.config.name}, {count_parameters(lm.model):,} parameters, "
               f"{lm.model.state_numel_per_position():,} state numbers/position)")
    del lm
    ngram_bin = out / "lm4.bin"
    if not ngram_bin.exists():
        typer.echo(f"demo: building a 4-gram on {train} (lmplz, cached in {ngram_bin})")
        build_ngram(train, 4, out / "lm4.arpa", ngram_bin)
    return ngram_bin


def _rescore_command():
    """`rescore` as a command of its own, so that the demo runs it as its printed command line would: the
    same options, parsed the same way, with the same defaults."""
    from .rescore import rescore

    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    one.command()(rescore)
    return typer.main.get_command(one)
