"""Inference precision (`--precision fp32|bf16|fp16` of eval, rescore, tune and serve): scoring speed,
log-prob agreement with fp32 and the effect on dev WER, with a trained LM on the dev n-best lists and
lattices of both voices (docs/benchmarks.md, section `inference-precision-<device>`).

    python benchmarks/bench_inference_precision.py [--device cpu|cuda] [--precisions fp32,bf16]
        [--lm models/bible-small] [--ngram runs/lm4.bin] [--data ../shared/data] [--repeats 3] [--no-lattices]

Speed: tokens/s of `NeuralScorer.token_logprobs` over every hypothesis of both voices' lists (words + </s>,
scored from <s>), with prefix sharing (the default path) and as padded rows, medians of `--repeats` timings
alternated with fp32's. Agreement: per-token and per-hypothesis differences of the natural-log probabilities
from fp32's. WER: the n-best lists ranked with benchmarks/dev_weights.json and the lattices rescored with
lattices/weights.json (both LMs, order-4 histories); "best differs" counts utterances whose best words are
not fp32's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DOC, command, machine, paired_medians, write_section  # noqa: E402

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.device import PRECISIONS, pick_device  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.decode.wer import corpus_wer  # noqa: E402
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, build_rescorer  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.nbest.components import apply_weights, compute_components  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_nbest, read_text  # noqa: E402
from smallstate_lm.rescoring.runs.lattice_files import RunOptions, rescore_lattice_files  # noqa: E402
from smallstate_lm.scoring.scorer import NeuralScorer  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402

VOICES = ("festival_slt", "festival_kal")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_scoring(scorer: NeuralScorer, groups, device: torch.device):
    def run():
        with torch.inference_mode():
            scorer.token_logprobs(groups)
        sync(device)

    return run


def nbest_wer(utts, neural: NeuralScorer, ngram: NgramLM, weights: Weights, refs) -> tuple[float, dict]:
    with torch.inference_mode():
        comps, _ = compute_components(utts, neural, ngram, progress=False)
    best = {u.utt: u.hyps[0].words for u in apply_weights(utts, comps, weights)}
    return corpus_wer(refs, best)[0].wer, best


def lattice_wer(lm, ngram: NgramLM, weights: Weights, files, words: Path, refs) -> tuple[float, dict, float]:
    rescorer = build_rescorer(weights, lm, ngram, ExpandConfig(max_ngram_order=4))
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        s = rescore_lattice_files(files, SymbolTable.read(words), rescorer, Path(tmp), refs,
                                  RunOptions(nbest=0, write_lattices=False), progress=False)
        best = read_text(Path(tmp) / "best.txt")
    return s.wer["wer"], best, s.seconds


def differing(a: dict, b: dict) -> int:
    return sum(a[k] != b.get(k) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", default=None, help="comma-separated, fp32 first [default: fp32,bf16 on the "
                    "CPU, fp32,bf16,fp16 on CUDA]")
    ap.add_argument("--lm", default=str(ROOT / "models" / "bible-small"))
    ap.add_argument("--ngram", default=str(ROOT / "runs" / "lm4.bin"))
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=None, help="[default: 8192 on CUDA, 512 on the CPU, "
                    "as the service]")
    ap.add_argument("--no-lattices", action="store_true", help="n-best lists only")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = pick_device(args.device)
    precisions = (args.precisions or ("fp32,bf16,fp16" if device.type == "cuda" else "fp32,bf16")).split(",")
    if precisions[0] != "fp32" or any(p not in PRECISIONS for p in precisions):
        sys.exit(f"--precisions: fp32 first, then any of {', '.join(PRECISIONS)}; got {args.precisions}")
    batch_tokens = args.batch_tokens or (8192 if device.type == "cuda" else 512)
    data = Path(args.data) / "dev"
    lists = {v: read_nbest(data / v / "nbest.tsv") for v in VOICES}
    refs = {v: read_text(data / v / "ref.txt") for v in VOICES}
    lattices = {v: sorted((data / v / "fst").glob("*.lat.fst")) for v in VOICES}
    do_lattices = not args.no_lattices and all(lattices.values())
    groups = [[h.words for h in u.hyps] for v in VOICES for u in lists[v]]
    n_tokens = sum(len(h) + 1 for g in groups for h in g)
    ngram = NgramLM(args.ngram)
    nbest_w = Weights.load(ROOT / "benchmarks" / "dev_weights.json")
    lat_w = Weights.load(ROOT / "lattices" / "weights.json")

    models = {p: load_model(args.lm, device, precision=p) for p in precisions}
    rows, agree, wers = [], [], []
    ref_lp, ref_best = None, {}
    for p in precisions:
        lm = models[p]
        tree = NeuralScorer(lm.model, lm.vocab, device, batch_tokens)
        with torch.inference_mode():
            lp = tree.token_logprobs(groups)
        flat = np.concatenate([a for g in lp for a in g])
        sums = np.array([a.sum() for g in lp for a in g])
        if ref_lp is None:
            ref_lp = (flat, sums)
        else:
            d, ds = np.abs(flat - ref_lp[0]), np.abs(sums - ref_lp[1])
            agree.append(f"| {p} | {d.max():.4f} | {d.mean():.5f} | {np.percentile(d, 99):.4f} | {ds.max():.4f} | "
                         f"{ds.mean():.4f} |")
        cells = []
        for v in VOICES:
            wer, best = nbest_wer(lists[v], tree, ngram, nbest_w, refs[v])
            ref_best.setdefault(("nbest", v), best)
            cells.append(f"{100 * wer:.2f} ({differing(best, ref_best[('nbest', v)])})")
        lat_seconds = 0.0
        for v in VOICES if do_lattices else ():
            wer, best, secs = lattice_wer(lm, ngram, lat_w, lattices[v], data / "words.txt", refs[v])
            ref_best.setdefault(("lattice", v), best)
            cells.append(f"{100 * wer:.2f} ({differing(best, ref_best[('lattice', v)])})")
            lat_seconds += secs
        if do_lattices:
            cells.append(f"{lat_seconds:.1f}")
        wers.append(f"| {p} | " + " | ".join(cells) + " |")
        state = lm.model.state_numel_per_position() * next(lm.model.parameters()).element_size()
        if p == "fp32":
            base_state = state
            continue
        fp32 = models["fp32"]
        for share, label in ((True, "prefix sharing"), (False, "padded rows")):
            a = NeuralScorer(fp32.model, fp32.vocab, device, batch_tokens, share_prefixes=share)
            b = NeuralScorer(lm.model, lm.vocab, device, batch_tokens, share_prefixes=share)
            t32, tp = paired_medians(timed_scoring(a, groups, device), timed_scoring(b, groups, device),
                                     args.repeats)
            rows.append(f"| {p} | {label} | {n_tokens / tp:,.0f} | {n_tokens / t32:,.0f} | {t32 / tp:.2f} | "
                        f"{state:,} / {base_state:,} |")
        print(rows[-2], rows[-1], sep="\n", flush=True)

    lat_head = (" | slt lattices WER % (best differs) | kal lattices WER % (best differs) | lattice seconds"
                if do_lattices else "")
    body = "\n".join([
        f"Command: `{command()}`. Machine: {machine()}, device {device}.",
        "",
        f"`{Path(args.lm).name}` scored in each precision (`--precision`: the weights and the LM state cast after "
        "loading; the output softmax and every log-prob stay float32). All "
        f"{sum(len(g) for g in groups):,} hypotheses of both voices' dev 50-best lists, {n_tokens:,} tokens, "
        f"batch_tokens {batch_tokens}; speed-up = fp32 time / this precision's time, medians of {args.repeats} "
        "timings alternated in one process.",
        "",
        "| precision | path | tokens/s | fp32 tokens/s | speed-up | state bytes per position (this / fp32) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Agreement with fp32 (natural-log probabilities; per token, and per hypothesis summed over its tokens):",
        "",
        "| precision | token max abs diff | token mean abs diff | token p99 abs diff | hypothesis max abs diff | "
        "hypothesis mean abs diff |",
        "|---|---|---|---|---|---|",
        *agree,
        "",
        "Dev WER (n-best lists ranked with benchmarks/dev_weights.json; lattices rescored with lattices/weights.json, "
        "both LMs, order-4 histories; in brackets the utterances whose best words differ from fp32's):",
        "",
        "| precision | slt n-best WER % (best differs) | kal n-best WER % (best differs)" + lat_head + " |",
        "|---|---|---" + ("|---|---|---" if do_lattices else "") + "|",
        *wers,
    ])
    print(body)
    if not args.no_write:
        write_section(f"inference-precision-{device.type}", f"## Inference precision on {device.type}\n\n" + body,
                      args.doc)


if __name__ == "__main__":
    main()
