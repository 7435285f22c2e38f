"""Longest length solved per model and algorithmic task (after Dowdell & Zhang 2019,
table 4): self-attention, convolution, persistent convolution, highway convolution
and self-attention + convolution, each trained from scratch on each of the seven
tasks of `smallstate_lm.tasks` with the same budget (wall clock and/or steps, one CPU
thread by default) and the same shrunk widths. Writes a markdown table to --out
(atomically, rewritten after every run, so a partial table survives an interruption).

    python scripts/task_table.py --out docs/task_table.md --minutes 1

Models whose architecture is not available in this checkout are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from smallstate_lm.cli import parse_overrides  # noqa: E402
from smallstate_lm.errors import ConfigError  # noqa: E402
from smallstate_lm.files import atomic_write_text  # noqa: E402
from smallstate_lm.tasks import TASKS, TaskConfig, build_task_model, format_summary, get_task, run_task  # noqa: E402

MODELS = {  # row label -> preset
    "self-attention": "small",
    "conv": "conv-small",
    "persistent-conv": "pconv-small",
    "highway-conv": "hconv-small",
    "SA + conv": "sa-conv-small",
}
# Every preset above is 4 layers of width 256; this shrinks them alike so that a
# minute of one CPU thread is hundreds of steps. Kernel width and other
# architecture-specific settings stay as in the presets.
SMALL = {"n_layers": 2, "ff_per_layer": 1, "d_model": 64, "n_heads": 4, "d_ff": 256, "d_embed": 64, "dropout": 0.0}


def render(results: dict, notes: dict, args, overrides: dict, tasks: list[str], models: list[str]) -> str:
    budget = " and ".join(x for x in (f"{args.minutes:g} min" if args.minutes else "",
                                      f"{args.steps} steps" if args.steps else "") if x)
    lines = [
        "# Algorithmic tasks: longest length solved",
        "",
        f"Budget per run: {budget} on {args.threads} CPU thread(s), training from scratch; batch {args.batch}, "
        f"seed {args.seed}, learning rate {args.lr:g}. Curriculum: start at length 5, check a fresh held-out "
        f"batch of 128 every {args.eval_every} steps (teacher-forced argmax), grow the length by 1 only when "
        f"every output symbol of every example is right, up to {args.max_length}.",
        "",
        "Model overrides on top of each preset: " + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ".",
        "",
        "Cells: longest length solved (0: not even length 5; a length followed by + means the maximum was "
        "reached); n/a: model skipped (see notes); blank: not run yet.",
        "",
        "| model | preset | parameters | " + " | ".join(tasks) + " |",
        "|---|---|---:|" + "---:|" * len(tasks),
    ]
    for label in models:
        preset = MODELS[label]
        row = results.get(label, {})
        params = next((f"{r['parameters']:,}" for r in row.values()), "")
        cells = []
        for t in tasks:
            if label in notes:
                cells.append("n/a")
            elif t in row:
                r = row[t]
                cells.append(f"{r['solved_length']}{'+' if r['stop_reason'] == 'solved' else ''}")
            else:
                cells.append("")
        lines.append(f"| {label} | {preset} | {params} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Notes:", ""] + [f"- {label} ({MODELS[label]}): {msg}" for label, msg in notes.items()]
    details = [(label, t, r) for label in models for t, r in results.get(label, {}).items()]
    if details:
        lines += ["", "Runs (steps, seconds, exact-match accuracy of 512 held-out examples at the length being "
                  "trained when the run stopped):", ""]
        for label, t, r in details:
            lines.append(f"- {label} / {t}: solved {r['solved_length']}, {r['steps']} steps, {r['seconds']:.0f} s, "
                         f"{100 * r['final_accuracy']:.1f}% at length {r['final_length']} "
                         f"({100 * r['final_symbol_accuracy']:.1f}% of symbols)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Markdown file to write.")
    ap.add_argument("--minutes", type=float, default=None, help="Wall-clock budget per run [default: 1].")
    ap.add_argument("--steps", type=int, default=None, help="Step budget per run (with --minutes: whichever first).")
    ap.add_argument("--tasks", default=",".join(TASKS), help="Comma-separated tasks [default: all seven].")
    ap.add_argument("--models", default=",".join(MODELS), help=f"Comma-separated rows among: {', '.join(MODELS)}.")
    ap.add_argument("--set", dest="set_", action="append", default=[],
                    help="Extra model override key=value for every model (repeatable).")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--jsonl", type=Path, default=None, help="Also append every run's JSON record here.")
    ap.add_argument("--quiet", action="store_true", help="No progress bars.")
    args = ap.parse_args(argv)
    if args.minutes is None and args.steps is None:
        args.minutes = 1.0
    try:
        tasks = [get_task(t.strip()).name for t in args.tasks.split(",") if t.strip()]
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            raise ConfigError(f"unknown model row(s) {', '.join(unknown)}; choose among: {', '.join(MODELS)}")
        overrides = {**SMALL, **parse_overrides(args.set_)}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    results: dict[str, dict[str, dict]] = {}
    notes: dict[str, str] = {}
    t0 = time.perf_counter()
    atomic_write_text(args.out, render(results, notes, args, overrides, tasks, models))
    for label in models:
        preset = MODELS[label]
        try:
            build_task_model(TaskConfig(task=tasks[0], preset=preset, overrides=overrides, steps=1), get_task(tasks[0]))
        except ConfigError as e:
            if "not available yet" not in str(e):
                raise
            notes[label] = f"skipped: {e}"
            atomic_write_text(args.out, render(results, notes, args, overrides, tasks, models))
            print(f"{label}: {e} (skipped)", file=sys.stderr)
            continue
        for t in tasks:
            tc = TaskConfig(task=t, preset=preset, overrides=overrides, minutes=args.minutes, steps=args.steps,
                            batch=args.batch, seed=args.seed, max_length=args.max_length, eval_every=args.eval_every,
                            lr=args.lr, progress=not args.quiet)
            r = run_task(tc)
            print(f"{label}: " + format_summary(r).replace("\n", "\n  "), file=sys.stderr)
            results.setdefault(label, {})[t] = r
            if args.jsonl:
                with open(args.jsonl, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"row": label, **r}) + "\n")
            atomic_write_text(args.out, render(results, notes, args, overrides, tasks, models))
    print(f"table -> {args.out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
