"""Issue 44's GPU call: a wider release candidate and every model family at one budget, trained at
once on one GPU (docs/results.md, "Every model family at one GPU budget").

    python scripts/release_gpu.py plan                      # members, parameters, state, budget
    python scripts/release_gpu.py run --out $OUT --data gpu_data --minutes 7 --device cuda
    python scripts/release_gpu.py table --results docs/families/results.jsonl --section families

Two kinds of member share the GPU, each its own `smallstate-lm train` (or `distill`) process:
- release candidates: small-state Transformers at d 384-512 with dropout over many epochs, state at
  most 2,048 numbers per history position, the checkpoint chosen on valid.txt; their weights come
  back (int8 per row, `run_transport.pack`) for the CPU assessment (`state_tradeoff.py assess`);
- the families at `bible-small`'s non-embedding parameter budget (each preset's one size knob solved
  to meet it within --tolerance) for the same wall-clock minutes, by `bible-small`'s recipe: `small`
  itself, the same with a BPE tokenizer (its weights return too: issue 43's full-budget pair),
  Transformer-XL, adaptive span, feedback memory, all-attention, active memory, LSTM, and an LSTM
  distilled from --teacher.

Every member, when it ends, has its valid and dev perplexity computed on the same device and one JSON
line appended to OUT/results.jsonl, so a call cut short still returns what finished. At --pack-at
seconds the returned members are packed whatever they reached (their best checkpoint so far).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DATA = ROOT.parent / "shared" / "data" / "text"
# models/bible-small's recipe (its README): every family member trains by it
RECIPE = {"lr": 2e-3, "batch_tokens": 4096, "warmup_steps": 500}
COMMON = ["--max-epochs", "1000", "--valid-every", "1000", "--patience", "0", "--quiet", "--seed", "1"]


class Refused(Exception):
    """A bad argument: one line, exit status 2."""


@dataclasses.dataclass
class Member:
    name: str
    kind: str  # "release" or "family"
    preset: str
    sets: dict
    knob: str | None = None  # the config field solved so that the non-embedding count meets the budget
    tokenizer: str = "word"
    distill: bool = False
    returns: bool = False  # weights packed for the trip back
    lr: float = RECIPE["lr"]
    batch_tokens: int = RECIPE["batch_tokens"]
    nonemb: int = 0
    state: int = 0
    state_fixed: int = 0


def members() -> list[Member]:
    # Release: state <= 2,048 numbers per position at d 384-512 means shared keys/values (only keys
    # are stored); issue 24 found more attention layers better at a fixed state, so each width gets
    # as many as its state allows. Adam's step shrinks with width (lr ~ 1/d from bible-small's 2e-3 at
    # d 256) and grows with the doubled batch; more dropout for three times the parameters.
    release = [
        Member("r512-4L-2F-kv", "release", "small", dict(d_model=512, n_heads=8, d_ff=2048, n_layers=4, ff_per_layer=2,
                                                          shared_kv=True, dropout=0.3),
               returns=True, lr=1.4e-3, batch_tokens=8192),
        Member("r384-5L-2F-kv", "release", "small", dict(d_model=384, n_heads=6, d_ff=1536, n_layers=5, ff_per_layer=2,
                                                          shared_kv=True, dropout=0.3),
               returns=True, lr=1.8e-3, batch_tokens=8192),
    ]
    fam = dict(dropout=0.2)
    families = [
        Member("small", "family", "small", dict(fam)),
        Member("small-bpe2000", "family", "small", dict(fam), tokenizer="bpe:2000", returns=True),
        Member("xl-small", "family", "xl-small", dict(fam), knob="d_ff"),
        Member("span-small", "family", "span-small", dict(fam), knob="d_ff"),
        Member("feedback-small", "family", "feedback-small", dict(fam), knob="d_ff"),
        Member("allatt-small", "family", "allatt-small", dict(fam), knob="n_persistent"),
        # conv-small's full-width kernels (20 x d x d per layer) alone are its budget at 4 layers: 2 layers
        # keep the kernel and the feed-forward sublayers
        Member("conv-small", "family", "conv-small", dict(fam, n_layers=2), knob="d_ff"),
        Member("lstm-small", "family", "lstm-small", dict(fam), knob="d_model"),
        Member("distill-lstm-small", "family", "lstm-small", dict(fam), knob="d_model", distill=True),
    ]
    return release + families


def config_of(m: Member):
    from smallstate_lm.models import get_preset

    return get_preset(m.preset).replace(vocab_size=1000, **m.sets)


def solve(m: Member, budget: int) -> None:
    """Set the member's knob (a multiple of 8) so its non-embedding count is nearest the budget:
    the count grows with every knob, so bisection."""
    from state_tradeoff import nonembedding

    cfg = config_of(m)
    if m.knob:
        lo, hi = 1, 2048  # in steps of 8
        while lo < hi:
            mid = (lo + hi) // 2
            if nonembedding(cfg.replace(**{m.knob: 8 * mid})) < budget:
                lo = mid + 1
            else:
                hi = mid
        best = min((8 * v for v in (lo - 1, lo) if v >= 1),
                   key=lambda v: abs(nonembedding(cfg.replace(**{m.knob: v})) - budget))
        m.sets[m.knob] = best
        cfg = cfg.replace(**{m.knob: best})
    cfg.validate()
    m.nonemb = nonembedding(cfg)
    import torch

    from smallstate_lm.models import build_model

    with torch.device("meta"):
        model = build_model(cfg)
        m.state = model.state_numel_per_position()
        m.state_fixed = model.state_numel_fixed()


def plan(tolerance: float) -> tuple[list[Member], int]:
    from state_tradeoff import nonembedding

    from smallstate_lm.models import get_preset

    budget = nonembedding(get_preset("small").replace(vocab_size=1000))
    out = members()
    for m in out:
        solve(m, budget)
    off = [m for m in out if m.kind == "family" and abs(m.nonemb / budget - 1) > tolerance]
    if off:
        raise Refused("outside the budget: " + ", ".join(f"{m.name} {m.nonemb:,}" for m in off))
    big = [m for m in out if m.kind == "release" and m.state > 2048]
    if big:
        raise Refused("release candidates over 2,048 state numbers per position: "
                      + ", ".join(f"{m.name} {m.state:,}" for m in big))
    return out, budget


def cmd_plan(args) -> None:
    out, budget = plan(args.tolerance)
    print(f"family budget: {budget:,} non-embedding parameters (models/bible-small's)")
    print(f"{'member':<22}{'preset':<16}{'knob':<22}{'non-embedding':>15}{'vs budget':>11}{'state/position':>16}")
    for m in out:
        knob = f"{m.knob}={m.sets[m.knob]}" if m.knob else "-"
        fixed = f" + {m.state_fixed:,}" if m.state_fixed else ""
        print(f"{m.name:<22}{m.preset:<16}{knob:<22}{m.nonemb:>15,}{100 * (m.nonemb / budget - 1):>+10.1f}%"
              f"{m.state:>9,}{fixed}")


def command(m: Member, args, out: Path) -> list[str]:
    text = Path(args.data)
    sets = []
    for k, v in m.sets.items():
        sets += ["--set", f"{k}={json.dumps(v)}"]
    lr = ["--lr", str(m.lr), "--batch-tokens", str(m.batch_tokens), "--warmup-steps", str(RECIPE["warmup_steps"])]
    where = ["--train", str(text / "train.txt"), "--valid", str(text / "valid.txt")]
    tail = [*COMMON, "--max-minutes", str(args.minutes), "--threads", str(args.threads), "--device", args.device,
            "--out", str(out)]
    if m.distill:
        return ["distill", "--teacher", args.teacher, "--student-preset", m.preset, *where, *sets, *lr, *tail]
    return ["train", *where, "--eval-text", str(text / "dev.txt"), "--preset", m.preset, "--tokenizer", m.tokenizer,
            *sets, *lr, *tail]


class Results:
    """OUT/results.jsonl, one line per finished member, appended under a lock."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()

    def add(self, record: dict) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run_member(m: Member, args, runs: Path, results: Results, env: dict, procs: dict, t0: float) -> None:
    out = runs / m.name
    cmd = command(m, args, out)
    record = {"member": m.name, "kind": m.kind, "preset": m.preset, "sets": m.sets, "tokenizer": m.tokenizer,
              "distill": m.distill, "nonemb": m.nonemb, "state": m.state, "state_fixed": m.state_fixed,
              "command": "smallstate-lm " + " ".join(cmd)}
    log = open(runs / f"{m.name}.log", "w")
    print(f"{m.name}: smallstate-lm {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "smallstate_lm.cli", *cmd], stdout=subprocess.PIPE, stderr=log,
                            env=env, text=True)
    procs[m.name] = proc
    text = proc.stdout.read()
    proc.wait()
    log.close()
    if proc.returncode != 0 or "{" not in text:
        tail = (runs / f"{m.name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        record.update(failed=proc.returncode, log_tail=tail, seconds=time.time() - t0)
        results.add(record)
        print(f"{m.name}: failed ({proc.returncode}): {' | '.join(tail)}", flush=True)
        return
    summary = json.loads(text[text.index("{"):])
    (out / "summary.json").write_text(json.dumps({**summary, "command": record["command"]}, indent=2))
    record["summary"] = summary
    for name in ("valid", "dev"):
        ev = subprocess.run([sys.executable, "-m", "smallstate_lm.cli", "eval", "--model", str(out), "--text",
                             str(Path(args.data) / f"{name}.txt"), "--device", args.device, "--json",
                             "--threads", str(args.threads)], capture_output=True, text=True, env=env)
        if ev.returncode == 0 and "{" in ev.stdout:
            record[name] = json.loads(ev.stdout[ev.stdout.index("{"):])
        else:
            record[name] = {"failed": ev.returncode, "stderr": ev.stderr.strip().splitlines()[-2:]}
    record["seconds"] = time.time() - t0
    results.add(record)
    ppl = {k: record[k].get("perplexity") for k in ("valid", "dev")}
    print(f"{m.name}: {summary.get('stop_reason')} after {summary.get('tokens', 0):,} tokens; valid "
          f"{ppl['valid']}, dev {ppl['dev']} ({record['seconds']:.0f} s)", flush=True)


def cmd_run(args) -> None:
    from run_transport import pack

    chosen, _ = plan(args.tolerance)
    if args.members:
        names = set(args.members.split(","))
        unknown = names - {m.name for m in chosen}
        if unknown:
            raise Refused(f"--members: unknown {', '.join(sorted(unknown))}")
        chosen = [m for m in chosen if m.name in names]
    for f in ("train.txt", "valid.txt", "dev.txt"):
        if not (Path(args.data) / f).is_file():
            raise Refused(f"--data {args.data}: no {f} there")
    if any(m.distill for m in chosen) and not (Path(args.teacher) / "model.pt").exists():
        raise Refused(f"--teacher {args.teacher}: no model.pt there")
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    results = Results(out / "results.jsonl")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    results.add({"call": {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
                          "cpus": os.cpu_count(), "minutes": args.minutes, "members": len(chosen),
                          "started": time.strftime("%FT%T%z")}})
    t0, procs = time.time(), {}
    threads = [threading.Thread(target=run_member, args=(m, args, runs, results, env, procs, t0), daemon=True)
               for m in chosen]
    for t in threads:
        t.start()
    deadline = t0 + args.pack_at
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    late = [name for name, p in procs.items() if p.poll() is None]
    for name in late:  # the returned members keep their best checkpoint so far
        procs[name].kill()
        print(f"{name}: stopped at --pack-at {args.pack_at:.0f} s", flush=True)
    keep = runs.parent / (runs.name + "-return")
    keep.mkdir(exist_ok=True)
    order = [m.name for m in chosen if m.returns and (runs / m.name / "model.pt").exists()]
    for name in order:
        if not (keep / name).exists():
            os.symlink((runs / name).resolve(), keep / name)
            if (runs / f"{name}.log").exists():
                os.symlink((runs / f"{name}.log").resolve(), keep / f"{name}.log")
    (keep / "family.json").write_text(json.dumps({"members": [{"name": n} for n in order]}))
    if order:
        pack(keep, out, args.limit_mb, prefix="release")
    print(f"call done in {time.time() - t0:.0f} s", flush=True)


def cmd_table(args) -> None:
    """The families table from results.jsonl files (later files' rows replace earlier ones of the
    same member only where the earlier failed), written into docs/results.md's section."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import write_section

    rows, calls = {}, []
    for path in args.results:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise Refused(f"{path}: cannot read it ({e.strerror or e})") from None
        call = {}
        records = [json.loads(line) for line in lines]
        for r in records:
            if "call" in r:  # processes that shared the device (calls before it was recorded: the file's count)
                call = {"members": sum("member" in x for x in records), **r["call"]}
                calls.append(call)
                continue
            if r["member"] not in rows or "failed" in rows[r["member"]][0]:
                rows[r["member"]] = (r, call)
    if not rows:
        raise Refused("no members in " + ", ".join(args.results))
    lines = ["| model | kind | size knob | parameters | non-embedding | state / position | trained tokens | "
             "minutes, GPU shared by | tokens/s | valid ppl | dev ppl |", "|---" * 11 + "|"]
    order = [m.name for m in members()]
    for name, (r, call) in sorted(rows.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        knob = ", ".join(f"{k} {v}" for k, v in r["sets"].items() if k != "dropout") or "-"
        state = f"{r['state']:,}" + (f" + {r['state_fixed']:,} fixed" if r["state_fixed"] else "")
        if "failed" in r:
            lines.append(f"| `{name}` | {r['preset']} | {knob} | - | {r['nonemb']:,} | {state} | - | "
                         f"{call.get('minutes', '?')} | - | failed: {' '.join(r['log_tail'])[:80]} | - |")
            continue
        s, v, d = r["summary"], r["valid"], r["dev"]
        sharing = "alone" if call.get("members") == 1 else f"{call.get('members', '?')}"
        dev = f"{d['perplexity']:.2f}" + (f" ({d['perplexity_per_token']:.2f} per piece)"
                                          if r["tokenizer"] != "word" else "")
        lines.append(f"| `{name}` | {r['preset']}{', ' + r['tokenizer'] if r['tokenizer'] != 'word' else ''}"
                     f"{', distilled' if r['distill'] else ''} | {knob} | {v['parameters']:,} | {r['nonemb']:,} | "
                     f"{state} | {s['tokens'] / 1e6:.1f}M | {call.get('minutes')}, {sharing} | "
                     f"{s['tokens'] / s['elapsed_seconds']:,.0f} | {v['perplexity']:.2f} | {dev} |")
    devices = sorted({f"{c['device']} (torch {c['torch']}, Python {c['python']}, {c['cpus']} CPUs)" for c in calls})
    body = "\n".join([*lines, "", f"Device: {'; '.join(devices)}; perplexities computed there by `smallstate-lm "
                       "eval --device cuda` (fp32) on the best-valid checkpoint."])
    print(body)
    if args.section:
        write_section(args.section + "-table", body, doc=ROOT / "docs" / "results.md", header="# Results\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="print the members")
    p.add_argument("--tolerance", type=float, default=0.05)
    p = sub.add_parser("run", help="train every member at once, evaluate, pack the returned ones")
    p.add_argument("--out", required=True, help="folder for results.jsonl and the packed parts")
    p.add_argument("--data", default=str(DATA), help="folder with train.txt, valid.txt, dev.txt")
    p.add_argument("--runs", default=str(ROOT / "runs" / "release"))
    p.add_argument("--minutes", type=float, default=7.0, help="wall-clock training minutes of every member")
    p.add_argument("--pack-at", type=float, default=None, help="seconds after the start at which the returned "
                   "members are packed whatever they reached [default: minutes + 90 s]")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--teacher", default=str(ROOT / "models" / "bible-small"))
    p.add_argument("--members", default=None, help="only these members, comma-separated")
    p.add_argument("--limit-mb", type=float, default=58.0, help="most megabytes of packed weights")
    p.add_argument("--tolerance", type=float, default=0.05)
    p = sub.add_parser("table", help="the families table from results.jsonl")
    p.add_argument("--results", nargs="+", default=[str(ROOT / "docs" / "families" / "results.jsonl")])
    p.add_argument("--section", default=None, help="docs/results.md section to write (name-table)")
    args = ap.parse_args(argv)
    if getattr(args, "pack_at", 0) is None:
        args.pack_at = args.minutes * 60 + 90
    try:
        {"plan": cmd_plan, "run": cmd_run, "table": cmd_table}[args.cmd](args)
    except Refused as e:
        print(f"release_gpu: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
