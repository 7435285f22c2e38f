"""Rescoring many lattice files: read, expand, write outputs; report and skip bad files.

The work per lattice ends in a `LatticeResult` (small, picklable: it can come back
from a remote worker, see `runs/ray_runner.py`) and `LatticeOutputs` turns results into
files, so the local and the distributed runs write the same outputs the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ...errors import ConfigError, SmallstateError
from ...files import BackgroundWriter, atomic_write_text
from ...weights import Weights
from ..decode.transcript import decode_lattices
from ..decode.wer import write_wer_report
from ..expand.rescorer import ExpandedLattice, ExpandStats, LatticeRescorer
from ..formats.fst_binary import write_fst_bytes
from ..formats.k2 import K2_KINDS, K2Writer
from ..formats.kaldi.write import KaldiArchiveWriter
from ..formats.lattice_io import (
    LatticeInput,
    lattice_inputs,
    read_lattice,  # noqa: F401  (re-exported: benchmarks import it from here)
)
from ..formats.resolve import (
    LATTICE_FORMATS,
    ResolvedInput,
    is_rspecifier,
    parse_rspecifier,
    resolve_input,
    utterance_id,
)
from ..lattices.kbest import ScoredPath, best_costs, nbest_paths
from ..lattices.lattice import Lattice, LatticeFormatError, SymbolTable
from ..nbest.lists import Hypothesis, Utterance, write_nbest_jsonl, write_text

# Expanded lattices whose results are made together (their best paths' confidences aligned in the same passes),
# and the arcs they may hold between them (some 100 bytes each) before their results are made
DECODE_BATCH = 64
DECODE_ARCS = 2_000_000


def is_archive_input(spec: str | Path | ResolvedInput) -> bool:
    """A Kaldi archive or script (by rspecifier, name or content): many lattices, written back as one archive."""
    return resolve_input(spec).many


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
class CtmOptions:
    """CTM output: times from transition-ids count frames of `frame_shift` seconds after subsampling by
    `subsampling` (Kaldi's defaults: 10 ms, 1; chain models: 3); SLF lattices carry their own times."""

    frame_shift: float = 0.01
    subsampling: int = 1

    @property
    def seconds_per_tid(self) -> float:
        return self.frame_shift * self.subsampling


@dataclass
class LatticeResult:
    """What the outputs need from one input lattice: its n-best (best first, as
    `ExpandedLattice.nbest` gives them), its transcript `best` (the best path, or the consensus with
    `decode` "mbr") with each word's confidence, the confidences of the n-best's first (the best path), the
    first pass's best words, the rescored lattice (None when not written) and the
    expansion's counters; or, for a file that failed, only `error`. Lattices of a Kaldi
    archive name it (`archive`, `kind`), so that they are written back into one; `ctm`
    holds (word, start, duration, confidence) of the transcript's words when asked."""

    path: str
    name: str = ""
    nbest: list[ScoredPath] = field(default_factory=list)  # empty when no n-best list was asked for
    best: list[str] = field(default_factory=list)
    first_pass: list[str] = field(default_factory=list)
    lattice: Lattice | None = None
    fst: bytes | None = None  # instead of `lattice`: its OpenFST bytes, made where the lattice was rescored
    stats: ExpandStats | None = None
    error: str | None = None
    archive: str | None = None
    kind: str | None = None
    ctm: list[tuple[str, float, float, float]] | None = None
    confidences: list[float] = field(default_factory=list)  # per word of `best`
    path_confidences: list[float] = field(default_factory=list)  # per word of nbest[0]
    decode: str = "viterbi"

    @classmethod
    def many(cls, done: Sequence[tuple[str, ExpandedLattice]], w: Weights, nbest: int = 10,
             write_lattices: bool = True, ctm: CtmOptions | None = None,
             first_pass: bool = True) -> list[LatticeResult]:
        """The results of expanded lattices (input path, lattice), in order; a lattice whose decode fails
        (e.g. --ctm for a lattice without times) gets a failure result naming it. Their best paths'
        confidences are aligned together (`decode_lattices`). Without `first_pass`, `first_pass` stays empty
        (no first-pass WER to report)."""
        exps = [exp for _, exp in done]
        dags = [exp.dag(w) for exp in exps] if nbest > 0 else None
        best_in = [None] * len(exps)
        if dags and all(exp.node_level is not None for exp in exps):
            best_in = best_costs(dags, [exp.node_level for exp in exps])
        failed: dict[int, SmallstateError] = {}  # a lattice's error is its own result, not the run's
        hyps: list[list[ScoredPath]] = []
        for k, exp in enumerate(exps):
            try:
                hyps.append(nbest_paths(exp, w, nbest, dags[k], best_in[k]) if dags else [])
            except SmallstateError as e:
                failed[k] = e
                hyps.append([])
        ok = [k for k in range(len(exps)) if k not in failed]
        paths = [hyps[k][0].words if hyps[k] else None for k in ok]
        frame_shift = ctm.seconds_per_tid if ctm is not None else None
        # confidences only where an output holds them: `--nbest 0` without a CTM keeps the best-path-only speed
        decoded = dict(zip(ok, decode_lattices([exps[k] for k in ok], w, paths, frame_shift, confidences=nbest > 0,
                                               dags=[dags[k] for k in ok] if dags else None)))
        out = []
        for k, (path, exp) in enumerate(done):
            err, d = failed.get(k), decoded.get(k)
            if isinstance(d, SmallstateError):
                err = d
            if err is None:
                try:
                    out.append(cls(path=str(path), name=exp.name, nbest=hyps[k], best=d.words,
                                   first_pass=exp.first_pass_words(w.am_scale) if first_pass else [],
                                   lattice=exp.to_lattice(w) if write_lattices else None, stats=exp.stats,
                                   ctm=d.timed, confidences=d.confidences, path_confidences=d.path_confidences,
                                   decode=w.decode))
                    continue
                except SmallstateError as e:
                    err = e
            out.append(cls.failure(path, f"{path}: {err}"))
        return out

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

    def encoded(self) -> LatticeResult:
        """The same result to ship from a worker process: a rescored lattice bound for its own file already
        in OpenFST bytes (the worker does the encoding, the writer only writes), others `without_symbols`."""
        if self.lattice is None or self.archive is not None:
            return self.without_symbols()
        return dataclasses.replace(self, lattice=None, fst=write_fst_bytes(self.lattice, "lattice4"))


def check_archive_outputs(specs: Sequence[Path | str | ResolvedInput]) -> None:
    """Refuse inputs whose rescored archives would land at the same `lattices/<name>` (two `lat.1.gz` from
    different directories), before anything is written."""
    seen: dict[str, str] = {}
    for spec in specs:
        if not is_archive_input(spec):
            continue
        name = archive_output_name(str(spec))
        if name in seen:
            raise ConfigError(f"{seen[name]} and {spec} would both be written back as lattices/{name}: rescore them "
                              "in separate runs (separate -o), or rename one")
        seen[name] = str(spec)


def archive_output_name(spec: str) -> str:
    """The file name a rescored Kaldi archive gets under `out/lattices/`: the input archive's own name
    (`lat.1.gz` stays `lat.1.gz`), or for a script `x.scp` the archive `x.ark`."""
    kind, path = parse_rspecifier(spec)
    return path.name[: -len(".scp")] + ".ark" if kind == "scp" and path.name.endswith(".scp") else path.name


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int | None):
    from tqdm import tqdm  # only when shown: a quiet run need not import it

    return tqdm(total=total, desc="lattices", unit="lat")


