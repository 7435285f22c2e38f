"""Rescoring many lattice files: read, expand, write outputs; report and skip bad files.

The work per lattice ends in a `LatticeResult` (small, picklable: it can come back
from a remote worker, see `ray_runner.py`) and `LatticeOutputs` turns results into
files, so the local and the distributed runs write the same outputs the same way.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from tqdm import tqdm

from ..weights import Weights
from .lattice import Lattice, SymbolTable
from .lattice_expand import ExpandedLattice, ExpandStats, LatticeRescorer
from .lattice_io import read_lattice, utterance_id, write_fst
from .nbest_io import Hypothesis, Utterance, write_nbest_jsonl, write_text
from .wer import write_wer_report


@dataclass
class LatticeRunSummary:
    lattices: int = 0
    failed: list[str] = field(default_factory=list)
    arcs: int = 0
    expanded_states: int = 0
    lm_calls: int = 0
    peak_state_bytes: int = 0
    pruned_harder: list[str] = field(default_factory=list)
    seconds: float = 0.0
    wer: dict | None = None
    first_pass_wer: dict | None = None

    def line(self) -> str:
        s = (f"{self.lattices} lattices, {self.arcs} arcs, {self.expanded_states} expanded states, "
             f"{self.lm_calls} LM calls, peak LM state {self.peak_state_bytes / 2**20:.1f} MiB, {self.seconds:.1f} s")
        if self.wer is not None:
            s += f"; WER {100 * self.wer['wer']:.2f}% (first pass {100 * self.first_pass_wer['wer']:.2f}%)"
        if self.pruned_harder:
            s += f"; pruned harder to stay under --max-states in {len(self.pruned_harder)} lattice(s)"
        if self.failed:
            s += f"; {len(self.failed)} lattice(s) failed"
        return s


@dataclass
class LatticeResult:
    """What the outputs need from one input lattice: its n-best (best first, each a dict
    of words and natural-log components as `ExpandedLattice.nbest` gives them), the
    first pass's best words, the rescored lattice (None when not written) and the
    expansion's counters; or, for a file that failed, only `error`."""

    path: str
    name: str = ""
    nbest: list[dict] = field(default_factory=list)  # empty when no n-best list was asked for
    best: list[str] = field(default_factory=list)
    first_pass: list[str] = field(default_factory=list)
    lattice: Lattice | None = None
    stats: ExpandStats | None = None
    error: str | None = None

    @classmethod
    def of(cls, path: str | Path, exp: ExpandedLattice, w: Weights, nbest: int = 10,
           write_lattices: bool = True) -> LatticeResult:
        first_pass_scales = (w.am_scale, 1.0)  # the decoder's own best path: graph + am_scale * acoustic
        hyps = exp.nbest(w, nbest) if nbest > 0 else []
        return cls(path=str(path), name=exp.name, nbest=hyps, best=hyps[0]["words"] if hyps else exp.best_words(w),
                   first_pass=exp.source.best_path(*first_pass_scales)[0],
                   lattice=exp.to_lattice(w) if write_lattices else None, stats=exp.stats)

    @classmethod
    def failure(cls, path: str | Path, error: Exception | str) -> LatticeResult:
        return cls(path=str(path), error=str(error))

    def without_symbols(self) -> LatticeResult:
        """The same result with the rescored lattice's symbol table dropped (writing an
        OpenFST lattice needs only the word ids), so that shipping results does not
        copy the decoder's whole table once per lattice."""
        if self.lattice is None:
            return self
        return dataclasses.replace(self, lattice=dataclasses.replace(self.lattice, symbols=None))


