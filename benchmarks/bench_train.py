"""Training and scoring throughput of every model family relative to the small-state
Transformer, measured in one process with alternating timings (docs/benchmarks.md).

    python benchmarks/bench_train.py [--presets xl-small,span-small,...] [--threads 1]

Each preset is built at the real vocabulary size (18,781 words) and timed on the same
16 x 64 batch: forward + backward (training, dropout on) and forward without gradients
(scoring), each paired with the `small` Transformer so that load from other processes
hits both alike. Ratios > 1 mean faster than `small`.
"""

from __future__ import annotations

import argparse

import torch
from common import command, machine, paired_medians, write_section

from smallstate_lm.models import build_model, count_parameters, get_preset

VOCAB = 18_781
DEFAULT = ("xl-small,span-small,feedback-small,allatt-small,conv-small,pconv-small,hconv-small,cgru-small,"
           "sa-conv-small,sa-hconv-small,lstm-small")


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(get_preset(name).replace(vocab_size=VOCAB))


def timers(model, tokens):
    B = tokens.shape[0]

    def train_step():
        model.train()
        model.zero_grad(set_to_none=True)
        logp, _ = model.score(tokens, model.initial_state(B))
        (-logp.mean()).backward()

    @torch.no_grad()
    def score():
        model.eval()
        model.score(tokens, model.initial_state(B))

    return train_step, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=DEFAULT)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = torch.randint(3, VOCAB, (16, 64), generator=torch.Generator().manual_seed(0))
    n = tokens.numel()
    ref_train, ref_score = timers(make("small"), tokens)
    rows = []
    for name in [p.strip() for p in args.presets.split(",") if p.strip()]:
        model = make(name)
        tr, sc = timers(model, tokens)
        t_ref, t_model = paired_medians(ref_train, tr, args.repeats)
        s_ref, s_model = paired_medians(ref_score, sc, args.repeats)
        rows.append(f"| `{name}` | {count_parameters(model):,} | {t_ref / t_model:.2f} | {s_ref / s_model:.2f} | "
                    f"{n / t_model:,.0f} / {n / t_ref:,.0f} | {n / s_model:,.0f} / {n / s_ref:,.0f} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        "## Training and scoring throughput of the model families",
        "",
        f"Command: `{command()}`. Machine: {machine()}. Each model at the real vocabulary (18,781), one 16 x 64 "
        f"batch, {args.threads} thread(s), medians of {args.repeats} timings alternated with the `small` "
        "Transformer (4L-2F, d 256). Speed is the ratio of `small`'s time to the model's (> 1: faster); the "
        "tokens/s pairs (model / small) are this shared CPU's and only indicative.",
        "",
        "| model | parameters | training speed vs small | scoring speed vs small | training tok/s | scoring tok/s |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    write_section("model-families", body)


if __name__ == "__main__":
    main()
