"""The small-state trade-off on your own text (docs/results.md, "state-tradeoff"): a family of
Transformer LMs at one non-embedding parameter budget, a standard Transformer (F = 1) beside
models that trade attention layers for feed-forward sublayers (L x F) and shared key/value
variants, all trained by one recipe; then one table row per model and a plot of perplexity
against the state kept per history position.

    python scripts/state_tradeoff.py plan                       # the family: d_ff, parameters, state
    python scripts/state_tradeoff.py train --jobs 7 --device cuda --max-tokens 24e6 --max-minutes 7
    python scripts/state_tradeoff.py assess --ngram runs/lm4.bin --exact 7L-1F,4L-2F
    python scripts/state_tradeoff.py table --section state-tradeoff

Every member is `--preset` (default `small`) with `n_layers`, `ff_per_layer`, `shared_kv` and a
`d_ff` solved so that its non-embedding parameters meet `--budget` (default: the 4L-2F member
at d_ff = 4 d); `--fixed-d-ff` keeps d_ff and refuses a family whose counts differ by more than
`--tolerance`. Each step resumes: `train` skips finished runs and continues interrupted ones
from their last.pt; `assess` keeps its results per run (assess.json). `pack`/`unpack` move the
trained weights between machines as int8 with a scale per row (xz-compressed, split into parts):
a GPU host that returns at most a few tens of MiB can hand back a whole family.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from smallstate_lm.files import atomic_write_text  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
DEFAULT_FAMILY = "7x1,4x2,3x3,2x5,7x1kv,4x2kv,3x3kv"
# the recipe that made models/bible-small (its README), with the budget in tokens so that
# every member sees the same training
RECIPE = ["--lr", "2e-3", "--batch-tokens", "4096", "--warmup-steps", "500", "--max-epochs", "1000",
          "--valid-every", "1000", "--patience", "0", "--quiet"]


class Refused(Exception):
    """A bad argument or input: reported as one line, exit status 2."""


@dataclasses.dataclass
class Member:
    name: str  # e.g. "4L-2F-sharedkv"
    n_layers: int
    ff_per_layer: int
    shared_kv: bool
    d_ff: int = 0
    nonemb: int = 0
    state: int = 0  # numbers per history position

    def overrides(self) -> dict:
        return {"n_layers": self.n_layers, "ff_per_layer": self.ff_per_layer, "shared_kv": self.shared_kv,
                "d_ff": self.d_ff}


def parse_family(text: str) -> list[Member]:
    """'7x1,4x2kv' -> members; LxF with an optional 'kv' (shared keys/values)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)(kv)?", item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise Refused(f"--family: {item!r} is not LxF[kv] with L, F >= 1 (e.g. 7x1, 4x2, 3x3kv)")
        L, F, kv = int(m.group(1)), int(m.group(2)), bool(m.group(3))
        out.append(Member(f"{L}L-{F}F{'-sharedkv' if kv else ''}", L, F, kv))
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise Refused(f"--family lists a member twice: {', '.join(names)}")
    return out


