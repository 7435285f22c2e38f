"""Dev perplexity against training tokens: how fast a training recipe converges per
token, whatever the CPU (docs/benchmarks.md, a table and a PNG plot).

    python benchmarks/bench_convergence.py --train TRAIN --valid VALID --dev DEV \\
        [--tokens 4000000] [--budgets 410000,860000,4000000] \\
        [--variant NAME="--set pos=none --batch-tokens 4096" ...] [--threads 2] [--jobs 1]

The default recipe is `smallstate-lm train --preset small` with no other option, run
until --tokens training tokens (words + </s>; the cosine schedule spans them). Each
--variant adds train options to that command. Every run validates on --valid every
--every tokens and at each budget; at a budget the table reports the dev perplexity of
the checkpoint with the best validation perplexity so far (selection never sees dev).
Runs go to runs/convergence/<name>; a finished run is read back, not trained again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from common import command, machine, write_section

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "convergence"
PLOTS = ROOT / "docs"
# the reference point of the target: a plain 4-layer nn.TransformerEncoder LM (DESIGN.md §7)
REFERENCE = {410_000: 139.1, 860_000: 108.4}


def run_one(name: str, extra: list[str], args) -> Path:
    """Train one variant with the CLI in a child process; returns its run directory."""
    out = OUT / name
    if (out / "done.json").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    budgets = sorted({int(b) for b in args.budgets.split(",")} | set(range(args.every, args.tokens, args.every)))
    argv = ["train", "--train", args.train, "--valid", args.valid, "--preset", "small", *extra,
            "--max-tokens", str(args.tokens), "--valid-every", str(10**9), "--patience", "0",
            "--eval-text", args.dev, "--threads", str(args.threads), "--quiet", "--out", str(out)]
    for b in budgets:
        argv += ["--valid-at-tokens", str(b)]
    exe = Path(sys.executable).with_name("smallstate-lm")
    with open(OUT / f"{name}.log", "w") as log:
        r = subprocess.run([str(exe), *argv], stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"variant {name} failed (exit {r.returncode}); see {OUT / (name + '.log')}")
    text = (OUT / f"{name}.log").read_text()
    summary = json.loads(text[text.rindex('{\n  "out"'):])  # the summary `train` prints last
    (out / "done.json").write_text(json.dumps({"summary": summary, "options": extra}, indent=2))
    return out


def curve(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("event") == "valid"]


def at_budget(points: list[dict], budget: int) -> dict | None:
    """The validation point chosen at `budget`: best valid ppl among those at or just past it
    (the first validation that reached the budget counts)."""
    reached = [p for p in points if p["tokens"] >= budget]
    if not reached:
        return None
    limit = reached[0]["tokens"]
    seen = [p for p in points if p["tokens"] <= limit]
    return min(seen, key=lambda p: p["valid_ppl"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="data/train.txt")
    ap.add_argument("--valid", default="data/valid.txt")
    ap.add_argument("--dev", default="data/dev.txt")
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--budgets", default="410000,860000,4000000")
    ap.add_argument("--every", type=int, default=100_000, help="validate every this many training tokens")
    ap.add_argument("--variant", action="append", default=[],
                    help='NAME="train options" added to the default recipe; repeatable')
    ap.add_argument("--no-default", action="store_true", help="run only the variants")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1, help="variants trained at once (threads each: --threads)")
    ap.add_argument("--section", default="convergence")
    args = ap.parse_args()

    variants = [] if args.no_default else [("default", [])]
    for v in args.variant:
        name, _, opts = v.partition("=")
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            ap.error(f"--variant needs NAME=\"options\" with a plain name, got {v!r}")
        variants.append((name, shlex.split(opts)))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outs = list(pool.map(lambda v: run_one(v[0], v[1], args), variants))

    budgets = [int(b) for b in args.budgets.split(",")]
    head = "| recipe | options | " + " | ".join(f"dev ppl at {b / 1e6:.2f}M" for b in budgets) + " | tokens/s |"
    rows = [head, "|---|---|" + "---|" * (len(budgets) + 1)]
    curves = {}
    for (name, extra), out in zip(variants, outs):
        pts = curve(out)
        curves[name] = pts
        done = json.loads((out / "done.json").read_text())["summary"]
        cells = []
        for b in budgets:
            p = at_budget(pts, b)
            cells.append("—" if p is None else f"{p['eval_ppl']:.1f}")
        rows.append(f"| {name} | `{shlex.join(extra) or '(defaults)'}` | " + " | ".join(cells)
                    + f" | {done['train_tokens_per_second']:,.0f} |")
    ref = " / ".join(f"{v:.1f} at {k / 1e6:.2f}M" for k, v in REFERENCE.items())
    plot = PLOTS / f"{args.section}.png"
    _plot(curves, plot)
    body = (f"## bench_convergence: dev perplexity against training tokens, `small` preset\n\n"
            f"Machine: {machine()}. Command: `{command()}`.\n\n"
            f"Each run: `smallstate-lm train --preset small` plus the options shown, stopped at "
            f"{args.tokens:,} training tokens (words + `</s>`; the cosine schedule spans them), validated every "
            f"{args.every:,} tokens; at each budget, the dev perplexity of the checkpoint with the best validation "
            f"perplexity so far. Reference (a plain 4-layer `nn.TransformerEncoder` LM, DESIGN.md §7): {ref}. "
            f"Tokens/s are training throughput on this machine's CPU at {args.threads} threads, "
            f"comparable only within this table.\n\n" + "\n".join(rows)
            + f"\n\n![dev ppl against tokens]({plot.name})\n")
    write_section(args.section, body)
    print("\n".join(rows))


def _plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        ax.plot([p["tokens"] / 1e6 for p in pts], [p["eval_ppl"] for p in pts], marker=".", label=name)
    ax.scatter([k / 1e6 for k in REFERENCE], list(REFERENCE.values()), marker="x", color="black",
               label="plain Transformer (reference)", zorder=5)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("dev perplexity")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


if __name__ == "__main__":
    main()
