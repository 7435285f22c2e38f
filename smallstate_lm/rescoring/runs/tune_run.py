"""Weight tuning on a dev set end to end, as `smallstate-lm tune` runs it: which weights to search and on which
grid, then the dev n-best lists scored (`runs/nbest_run.py`) or the dev lattices expanded once with the LMs, and the
search itself (`runs/tune.py`), which re-ranks the stored components without another LM call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ...errors import SmallstateError
from ...weights import Weights
from ..formats.resolve import ResolvedInput
from ..nbest.formats import ImportOptions, read_nbest_inputs
from ..nbest.lists import read_text
from .context_run import ContextPlan
from .lattice_run import LatticeRun, build_lattice_rescorer, lattice_symbols
from .nbest_run import NBestScoring, load_scorers, score_nbest
from .tune import DEFAULT_GRID, LAM_GRID, TuneResult, tune, tune_lattices

# a searched weight DEFAULT_GRID has no grid for (am_scale, graph_scale, oov_penalty) gets the LM weights' range
_OTHER_GRID = [round(x * 0.1, 3) for x in range(0, 21)]


@dataclass(frozen=True)
class TuneSearch:
    """What the search moves: the starting weights (those not searched are kept), each searched weight's grid,
    `mbr` (n-best lists only: also the posterior scale of minimum-Bayes-risk selection) and `decodes` (lattices
    only: the decodes to choose among, with the posterior scale; `runs/tune_decode.py`)."""

    base: Weights
    grid: dict[str, list[float]]
    mbr: bool = False
    decodes: tuple[str, ...] = ("viterbi",)


def tune_search(search: Sequence[str], base: Weights, neural: bool, ngram: bool, mbr: bool = False) -> TuneSearch:
    """The weights named in `search` on their default grids; the weight of an LM that is not given is 0 and not
    searched."""
    keys = list(search)
    if not neural:
        keys = [k for k in keys if k != "lm_weight"]
        base = dataclasses.replace(base, lm_weight=0.0)
    if not ngram:
        keys = [k for k in keys if k != "ngram_weight"]
        base = dataclasses.replace(base, ngram_weight=0.0)
    grid = {k: DEFAULT_GRID.get(k, LAM_GRID if k == "lam" else _OTHER_GRID) for k in keys}
    return TuneSearch(base, grid, mbr)


def tune_nbest_files(inputs: Sequence[Path], opts: ImportOptions, scoring: NBestScoring, refs: Path,
                     search: TuneSearch, on_note: Callable[[str], None] | None = None) -> tuple[TuneResult, int]:
    """(the tuned result, the number of dev utterances): every hypothesis of the dev n-best lists scored once
    with the LMs of `scoring`, then the search against the references in `refs`."""
    utts, _ = read_nbest_inputs(inputs, opts, on_note)
    ref = read_text(refs)  # before the LMs load: a wrong path fails at once
    comps, _ = score_nbest(utts, scoring)
    return tune(utts, comps, ref, search.base, search.grid, mbr=search.mbr), len(utts)


def tune_lattice_files(sources: Sequence[ResolvedInput], run: LatticeRun, refs: Path,
                       search: TuneSearch) -> tuple[TuneResult, int]:
    """(the tuned result, the number of dev lattices): each lattice expanded once with the LMs under the
    search's starting weights (`run` gives the inputs' words, the LMs, the expansion and the device), then the
    search by Viterbi on the stored expanded graphs. A dev set is read whole: a lattice that cannot be read
    stops the run. The decode and posterior scale are then chosen among `search.decodes`."""
    from tqdm import tqdm

    from ..formats.lattice_io import lattice_inputs

    symbols = lattice_symbols(run.words, sources)
    rescorer = build_lattice_rescorer(run.lm, run.ngram, search.base, run.expand, run.device, run.precision)
    lats = [item.load() for item in lattice_inputs(sources, symbols)]
    expanded = [e for _, e in tqdm(rescorer.expand_many(lats), total=len(lats), disable=not run.progress,
                                   desc="expand")]
    return tune_lattices(expanded, read_text(refs), search.base, search.grid, decodes=search.decodes), len(lats)


@dataclass(frozen=True)
class ContextChoice:
    """`tune --utt2doc`: the dev errors of each number of previous utterances read as context (0: none, the
    same in-order driver), with the weights tuned without context, and the one chosen (fewest errors; ties
    to the smaller)."""

    errors: dict[int, int]
    ref_words: int

    @property
    def chosen(self) -> int:
        return min(self.errors, key=lambda k: (self.errors[k], k))

    def line(self) -> str:
        return "WER% vs context utterances (tuned weights, in spoken order): " + "  ".join(
            f"{k}:{100 * e / self.ref_words:.2f}" for k, e in sorted(self.errors.items()))


def choose_context_utts(inputs, refs: Path, weights: Weights, plan: ContextPlan, candidates: Sequence[int],
                        nbest: tuple[ImportOptions, NBestScoring] | None = None,
                        lattices: LatticeRun | None = None) -> ContextChoice:
    """Rescore the dev set in spoken order once per K of `candidates` (and 0) under `weights` (tuned without
    context: re-tuning them for every K would re-decode the dev set per weight candidate), n-best lists
    (`nbest`: their import options and scorers) or lattices (`lattices`: the run's LMs and expansion)."""
    from ..decode.wer import align_counts
    from .context_run import lattices_in_context, nbest_in_context

    ref = read_text(refs)
    errors: dict[int, int] = {}
    ks = sorted({0, *candidates})
    if nbest is not None:
        opts, scoring = nbest
        utts, _ = read_nbest_inputs(inputs, opts)
        plan.check([u.utt for u in utts], "n-best lists")
        neural, ngram = load_scorers(scoring)
        for k in ks:
            ranked, _, _ = nbest_in_context(utts, neural, ngram, weights, plan.with_utts(k), scoring.progress)
            errors[k] = sum(align_counts(ref[u.utt], u.hyps[0].words).errors for u in ranked if u.utt in ref)
        ref_words = sum(len(ref[u.utt]) for u in utts if u.utt in ref)
    else:
        symbols = lattice_symbols(lattices.words, inputs)
        rescorer = build_lattice_rescorer(lattices.lm, lattices.ngram, weights, lattices.expand, lattices.device,
                                          lattices.precision)
        for k in ks:
            best = {}
            for _, r in lattices_in_context(inputs, symbols, rescorer, plan.with_utts(k), nbest=0,
                                            write_lattices=False):
                if r.error is not None:
                    raise SmallstateError(r.error)
                best[r.name] = r.best
            errors[k] = sum(align_counts(ref[u], words).errors for u, words in best.items() if u in ref)
        ref_words = sum(len(ref[u]) for u in best if u in ref)
    return ContextChoice(errors, ref_words)