class LatticeOutputs:
    """Collects `LatticeResult`s in any order and writes the run's outputs under `out`:
    `lattices/<name>.lat.fst` as each result arrives, then on `finish()` best.txt,
    nbest.jsonl (unless no n-best list was asked for) and (with `refs`) wer.txt in the order of
    `paths`, unless every result failed. Every file is written atomically, and nothing is created before the first
    output (a run that fails to start leaves no directory behind). A failed result is counted, reported through
    `on_error(path, message)` and skipped."""

    def __init__(self, paths: Sequence[Path], out: Path, refs: dict[str, list[str]] | None = None,
                 write_lattices: bool = True, progress: bool = True,
                 on_error: Callable[[Path, str], None] | None = None):
        self.t0 = time.perf_counter()
        self.paths, self.out, self.refs = [Path(p) for p in paths], Path(out), refs
        self.write_lattices, self.on_error = write_lattices, on_error
        self.summary = LatticeRunSummary()
        self.best: dict[str, list[str]] = {}
        self.first: dict[str, list[str]] = {}
        self.nbest_utts: list[Utterance] = []
        self.bar = tqdm(total=len(self.paths), disable=not progress, desc="lattices", unit="lat")

    def add(self, r: LatticeResult) -> None:
        self.bar.update(1)
        summary = self.summary
        if r.error is not None:
            summary.failed.append(r.path)
            if self.on_error:
                self.on_error(Path(r.path), r.error)
            return
        st = r.stats
        summary.lattices += 1
        summary.arcs += st.lattice_arcs
        summary.expanded_states += st.expanded_states
        summary.peak_state_bytes = max(summary.peak_state_bytes, st.peak_state_bytes)
        if st.pruned_harder:
            summary.pruned_harder.append(r.name)
        self.best[r.name] = r.best
        self.first[r.name] = r.first_pass
        if r.nbest:
            self.nbest_utts.append(Utterance(r.name, [
                Hypothesis(words=h["words"], am=h["am"], graph=h["graph"], id=str(k),
                           scores={key: v for key, v in h.items() if key != "words"} | {"rank": k})
                for k, h in enumerate(r.nbest)]))
        if self.write_lattices and r.lattice is not None:
            write_fst(self.out / "lattices" / f"{r.name}.lat.fst", r.lattice)

    def finish(self, lm_calls: int = 0) -> LatticeRunSummary:
        """Write nbest.jsonl, best.txt and wer.txt, or nothing when no lattice was rescored;
        `lm_calls` is the number of batched LM calls the run made (for the summary line)."""
        self.bar.close()
        summary = self.summary
        summary.lm_calls = lm_calls
        if self.best:  # when every lattice failed, nothing: an empty best.txt would pass for a result
            self._write(summary)
        summary.seconds = time.perf_counter() - self.t0
        return summary

    def _write(self, summary: LatticeRunSummary) -> None:
        out = self.out
        order = {utterance_id(p): k for k, p in enumerate(self.paths)}
        best = dict(sorted(self.best.items(), key=lambda kv: order.get(kv[0], 0)))
        self.nbest_utts.sort(key=lambda u: order.get(u.utt, 0))
        # nbest.jsonl first: its writer refuses non-finite scores, and then best.txt is not written either
        if self.nbest_utts:  # none with --nbest 0
            write_nbest_jsonl(out / "nbest.jsonl", self.nbest_utts)
        write_text(out / "best.txt", best)
        if self.refs is not None:
            total, fp = write_wer_report(out / "wer.txt", self.refs, best, self.first)
            summary.wer, summary.first_pass_wer = total.to_dict(), fp.to_dict()


def rescore_lattices(paths: Sequence[Path], symbols: SymbolTable | None, rescorer: LatticeRescorer, nbest: int = 10,
                     write_lattices: bool = True) -> Iterator[tuple[int, LatticeResult]]:
    """Yield `(index into paths, LatticeResult)` as lattices finish (not in input order);
    a file that fails to read or expand (a SmallstateError) yields a result with `error`."""
    paths = [Path(p) for p in paths]
    failures: list[tuple[int, LatticeResult]] = []

    def loader(path: Path):
        return lambda: read_lattice(path, symbols)

    def failed(i: int, err: Exception) -> None:
        failures.append((i, LatticeResult.failure(paths[i], err)))

    for i, exp in rescorer.expand_many([loader(p) for p in paths], on_error=failed):
        yield from failures
        failures.clear()
        yield i, LatticeResult.of(paths[i], exp, rescorer.w, nbest, write_lattices)
    yield from failures


def rescore_lattice_files(paths: Sequence[Path], symbols: SymbolTable, rescorer: LatticeRescorer, out: Path,
                          refs: dict[str, list[str]] | None = None, nbest: int = 10, write_lattices: bool = True,
                          progress: bool = True, on_error=None) -> LatticeRunSummary:
    """Rescore each lattice; a file that fails to read or expand is reported through
    `on_error(path, message)` and skipped, the others are still written."""
    outputs = LatticeOutputs(paths, out, refs, write_lattices, progress, on_error)
    calls_before = rescorer.lm_calls
    for _, r in rescore_lattices(paths, symbols, rescorer, nbest, write_lattices):
        outputs.add(r)
    return outputs.finish(rescorer.lm_calls - calls_before)
