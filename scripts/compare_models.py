"""Model comparison under one CPU budget (docs/results.md): every preset trained by the
same command line with only `--preset` changed, then perplexity, size, speed and
dev n-best WER (2-fold, as in scripts/dev_experiment.py) for each.

    python scripts/compare_models.py --presets small,xl-small,span-small,feedback-small \
        --minutes 8 --jobs 2 --section backends --ngram runs/lm4.bin

An entry `distill:PRESET` trains that preset with `smallstate-lm distill` from
`--teacher` (same budget and data). Trained runs are reused unless `--retrain`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from common import machine, write_section  # noqa: E402
from dev_experiment import run_voice  # noqa: E402

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.evaluate import evaluate_file  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.scoring.scorer import NeuralScorer  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
CLI = [sys.executable, "-m", "smallstate_lm.cli"]


def train_args(minutes: float, clock: str) -> list[str]:
    """What every model's training command shares (distillation included)."""
    return ["--train", str(DATA / "text" / "train.txt"), "--valid", str(DATA / "text" / "valid.txt"),
            "--max-minutes", str(minutes), "--clock", clock, "--threads", "1", "--batch-tokens", "1024",
            "--lr", "2e-3", "--warmup-steps", "50", "--valid-every", "100", "--patience", "0", "--quiet"]


