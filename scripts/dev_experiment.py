"""Dev-set rescoring experiment (docs/results.md): for each voice, weights are tuned
on one half of the utterances and applied to the other half (2-fold: every
utterance is scored with weights it was not tuned on), for four systems:
first pass, n-gram, neural, neural + n-gram.

    python scripts/dev_experiment.py --lm runs/hour --ngram runs/lm4.bin --data ../shared/data/dev
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_section  # noqa: E402

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.nbest import read_nbest_tsv, read_text  # noqa: E402
from smallstate_lm.rescoring.rescore import compute_components, totals  # noqa: E402
from smallstate_lm.rescoring.tune import DEFAULT_GRID, hypothesis_errors, tune  # noqa: E402
from smallstate_lm.scoring import NeuralScorer, Weights  # noqa: E402

GRAPH = [round(0.1 * i, 2) for i in range(11)]
SYSTEMS = {
    "n-gram": {"graph_scale": GRAPH, "ngram_weight": DEFAULT_GRID["ngram_weight"],
               "word_penalty": DEFAULT_GRID["word_penalty"]},
    "neural": {"graph_scale": GRAPH, "lm_weight": DEFAULT_GRID["lm_weight"],
               "word_penalty": DEFAULT_GRID["word_penalty"]},
    "neural + n-gram": {"graph_scale": GRAPH, "lm_weight": DEFAULT_GRID["lm_weight"],
                        "ngram_weight": DEFAULT_GRID["ngram_weight"], "word_penalty": DEFAULT_GRID["word_penalty"]},
}


def run_voice(voice_dir: Path, neural: NeuralScorer, ngram: NgramLM, am_scale: float) -> dict:
    utts = read_nbest_tsv(voice_dir / "nbest.tsv")
    refs = read_text(voice_dir / "ref.txt")
    t0 = time.perf_counter()
    comps, stats = compute_components(utts, neural, ngram, progress=True)
    errs, ref_words = hypothesis_errors(utts, refs)
    folds = [list(range(0, len(utts), 2)), list(range(1, len(utts), 2))]
    res = {"first pass": sum(int(e[0]) for e in errs), "oracle": sum(int(e.min()) for e in errs),
           "ref_words": ref_words, "seconds": time.perf_counter() - t0, "stats": stats}
    base = Weights(am_scale=am_scale, lm_weight=0.0, ngram_weight=0.0)
    for name, grid in SYSTEMS.items():
        total, weights = 0, []
        for k in range(2):
            tr, te = folds[k], folds[1 - k]
            r = tune([utts[i] for i in tr], [comps[i] for i in tr], refs, base, grid)
            weights.append(r.weights)
            for i in te:
                total += int(errs[i][int(np.argmax(totals(comps[i], r.weights)))])
        res[name] = total
        res[name + " weights"] = weights
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", required=True)
    ap.add_argument("--ngram", required=True)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "dev"))
    ap.add_argument("--am-scale", type=float, default=1 / 9.5, help="the decoder's acoustic scale")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    lm = load_model(args.lm)
    neural = NeuralScorer(lm.model, lm.vocab)
    ngram = NgramLM(args.ngram)
    rows, notes = [], []
    for voice in ("festival_slt", "festival_kal"):
        r = run_voice(Path(args.data) / voice, neural, ngram, args.am_scale)
        n = r["ref_words"]

        def pct(k, r=r, n=n):
            return 100 * r[k] / n

        rel = {k: 100 * (r["first pass"] - r[k]) / r["first pass"] for k in SYSTEMS}
        rows.append(f"| {voice} | {pct('first pass'):.2f} | " + " | ".join(
            f"{pct(k):.2f} ({-rel[k]:+.0f}%)" for k in SYSTEMS)
            + f" | {pct('oracle'):.2f} |")
        for k in SYSTEMS:
            ws = "; ".join(", ".join(f"{f}={getattr(w, f):g}" for f in ("graph_scale", "lm_weight", "ngram_weight",
                                                                           "word_penalty")) for w in r[k + " weights"])
            notes.append(f"- {voice}, {k}: fold weights {ws}")
        s = r["stats"]
        notes.append(f"- {voice}: {s.hypotheses} hypotheses, {s.tokens_total} neural tokens "
                     f"({s.tokens_computed} computed with prefix sharing), OOV {100 * s.oov_rate:.2f}%, "
                     f"scoring {r['seconds']:.0f} s on CPU")
        print(rows[-1], flush=True)
    body = "\n".join([
        "## N-best rescoring on the dev sets (PocketSphinx 50-best)",
        "",
        f"Command: `python scripts/dev_experiment.py --lm {args.lm} --ngram {args.ngram}` — neural LM: "
        f"{lm.config.name} from `{args.lm}` (see above), n-gram: KenLM 4-gram on the same training text "
        "(`smallstate-lm ngram train --order 4 --text ../shared/data/text/train.txt -o runs/lm4.arpa "
        "--binary runs/lm4.bin`). am_scale fixed at 1/9.5 (the decoder's); graph_scale, the LM weights and "
        "the word penalty tuned by grid + coordinate search. 2-fold: weights tuned on the even-numbered "
        "utterances score the odd ones and vice versa, so every WER below is on utterances the weights never saw.",
        "",
        "| voice | first pass | n-gram | neural | neural + n-gram | 50-best oracle |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "WER % (relative change from the first pass).",
        "",
        *notes,
    ])
    print(body)
    if not args.no_write:
        write_section("nbest-dev", body, doc=ROOT / "docs" / "results.md", header="# Results\n")


if __name__ == "__main__":
    main()
