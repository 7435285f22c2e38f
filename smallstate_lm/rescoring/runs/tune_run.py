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
from .nbest_run import NBestScoring, load_scorers
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
                     search: TuneSearch, on_note: Callable[[str], None] | None = None,
                     context: tuple[ContextPlan, Sequence[int]] | None = None,
                     ) -> tuple[TuneResult, int, ContextChoice | None]:
    """(the tuned result, the number of dev utterances, the context search or None): every hypothesis of the dev
    n-best lists scored once with the LMs of `scoring`, then the search against the references in `refs`. With
    `context` (the documents, the Ks to try), the lists are then ranked in spoken order once per K with the
    tuned weights (`choose_context_utts`)."""
    from ..nbest.components import compute_components

    utts, _ = read_nbest_inputs(inputs, opts, on_note)
    ref = read_text(refs)  # before the LMs load: a wrong path or a list missing from utt2doc fails at once
    if context is not None:
        context[0].check([u.utt for u in utts], "n-best lists")
    neural, ngram = load_scorers(scoring)
    comps, _ = compute_components(utts, neural, ngram, progress=scoring.progress)
    r = tune(utts, comps, ref, search.base, search.grid, mbr=search.mbr)
    choice = None
    if context is not None:
        choice = choose_context_utts(ref, context[1], lambda k: _nbest_best(utts, neural, ngram, r.weights,
                                                                            context[0].with_utts(k), scoring))
    return r, len(utts), choice


def tune_lattice_files(sources: Sequence[ResolvedInput], run: LatticeRun, refs: Path, search: TuneSearch,
                       context: tuple[ContextPlan, Sequence[int]] | None = None,
                       ) -> tuple[TuneResult, int, ContextChoice | None]:
    """(the tuned result, the number of dev lattices, the context search or None): each lattice expanded once
    with the LMs under the search's starting weights (`run` gives the inputs' words, the LMs, the expansion and
    the device), then the search by Viterbi on the stored expanded graphs. A dev set is read whole: a lattice
    that cannot be read stops the run. The decode and posterior scale are then chosen among `search.decodes`.
    With `context`, the lattices are then rescored in spoken order once per K with the tuned weights."""
    from tqdm import tqdm

    from ..formats.lattice_io import lattice_inputs

    symbols = lattice_symbols(run.words, sources)
    rescorer = build_lattice_rescorer(run.lm, run.ngram, search.base, run.expand, run.device, run.precision)
    lats = [item.load() for item in lattice_inputs(sources, symbols)]
    if context is not None:  # before the expansion: a lattice missing from utt2doc fails at once
        context[0].check([lat.name for lat in lats], "lattices")
    expanded = [e for _, e in tqdm(rescorer.expand_many(lats), total=len(lats), disable=not run.progress,
                                   desc="expand")]
    ref = read_text(refs)
    r = tune_lattices(expanded, ref, search.base, search.grid, decodes=search.decodes)
    choice = None
    if context is not None:
        tuned = rescorer.with_weights(r.weights)
        choice = choose_context_utts(ref, context[1], lambda k: _lattices_best(sources, symbols, tuned,
                                                                               context[0].with_utts(k)))
    return r, len(lats), choice


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


def choose_context_utts(ref: dict[str, list[str]], candidates: Sequence[int],
                        best_with: Callable[[int], dict[str, list[str]]]) -> ContextChoice:
    """The dev set rescored in spoken order once per K of `candidates` (and 0): `best_with(K)` gives each
    utterance's chosen words, under the weights tuned without context (re-tuning them for every K would
    re-decode the dev set per weight candidate)."""
    from ..decode.wer import align_counts

    errors: dict[int, int] = {}
    for k in sorted({0, *candidates}):
        best = best_with(k)
        errors[k] = sum(align_counts(ref[u], words).errors for u, words in best.items() if u in ref)
    return ContextChoice(errors, sum(len(ref[u]) for u in best if u in ref))


def _nbest_best(utts, neural, ngram, weights: Weights, plan: ContextPlan, scoring: NBestScoring) -> dict:
    from .context_run import nbest_in_context

    ranked, _, _ = nbest_in_context(utts, neural, ngram, weights, plan, scoring.progress)
    return {u.utt: u.hyps[0].words for u in ranked}


def _lattices_best(sources, symbols, rescorer, plan: ContextPlan) -> dict:
    from .context_run import lattices_in_context

    best = {}
    for _, r in lattices_in_context(sources, symbols, rescorer, plan, nbest=0, write_lattices=False):
        if r.error is not None:
            raise SmallstateError(r.error)
        best[r.name] = r.best
    return best
