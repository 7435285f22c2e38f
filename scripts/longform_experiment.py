"""Long-form dev experiment (docs/results.md, "Context across utterances"): does reading each utterance after
the rescorer's own transcripts of the previous ones lower WER?

2-fold over chapters (jas01, jas03, jas05 against jas02, jas04), both voices: on one fold the weights are tuned
without context (n-best: `tune`; lattices: `tune_lattices` on the fold's expansion), then K (the previous
utterances read) is chosen on the same fold by rescoring it in spoken order with those weights; the other fold
is rescored with both. Rows: no context (K = 0, the same driver), carried context K = 1, 2, 4, the K chosen on
the other fold, and the references as context (the upper bound). A paired bootstrap over utterances (both
voices pooled) gives the p-value of the chosen-K gain.

    python scripts/longform_experiment.py --lm runs/ctx5 --ngram runs/lm4.bin --out runs/longform-ctx5.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from smallstate_lm.lms import load_neural
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.decode.wer import align_counts
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.rescoring.nbest.components import compute_components
from smallstate_lm.rescoring.nbest.lists import read_nbest_tsv, read_text
from smallstate_lm.rescoring.runs.context_run import ContextPlan, lattices_in_context, nbest_in_context
from smallstate_lm.rescoring.runs.tune import DEFAULT_GRID, tune, tune_lattices
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.weights import Weights

FOLDS = (("jas01", "jas03", "jas05"), ("jas02", "jas04"))
KS = (0, 1, 2, 4)
GRID = {"graph_scale": [round(0.1 * i, 2) for i in range(11)], "lm_weight": DEFAULT_GRID["lm_weight"],
        "ngram_weight": DEFAULT_GRID["ngram_weight"], "word_penalty": DEFAULT_GRID["word_penalty"]}


def errors_of(best: dict[str, list[str]], refs) -> dict[str, int]:
    return {u: align_counts(refs[u], words).errors for u, words in best.items()}


def run_voice(vdir: Path, lm, ngram: NgramLM, plan: ContextPlan, symbols: SymbolTable, am_scale: float,
              lattices: bool) -> dict:
    refs = read_text(vdir / "ref.txt")
    utts = read_nbest_tsv(vdir / "nbest.tsv")
    names = [u.utt for u in utts]
    fold_of = {u: next(k for k, f in enumerate(FOLDS) if plan.document(u) in f) for u in names}
    scorer = NeuralScorer(lm.model, lm.vocab)
    comps, _ = compute_components(utts, scorer, ngram, progress=False)
    base = Weights(am_scale=am_scale, lm_weight=0.0, ngram_weight=0.0)
    out: dict = {"ref_words": {u: len(refs[u]) for u in names}, "fold": fold_of}
    settings = [*KS, "ref"]
    # n-best
    nb: dict = {"weights": [], "errors": {str(s): [{}, {}] for s in settings}, "seconds": {}}
    for k in range(2):
        tr = [i for i, u in enumerate(names) if fold_of[u] == k]
        w = tune([utts[i] for i in tr], [comps[i] for i in tr], refs, base, GRID).weights
        nb["weights"].append(dataclasses.asdict(w))
        for s in settings:
            t0 = time.perf_counter()
            ranked, _, _ = nbest_in_context(utts, scorer, ngram, w, plan.with_utts(4 if s == "ref" else s),
                                            said=refs if s == "ref" else None)
            nb["seconds"][str(s)] = nb["seconds"].get(str(s), 0.0) + time.perf_counter() - t0
            nb["errors"][str(s)][k] = errors_of({r.utt: r.hyps[0].words for r in ranked}, refs)
        print(vdir.name, "n-best fold", k, {s: sum(nb["errors"][str(s)][k].values()) for s in settings}, flush=True)
    out["nbest"] = nb
    if not lattices:
        return out
    files = [str(vdir / "fst" / f"{u}.lat.fst") for u in names]
    la: dict = {"weights": [], "errors": {str(s): [{}, {}] for s in settings}, "seconds": {}, "states": {},
                "peak_mib": {}}
    for k in range(2):
        w0 = Weights(**nb["weights"][k])
        tr = [u for u in names if fold_of[u] == k]
        rescorer = LatticeRescorer(w0, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=4))
        expanded = [e for _, e in rescorer.expand_many([read_fst(vdir / "fst" / f"{u}.lat.fst", symbols) for u in tr])]
        w = tune_lattices(expanded, refs, w0, GRID).weights
        la["weights"].append(dataclasses.asdict(w))
        for s in settings:
            r = LatticeRescorer(w, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=4))
            t0 = time.perf_counter()
            best, states = {}, 0
            for _, res in lattices_in_context(files, symbols, r, plan.with_utts(4 if s == "ref" else s), nbest=0,
                                              write_lattices=False, said=refs if s == "ref" else None):
                if res.error is not None:
                    raise SystemExit(res.error)
                best[res.name] = res.best
                states += res.stats.expanded_states
                la["peak_mib"][str(s)] = max(la["peak_mib"].get(str(s), 0.0), res.stats.peak_state_bytes / 2**20)
            la["seconds"][str(s)] = la["seconds"].get(str(s), 0.0) + time.perf_counter() - t0
            la["states"][str(s)] = la["states"].get(str(s), 0) + states
            la["errors"][str(s)][k] = errors_of(best, refs)
            print(vdir.name, "lattices fold", k, s, sum(la["errors"][str(s)][k].values()),
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    out["lattices"] = la
    return out


def in_order(names, vdir: Path, symbols, rescorer, plan: ContextPlan, w: Weights):
    """Each lattice of `names` expanded in spoken order after its document's chosen transcripts (under `w`):
    {name: ExpandedLattice}, for tuning the weights on what the LMs see with context."""
    histories: dict = {}
    out = {}
    for wave in plan.waves(names):
        lats = [read_fst(vdir / "fst" / f"{names[i]}.lat.fst", symbols) for i in wave]
        starts = {j: rescorer.context_start(plan.history(histories, names[i]).sentences()) for j, i in enumerate(wave)}
        for j, exp in rescorer.expand_many(lats, starts={j: s for j, s in starts.items() if s is not None},
                                           batch=len(wave)):
            out[names[wave[j]]] = exp
            plan.history(histories, names[wave[j]]).add(exp.best_words(w))
    return out


def retune(res: dict, vdir: Path, lm, ngram, plan: ContextPlan, symbols, k_ctx: int) -> dict:
    """The lattice weights tuned again on each fold's expansions read after its own chosen transcripts (K =
    `k_ctx`, starting from the fold's no-context weights), then the other fold rescored in order with them."""
    refs = read_text(vdir / "ref.txt")
    fold = res["fold"]
    errors = {}
    weights = []
    for k in range(2):
        w = Weights(**res["lattices"]["weights"][k])
        tr = [u for u in fold if fold[u] == k]
        r = LatticeRescorer(w, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=4))
        exps = in_order(tr, vdir, symbols, r, plan.with_utts(k_ctx), w)
        w_ctx = tune_lattices(list(exps.values()), refs, w, GRID).weights
        weights.append(dataclasses.asdict(w_ctx))
        te = [u for u in fold if fold[u] != k]
        r = LatticeRescorer(w_ctx, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=4))
        for u, exp in in_order(te, vdir, symbols, r, plan.with_utts(k_ctx), w_ctx).items():
            errors[u] = align_counts(refs[u], exp.best_words(w_ctx)).errors
        print(vdir.name, "retuned fold", k, w_ctx, flush=True)
    return {"errors": errors, "weights": weights, "k": k_ctx}