class LatticeOutputs:
    """Collects `LatticeResult`s in any order and writes the run's outputs under `out`:
    `lattices/<name>.lat.fst` as each result arrives (or, for lattices of a Kaldi archive or a k2 file,
    an entry of `lattices/<the input's name>`, completed on `finish()`), then on `finish()` best.txt,
    nbest.jsonl (unless no n-best list was asked for), best.ctm (with `ctm`) and (with `refs`) wer.txt
    in input order (the index given to `add`, else the order of `paths`), unless every result failed.
    Every file is written atomically, and nothing is created before the first output (a run that fails to
    start leaves no directory behind). A failed result is counted, reported through `on_error(path, message)`
    and skipped."""

    def __init__(self, paths: Sequence[Path] | None, out: Path, refs: dict[str, list[str]] | None = None,
                 write_lattices: bool = True, progress: bool = True,
                 on_error: Callable[[Path, str], None] | None = None, ctm: CtmOptions | None = None,
                 archive_text: bool = False):
        self.t0 = time.perf_counter()
        self.paths, self.out, self.refs = [Path(p) for p in paths or []], Path(out), refs
        self.write_lattices, self.on_error, self.ctm, self.archive_text = write_lattices, on_error, ctm, archive_text
        self.summary = LatticeRunSummary()
        self.best: dict[str, list[str]] = {}
        self.first: dict[str, list[str]] = {}
        self.timed: dict[str, list[tuple[str, float, float, float]]] = {}
        self.rank: dict[str, int] = {utterance_id(p): k for k, p in enumerate(self.paths)}
        self.nbest_utts: list[Utterance] = []
        self.archives: dict[str, object] = {}  # output archive name -> open KaldiArchiveWriter
        # archive entries wait here until every earlier input is in, so archives keep their input order
        self.held: dict[int, tuple[str, str | None, str, Lattice] | None] = {}
        self.next_index = 0
        self.archive_stack = contextlib.ExitStack()
        self.bar = _progress_bar(len(self.paths) or None) if progress else _NoBar()
        self.files = BackgroundWriter()  # single lattice files, written while the next ones are rescored

    def add(self, r: LatticeResult, index: int | None = None) -> None:
        self.bar.update(1)
        summary = self.summary
        if r.error is None and r.name in self.best:
            r = LatticeResult.failure(r.path, f"{r.path}: a second lattice named {r.name!r} (utterance ids, "
                                      "archive keys included, must be unique in a run)")
        if r.error is not None:
            summary.failed.append(r.path)
            if self.on_error:
                self.on_error(Path(r.path), r.error)
            self._release(index, None)
            return
        st = r.stats
        summary.lattices += 1
        summary.arcs += st.lattice_arcs
        summary.expanded_states += st.expanded_states
        summary.peak_state_bytes = max(summary.peak_state_bytes, st.peak_state_bytes)
        if st.pruned_harder:
            summary.pruned_harder.append(r.name)
        if index is not None:
            self.rank[r.name] = index
        self.best[r.name] = r.best
        self.first[r.name] = r.first_pass
        if r.ctm is not None:
            self.timed[r.name] = r.ctm
        if r.nbest:
            self.nbest_utts.append(Utterance(r.name, [
                Hypothesis(words=h.words, am=h.am, graph=h.graph, id=str(k), scores=h.scores() | {"rank": k},
                           confidences=r.path_confidences if k == 0 else None)
                for k, h in enumerate(r.nbest)],
                consensus=Hypothesis(r.best, confidences=r.confidences) if r.decode == "mbr" else None))
        entry = None
        if self.write_lattices and r.archive is not None and r.lattice is not None:
            entry = (r.archive, r.kind, r.name, r.lattice)
        elif self.write_lattices and (r.fst is not None or r.lattice is not None):  # bytes made by a worker, or here
            data = r.fst if r.fst is not None else write_fst_bytes(r.lattice, "lattice4")
            self.files.write(self.out / "lattices" / f"{r.name}.lat.fst", data)
        self._release(index, entry)

    def _release(self, index: int | None, entry) -> None:
        """Write archive entries in input order: `entry` of input `index` (None: nothing to write)."""
        if index is None:
            self._write_entry(entry)
            return
        self.held[index] = entry
        while self.next_index in self.held:
            e = self.held.pop(self.next_index)
            self.next_index += 1
            self._write_entry(e)

    def _write_entry(self, entry) -> None:
        if entry is None:
            return
        spec, kind, name, lattice = entry
        try:
            self._archive(spec, kind).write(name, lattice)
        except LatticeFormatError as e:  # e.g. a CompactLattice entry in an archive of Lattices: this entry's error
            self.summary.failed.append(f"{spec}[{name}]")
            if self.on_error:
                self.on_error(Path(spec), f"{spec}[{name}]: {e}")

    def _archive(self, spec: str, kind: str | None):
        name = archive_output_name(spec)
        if name not in self.archives:
            (self.out / "lattices").mkdir(parents=True, exist_ok=True)
            path = self.out / "lattices" / name
            writer = (K2Writer(path, kind) if kind in K2_KINDS
                      else KaldiArchiveWriter(path, kind or "compact", binary=not self.archive_text))
            self.archives[name] = self.archive_stack.enter_context(writer)
        return self.archives[name]

    def finish(self, lm_calls: int = 0) -> LatticeRunSummary:
        """Complete the archives; write nbest.jsonl, best.txt, best.ctm and wer.txt, or nothing when no
        lattice was rescored; `lm_calls` is the number of batched LM calls the run made (for the summary line)."""
        self.bar.close()
        try:
            self.files.close()  # every lattice file in place (or its error raised) before the run's summary files
        except BaseException:
            self.abort()
            raise
        for i in sorted(self.held):  # inputs that never came back (a stopped run): write what did
            self.next_index = i
            self._release(i, self.held.pop(i))
        self.archive_stack.close()  # renames each archive into place
        summary = self.summary
        summary.lm_calls = lm_calls
        if self.best:  # when every lattice failed, nothing: an empty best.txt would pass for a result
            self._write(summary)
        summary.seconds = time.perf_counter() - self.t0
        return summary

    def abort(self) -> None:
        """Drop the archives being written (nothing half-written is left at their names)."""
        self.bar.close()
        self.files.cancel()  # the lattice files not yet begun are not written; those written are whole
        self.archive_stack.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def _write(self, summary: LatticeRunSummary) -> None:
        out, rank = self.out, self.rank
        best = dict(sorted(self.best.items(), key=lambda kv: rank.get(kv[0], 0)))
        self.nbest_utts.sort(key=lambda u: rank.get(u.utt, 0))
        # nbest.jsonl first: its writer refuses non-finite scores, and then best.txt is not written either
        if self.nbest_utts:  # none with --nbest 0
            write_nbest_jsonl(out / "nbest.jsonl", self.nbest_utts)
        write_text(out / "best.txt", best)
        if self.ctm is not None:
            write_ctm(out / "best.ctm", {u: self.timed[u] for u in best if u in self.timed})
        if self.refs is not None:
            total, fp = write_wer_report(out / "wer.txt", self.refs, best, self.first)
            summary.wer, summary.first_pass_wer = total.to_dict(), fp.to_dict()


