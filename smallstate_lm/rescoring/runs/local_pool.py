"""Rescoring lattice files on several local worker processes (`rescore --jobs N`).

Expansion bookkeeping is Python and numpy on one core; on a CPU host with an n-gram (or a small LM) the
other cores would sit idle. Each worker loads the LMs once (a `RescoreJob`), takes tasks of inputs in
order (a run of single-lattice files, `ExpandConfig.lattices_per_batch` at a time, or one Kaldi archive, read
as a stream by the worker), and sends back its `LatticeResult`s; the driver adds them in input order to the
same `LatticeOutputs` as the one-process run, so the outputs are the same files with the same contents.

Workers are forked when this process has not imported torch (nothing to inherit that dislikes fork), else
spawned; with a neural LM each worker uses an equal share of the CPU threads.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

from ...errors import ConfigError, SmallstateError
from ..lattices.lattice import SymbolTable
from .lattice_files import (
    LatticeOutputs,
    LatticeRunSummary,
    check_archive_outputs,
    is_archive_input,
    is_single_lattice_file,
    rescore_lattices,
)

_worker: tuple | None = None  # (symbols, rescorer, job, ctm) of this worker process
_start_error: BaseException | None = None  # why this worker could not load: raised by its first task


def _start(job, cwd: str, threads: int | None, symbols: SymbolTable | None) -> None:
    global _worker, _start_error
    from .jobs import load_rescorer

    os.chdir(cwd)  # relative paths as the user typed them, and error messages that name them so
    try:
        if threads is not None and "torch" in sys.modules:
            import torch

            torch.set_num_threads(threads)
        if symbols is None and job.words is not None:
            symbols = SymbolTable.read(job.words)
        _worker = (symbols, load_rescorer(job, "cpu"), job, job.ctm)
    except SmallstateError as e:  # a bad model file: the user's error, sent back with the first task
        _start_error = e


def _run(specs: list[str]) -> tuple[list[bytes], int]:
    """Rescore one task's inputs: the results in input order (pickled, symbol tables dropped), LM calls."""
    if _start_error is not None:
        raise _start_error
    symbols, rescorer, job, ctm = _worker
    calls = rescorer.lm_calls
    if job.context is not None:
        from .context_run import lattices_in_context

        results = lattices_in_context(specs, symbols, rescorer, job.context, job.nbest, job.write_lattices, ctm)
    else:
        results = rescore_lattices(specs, symbols, rescorer, job.nbest, job.write_lattices, ctm)
    got = sorted(results, key=lambda x: x[0])
    return [pickle.dumps(r.encoded(), protocol=pickle.HIGHEST_PROTOCOL) for _, r in got], \
        rescorer.lm_calls - calls


def _tasks(paths: Sequence[str], per_task: int) -> list[list[str]]:
    """Consecutive single-lattice files `per_task` at a time; each Kaldi archive or script alone."""
    tasks: list[list[str]] = []
    run: list[str] = []
    for p in paths:
        many = is_archive_input(p)
        if many or len(run) == per_task:
            if run:
                tasks.append(run)
            run = []
        if many:
            tasks.append([p])
        else:
            run.append(p)
    return tasks + ([run] if run else [])


def _document_tasks(specs: Sequence[str], context, per_block: int) -> list[list[str]] | None:
    """With context, whole blocks of `per_block` documents per task (a document's utterances depend on each
    other; `context_run.document_groups`). None where a Kaldi archive or k2 file is among the inputs: its
    utterances, known only once read, may belong to any document, so the inputs are one task."""
    from ..formats.resolve import utterance_id
    from .context_run import document_groups

    if any(is_archive_input(p) for p in specs):
        return None
    names = [utterance_id(Path(p)) for p in specs]
    context.check(names, "lattices")
    return [[specs[i] for i in g] for g in document_groups(names, context, per_block)]


def rescore_lattice_files_pool(paths: Sequence[Path | str], job, jobs: int, out: Path,
                               refs: dict[str, list[str]] | None = None, progress: bool = True,
                               on_error: Callable[[Path, str], None] | None = None,
                               symbols: SymbolTable | None = None) -> LatticeRunSummary:
    """`rescore_lattice_files` on `jobs` local worker processes (CPU only) for a `RescoreJob`: same outputs,
    same reports. `symbols`, when the caller has read `job.words` already, go to the workers (a forked one
    shares them)."""
    if jobs < 2:
        raise ConfigError(f"a worker pool needs --jobs >= 2, got {jobs}")
    specs = [str(p) for p in paths]
    check_archive_outputs(specs)
    per_task = job.config.lattices_per_batch(job.lm is not None)
    by_document = job.context is not None and (tasks := _document_tasks(specs, job.context, per_task)) is not None
    if job.context is not None and not by_document:
        tasks = [specs]
    elif not by_document:
        tasks = _tasks(specs, min(per_task, -(-len(specs) // (2 * jobs))))  # two tasks per worker at least
    single = specs if all(is_single_lattice_file(p) for p in specs) else None  # the progress bar's total, when known
    outputs = LatticeOutputs(single, out, refs, job.write_lattices, progress, on_error, job.ctm, job.archive_text)
    threads = max(1, (os.cpu_count() or 1) // jobs) if job.lm is not None else None
    method = "spawn" if "torch" in sys.modules else "fork"
    index, lm_calls = 0, 0
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(tasks)) or 1, mp_context=multiprocessing.get_context(method),
                               initializer=_start, initargs=(job, os.getcwd(), threads, symbols))
    try:
        for blobs, calls in pool.map(_run, tasks):
            lm_calls += calls
            for blob in blobs:
                # documents are tasks out of input order: their files are put in order by name, not by index
                outputs.add(pickle.loads(blob), None if by_document else index)
                index += 1
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # an error ends the run now, not after the queued tasks
        outputs.abort()
        raise
    pool.shutdown()
    return outputs.finish(lm_calls)
