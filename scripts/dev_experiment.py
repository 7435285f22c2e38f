"""Dev-set rescoring experiment (docs/results.md): for each voice, weights are tuned
on one half of the utterances and applied to the other half (2-fold: every
utterance is scored with weights it was not tuned on), for four systems:
first pass, n-gram, neural, neural + n-gram.

    python scripts/dev_experiment.py --lm runs/hour --ngram runs/lm4.bin --data ../shared/data/dev

With --lattices --mbr, the lattice rows also compare the consensus (MBR) decode with the best path and
judge the word confidences (NCE, ECE) of the first pass and of the rescored lattices (docs/results.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_section  # noqa: E402

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.decode.confidence_eval import (  # noqa: E402
    evaluate_confidences,
    label_transcripts,
    nce,
    plot_reliability,
    reliability_table,
)
from smallstate_lm.rescoring.decode.transcript import decode_lattice, first_pass_decode  # noqa: E402
from smallstate_lm.rescoring.decode.wer import align_counts  # noqa: E402
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer  # noqa: E402
from smallstate_lm.rescoring.formats.lattice_io import read_fst  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.nbest.components import compute_components, ranking  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_nbest_tsv, read_text  # noqa: E402
from smallstate_lm.rescoring.runs.tune import DEFAULT_GRID, hypothesis_errors, tune, tune_lattices  # noqa: E402
from smallstate_lm.rescoring.runs.tune_decode import MBR_GRID, POSTERIOR_GRID, choose_decode  # noqa: E402
from smallstate_lm.scoring.scorer import NeuralScorer  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402

GRAPH = [round(0.1 * i, 2) for i in range(11)]
SYSTEMS = {
    "n-gram": {"graph_scale": GRAPH, "ngram_weight": DEFAULT_GRID["ngram_weight"],
               "word_penalty": DEFAULT_GRID["word_penalty"]},
    "neural": {"graph_scale": GRAPH, "lm_weight": DEFAULT_GRID["lm_weight"],
               "word_penalty": DEFAULT_GRID["word_penalty"]},
    "neural + n-gram": {"graph_scale": GRAPH, "lm_weight": DEFAULT_GRID["lm_weight"],
                        "ngram_weight": DEFAULT_GRID["ngram_weight"], "word_penalty": DEFAULT_GRID["word_penalty"]},
    # per-word log(lam p_nn + (1 - lam) p_ng); tune() adds the lam grid
    "neural + n-gram, linear": {"graph_scale": GRAPH, "lm_weight": DEFAULT_GRID["lm_weight"],
                                "word_penalty": DEFAULT_GRID["word_penalty"]},
    # the same, then the hypothesis with the fewest expected errors (tune(mbr=True))
    "neural + n-gram, linear, MBR": {"graph_scale": GRAPH, "lm_weight": DEFAULT_GRID["lm_weight"],
                                     "word_penalty": DEFAULT_GRID["word_penalty"]},
}
LINEAR = {"neural + n-gram, linear", "neural + n-gram, linear, MBR"}
MBR = {"neural + n-gram, linear, MBR"}
ORDERS = "exact,4,3,2"


def run_voice(voice_dir: Path, neural: NeuralScorer, ngram: NgramLM, am_scale: float,
              systems: tuple[str, ...] = tuple(SYSTEMS)) -> dict:
    utts = read_nbest_tsv(voice_dir / "nbest.tsv")
    refs = read_text(voice_dir / "ref.txt")
    t0 = time.perf_counter()
    comps, stats = compute_components(utts, neural, ngram, progress=True)
    errs, ref_words = hypothesis_errors(utts, refs)
    folds = [list(range(0, len(utts), 2)), list(range(1, len(utts), 2))]
    res = {"first pass": sum(int(e[0]) for e in errs), "oracle": sum(int(e.min()) for e in errs),
           "ref_words": ref_words, "seconds": time.perf_counter() - t0, "stats": stats}
    base = Weights(am_scale=am_scale, lm_weight=0.0, ngram_weight=0.0)
    for name in systems:
        grid, total, weights = SYSTEMS[name], 0, []
        for k in range(2):
            tr, te = folds[k], folds[1 - k]
            b = dataclasses.replace(base, interpolation="linear") if name in LINEAR else base
            r = tune([utts[i] for i in tr], [comps[i] for i in tr], refs, b, grid, mbr=name in MBR)
            weights.append(r.weights)
            for i in te:
                total += int(errs[i][int(ranking(utts[i], comps[i], r.weights)[0][0])])
        res[name] = total
        res[name + " weights"] = weights
    res["utts"], res["folds"] = utts, folds
    return res


LATTICE_SYSTEMS = ("n-gram", "neural + n-gram")


def first_pass_scale(expanded, refs, am_scale: float) -> float:
    """The posterior scale whose first-pass confidences have the highest NCE on `expanded` (a tuning half)."""
    def score(s):
        out = {e.name: first_pass_decode(e, am_scale, s) for e in expanded}
        return nce(*label_transcripts(refs, out))
    return max(POSTERIOR_GRID, key=score)


def run_decodes(tune_half, test_half, refs, tuned: Weights, tuned_errors: int, grid, acc: dict) -> None:
    """Viterbi and MBR with their scales (and MBR's word penalty) chosen on `tune_half`
    (`choose_decode`), then both, the decode `tune --decode viterbi,mbr` picks, and the first pass applied to
    `test_half`: errors and (words, confidences) per utterance added to `acc`."""
    vit = choose_decode(tune_half, refs, tuned, tuned_errors, ("viterbi",)).weights
    mbr = choose_decode(tune_half, refs, tuned, tuned_errors, ("mbr",), grid)
    auto = mbr.weights if mbr.errors < tuned_errors else vit
    fp_scale = first_pass_scale(tune_half, refs, tuned.am_scale)
    for name, w in (("viterbi", vit), ("mbr", mbr.weights), ("auto", auto)):
        acc.setdefault(name + " weights", []).append(w)
        for e in test_half:
            d = decode_lattice(e, w)
            acc.setdefault(name, {})[e.name] = (d.words, d.confidences)
    acc.setdefault("first pass scale", []).append(fp_scale)
    for e in test_half:
        acc.setdefault("first pass", {})[e.name] = first_pass_decode(e, tuned.am_scale, fp_scale)


def decode_summary(acc: dict, refs) -> dict:
    """Per decode of `acc`: WER % and the confidence report over every test half."""
    out = {}
    for name in ("first pass", "viterbi", "mbr", "auto"):
        hyps = acc[name]
        errors = sum(align_counts(refs[u], words).errors for u, (words, _) in hyps.items())
        ref_words = sum(len(refs[u]) for u in hyps)
        out[name] = (100 * errors / ref_words, evaluate_confidences(*label_transcripts(refs, hyps)))
    return out


def run_lattices(voice_dir: Path, res: dict, symbols: SymbolTable, model, vocab, ngram: NgramLM,
                 orders, systems: tuple[str, ...] = LATTICE_SYSTEMS, mbr: bool = False) -> list[dict]:
    """Lattice rescoring, 2-fold like the n-best table, with weights tuned on lattices: for
    each half, the lattices of both halves are expanded with the LMs of the system (starting
    from that half's n-best weights, which only steer pruning and merging), the weights are
    tuned on that half's expanded lattices (`tune_lattices`, the LMs' scores in the expansion)
    and the other half is decoded with them."""
    refs = read_text(voice_dir / "ref.txt")
    rows = []
    for order in orders:
        for system in systems:
            neural = system != "n-gram"
            errors, ref_words, states, calls, seconds, peak, tuned = 0, 0, 0, 0, 0.0, 0, []
            acc: dict = {}
            for k in range(2):
                w0 = res[system + " weights"][k]
                rescorer = LatticeRescorer(w0, model if neural else None, vocab if neural else None, ngram,
                                           ExpandConfig(max_ngram_order=order))
                names = [u.utt for u in res["utts"]]
                t0 = time.perf_counter()
                calls0 = rescorer.lm_calls
                lats = [read_fst(voice_dir / "fst" / f"{u}.lat.fst", symbols) for u in names]
                expanded = dict(rescorer.expand_many(lats))
                seconds += time.perf_counter() - t0
                calls += rescorer.lm_calls - calls0
                tune_half = [expanded[i] for i in res["folds"][k]]
                r = tune_lattices(tune_half, refs, w0, SYSTEMS[system])
                tuned.append(r.weights)
                if mbr:
                    run_decodes(tune_half, [expanded[i] for i in res["folds"][1 - k]], refs, r.weights, r.errors,
                                SYSTEMS[system], acc)
                for i in res["folds"][1 - k]:
                    exp = expanded[i]
                    errors += align_counts(refs[names[i]], exp.best_words(r.weights)).errors
                    ref_words += len(refs[names[i]])
                    states += exp.stats.expanded_states
                    peak = max(peak, exp.stats.peak_state_bytes)
            rows.append({"order": "exact" if order is None else order, "system": system,
                         "wer": 100 * errors / ref_words, "nbest_wer": 100 * res[system] / res["ref_words"],
                         "states": states, "calls": calls, "seconds": seconds, "peak_mb": peak / 2**20,
                         "weights": tuned})
            if mbr:
                rows[-1]["decodes"] = decode_summary(acc, refs)
                rows[-1]["decode weights"] = acc
            print({k: v for k, v in rows[-1].items() if k not in ("weights", "decode weights", "decodes")},
                  flush=True)
            for name, (wer, rep) in rows[-1].get("decodes", {}).items():
                print(f"  {name}: WER {wer:.2f}%, {rep.line()}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", required=True)
    ap.add_argument("--ngram", required=True)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "dev"))
    ap.add_argument("--am-scale", type=float, default=1 / 9.5, help="the decoder's acoustic scale")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--lattices", action="store_true", help="also rescore the dev lattices (slow on CPU)")
    ap.add_argument("--orders", default=ORDERS, help="lattice history orders to compare")
    ap.add_argument("--mbr", action="store_true", help="with --lattices: also the consensus (MBR) decode and the "
                    "word confidences' NCE/ECE (section lattice-mbr-dev of docs/results.md)")
    args = ap.parse_args()
    lm = load_model(args.lm)
    neural = NeuralScorer(lm.model, lm.vocab)
    ngram = NgramLM(args.ngram)
    rows, notes, lat_rows, lat_notes, mbr_rows = [], [], [], [], []
    orders = [None if o == "exact" else int(o) for o in args.orders.split(",")]
    symbols = SymbolTable.read(Path(args.data) / "words.txt") if args.lattices else None
    for voice in ("festival_slt", "festival_kal"):
        r = run_voice(Path(args.data) / voice, neural, ngram, args.am_scale)
        if args.lattices:
            for row in run_lattices(Path(args.data) / voice, r, symbols, lm.model, lm.vocab, ngram, orders,
                                    mbr=args.mbr):
                if args.mbr:
                    mbr_rows.append((voice, row))
                lat_rows.append(f"| {voice} | {row['system']} | {row['order']} | {row['wer']:.2f} | "
                                f"{row['nbest_wer']:.2f} | {row['states']:,} | "
                                f"{row['calls']:,} | {row['seconds']:.0f} | {row['peak_mb']:.1f} |")
                fields = ("graph_scale", "lm_weight", "lam", "word_penalty") if row["system"] in LINEAR else (
                    "graph_scale", "lm_weight", "ngram_weight", "word_penalty")
                ws = "; ".join(", ".join(f"{f}={getattr(w, f):g}" for f in fields) for w in row["weights"])
                lat_notes.append(f"- {voice}, {row['system']}, histories {row['order']}: fold weights {ws}")
        n = r["ref_words"]

        def pct(k, r=r, n=n):
            return 100 * r[k] / n

        rel = {k: 100 * (r["first pass"] - r[k]) / r["first pass"] for k in SYSTEMS}
        rows.append(f"| {voice} | {pct('first pass'):.2f} | " + " | ".join(
            f"{pct(k):.2f} ({-rel[k]:+.0f}%)" for k in SYSTEMS)
            + f" | {pct('oracle'):.2f} |")
        for k in SYSTEMS:
            fields = ("graph_scale", "lm_weight", "lam", "word_penalty") if k in LINEAR else (
                "graph_scale", "lm_weight", "ngram_weight", "word_penalty")
            fields += ("mbr_scale",) if k in MBR else ()
            ws = "; ".join(", ".join(f"{f}={getattr(w, f):g}" for f in fields) for w in r[k + " weights"])
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
        "utterances score the odd ones and vice versa, so every WER below is on utterances the weights never saw. "
        "MBR: with the linear system's weights tuned, the scale of the posterior softmax(scale * total) over "
        "each list is chosen from 0-3 and every weight searched once more; the hypothesis with the fewest "
        "expected word errors under that posterior wins (`smallstate-lm tune --mbr`).",
        "",
        "| voice | first pass | " + " | ".join(SYSTEMS) + " | 50-best oracle |",
        "|---|---|" + "---|" * len(SYSTEMS) + "---|",
        *rows,
        "",
        "WER % (relative change from the first pass).",
        "",
        *notes,
    ])
    print(body)
    if not args.no_write:
        write_section("nbest-dev", body, doc=ROOT / "docs" / "results.md", header="# Results\n")
    if lat_rows:
        lat_body = "\n".join([
            "## Lattice rescoring on the dev sets",
            "",
            f"Command: `python scripts/dev_experiment.py --lm {args.lm} --ngram {args.ngram} --lattices"
            + ("" if args.orders == ORDERS else f" --orders {args.orders}") + "` — the "
            "lattices (`fst/*.lat.fst`) expanded with each system's LMs, histories merged on the last n-1 words "
            "or kept exact (beam 12, at most 64 expanded states per lattice state); 2-fold as above, with the "
            "weights (graph_scale, the LM weights, word_penalty) tuned on the other half's *expanded lattices* "
            "(`tune_lattices`: what `smallstate-lm tune lattices... --lm --ngram` does), each fold's expansion "
            "started from that fold's n-best weights. The n-gram system is tuned and expanded the same way "
            "without the neural LM. Seconds and LM calls are totals over both folds' expansions (each expands "
            "all 120 lattices of a voice) on this 2-core CPU; peak LM state memory is the most held at once, "
            "with up to 16 lattices expanded together.",
            "",
            "| voice | system | histories | lattice WER % | 50-best WER % (2-fold) | expanded states | LM calls "
            "| seconds | peak LM state MiB |",
            "|---|---|---|---|---|---|---|---|---|",
            *lat_rows,
            "",
            *lat_notes,
        ])
        print(lat_body)
        if not args.no_write:
            write_section("lattice-dev", lat_body, doc=ROOT / "docs" / "results.md", header="# Results\n")
    if mbr_rows:
        mbr_body = mbr_section(args, mbr_rows, write_plot=not args.no_write)
        print(mbr_body)
        if not args.no_write:
            write_section("lattice-mbr-dev", mbr_body, doc=ROOT / "docs" / "results.md", header="# Results\n")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def mbr_section(args, mbr_rows: list[tuple[str, dict]], write_plot: bool) -> str:
    """The section lattice-mbr-dev: WER of the best path against the consensus, NCE/ECE of the confidences,
    the decodes' weights per fold, and the reliability diagram of the neural + n-gram system."""
    table, notes, reports = [], [], {}
    for voice, row in mbr_rows:
        d = row["decodes"]
        acc = row["decode weights"]
        table.append(f"| {voice} | {row['system']} | {row['order']} | {d['first pass'][0]:.2f} | "
                     f"{d['viterbi'][0]:.2f} | {d['mbr'][0]:.2f} | {d['auto'][0]:.2f} | "
                     + " | ".join(f"{d[k][1].nce:.3f} / {d[k][1].ece:.3f}" for k in ("first pass", "viterbi", "mbr"))
                     + " |")
        ws = "; ".join(f"viterbi posterior_scale={v.posterior_scale:g}; mbr mbr_scale={m.mbr_scale:g} "
                       f"word_penalty={m.word_penalty:g} posterior_scale={m.posterior_scale:g}; tune picks {a.decode}"
                       for v, m, a in zip(acc["viterbi weights"], acc["mbr weights"], acc["auto weights"]))
        fp = ", ".join(f"{s:g}" for s in acc["first pass scale"])
        notes.append(f"- {voice}, {row['system']}: folds {ws}; first-pass posterior scale {fp}")
        if row["system"] == "neural + n-gram":
            for k in ("first pass", "viterbi", "mbr"):
                reports[f"{voice.replace('festival_', '')} {k}"] = d[k][1]
    plot = ROOT / "docs" / "reliability.png"
    plotted = write_plot and reports and plot_reliability(reports, str(plot))
    cmd = (f"python scripts/dev_experiment.py --lm {args.lm} --ngram {args.ngram} --lattices --mbr"
           + ("" if args.orders == ORDERS else f" --orders {args.orders}"))
    return "\n".join([
        "## Consensus (MBR) decoding and word confidences on the dev lattices (issue 29)",
        "",
        f"Command: `{cmd}` on {_cpu_model()} (2 cores, shared). The lattice rows of \"Lattice rescoring on the "
        "dev sets\" re-decoded: 2-fold, each fold's weights tuned by Viterbi on the other half's expanded lattices "
        "(as there); then on that "
        "half the posterior scale of the best path's confidences is the one with the highest NCE, and the "
        "consensus decode (`rescoring/decode/consensus.py`, Xu et al. 2011) gets the posterior scale of its decision "
        f"(`mbr_scale`, from {', '.join(f'{s:g}' for s in MBR_GRID)}) with the fewest errors, its word "
        "penalty searched once more, then the scale of its confidences by NCE (`tune --decode`); the first "
        "pass's confidences (the decoder's lattice alone, graph + acoustic/9.5) get their own scale by NCE "
        "too. \"tune picks\" is `tune --decode viterbi,mbr`: MBR where it made "
        "fewer errors than Viterbi on the tuning half. A word is correct when the WER alignment matches it; NCE "
        "clips confidences to [1e-4, 1 - 1e-4]; ECE over 10 equal bins.",
        "",
        "| voice | system | histories | first-pass WER % | Viterbi WER % | MBR WER % | tune picks: WER % | "
        "NCE / ECE first pass | NCE / ECE Viterbi | NCE / ECE MBR |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *table,
        "",
        *notes,
        "",
        "Reliability of the neural + n-gram system's confidences (fraction of words correct per confidence "
        "bin; every test half):",
        "",
        reliability_table(reports) if reports else "",
        "",
        "![reliability diagram](reliability.png)" if plotted else "",
    ])


if __name__ == "__main__":
    main()
