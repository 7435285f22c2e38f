"""Rescoring many lattice files: read, expand, write outputs; report and skip bad files."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from ..errors import SmallstateError
from .expand import ExpandStats, LatticeRescorer
from .lattice import SymbolTable, read_fst, read_slf, write_fst
from .nbest import Hypothesis, Utterance, write_nbest_jsonl, write_text
from .wer import write_wer_report


def lattice_name(path: Path) -> str:
    name = path.name
    for suffix in (".lat.fst", ".fst", ".lm.slf.gz", ".slf.gz", ".lm.slf", ".slf", ".gz"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def read_lattice(path: Path, symbols: SymbolTable):
    name = path.name
    if name.endswith(".fst"):
        lat = read_fst(path, symbols)
    elif ".slf" in name:
        lat = read_slf(path, symbols)
    else:
        raise SmallstateError(f"{path}: unknown lattice format; expected .fst (OpenFST) or .slf[.gz] (HTK SLF)")
    lat.name = lattice_name(path)
    return lat


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


def rescore_lattice_files(paths: Sequence[Path], symbols: SymbolTable, rescorer: LatticeRescorer, out: Path,
                          refs: dict[str, list[str]] | None = None, nbest: int = 10, write_lattices: bool = True,
                          progress: bool = True, on_error=None) -> LatticeRunSummary:
    """Rescore each lattice; a file that fails to read or expand is reported through
    `on_error(path, message)` and skipped, the others are still written."""
    t0 = time.perf_counter()
    summary = LatticeRunSummary()
    best: dict[str, list[str]] = {}
    first: dict[str, list[str]] = {}
    nbest_utts: list[Utterance] = []
    first_pass_scales = (rescorer.w.am_scale, 1.0)  # the decoder's own best path: graph + am_scale * acoustic
    if write_lattices:
        (out / "lattices").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in paths]

    def loader(path: Path):
        return lambda: read_lattice(path, symbols)

    def failed(i: int, err: Exception) -> None:
        summary.failed.append(str(paths[i]))
        if on_error:
            on_error(paths[i], str(err))

    bar = tqdm(total=len(paths), disable=not progress, desc="lattices", unit="lat")
    calls_before = rescorer.lm_calls
    for _, exp in rescorer.expand_many([loader(p) for p in paths], on_error=failed):
        bar.update(1)
        st: ExpandStats = exp.stats
        summary.lattices += 1
        summary.arcs += st.lattice_arcs
        summary.expanded_states += st.expanded_states
        summary.peak_state_bytes = max(summary.peak_state_bytes, st.peak_state_bytes)
        if st.pruned_harder:
            summary.pruned_harder.append(exp.name)
        hyps = exp.nbest(rescorer.w, nbest)
        best[exp.name] = hyps[0]["words"]
        first[exp.name] = exp.source.best_path(*first_pass_scales)[0]
        nbest_utts.append(Utterance(exp.name, [
            Hypothesis(words=h["words"], am=h["am"], graph=h["graph"], id=str(r),
                       scores={k: v for k, v in h.items() if k != "words"} | {"rank": r})
            for r, h in enumerate(hyps)]))
        if write_lattices:
            write_fst(out / "lattices" / f"{exp.name}.lat.fst", exp.to_lattice(rescorer.w))
    bar.update(len(summary.failed))
    bar.close()
    summary.lm_calls = rescorer.lm_calls - calls_before
    order = {lattice_name(p): k for k, p in enumerate(paths)}
    best = dict(sorted(best.items(), key=lambda kv: order.get(kv[0], 0)))
    nbest_utts.sort(key=lambda u: order.get(u.utt, 0))
    write_text(out / "best.txt", best)
    if nbest_utts:
        write_nbest_jsonl(out / "nbest.jsonl", nbest_utts)
    if refs is not None and best:
        total, fp = write_wer_report(out / "wer.txt", refs, best, first)
        summary.wer, summary.first_pass_wer = total.to_dict(), fp.to_dict()
    summary.seconds = time.perf_counter() - t0
    return summary


