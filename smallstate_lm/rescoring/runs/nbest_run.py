"""N-best files rescored end to end, as `smallstate-lm rescore` and `tune` run them: the inputs read in any of
NBEST_FORMATS, the LMs loaded by path, every hypothesis scored once; then ranked under the weights and written
(best.txt, nbest.jsonl, wer.txt), or handed to the weight search (`runs/tune_run.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from ...lms import load_lms
from ...weights import Weights
from ..decode.wer import ErrorCounts, write_wer_report
from ..nbest.components import Components, ScoreStats, apply_weights, compute_components
from ..nbest.confidence import with_confidences
from ..nbest.formats import ImportOptions, read_nbest_inputs
from ..nbest.lists import Utterance, write_nbest_jsonl, write_text
from .context_run import ContextPlan, nbest_in_context

if TYPE_CHECKING:
    from ...ngram import NgramLM
    from ...scoring.scorer import NeuralScorer


@dataclass(frozen=True)
class NBestScoring:
    """The LMs that score the hypotheses, by path: a neural LM run directory or checkpoint and/or a KenLM
    file (at least one); the neural LM's `device`, `precision` and padded tokens per forward (`batch_tokens`);
    `prefix_sharing` False scores each hypothesis as its own padded row; `progress` shows a bar."""

    lm: Path | None = None
    ngram: Path | None = None
    device: str = "auto"
    batch_tokens: int = 8192
    prefix_sharing: bool = True
    progress: bool = True
    precision: str = "fp32"
    choose_paths: bool = True  # on CUDA: tree attention or padded rows per call, whichever measured faster


def load_scorers(scoring: NBestScoring) -> tuple[NeuralScorer | None, NgramLM | None]:
    """The neural scorer (None without --lm) and the n-gram (None without --ngram)."""
    loaded, ngram = load_lms(scoring.lm, scoring.ngram, scoring.device, precision=scoring.precision)
    if loaded is None:
        return None, ngram
    from ...scoring.scorer import NeuralScorer

    device = next(loaded.model.parameters()).device
    scorer = NeuralScorer(loaded.model, loaded.vocab, device, scoring.batch_tokens, scoring.prefix_sharing)
    # on a GPU tree attention can lose to padded rows: measure both (on a CPU it wins)
    if device.type == "cuda" and scoring.choose_paths and scoring.prefix_sharing:
        scorer.choose_paths()
    return scorer, ngram


def score_nbest(utts: Sequence[Utterance], scoring: NBestScoring) -> tuple[list[Components], ScoreStats]:
    """Each hypothesis's score components (one `Components` per utterance) with the LMs of `scoring`."""
    neural, ngram = load_scorers(scoring)
    return compute_components(utts, neural, ngram, progress=scoring.progress)


@dataclass
class NBestRunSummary:
    stats: ScoreStats
    wer: ErrorCounts | None = None
    first_pass_wer: ErrorCounts | None = None

    def line(self) -> str:
        s = self.stats
        text = (f"{s.utterances} utterances, {s.hypotheses} hypotheses, {s.tokens_total} tokens "
                f"({s.tokens_computed} computed), OOV {100 * s.oov_rate:.2f}%, {s.seconds:.1f} s")
        if self.wer is not None:
            text += f"; WER {100 * self.wer.wer:.2f}% (first pass {100 * self.first_pass_wer.wer:.2f}%)"
        return text


def rescore_nbest_files(inputs: Sequence[Path], opts: ImportOptions, scoring: NBestScoring, weights: Weights,
                        out: Path, refs: dict[str, list[str]] | None = None,
                        on_note: Callable[[str], None] | None = None,
                        context: ContextPlan | None = None) -> NBestRunSummary:
    """Rescore n-best inputs under `weights` into `out`: nbest.jsonl (every hypothesis, best first, with its
    components; the best one with its word confidences), best.txt and, with `refs`, wer.txt against the first
    pass's choice. `context`: in spoken order, each list scored after its document's chosen transcripts."""
    utts, _ = read_nbest_inputs(inputs, opts, on_note)
    if context is not None:
        context.check([u.utt for u in utts], "n-best lists")
        neural, ngram = load_scorers(scoring)
        ranked, _, stats = nbest_in_context(utts, neural, ngram, weights, context, progress=scoring.progress)
    else:
        comps, stats = score_nbest(utts, scoring)
        ranked = apply_weights(utts, comps, weights)
    ranked = with_confidences(ranked, weights)
    best = {u.utt: u.hyps[0].words for u in ranked}
    write_nbest_jsonl(out / "nbest.jsonl", ranked)  # first: it refuses non-finite scores, before best.txt exists
    write_text(out / "best.txt", best)
    summary = NBestRunSummary(stats)
    if refs is not None:
        first_pass = {u.utt: u.hyps[0].words for u in utts}
        summary.wer, summary.first_pass_wer = write_wer_report(out / "wer.txt", refs, best, first_pass)
    return summary
