"""A subword LM against a word-level LM on the dev n-best lists (docs/results.md): 2-fold WER of each with the
n-gram, tuned as scripts/dev_experiment.py tunes "neural + n-gram", and what becomes of the hypotheses that hold
a word outside the word-level LM's vocabulary (scored there as <unk> plus a tuned penalty): how many there are,
how many change rank between the two systems, and the errors of the utterances whose best hypothesis changes.

    python scripts/subword_vs_word.py --word runs/i43/word --subword runs/i43/bpe2000 --ngram runs/lm4.bin
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.nbest.components import compute_components, ranking  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_nbest_tsv, read_text  # noqa: E402
from smallstate_lm.rescoring.runs.tune import DEFAULT_GRID, hypothesis_errors, tune  # noqa: E402
from smallstate_lm.scoring.scorer import NeuralScorer  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402

GRID = {"graph_scale": [round(0.1 * i, 2) for i in range(11)], "lm_weight": DEFAULT_GRID["lm_weight"],
        "ngram_weight": DEFAULT_GRID["ngram_weight"], "word_penalty": DEFAULT_GRID["word_penalty"],
        "oov_penalty": [0.0, -2.0, -5.0, -10.0]}


def ranks_2fold(utts, comps, refs, errs, am_scale: float) -> tuple[list[np.ndarray], int, list[Weights]]:
    """Each utterance's ranking under the weights tuned on the other half, the errors of the best, the weights."""
    folds = [list(range(0, len(utts), 2)), list(range(1, len(utts), 2))]
    orders: list[np.ndarray] = [None] * len(utts)  # type: ignore[list-item]
    errors, weights = 0, []
    base = Weights(am_scale=am_scale, lm_weight=0.0, ngram_weight=0.0)
    for k in range(2):
        tr, te = folds[k], folds[1 - k]
        r = tune([utts[i] for i in tr], [comps[i] for i in tr], refs, base, GRID)
        weights.append(r.weights)
        for i in te:
            orders[i] = np.asarray(ranking(utts[i], comps[i], r.weights)[0])
            errors += int(errs[i][orders[i][0]])
    return orders, errors, weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--word", required=True)
    ap.add_argument("--subword", required=True)
    ap.add_argument("--ngram", required=True)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "dev"))
    ap.add_argument("--am-scale", type=float, default=1 / 9.5)
    args = ap.parse_args()
    ngram = NgramLM(args.ngram)
    lms = {"word": load_model(args.word), "subword": load_model(args.subword)}
    word_vocab = lms["word"].vocab
    for voice in ("festival_slt", "festival_kal"):
        d = Path(args.data) / voice
        utts, refs = read_nbest_tsv(d / "nbest.tsv"), read_text(d / "ref.txt")
        errs, ref_words = hypothesis_errors(utts, refs)
        out = {}
        for name, lm in lms.items():
            comps, _ = compute_components(utts, NeuralScorer(lm.model, lm.vocab), ngram, progress=False)
            out[name] = ranks_2fold(utts, comps, refs, errs, args.am_scale)
        has_oov = [np.array([any(w not in word_vocab for w in h.words) for h in u.hyps]) for u in utts]
        n_hyps = sum(len(u.hyps) for u in utts)
        n_oov = sum(int(m.sum()) for m in has_oov)
        moved = 0  # hypotheses with an OOV word whose rank differs between the two systems
        for i, m in enumerate(has_oov):
            rank = {name: np.empty(len(m), dtype=np.int64) for name in out}
            for name in out:
                rank[name][out[name][0][i]] = np.arange(len(m))
            moved += int((m & (rank["word"] != rank["subword"])).sum())
        changed = [i for i in range(len(utts)) if out["word"][0][i][0] != out["subword"][0][i][0]]
        involving = [i for i in changed if has_oov[i][out["word"][0][i][0]] or has_oov[i][out["subword"][0][i][0]]]
        delta = sum(int(errs[i][out["subword"][0][i][0]]) - int(errs[i][out["word"][0][i][0]]) for i in involving)
        print(f"## {voice}: {len(utts)} utterances, {ref_words} reference words, first pass "
              f"{100 * sum(int(e[0]) for e in errs) / ref_words:.2f}% WER")
        for name in out:
            print(f"- {name} + n-gram: 2-fold 50-best WER {100 * out[name][1] / ref_words:.2f}% "
                  f"({out[name][1]} errors); fold weights: "
                  + "; ".join(", ".join(f"{k}={v:g}" for k, v in dataclasses.asdict(w).items()
                                        if k in GRID) for w in out[name][2]))
        print(f"- hypotheses with a word outside the word LM's vocabulary: {n_oov} of {n_hyps} "
              f"({100 * n_oov / n_hyps:.1f}%); their rank differs between the systems for {moved}")
        print(f"- utterances whose best hypothesis differs: {len(changed)}; of them {len(involving)} where either "
              f"best holds such a word, with {delta:+d} errors for the subword system there")


if __name__ == "__main__":
    main()
