"""Training-step speed under bf16 autocast relative to fp32 on this machine's CPU
(`smallstate-lm train --precision bf16`), measured in one process with alternating
timings (docs/benchmarks.md).

    python benchmarks/bench_precision.py [--presets small,8L-3F] [--threads 1]

Each preset is built at the real vocabulary size (18,781 words) and trained (forward +
backward + AdamW step) on the same 64 x 64 batch, the size of `--batch-tokens 4096`.
The gain depends on bf16 matrix units (AMX, AVX512-BF16); without them bf16 can be
slower than fp32.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from common import command, machine, paired_medians, write_section

from smallstate_lm.models import build_model, count_parameters, get_preset

VOCAB = 18_781


def step_fn(name: str, tokens: torch.Tensor, bf16: bool):
    torch.manual_seed(0)
    model = build_model(get_preset(name).replace(vocab_size=VOCAB)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B = tokens.shape[0]
    losses = []

    def step():
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            logp, _ = model.score(tokens, model.initial_state(B))
            loss = -logp.float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    return model, step, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small,8L-3F")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = torch.randint(3, VOCAB, (64, 64), generator=torch.Generator().manual_seed(0))
    n = tokens.numel()
    rows = []
    for name in [p.strip() for p in args.presets.split(",") if p.strip()]:
        model, fp32, l32 = step_fn(name, tokens, bf16=False)
        _, bf16, l16 = step_fn(name, tokens, bf16=True)
        t32, t16 = paired_medians(fp32, bf16, args.repeats)
        rows.append(f"| `{name}` | {count_parameters(model):,} | {t32 / t16:.2f} | {n / t16:,.0f} / {n / t32:,.0f} | "
                    f"{l16[0]:.4f} / {l32[0]:.4f} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        "## Training with bf16 autocast on the CPU",
        "",
        f"Command: `{command()}`. Machine: {machine()}. One 64 x 64 batch (4,096 tokens, as `--batch-tokens "
        f"4096`), forward + backward + AdamW step, {args.threads} thread(s), medians of {args.repeats} timings "
        "alternated between fp32 and bf16 autocast (`--precision bf16`). Speed-up = fp32 time / bf16 time; the "
        "tokens/s pairs (bf16 / fp32) are this shared CPU's and only indicative. First-step losses show bf16 "
        "computes the same loss to about 2 decimals.",
        "",
        "| model | parameters | bf16 speed-up | training tok/s (bf16 / fp32) | first-step loss (bf16 / fp32) |",
        "|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    write_section("train-precision", body)


if __name__ == "__main__":
    main()
