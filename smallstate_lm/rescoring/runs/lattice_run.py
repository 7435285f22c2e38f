"""Lattice files rescored end to end, as `smallstate-lm rescore` runs them: the inputs resolved once, the
decoder's symbol table, the LMs loaded by path, and the run in this process, on local worker processes
(`jobs`) or on a Ray cluster (`ray`): the same outputs from each (`lattice_files.LatticeOutputs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ...errors import ConfigError
from ...lms import load_lms
from ...weights import Weights
from ..expand.rescorer import ExpandConfig, LatticeRescorer, build_rescorer
from ..formats.resolve import ResolvedInput, resolve_input
from ..lattices.lattice import SymbolTable
from .context_run import ContextPlan
from .lattice_files import LatticeRunSummary, RunOptions, rescore_lattice_files


def classify_inputs(inputs: Sequence[Path]) -> tuple[list[ResolvedInput], bool]:
    """(each input resolved once, whether they are lattices rather than n-best lists). A directory or a missing
    file has no kind: among lattices it is reported and skipped like any unreadable lattice (a missing lat.2.gz
    beside lat.1.gz is a lattice input that is not there, not an n-best list)."""
    sources = [resolve_input(p) for p in inputs]
    kinds = {s.format is not None for p, s in zip(inputs, sources) if p.is_file() or s.format is not None}
    if len(kinds) > 1:
        raise ConfigError("give either n-best files or lattice files, not both")
    return sources, kinds == {True}


def split_lattice_inputs(inputs: Sequence[Path]) -> tuple[list[ResolvedInput], list[Path]]:
    """(the lattice inputs, resolved; the other inputs), for a dev set that may be either. A missing file among
    lattices is a lattice that is not there (reported as such), not an n-best list."""
    sources = [resolve_input(p) for p in inputs]
    some = any(s.format is not None for s in sources)
    picked = [s.format is not None or (some and not p.exists()) for p, s in zip(inputs, sources)]
    return [s for s, yes in zip(sources, picked) if yes], [p for p, yes in zip(inputs, picked) if not yes]


def lattice_symbols(words: Path | None, sources: Sequence[ResolvedInput]) -> SymbolTable | None:
    """The decoder's symbol table (`words`), or None where no input's format needs one (HTK SLF spells its
    words); the inputs are resolved already, so no file is looked at again."""
    if words is not None:
        return SymbolTable.read(words)
    for source in sources:
        fmt = source.format
        if fmt is not None and fmt.needs_symbols:
            raise ConfigError(f"{source}: {fmt.description} lattices need the decoder's symbol table: --words "
                              "words.txt")
    return None


def build_lattice_rescorer(lm: Path | None, ngram: Path | None, weights: Weights, config: ExpandConfig,
                           device: str = "auto", precision: str = "fp32") -> LatticeRescorer:
    """The LMs named by path (as the user gave them: errors name them so), loaded into a rescorer."""
    loaded, ng = load_lms(lm, ngram, device, precision=precision)
    return build_rescorer(weights, loaded, ng, config)


@dataclass(frozen=True)
class LatticeRun:
    """A lattice-rescoring run: the decoder's words.txt (None where every input is HTK SLF), the LMs by path
    (a neural LM run directory or checkpoint and/or a KenLM file), the weights, the expansion's settings, what
    is written besides best.txt (`outputs`), the LMs' device and the neural LM's precision, and where the work
    runs: `jobs` local CPU worker processes, or the Ray cluster at `ray` ('local', 'auto', HOST:PORT) with at
    most `ray_actors` workers."""

    words: Path | None = None
    lm: Path | None = None
    ngram: Path | None = None
    weights: Weights = field(default_factory=Weights)
    expand: ExpandConfig = field(default_factory=ExpandConfig)
    outputs: RunOptions = field(default_factory=RunOptions)
    device: str = "auto"
    jobs: int = 1
    ray: str | None = None
    ray_actors: int | None = None
    progress: bool = True
    precision: str = "fp32"
    context: ContextPlan | None = None  # --utt2doc: in spoken order, each lattice after the previous transcripts


OnError = Callable[[Path, str], None]


def rescore_lattice_run(sources: Sequence[ResolvedInput], run: LatticeRun, out: Path,
                        refs: dict[str, list[str]] | None = None, on_error: OnError | None = None) -> LatticeRunSummary:
    """Rescore the lattices of `sources` (from `classify_inputs`) into `out`; a lattice that fails to read or
    expand is reported through `on_error(path, message)` and skipped, the others are still written."""
    symbols = lattice_symbols(run.words, sources)
    if run.ray is not None:
        return _on_ray(sources, run, out, refs, on_error)
    if run.jobs > 1:
        return _on_local_pool(sources, run, symbols, out, refs, on_error)
    rescorer = build_lattice_rescorer(run.lm, run.ngram, run.weights, run.expand, run.device, run.precision)
    return rescore_lattice_files(sources, symbols, rescorer, out, refs, run.outputs, progress=run.progress,
                                 on_error=on_error, context=run.context)


def _worker_job(run: LatticeRun):
    """The run as its workers receive it: they load the models themselves, from absolute paths (a worker may
    run in another directory, or on another node)."""
    from .jobs import RescoreJob

    words, lm, ngram = (str(p.resolve()) if p else None for p in (run.words, run.lm, run.ngram))
    o = run.outputs
    return RescoreJob(words, lm, ngram, weights=run.weights, config=run.expand, nbest=o.nbest,
                      write_lattices=o.write_lattices, ctm=o.ctm, archive_text=o.archive_text, precision=run.precision,
                      context=run.context)


def _on_local_pool(sources, run: LatticeRun, symbols, out, refs, on_error) -> LatticeRunSummary:
    from .local_pool import rescore_lattice_files_pool

    job = _worker_job(run)
    if run.device not in ("auto", "cpu"):
        raise ConfigError(f"--jobs runs CPU workers; with --device {run.device} use one process per GPU (or --ray)")
    return rescore_lattice_files_pool(sources, job, run.jobs, out, refs, run.progress, on_error, symbols)


def _on_ray(sources, run: LatticeRun, out, refs, on_error) -> LatticeRunSummary:
    from .ray_runner import RayCluster, rescore_lattice_files_ray

    job = _worker_job(run)
    if run.outputs.ctm is not None or any(s.many for s in sources):
        raise ConfigError("--ray rescores single lattice files (.fst, SLF) without --ctm; rescore Kaldi "
                          "archives and k2 files, and write CTMs, without --ray")
    return rescore_lattice_files_ray(sources, job, out, refs, RayCluster(run.ray, run.device, run.ray_actors),
                                     run.progress, on_error)
