"""Dev perplexity against training tokens: how fast a training recipe converges per
token, whatever the CPU (docs/benchmarks.md, a table and a PNG plot).

    python benchmarks/bench_convergence.py --train TRAIN --valid VALID --dev DEV \\
        [--budgets 410000,860000,4000000] [--every 200000] \\
        [--variant NAME="--set pos=none --batch-tokens 4096" ...] [--threads 2] [--jobs 1]

The default recipe is `smallstate-lm train --preset small` with no other option; each
--variant adds train options to that command. Every recipe is trained once per budget
with `--max-tokens BUDGET` (training tokens: words + </s>; the cosine schedule spans
the budget), validated on --valid every --every tokens and at the end; the table gives
the dev perplexity of the checkpoint with the best validation perplexity (selection
never sees dev). Runs go to runs/convergence/<name>-<budget>; a finished run is read
back, not trained again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import command, machine, write_section

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "convergence"
PLOTS = ROOT / "docs"
# the reference point of the target: a plain 4-layer nn.TransformerEncoder LM (the project's reference architecture)
REFERENCE = {410_000: 139.1, 860_000: 108.4}


def run_one(name: str, extra: list[str], tokens: int, args) -> Path:
    """Train one variant to a token budget with the CLI in a child process; returns its
    run directory (runs/convergence/<name>-<budget>)."""
    out = OUT / f"{name}-{tokens}"
    if (out / "done.json").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["train", "--train", args.train, "--valid", args.valid, "--preset", "small", *extra,
            "--max-tokens", str(tokens), "--valid-every", str(10**9), "--patience", "0",
            "--eval-text", args.dev, "--threads", str(args.threads), "--quiet", "--out", str(out)]
    for b in range(args.every, tokens, args.every):
        argv += ["--valid-at-tokens", str(b)]
    exe = Path(sys.executable).with_name("smallstate-lm")
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        r = subprocess.run([str(exe), *argv], stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"{out.name} failed (exit {r.returncode}); see {log_path}")
    text = log_path.read_text()
    summary = json.loads(text[text.rindex('{\n  "out"'):])  # the summary `train` prints last
    (out / "done.json").write_text(json.dumps({"summary": summary, "options": extra,
                                               "command": "smallstate-lm " + shlex.join(argv)}, indent=2))
    return out


def curve(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("event") == "valid"]


def chosen(points: list[dict]) -> dict:
    """The checkpoint a user gets: the best validation perplexity of the run."""
    return min(points, key=lambda p: p["valid_ppl"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="data/train.txt")
    ap.add_argument("--valid", default="data/valid.txt")
    ap.add_argument("--dev", default="data/dev.txt")
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

    budgets = sorted(int(b) for b in args.budgets.split(","))
    jobs = [(name, extra, b) for name, extra in variants for b in budgets]
    # the longest runs first, so a parallel pool ends together
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][2])
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done_dirs = dict(zip(order, pool.map(lambda i: run_one(*jobs[i], args), order)))
    head = "| recipe | options | " + " | ".join(f"dev ppl at {b / 1e6:.2f}M" for b in budgets) + " | tokens/s |"
    rows = [head, "|---|---|" + "---|" * (len(budgets) + 1)]
    curves, ends = {}, {}
    for name, extra in variants:
        cells, speed = [], []
        for i, (n, _, b) in enumerate(jobs):
            if n != name:
                continue
            out = done_dirs[i]
            pts = curve(out)
            if b == budgets[-1]:
                curves[name] = pts
            cells.append(f"{chosen(pts)['eval_ppl']:.1f}")
            ends.setdefault(name, []).append((b, chosen(pts)["eval_ppl"]))
            speed.append(json.loads((out / "done.json").read_text())["summary"]["train_tokens_per_second"])
        rows.append(f"| {name} | `{shlex.join(extra) or '(defaults)'}` | " + " | ".join(cells)
                    + f" | {statistics.median(speed):,.0f} |")
    ref = " / ".join(f"{v:.1f} at {k / 1e6:.2f}M" for k, v in REFERENCE.items())
    plot = PLOTS / f"{args.section}.png"
    _plot(curves, ends, plot)
    body = (f"## bench_convergence: dev perplexity against training tokens, `small` preset\n\n"
            f"Machine: {machine()}. Command: `{command()}`.\n\n"
            f"One run per budget: `smallstate-lm train --preset small` plus the options shown and "
            f"`--max-tokens BUDGET` (training tokens: words + `</s>`; the cosine schedule spans the budget), "
            f"validated on the validation text every {args.every:,} tokens and at the end; the cell is the dev "
            f"perplexity of the checkpoint with the best validation perplexity (what `model.pt` holds). The plot "
            f"follows the longest run of each recipe; its dots are the runs with their own budget.\n\n"
            f"Reference (a plain 4-layer `nn.TransformerEncoder` LM, the project's reference architecture): {ref}. "
            f"Tokens/s: median training throughput of the runs on this machine's CPU at {args.threads} threads "
            f"each, {args.jobs} run(s) at a time; comparable only within this table.\n\n" + "\n".join(rows)
            + f"\n\n![dev ppl against tokens]({plot.name})\n")
    write_section(args.section, body)
    print("\n".join(rows))


def _plot(curves: dict[str, list[dict]], ends: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """Each recipe's longest run as a line, and the result of each budget's own run as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        line, = ax.plot([p["tokens"] / 1e6 for p in pts], [p["eval_ppl"] for p in pts], marker=".", label=name)
        if len(ends.get(name, [])) > 1:
            ax.scatter([b / 1e6 for b, _ in ends[name]], [v for _, v in ends[name]], s=60, color=line.get_color(),
                       edgecolors="black", zorder=4, label=f"{name}: run with that budget")
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
