"""Offline lattice rescoring on a Ray cluster, with Ray Data.

The driver makes a dataset of the lattice paths (`ray.data.from_items`), and
`map_batches` hands batches of them to a pool of `LatticeWorker` actors. Each actor
loads the neural LM and the n-gram once, in its constructor (on a GPU when the
cluster has GPUs: one GPU per actor), and rescores every batch with
`lattice_files.rescore_lattices`, the same call the local run makes. The per-lattice
`LatticeResult`s come back to the driver, where `lattice_files.LatticeOutputs` writes the same
files the local run writes (rescored lattices, best.txt, nbest.jsonl, wer.txt), and
a file that fails is reported and skipped as in the local run.

Preconditions: every node sees the lattice files, the symbol table, the LM and the
n-gram at the same paths (a shared filesystem) and runs the same environment, with
smallstate-lm importable. Relative paths resolve against the driver's working
directory.

A batch of `ExpandConfig.lattices_per_batch` lattices makes one batch of the LM calls,
as in the local run; when the lattices are split into the same batches, the outputs
are identical to the local run's. Other splits change which LM rows share a call,
which moves scores by float32 rounding (about 1e-6 nats), not the method.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ...errors import ConfigError, SmallstateError
from .jobs import RescoreJob, load_rescorer
from .lattice_files import LatticeOutputs, LatticeRunSummary, rescore_lattices

SEP = "\n"  # joins a document's paths (and their indices) in one row: no path holds a newline


class LatticeWorker:
    """A Ray Data map_batches callable: loads the LMs once, then turns each batch of
    lattice paths into rescoring results.

    Batch in: `index` (n,) int, the position in the driver's list; `path` (n,) str as
    the user gave it; `abspath` (n,) str. Batch out: `index` (n,); `result` (n,)
    bytes, a pickled `LatticeResult` each (the rescored lattice without its symbol table);
    `lm_calls` (n,) int, the batch's LM calls on its first row and 0 on the others,
    so that the column sums to the run's total.
    """

    def __init__(self, job: RescoreJob, device: str, cwd: str):
        from ..lattices.lattice import SymbolTable

        # With the driver's working directory, the paths the user typed work as given and
        # error messages name them as the local run would.
        self.in_cwd = os.path.isdir(cwd)
        if self.in_cwd:
            os.chdir(cwd)
        self.job = job
        self.symbols = SymbolTable.read(job.words) if job.words is not None else None
        self.rescorer = load_rescorer(job, device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        paths = [str(p) for p in batch["path" if self.in_cwd else "abspath"]]
        index = np.asarray(batch["index"])
        if self.job.context is not None:  # one block of documents: its paths and their indices joined (`_dataset`)
            paths = paths[0].split(SEP)
            index = np.array([int(i) for i in str(index[0]).split(SEP)], dtype=np.int64)
        n = len(paths)
        results = np.empty(n, dtype=object)  # (n,) pickled LatticeResult
        calls_before = self.rescorer.lm_calls
        if self.job.context is not None:  # a batch is a block of whole documents (`_dataset`): in spoken order
            from .context_run import lattices_in_context

            results_of = lattices_in_context(paths, self.symbols, self.rescorer, self.job.context, self.job.nbest,
                                             self.job.write_lattices)
        else:
            results_of = rescore_lattices(paths, self.symbols, self.rescorer, self.job.nbest, self.job.write_lattices)
        for i, r in results_of:
            # Pickled here, as Ray would pickle a column of arbitrary objects anyway, but without
            # its failed attempt at an Arrow conversion first; only the driver unpickles it.
            results[i] = pickle.dumps(r.without_symbols(), protocol=pickle.HIGHEST_PROTOCOL)
        lm_calls = np.zeros(n, dtype=np.int64)
        lm_calls[:1] = self.rescorer.lm_calls - calls_before
        return {"index": index, "result": results, "lm_calls": lm_calls}


def _connect(address: str) -> bool:
    """Connect to Ray (`local`: start a private instance); True when this call started
    or joined it, so the caller should shut it down. An address that nothing answers
    on fails at once (Ray itself would retry for minutes)."""
    import ray

    if ray.is_initialized():
        return False
    if address == "local":
        ray.init(include_dashboard=False, logging_level="warning")
        return True
    host_port = address.split("://", 1)[-1]
    if address != "auto" and ":" in host_port:
        host, port = host_port.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except (OSError, ValueError) as e:
            raise ConfigError(f"--ray {address}: no Ray cluster answers there ({e})") from None
    try:
        ray.init(address=address, logging_level="warning")
    except ConnectionError as e:
        raise ConfigError(f"--ray {address}: {e}") from None
    return True


def _remote_error(e: BaseException) -> SmallstateError | None:
    """The user-facing error (a SmallstateError, such as a bad checkpoint an actor found
    while loading) inside a Ray failure, or None. Ray keeps it as the `cause` of a
    RayTaskError, which an ActorDiedError carries among its args, under Ray Data's own
    exceptions."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, SmallstateError) and type(x).__module__.startswith("smallstate_lm"):
            return x
        todo += [getattr(x, "cause", None), x.__cause__, x.__context__]
        todo += [a for a in getattr(x, "args", ()) if isinstance(a, BaseException)]
    return None


