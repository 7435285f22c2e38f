"""Hugging Face causal LMs (`--lm hf:DIR`) on the dev 50-best lists: padded rows against prefix sharing (one
forward per trie with a 4-D ancestor mask), beside our `small` scored both ways, in hypothesis tokens per second
(the LM's tokens: pieces and `</s>`), and the largest difference between the two ways' log-probs.

The HF models are made here (`scripts/make_hf_model.py`: a tokenizer trained on the training text, random
weights: pretrained weights cannot be fetched on this machine, and speed does not depend on them).

    python benchmarks/bench_hf.py [--utts 40] [--sizes tiny,small] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from common import command, machine, write_section  # noqa: E402

from smallstate_lm.lms import load_neural as load_model  # noqa: E402
from smallstate_lm.models import build_model, count_parameters, get_preset  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_nbest  # noqa: E402
from smallstate_lm.scoring.scorer import NeuralScorer  # noqa: E402
from smallstate_lm.vocab import Vocabulary  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
# (d_model, layers, heads, tokenizer size): "tiny" as the tests' models, "small" near our `small`'s size
SIZES = {"tiny": (64, 2, 4, 1000), "small": (256, 6, 4, 8000)}


def timed(scorer: NeuralScorer, groups, rounds: int) -> tuple[float, list]:
    best, out = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = scorer.encoded_logprobs(groups)
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(name: str, model, vocab, lists, rounds: int) -> dict:
    groups = [[vocab.encode(h) + [1] for h in hyps] for hyps in lists]
    tokens = sum(len(h) for hyps in groups for h in hyps)
    padded = NeuralScorer(model, vocab, share_prefixes=False)
    shared = NeuralScorer(model, vocab, share_prefixes=True, use_tree=True)
    timed(shared, groups[:2], 1)  # first calls allocate
    t_pad, lp_pad = timed(padded, groups, rounds)
    t_tree, lp_tree = timed(shared, groups, rounds)
    diff = max(float(np.abs(a - b).max()) for ua, ub in zip(lp_pad, lp_tree) for a, b in zip(ua, ub))
    return {"model": name, "params": count_parameters(model), "tokens": tokens, "padded": tokens / t_pad,
            "shared": tokens / t_tree, "diff": diff, "tree": shared.use_tree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--utts", type=int, default=40, help="utterances per voice")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from make_hf_model import make

    torch.manual_seed(0)
    data = Path(args.data)
    lists = []
    for voice in ("festival_slt", "festival_kal"):
        lists += [[h.words for h in u.hyps] for u in read_nbest(data / "dev" / voice / "nbest.tsv")[: args.utts]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            d, layers, heads, pieces = SIZES[size]
            for arch in ("gpt2", "llama"):
                out = make(Path(tmp) / f"{arch}-{size}", arch, data / "text" / "train.txt", pieces, d, layers, heads)
                lm = load_model(f"hf:{out}")
                rows.append(measure(f"HF {arch} {size} (d {d}, {layers} layers, {pieces:,} pieces)", lm.model,
                                    lm.vocab, lists, args.rounds))
                print(rows[-1], flush=True)
    words = sorted({w for hyps in lists for h in hyps for w in h})
    vocab = Vocabulary(["<s>", "</s>", "<unk>", *words])
    ours = build_model(get_preset("small").replace(vocab_size=max(len(vocab), 18780))).eval()
    rows.append(measure("ours `small` (4L-2F, d 256, 18,780 words)", ours, vocab, lists, args.rounds))
    print(rows[-1], flush=True)
    lines = ["| LM | parameters | hypothesis tokens | padded rows tok/s | prefix sharing tok/s | speed-up | "
             "largest log-prob difference |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params']:,} | {r['tokens']:,} | {r['padded']:,.0f} | {r['shared']:,.0f} | "
                     f"{r['shared'] / r['padded']:.2f}x | {r['diff']:.1e} |")
    body = "\n".join([
        "## bench_hf: Hugging Face LMs with prefix sharing against padded rows",
        "", f"- Command: `{command()}`", f"- Machine: {machine()}",
        f"- {args.utts} utterances of each voice's dev 50-best lists; the best of {args.rounds} rounds each; "
        "random weights (tokenizers trained on the training text by `scripts/make_hf_model.py`).", "", *lines])
    print(body)
    if not args.no_write:
        write_section("bench-hf", body)


if __name__ == "__main__":
    main()