def two_fold(voice: dict, kind: str) -> dict:
    """Per utterance, errors of each setting with the weights of the fold it was not tuned on, and of the K
    chosen on that fold (fewest errors there; ties to the smaller K)."""
    part, fold = voice[kind], voice["fold"]
    per: dict = {}
    chosen = []
    for k in range(2):  # weights and K tuned on fold k, applied to the other
        tuned_on = [u for u in fold if fold[u] == k]
        best_k = min(KS[1:], key=lambda s: (sum(part["errors"][str(s)][k][u] for u in tuned_on), s))
        chosen.append(best_k)
        for u in fold:
            if fold[u] != k:
                for s in [*KS, "ref"]:
                    per.setdefault(str(s), {})[u] = part["errors"][str(s)][k][u]
                per.setdefault("chosen", {})[u] = part["errors"][str(best_k)][k][u]
    return {"per_utt": per, "chosen_k": chosen}


def bootstrap_p(base: np.ndarray, new: np.ndarray, rounds: int = 10000, seed: int = 0) -> float:
    """One-sided paired bootstrap over utterances: the share of resamples where `new` has no fewer errors."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base), size=(rounds, len(base)))
    delta = (new - base)[idx].sum(1)
    return float((delta >= 0).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", required=True)
    ap.add_argument("--ngram", required=True)
    ap.add_argument("--data", default="../shared/data/longform")
    ap.add_argument("--words", default="../shared/data/dev/words.txt")
    ap.add_argument("--voices", default="festival_slt,festival_kal")
    ap.add_argument("--am-scale", type=float, default=1 / 9.5)
    ap.add_argument("--no-lattices", action="store_true")
    ap.add_argument("--out", required=True, help="JSON file for the raw numbers")
    ap.add_argument("--retune", type=int, default=None, metavar="K", help="with --out of an earlier run: the lattice "
                    "weights tuned again on expansions read after K chosen transcripts (added to the JSON)")
    args = ap.parse_args()
    if args.retune is not None:
        lm = load_neural(args.lm)
        res = json.loads(Path(args.out).read_text())
        data, plan = Path(args.data), ContextPlan.read(Path(args.data) / "utt2doc")
        for v in args.voices.split(","):
            res[v]["retuned"] = retune(res[v], data / v, lm, NgramLM(args.ngram), plan,
                                       SymbolTable.read(args.words), args.retune)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        summarize(res)
        return
    lm = load_neural(args.lm)
    ngram = NgramLM(args.ngram)
    data = Path(args.data)
    plan = ContextPlan.read(data / "utt2doc")
    symbols = SymbolTable.read(args.words)
    res = {v: run_voice(data / v, lm, ngram, plan, symbols, args.am_scale, not args.no_lattices)
           for v in args.voices.split(",")}
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    summarize(res)


def summarize(res: dict) -> None:
    for kind in ("nbest", "lattices"):
        if any(kind not in v for v in res.values()):
            continue
        pooled: dict = {}
        for voice, v in res.items():
            tf = two_fold(v, kind)
            words = sum(v["ref_words"].values())
            row = {s: 100 * sum(e.values()) / words for s, e in tf["per_utt"].items()}
            print(f"{kind} {voice}: " + ", ".join(f"{s} {x:.2f}" for s, x in row.items()), "chosen K", tf["chosen_k"])
            print(f"{kind} {voice} seconds (both folds' runs): " + ", ".join(
                f"{s} {x:.0f}" for s, x in v[kind]["seconds"].items()))
            if "peak_mib" in v[kind]:
                print(f"{kind} {voice} peak LM state MiB: " + ", ".join(
                    f"{s} {x:.1f}" for s, x in v[kind]["peak_mib"].items()))
            for s, e in tf["per_utt"].items():
                pooled.setdefault(s, []).extend(e[u] for u in sorted(e))
        if kind == "lattices" and all("retuned" in v for v in res.values()):
            pooled["retuned"] = []
            for voice, v in res.items():
                e = v["retuned"]["errors"]
                words = sum(v["ref_words"].values())
                print(f"lattices {voice}: weights re-tuned with context K={v['retuned']['k']}: "
                      f"{100 * sum(e.values()) / words:.2f}")
                pooled["retuned"].extend(e[u] for u in sorted(e))
        base = np.array(pooled["0"])
        for s in [x for x in ("1", "2", "4", "chosen", "ref", "retuned") if x in pooled]:
            p = bootstrap_p(base, np.array(pooled[s]))
            print(f"{kind} pooled: {s} {int(np.sum(pooled[s]))} errors vs {int(base.sum())} without, p = {p:.4f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summary":
        summarize(json.loads(Path(sys.argv[2]).read_text()))
    else:
        main()