def write_ctm(path: Path, timed: dict[str, list[tuple[str, float, float, float]]]) -> None:
    """Kaldi/NIST CTM: `utt 1 start duration word confidence` per word (seconds, channel 1; the confidence a
    posterior in [0, 1], as lattice-to-ctm-conf writes it), utterances in the given order."""
    atomic_write_text(path, "".join(_ctm_line(utt, *w) for utt, words in timed.items() for w in words))


def _ctm_line(utt: str, word: str, start: float, dur: float, conf: float) -> str:
    # the end is rounded as the starts are, so that a word ending where the next starts still does once printed
    a, b = round(start, 3), round(start + dur, 3)
    return f"{utt} 1 {a:.3f} {b - a:.3f} {word} {conf:.4f}\n"


def rescore_lattices(inputs: Iterable[Path | str | ResolvedInput | LatticeInput], symbols: SymbolTable | None,
                     rescorer: LatticeRescorer, nbest: int = 10, write_lattices: bool = True,
                     ctm: CtmOptions | None = None, starts=None,
                     batch: int | None = None) -> Iterator[tuple[int, LatticeResult]]:
    """Yield `(index of the input, LatticeResult)` as lattices finish (not in input order);
    an input that fails to read or expand (a SmallstateError) yields a result with `error`.
    Paths are expanded by `lattice_inputs` (a Kaldi archive gives one input per entry), lazily. `starts` and
    `batch` go to `expand_many` (lattices read after a context, `context_run`)."""
    items: dict[int, LatticeInput] = {}  # inputs in flight only: an archive's entries are not all held
    failures: list[tuple[int, LatticeResult]] = []

    def source() -> Iterator[Callable[[], Lattice]]:
        n = 0  # expand_many numbers the inputs in this order
        for x in inputs:
            for item in [x] if isinstance(x, LatticeInput) else lattice_inputs([x], symbols):
                items[n] = item
                n += 1
                yield item.load

    def failed(i: int, err: Exception) -> None:
        failures.append((i, LatticeResult.failure(items.pop(i).origin, err)))

    done: list[tuple[int, LatticeInput, ExpandedLattice]] = []

    def results() -> Iterator[tuple[int, LatticeResult]]:
        rs = LatticeResult.many([(it.origin, exp) for _, it, exp in done], rescorer.w, nbest, write_lattices, ctm,
                                rescorer.cfg.first_pass)
        for (i, it, _), r in zip(done, rs):
            if r.error is None:
                r.name, r.archive, r.kind = it.name, it.archive, it.kind
            yield i, r
        done.clear()

    for i, exp in rescorer.expand_many(source(), on_error=failed, starts=starts, batch=batch):
        yield from failures
        failures.clear()
        done.append((i, items.pop(i), exp))
        if len(done) >= DECODE_BATCH or sum(len(x.src) for _, _, x in done) >= DECODE_ARCS:
            yield from results()
    yield from results()
    yield from failures