@dataclass(frozen=True)
class RayCluster:
    """Where and how a run uses Ray. `address`: `local` starts a Ray instance on this machine for the run
    (and stops it after); anything else goes to `ray.init(address=...)`: `auto`, `HOST:PORT` or
    `ray://HOST:PORT`; an already initialised Ray is used as it is. `device`: `auto` uses one GPU per actor
    when the cluster has GPUs, else one CPU; `cpu` forces CPUs; `cuda` requires GPUs. `max_actors`: the
    most actors at once [default: the cluster's GPUs, or CPUs]. `batch_size`: lattices per batch
    [default: `job.config.lattices_per_batch`]."""

    address: str = "local"
    device: str = "auto"
    max_actors: int | None = None
    batch_size: int | None = None

    def __post_init__(self):
        if self.max_actors is not None and self.max_actors < 1:
            raise ConfigError(f"the number of Ray actors must be >= 1, got {self.max_actors}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"the Ray batch size must be >= 1, got {self.batch_size}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda on Ray, got {self.device!r}")


def rescore_lattice_files_ray(paths: Sequence[Path], job: RescoreJob, out: Path,
                              refs: dict[str, list[str]] | None = None, cluster: RayCluster = RayCluster(),
                              progress: bool = True,
                              on_error: Callable[[Path, str], None] | None = None) -> LatticeRunSummary:
    """Rescore lattice files on a Ray cluster (`cluster`) and write the local run's outputs to `out`. A file
    that fails is reported through `on_error(path, message)` and skipped, as in
    `lattice_files.rescore_lattice_files`."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise ConfigError("rescoring on Ray needs Ray Data: pip install 'ray[data]'") from None
    paths = [Path(p) for p in paths]
    if not paths:
        return LatticeOutputs(paths, out, refs, job.write_lattices, progress, on_error).finish()
    started = _connect(cluster.address)
    ray_data_log = logging.getLogger("ray.data")
    log_level = ray_data_log.level
    outputs = None
    try:
        if not progress:
            ray_data_log.setLevel(logging.ERROR)
        ds = _dataset(paths, job, cluster)
        outputs = LatticeOutputs(paths, out, refs, job.write_lattices, progress, on_error)
        return _collect(ds, paths, outputs)
    finally:
        if outputs is not None:
            outputs.bar.close()  # before any error message, not at exit
        ray_data_log.setLevel(log_level)
        if started:
            ray.shutdown()


def _dataset(paths: list[Path], job: RescoreJob, cluster: RayCluster):
    """The lattice paths as a Ray dataset mapped, a batch at a time, by a pool of `LatticeWorker` actors."""
    import ray
    import ray.data

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if cluster.device.startswith("cuda") and gpus == 0:
        raise ConfigError(f"device {cluster.device!r} requested but the Ray cluster has no GPUs")
    use_gpu = gpus > 0 and cluster.device != "cpu"
    batch = cluster.batch_size or job.config.lattices_per_batch(job.lm is not None)
    if job.context is not None:  # a row per block of documents, a batch per row: one worker reads it in order
        from ..formats.resolve import utterance_id
        from .context_run import document_groups

        names = [utterance_id(p) for p in paths]
        job.context.check(names, "lattices")
        groups = document_groups(names, job.context, batch)
        items = [{"index": SEP.join(map(str, g)), "path": SEP.join(str(paths[i]) for i in g),
                  "abspath": SEP.join(str(paths[i].resolve()) for i in g)} for g in groups]
        batch = 1
    else:
        items = [{"index": i, "path": str(p), "abspath": str(p.resolve())} for i, p in enumerate(paths)]
    n_batches = math.ceil(len(items) / batch)
    actors = min(cluster.max_actors or (gpus if use_gpu else max(1, int(resources.get("CPU", 1)))), n_batches)
    ray.data.DataContext.get_current().enable_progress_bars = False  # the driver's own bar counts lattices
    # One block per batch keeps the batches in input order, as the local run forms them.
    ds = ray.data.from_items(items, override_num_blocks=n_batches)
    return ds.map_batches(LatticeWorker, fn_constructor_args=(job, "cuda" if use_gpu else "cpu", os.getcwd()),
                          batch_size=batch, batch_format="numpy",
                          compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
                          num_cpus=1, num_gpus=1 if use_gpu else 0)


def _collect(ds, paths: list[Path], outputs: LatticeOutputs) -> LatticeRunSummary:
    """The workers' results added to `outputs` as they come; a user's error inside Ray's raised as itself."""
    lm_calls = 0
    try:
        for rows in ds.iter_batches(batch_size=None, batch_format="numpy"):
            lm_calls += int(rows["lm_calls"].sum())
            for i, blob in zip(rows["index"].tolist(), rows["result"]):
                r = pickle.loads(blob)
                r.path = str(paths[i])  # the user's spelling, whichever path the worker read
                outputs.add(r)
    except BaseException as e:
        outputs.abort()  # stop writing: the files not begun are dropped, as in the local run
        inner = _remote_error(e) if isinstance(e, Exception) else None
        if inner is not None:
            raise inner from None
        raise
    return outputs.finish(lm_calls)