def train_one(entry: str, out: Path, minutes: float, clock: str, teacher: str | None, retrain: bool,
              distill_args: list[str]) -> dict:
    summary_file = out / "summary.json"
    if summary_file.exists() and not retrain:
        return json.loads(summary_file.read_text())
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    if entry.startswith("distill:"):
        if not teacher:
            raise SystemExit(f"{entry}: needs --teacher")
        cmd = [*CLI, "distill", "--teacher", teacher, "--student-preset", entry.split(":", 1)[1],
               *train_args(minutes, clock), *distill_args, "--out", str(out)]
    else:
        cmd = [*CLI, "train", *train_args(minutes, clock), "--preset", entry, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"{entry}: training failed ({proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    text = proc.stdout
    summary = json.loads(text[text.index("{"):])
    summary["wall_seconds"] = time.perf_counter() - t0
    summary["command"] = " ".join(["smallstate-lm", *cmd[len(CLI):]]).replace(str(DATA), "../shared/data")
    out.mkdir(parents=True, exist_ok=True)
    summary_file.write_text(json.dumps(summary, indent=2))
    print(f"{entry}: trained, best valid ppl {summary.get('best_valid_ppl')}", flush=True)
    return summary


def assess(entry: str, out: Path, ngram: NgramLM) -> dict:
    cached = out / "assess.json"
    if cached.exists() and cached.stat().st_mtime >= (out / "model.pt").stat().st_mtime:
        return json.loads(cached.read_text())
    valid = evaluate_file(out, DATA / "text" / "valid.txt")
    dev = evaluate_file(out, DATA / "text" / "dev.txt")
    lm = load_model(out)
    scorer = NeuralScorer(lm.model, lm.vocab)
    wer = {}
    for voice in ("festival_slt", "festival_kal"):
        r = run_voice(DATA / "dev" / voice, scorer, ngram, 1 / 9.5)
        wer[voice] = {k: 100 * r[k] / r["ref_words"] for k in ("first pass", "neural", "neural + n-gram")}
        wer[voice]["n-best seconds"] = r["seconds"]
    result = {"valid": valid, "dev": dev, "wer": wer}
    cached.write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", required=True, help="comma-separated presets (or distill:PRESET)")
    ap.add_argument("--minutes", type=float, default=8.0, help="training budget per model (wall clock, 1 thread)")
    ap.add_argument("--jobs", type=int, default=2, help="models trained at once (one thread each)")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "cmp"))
    ap.add_argument("--ngram", default=str(ROOT / "runs" / "lm4.bin"))
    ap.add_argument("--teacher", default=None, help="teacher run directory for distill: entries")
    ap.add_argument("--distill-args", default="", help="extra `smallstate-lm distill` arguments, e.g. "
                    "'--top-k 64 --teacher-cache runs/teacher.cache'")
    ap.add_argument("--section", required=True, help="name of the docs/results.md section to write")
    ap.add_argument("--title", default="Model comparison under one CPU budget")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="budget in wall-clock or in each process's CPU time (fair on a shared machine)")
    args = ap.parse_args()
    entries = [e.strip() for e in args.presets.split(",") if e.strip()]
    runs = Path(args.runs)
    outs = {e: runs / e.replace(":", "-") for e in entries}
    with ThreadPoolExecutor(args.jobs) as pool:
        summaries = dict(zip(entries, pool.map(
            lambda e: train_one(e, outs[e], args.minutes, args.clock, args.teacher, args.retrain,
                                args.distill_args.split()),
            entries)))
    ngram = NgramLM(args.ngram)
    import torch

    torch.set_num_threads(2)
    rows, notes = [], []
    for e in entries:
        s = summaries[e]
        if "error" in s:
            rows.append(f"| `{e}` | training failed: {s['error']} |")
            continue
        a = assess(e, outs[e], ngram)
        v, d, w = a["valid"], a["dev"], a["wer"]
        state = f"{v['state_numel_per_position']:,}"
        if v.get("state_numel_fixed"):
            state += f" + {v['state_numel_fixed']:,} fixed"
        rows.append(
            f"| `{e}` | {v['parameters']:,} | {s['steps']:,} | {v['perplexity']:.1f} | {d['perplexity']:.1f} | "
            f"{state} | {s['train_tokens_per_second']:,.0f} | {d['tokens_per_second']:,.0f} | "
            + " | ".join(f"{w[voice]['neural']:.2f} / {w[voice]['neural + n-gram']:.2f}"
                         for voice in ("festival_slt", "festival_kal")) + " |")
        if v.get("model_report"):
            notes.append(f"- `{e}`: " + "; ".join(f"{k}: {val}" for k, val in v["model_report"].items()))
        print(rows[-1], flush=True)
    first = {voice: f"{a['wer'][voice]['first pass']:.2f}" for voice in ("festival_slt", "festival_kal")} \
        if rows else {}
    cmd_example = next((summaries[e]["command"] for e in entries if "command" in summaries[e]), "")
    body = "\n".join([
        f"## {args.title}",
        "",
        f"Every model trained for {args.minutes:g} minutes of "
        f"{'wall clock' if args.clock == 'wall' else 'CPU time (its own process, `--clock cpu`)'} on one CPU "
        f"thread, {args.jobs} at a time on "
        f"this 2-core machine ({machine()}), by the same command with only the preset changed, e.g.:",
        "",
        f"```\n{cmd_example}\n```",
        "",
        f"Table written by `python scripts/compare_models.py --presets {args.presets} --minutes {args.minutes:g} "
        f"--jobs {args.jobs} --clock {args.clock} --section {args.section}"
        + (f" --teacher {args.teacher}" if args.teacher else "")
        + (f" --distill-args '{args.distill_args}'" if args.distill_args else "") + "`. Perplexity as in "
        "`smallstate-lm eval` (each sentence from `<s>`, `</s>` counted, OOV as `<unk>`). State: numbers stored "
        "per history position (+ numbers per "
        "row that do not grow). Training tokens/s: forward + backward, validation excluded, 1 thread. Scoring "
        "tokens/s: `eval` on dev, 2 threads. WER %: dev 50-best lists, 2-fold (weights tuned on one half, "
        "applied to the other), neural alone / neural + KenLM 4-gram; first pass "
        f"{first.get('festival_slt', '?')} (slt) and {first.get('festival_kal', '?')} (kal).",
        "",
        "| model | parameters | steps | valid ppl | dev ppl | state / position | train tok/s | score tok/s "
        "| slt WER | kal WER |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *notes,
    ])
    print(body)
    write_section(args.section, body, doc=ROOT / "docs" / "results.md", header="# Results\n")


if __name__ == "__main__":
    main()