def parse_count(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise Refused(f"expected a number such as 5.2M, 24e6 or 5242880, got {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6}[m.group(2)]


def parse_sets(items: list[str]) -> dict:
    """--set key=value for every member, values parsed as `smallstate-lm train --set` parses them."""
    from smallstate_lm.cli import parse_overrides
    from smallstate_lm.models import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or key not in fields:
            raise Refused(f"--set {item!r}: expected key=value with key a model config field "
                          f"({', '.join(sorted(fields))})")
        if key in ("n_layers", "ff_per_layer", "shared_kv", "d_ff", "vocab_size"):
            raise Refused(f"--set {key}: set by the family (use --family, --budget or --fixed-d-ff)")
    return parse_overrides(items)


def base_config(args):
    """The preset with --d-model, --heads and --set applied (ModelConfig checks each value's type)."""
    from smallstate_lm.errors import ConfigError
    from smallstate_lm.models import PRESETS, get_preset

    if args.preset not in PRESETS:
        raise Refused(f"--preset {args.preset!r}: unknown; choose one of: {', '.join(PRESETS)}")
    cfg = get_preset(args.preset)
    if cfg.arch != "transformer":
        raise Refused(f"--preset {args.preset!r} is a {cfg.arch} model; the trade-off is between Transformer shapes")
    if args.d_model < 8:
        raise Refused(f"--d-model must be >= 8, got {args.d_model}")
    heads = args.heads or max(1, args.d_model // 64)
    sets = parse_sets(args.set)
    try:
        return cfg.replace(**{"d_model": args.d_model, "n_heads": heads, "d_ff": 4 * args.d_model,
                              "dropout": args.dropout, "vocab_size": 1000, **sets})  # --set last, as in train
    except ConfigError as e:
        given = f" with --set {' '.join(args.set)}" if args.set else ""
        raise Refused(f"model config{given}: {e}") from None


def nonembedding(cfg) -> int:
    """Parameters that do not grow with the vocabulary: the count at V minus V times the
    count per vocabulary entry (built on the meta device, nothing allocated)."""
    import torch

    from smallstate_lm.models import build_model

    def count(v):
        with torch.device("meta"):
            m = build_model(cfg.replace(vocab_size=v))
        return sum(p.numel() for p in m.parameters())

    per_word = count(1001) - count(1000)
    return count(1000) - 1000 * per_word


def plan(args) -> tuple[list[Member], int]:
    """The family with each member's d_ff, non-embedding parameters and state, and the budget."""
    import torch

    from smallstate_lm.errors import ConfigError
    from smallstate_lm.models import build_model

    base = base_config(args)
    members = parse_family(args.family)
    if args.budget is not None:
        budget = parse_count(args.budget)
        if budget <= 0:
            raise Refused(f"--budget must be > 0, got {args.budget}")
    else:
        budget = nonembedding(base.replace(n_layers=4, ff_per_layer=2, shared_kv=False))
    for m in members:
        cfg = base.replace(n_layers=m.n_layers, ff_per_layer=m.ff_per_layer, shared_kv=m.shared_kv)
        try:
            cfg.validate()
        except ConfigError as e:
            raise Refused(f"{m.name}: {e}") from None
        if args.fixed_d_ff:
            m.d_ff = cfg.d_ff
        else:  # non-embedding parameters are linear in d_ff: solve, then round to a multiple of 8
            a = nonembedding(cfg.replace(d_ff=8))
            b = (nonembedding(cfg.replace(d_ff=16)) - a) / 8
            m.d_ff = max(8, 8 * round((8 + (budget - a) / b) / 8)) if b > 0 else cfg.d_ff
        cfg = cfg.replace(d_ff=m.d_ff)
        m.nonemb = nonembedding(cfg)
        with torch.device("meta"):
            m.state = build_model(cfg).state_numel_per_position()
    off = [m for m in members if abs(m.nonemb / budget - 1) > args.tolerance]
    if off:
        detail = ", ".join(f"{m.name} {m.nonemb:,} ({100 * (m.nonemb / budget - 1):+.1f}%)" for m in members)
        raise Refused(f"the family's non-embedding parameters differ from the budget {budget:,.0f} by more than "
                      f"±{100 * args.tolerance:g}%: {detail}")
    return members, int(budget)


def check_readable(*paths: str) -> None:
    for p in paths:
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            raise Refused(f"{p}: cannot read it ({e.strerror or e})") from None


def train_command(args, m: Member, out: Path, resume: bool) -> list[str]:
    sets = [f"{k}={json.dumps(v)}" for k, v in m.overrides().items()]
    sets += [f"d_model={args.d_model}", f"n_heads={args.heads or max(1, args.d_model // 64)}",
             f"dropout={args.dropout}", *args.set]
    cmd = ["train", "--train", args.train, "--valid", args.valid, "--eval-text", args.dev, "--preset", args.preset]
    for s in sets:
        cmd += ["--set", s]
    cmd += [*RECIPE, "--max-tokens", str(int(parse_count(args.max_tokens))), "--threads", str(args.threads),
            "--device", args.device, "--seed", str(args.seed), "--out", str(out)]
    if args.max_minutes:
        cmd += ["--max-minutes", str(args.max_minutes)]
    return cmd + (["--resume"] if resume else [])


def cmd_plan(args) -> None:
    members, budget = plan(args)
    print(f"budget: {budget:,} non-embedding parameters (d_model {args.d_model}, preset {args.preset})")
    print(f"{'member':<18}{'d_ff':>6}{'non-embedding':>15}{'vs budget':>11}{'state/position':>16}")
    for m in members:
        print(f"{m.name:<18}{m.d_ff:>6}{m.nonemb:>15,}{100 * (m.nonemb / budget - 1):>+10.1f}%{m.state:>16,}")


def cmd_train(args) -> None:
    members, budget = plan(args)
    check_readable(args.train, args.valid, args.dev)
    if parse_count(args.max_tokens) <= 0:
        raise Refused(f"--max-tokens must be > 0, got {args.max_tokens}")
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(runs / "family.json", json.dumps(
        {"budget": budget, "d_model": args.d_model, "preset": args.preset, "set": args.set,
         "dropout": args.dropout, "max_tokens": int(parse_count(args.max_tokens)),
         "members": [dataclasses.asdict(m) for m in members]}, indent=2))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    pending = []
    for m in members:
        out = runs / m.name
        summary = out / "summary.json"
        if summary.exists() and json.loads(summary.read_text()).get("tokens", 0) >= parse_count(args.max_tokens):
            print(f"{m.name}: trained already ({summary})", flush=True)
            continue
        resume = (out / "last.pt").exists()
        if out.exists() and not resume:
            subprocess.run(["rm", "-rf", str(out)], check=True)
        pending.append((m, out, train_command(args, m, out, resume)))
    t0, running, failed = time.time(), [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            m, out, cmd = pending.pop(0)
            out.parent.mkdir(parents=True, exist_ok=True)
            log = open(runs / f"{m.name}.log", "a")
            print(f"{m.name}: smallstate-lm {' '.join(cmd)}", flush=True)
            running.append((m, out, cmd, log, subprocess.Popen([sys.executable, "-m", "smallstate_lm.cli", *cmd],
                                                              stdout=subprocess.PIPE, stderr=log, env=env, text=True)))
        time.sleep(2)
        for item in list(running):
            m, out, cmd, log, proc = item
            if proc.poll() is None:
                continue
            running.remove(item)
            text = proc.stdout.read()
            log.close()
            if proc.returncode != 0 or "{" not in text:
                failed.append(m.name)
                tail = (runs / f"{m.name}.log").read_text().strip().splitlines()[-1:]
                print(f"{m.name}: training failed ({proc.returncode}): {' '.join(tail)}", flush=True)
                continue
            s = json.loads(text[text.index("{"):])
            if s.get("state_numel_per_position") != m.state:  # the run is not the member it was meant to be
                failed.append(m.name)
                print(f"{m.name}: trained a model with {s.get('state_numel_per_position')} state numbers per "
                      f"position, expected {m.state}", flush=True)
                continue
            s.update(member=dataclasses.asdict(m), command="smallstate-lm " + " ".join(cmd))
            atomic_write_text(out / "summary.json", json.dumps(s, indent=2))
            print(f"{m.name}: {s['stop_reason']} after {s['tokens']:,} tokens, best valid ppl "
                  f"{s['best_valid_ppl']:.2f} ({time.time() - t0:.0f} s)", flush=True)
    if failed:
        raise Refused(f"training failed for {', '.join(failed)} (logs in {runs})")


# ---- transport (scripts/run_transport.py) ------------------------------------------------


def cmd_pack(args) -> None:
    from run_transport import pack

    pack(Path(args.runs), Path(args.out), args.limit_mb)


def cmd_unpack(args) -> None:
    from run_transport import TransportError, unpack

    try:
        unpack([Path(p) for p in args.parts], Path(args.runs))
    except TransportError as e:
        raise Refused(str(e)) from None


# ---- assessment (CPU) ---------------------------------------------------------------------


def assess_one(run: Path, args, ngram, symbols) -> dict:
    """Perplexities, interpolation, 2-fold dev WER (50-best and order-4 lattices), and one timed
    rescoring of all dev lattices with fixed weights (seconds, peak LM state)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from dev_experiment import run_lattices, run_voice

    from smallstate_lm.checkpoint import load_model
    from smallstate_lm.evaluate import evaluate_file
    from smallstate_lm.rescoring.decode.wer import align_counts
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
    from smallstate_lm.rescoring.formats.lattice_io import read_fst
    from smallstate_lm.rescoring.nbest.lists import read_text
    from smallstate_lm.scoring.scorer import NeuralScorer
    from smallstate_lm.weights import Weights

    cached = run / "assess.json"
    result = json.loads(cached.read_text()) if cached.exists() else {}
    if result.get("model_mtime") != (run / "model.pt").stat().st_mtime:
        result = {"model_mtime": (run / "model.pt").stat().st_mtime}
    if args.retime:  # timings from a quiet machine: the order-4 pass and scoring speed measured again
        result = {k: v for k, v in result.items() if k not in ("order4", "valid", "dev")}
    torch.set_num_threads(args.threads)

    def save():
        atomic_write_text(cached, json.dumps(result, indent=2))

    if "dev" not in result:
        result["valid"] = evaluate_file(run, args.valid)
        result["dev"] = evaluate_file(run, args.dev, ngram=args.ngram)
        save()
    lm = load_model(run)
    result["nonemb"] = nonembedding(lm.config)
    voices = ("festival_slt", "festival_kal")
    if "wer" not in result:
        wer = {}
        scorer = NeuralScorer(lm.model, lm.vocab)
        for voice in voices:
            r = run_voice(DATA / "dev" / voice, scorer, ngram, 1 / 9.5, systems=("neural + n-gram",))
            lat = run_lattices(DATA / "dev" / voice, r, symbols, lm.model, lm.vocab, ngram, [4],
                               systems=("neural + n-gram",))[0]
            wer[voice] = {"first pass": 100 * r["first pass"] / r["ref_words"],
                          "nbest": 100 * r["neural + n-gram"] / r["ref_words"], "lattice": lat["wer"],
                          "ref_words": r["ref_words"]}
        result["wer"] = wer
        save()
    weights = Weights(**{k: v for k, v in json.loads((ROOT / "lattices" / "weights.json").read_text()).items()
                         if k in {f.name for f in dataclasses.fields(Weights)}})
    names = [(v, p) for v in voices for p in sorted((DATA / "dev" / v / "fst").glob("*.lat.fst"))]
    refs = {utt: words for v in voices for utt, words in read_text(DATA / "dev" / v / "ref.txt").items()}
    modes = [("order4", 4)] + ([("exact", None)] if run.name in args.exact else [])
    for key, order in modes:
        if key in result:
            continue
        rescorer = LatticeRescorer(weights, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=order))
        t0 = time.perf_counter()
        lats = [read_fst(p, symbols) for _, p in names]
        by_index = dict(rescorer.expand_many(lats))  # (index, lattice) pairs, in the order they finish
        seconds = time.perf_counter() - t0
        done = [(i, by_index[i]) for i in range(len(lats))]
        stats = [exp.stats for _, exp in done]
        errors = sum(align_counts(refs[p.name.split(".")[0]], exp.best_words(weights)).errors
                     for (_, p), (_, exp) in zip(names, done))
        result[key] = {"seconds": seconds, "peak_state_mib": max(s.peak_state_bytes for s in stats) / 2**20,
                       "expanded_states": sum(s.expanded_states for s in stats),
                       "lm_rows": sum(s.lm_rows for s in stats), "lattices": len(done),
                       "wer": 100 * errors / sum(len(refs[p.name.split('.')[0]]) for _, p in names),
                       "pruned_harder": sum(bool(s.pruned_harder) for s in stats)}
        save()
        print(f"{run.name} {key}: {result[key]}", flush=True)
    return result


def cmd_assess(args) -> None:
    from smallstate_lm.ngram import NgramLM
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable

    check_readable(args.ngram, args.valid, args.dev)
    runs = [p for p in sorted(Path(args.runs).iterdir()) if (p / "model.pt").exists()]
    runs += [Path(p) for p in args.also]
    if not runs:
        raise Refused(f"{args.runs}: no trained runs (run `train`, or `unpack` a family)")
    args.exact = set(filter(None, args.exact.split(",")))
    ngram = NgramLM(args.ngram)
    symbols = SymbolTable.read(DATA / "dev" / "words.txt")
    for run in runs:
        t0 = time.time()
        result = assess_one(run, args, ngram, symbols)
        print(f"{run.name}: assessed ({time.time() - t0:.0f} s)", flush=True)
        if args.record:
            record(run, result, Path(args.record))


def record(run: Path, result: dict, folder: Path) -> None:
    """One JSON per run (its assessment and training summary) in `folder`: a table can be
    rebuilt from these after runs/ is gone, and later runs added to it."""
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    atomic_write_text(folder / f"{run_label(run.name, summary)}.json",
                      json.dumps({"run": run.name, "summary": summary, "assess": result}, indent=1))


def run_label(name: str, summary: dict) -> str:
    """The run's name and its training tokens: one shape trained to two budgets stays two rows."""
    tokens = summary.get("tokens")
    return f"{name}-{tokens / 1e6:.0f}M" if tokens else name


def cmd_table(args) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import machine, write_section

    found = {}  # run name -> (summary, assessment): recorded JSON first, live runs over it
    if args.recorded and Path(args.recorded).is_dir():
        for f in sorted(Path(args.recorded).glob("*.json")):
            r = json.loads(f.read_text())
            found[run_label(r["run"], r["summary"])] = (r["run"], r["summary"], r["assess"])
    dirs = [p for p in sorted(Path(args.runs).iterdir())] if Path(args.runs).is_dir() else []
    for run in dirs + [Path(p) for p in args.also]:
        if (run / "assess.json").exists():
            s = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
            found[run_label(run.name, s)] = (run.name, s, json.loads((run / "assess.json").read_text()))
    found = {k: v for k, v in found.items() if "wer" in v[2]}
    if not found:
        raise Refused(f"{args.runs}: nothing assessed yet (run `assess`)")
    rows, points = [], []

    def timed(x: dict) -> str:
        return f"{x['peak_state_mib']:.0f} / {x['seconds']:.0f} / {x['wer']:.2f}" if x else "-"

    order = sorted(found.values(), key=lambda r: (-r[2]["valid"]["state_numel_per_position"], -r[1].get("tokens", 0)))
    for name, s, a in order:
        v, d, w = a["valid"], a["dev"], a["wer"]
        rows.append(
            f"| `{name}` | {a['nonemb']:,} | {v['parameters']:,} | {v['state_numel_per_position']:,} | "
            f"{s.get('tokens', 0) / 1e6:.0f}M | {v['perplexity']:.2f} | {d['perplexity']:.2f} | "
            f"{d['interpolation']['perplexity']:.2f} | "
            + " | ".join(f"{w[x]['lattice']:.2f} / {w[x]['nbest']:.2f}" for x in ("festival_slt", "festival_kal"))
            + f" | {timed(a.get('order4'))} | {timed(a.get('exact'))} | {d['tokens_per_second']:,.0f} |")
        points.append((f"{name} ({s.get('tokens', 0) / 1e6:.0f}M)", v["state_numel_per_position"],
                       d["perplexity"]))
    body = "\n".join([
        "| model | non-embedding params | params | state / position | trained tokens | valid ppl | dev ppl | "
        "dev ppl + 4-gram | slt WER lattice / 50-best | kal WER lattice / 50-best | 240 lattices, order 4: "
        "peak LM state MiB / s / WER % | exact histories: MiB / s / WER % | scoring tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", f"Assessed on {machine().split(', load average')[0]}, one model at a time."])
    print(body)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        states = sorted({p[1] for p in points})
        for name, state, ppl in points:
            # a label goes left where the next column of points is close on the right
            right = [x for x in states if x > state]
            left = bool(right) and right[0] < 1.4 * state
            ax.scatter(state, ppl, color="tab:red" if "sharedkv" in name else "tab:blue")
            ax.annotate(name, (state, ppl), textcoords="offset points", fontsize=7,
                        xytext=(-6, -3) if left else (6, -3), ha="right" if left else "left")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state: numbers kept per history position")
        ax.set_ylabel("dev perplexity")
        ax.set_title("Dev perplexity against state (red: shared keys/values)")
        ax.margins(x=0.25)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = Path(args.plot).with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, args.plot)
    if args.section:
        write_section(args.section + "-table", body, doc=ROOT / "docs" / "results.md", header="# Results\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def family_args(p):
        p.add_argument("--family", default=DEFAULT_FAMILY, help="members LxF[kv], comma-separated")
        p.add_argument("--preset", default="small", help="the preset every member starts from")
        p.add_argument("--set", action="append", default=[], help="model config key=value for every member")
        p.add_argument("--d-model", type=int, default=256)
        p.add_argument("--heads", type=int, default=None, help="attention heads [default: d_model / 64]")
        p.add_argument("--dropout", type=float, default=0.2)
        p.add_argument("--budget", default=None, help="non-embedding parameters, e.g. 5.2M [default: the 4L-2F "
                       "member's at d_ff = 4 d_model]")
        p.add_argument("--tolerance", type=float, default=0.05, help="largest relative distance from the budget")
        p.add_argument("--fixed-d-ff", action="store_true", help="keep d_ff = 4 d_model for every member "
                       "(and refuse the family if its counts then differ by more than the tolerance)")

    def data_args(p):
        p.add_argument("--runs", default=str(ROOT / "runs" / "tradeoff"))
        p.add_argument("--train", default=str(DATA / "text" / "train.txt"))
        p.add_argument("--valid", default=str(DATA / "text" / "valid.txt"))
        p.add_argument("--dev", default=str(DATA / "text" / "dev.txt"))
        p.add_argument("--threads", type=int, default=2)

    p = sub.add_parser("plan", help="print the family")
    family_args(p)
    p = sub.add_parser("train", help="train every member (resumes)")
    family_args(p)
    data_args(p)
    p.add_argument("--jobs", type=int, default=2, help="members trained at once")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", default="24e6", help="training tokens per member (the cosine spans them)")
    p.add_argument("--max-minutes", type=float, default=None, help="safety cap per member (a run stopped by it "
                   "is continued by the next `train`)")
    p.add_argument("--seed", type=int, default=1)
    p = sub.add_parser("pack", help="trained weights -> int8 parts for transport")
    p.add_argument("--runs", default=str(ROOT / "runs" / "tradeoff"))
    p.add_argument("--out", required=True)
    p.add_argument("--limit-mb", type=float, default=67.0, help="most megabytes in all parts together")
    p = sub.add_parser("unpack", help="parts from pack -> run directories")
    p.add_argument("parts", nargs="+")
    p.add_argument("--runs", default=str(ROOT / "runs" / "tradeoff"))
    p = sub.add_parser("assess", help="perplexities, WER, lattice time and memory per run (CPU)")
    data_args(p)
    p.add_argument("--ngram", default=str(ROOT / "runs" / "lm4.bin"), help="KenLM model (the full-text 4-gram)")
    p.add_argument("--exact", default="", help="runs also rescored with exact histories, comma-separated")
    p.add_argument("--also", action="append", default=[], help="another model directory to assess (a baseline)")
    p.add_argument("--retime", action="store_true", help="measure the order-4 lattice pass and the "
                   "perplexities (with their speed) again, keeping the WER and exact runs: for timings taken with "
                   "nothing else running")
    p.add_argument("--record", default=None, help="folder to copy each run's results into (one JSON per run)")
    p = sub.add_parser("table", help="the table (and plot) from what assess wrote")
    p.add_argument("--runs", default=str(ROOT / "runs" / "tradeoff"))
    p.add_argument("--also", action="append", default=[])
    p.add_argument("--recorded", default=None, help="folder of JSON written by `assess --record`")
    p.add_argument("--plot", default=None, help="PNG of dev perplexity against state per position")
    p.add_argument("--section", default=None, help="docs/results.md section to write (name-table)")
    args = ap.parse_args(argv)
    try:
        {"plan": cmd_plan, "train": cmd_train, "pack": cmd_pack, "unpack": cmd_unpack, "assess": cmd_assess,
         "table": cmd_table}[args.cmd](args)
    except Refused as e:
        print(f"state_tradeoff: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # the library's own errors name the file and what was expected
        from smallstate_lm.errors import SmallstateError

        if not isinstance(e, SmallstateError):
            raise
        print(f"state_tradeoff: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