@dataclass(frozen=True)
class RunOptions:
    """What a run writes besides best.txt: `nbest` hypotheses per lattice in nbest.jsonl (0: no file), the
    rescored lattices (`write_lattices`), best.ctm (with `ctm`), and rescored Kaldi archives as text (`ark,t`,
    with `archive_text`) instead of binary."""

    nbest: int = 10
    write_lattices: bool = True
    ctm: CtmOptions | None = None
    archive_text: bool = False


def rescore_lattice_files(inputs: Sequence[Path | str | ResolvedInput], symbols: SymbolTable | None,
                          rescorer: LatticeRescorer, out: Path, refs: dict[str, list[str]] | None = None,
                          options: RunOptions | None = None, progress: bool = True,
                          on_error: Callable[[Path, str], None] | None = None, context=None) -> LatticeRunSummary:
    """Rescore each lattice of the given files and Kaldi archives (each resolved once, see `resolve_input`); an
    input that fails to read or expand is reported through `on_error(path, message)` and skipped, the others
    are still written. `context` (a `context_run.ContextPlan`): in spoken order, each lattice read after its
    document's transcripts."""
    o = options or RunOptions()
    sources = [resolve_input(p) for p in inputs]
    check_archive_outputs(sources)
    single = None if any(s.many for s in sources) else [s.spec for s in sources]  # the progress bar's total
    outputs = LatticeOutputs(single, out, refs, o.write_lattices, progress, on_error, o.ctm, o.archive_text)
    calls_before = rescorer.lm_calls
    try:
        if context is not None:
            results = context.lattices(sources, symbols, rescorer, o.nbest, o.write_lattices, o.ctm)
        else:
            results = rescore_lattices(sources, symbols, rescorer, o.nbest, o.write_lattices, o.ctm)
        for i, r in results:
            outputs.add(r, i)
    except BaseException:
        outputs.abort()
        raise
    return outputs.finish(rescorer.lm_calls - calls_before)


def is_single_lattice_file(p: Path | str) -> bool:
    """A one-lattice file (so the progress bar knows its total in advance), by name only: no file is opened."""
    name = Path(p).name
    return not is_rspecifier(p) and any(name.endswith(f.suffixes) and not f.many for f in LATTICE_FORMATS)
