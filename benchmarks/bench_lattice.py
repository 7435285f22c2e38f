"""Lattice rescoring: history merging (order n) against exact histories, in one run.

Both rescore the same lattices with the same LMs and weights; reported: WER, expanded
states, LM calls, seconds (per mode, best of --repeats alternating runs; lattices
are expanded `batch_lattices` at a time, sharing LM calls), peak LM state memory (all lattices in flight together).

    python benchmarks/bench_lattice.py --lm models/bible-small --ngram runs/demo/lm4.bin \\
        [--lattices DIR_OR_FILES ...] [--words words.txt] [--refs ref.txt] [--weights weights.json] [--order 4]

With `--against REV`: `smallstate-lm rescore` with the n-gram alone, this tree against a `git worktree`
of REV, side by side in one run (alternating, the fastest of --repeats kept): wall time of the whole
command (start-up and imports included), expanded states per second, and whether best.txt is identical.

    python benchmarks/bench_lattice.py --against 7cc0070 --ngram runs/lm4.bin --lattices runs/devlat
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DOC, command, machine, write_section  # noqa: E402

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.decode.wer import align_counts  # noqa: E402
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_text  # noqa: E402
from smallstate_lm.rescoring.runs.lattice_files import read_lattice  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", default=str(ROOT / "models" / "bible-small"))
    ap.add_argument("--ngram", default=str(ROOT / "runs" / "demo" / "lm4.bin"))
    ap.add_argument("--lattices", nargs="+", default=[str(ROOT / "lattices")],
                    help="lattice files, or directories of *.lat.fst")
    ap.add_argument("--words", default=None, help="symbol table [default: words.txt beside the lattices]")
    ap.add_argument("--refs", nargs="+", default=None, help="reference file(s) [default: ref.txt beside them]")
    ap.add_argument("--weights", default=None, help="[default: weights.json beside the lattices, if any]")
    ap.add_argument("--order", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per mode; the fastest is kept")
    ap.add_argument("--limit", type=int, default=None, help="at most this many lattices per directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--doc", default=str(DOC), help="the markdown file whose section the run (re)writes")
    ap.add_argument("--breakdown", action="store_true", help="where the wall time of a rescoring run with the "
                    "neural LM and the n-gram goes (read, expansion bookkeeping, n-gram, LM forward, k-best, write)")
    ap.add_argument("--against", metavar="REV", help="compare n-gram-only `rescore` with git revision REV")
    ap.add_argument("--nbest", type=int, default=10, help="with --against: this tree's rescore --nbest (REV keeps "
                    "its default, 10)")
    ap.add_argument("--jobs", type=int, default=1, help="with --against: also time this tree with rescore --jobs N "
                    "(worker processes)")
    args = ap.parse_args()
    if args.against:
        return against(args)
    if args.breakdown:
        return breakdown(args)
    files: list[Path] = []
    for p in map(Path, args.lattices):
        files.extend(sorted(p.glob("*.lat.fst"))[: args.limit] if p.is_dir() else [p])
    def home(f: Path) -> Path:  # shared/data layout keeps lattices in <voice>/fst/
        return f.parent.parent if f.parent.name == "fst" else f.parent

    first_dir = home(files[0])
    words = Path(args.words) if args.words else next(p for p in (first_dir / "words.txt", first_dir.parent /
                                                                 "words.txt") if p.exists())
    # references per directory: utterance ids repeat across voices
    ref_files = {d: read_text(d / "ref.txt") for d in {home(f) for f in files}} if not args.refs else None
    extra_refs: dict[str, list[str]] = {}
    for r in args.refs or []:
        extra_refs.update(read_text(r))
    weights_path = Path(args.weights) if args.weights else first_dir / "weights.json"
    w = Weights.load(weights_path) if weights_path.exists() else Weights(am_scale=1 / 9.5)
    symbols = SymbolTable.read(words)
    lm = load_model(args.lm, args.device)
    ngram = NgramLM(args.ngram)
    modes = {f"order {args.order}": args.order, "exact": None}
    rescorers = {k: LatticeRescorer(w, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=o), args.device)
                 for k, o in modes.items()}
    acc = {k: {"errors": 0, "states": 0, "calls": 0, "seconds": 0.0, "peak": 0} for k in modes}
    lats = [read_lattice(f, symbols) for f in files]
    refs = [ref_files[home(f)][lat.name] if ref_files else extra_refs[lat.name] for f, lat in zip(files, lats)]
    ref_words = sum(len(r) for r in refs)
    for _ in range(args.repeats):  # alternate the modes, keep each one's fastest run
        for k, rs in rescorers.items():
            a = {"errors": 0, "states": 0, "peak": 0}
            calls0 = rs.lm_calls
            t0 = time.perf_counter()
            for j, exp in rs.expand_many(lats):
                a["errors"] += align_counts(refs[j], exp.nbest(w, 1)[0]["words"]).errors
                a["states"] += exp.stats.expanded_states
                a["peak"] = max(a["peak"], exp.stats.peak_state_bytes)
            seconds = time.perf_counter() - t0
            if acc[k]["seconds"] == 0.0 or seconds < acc[k]["seconds"]:
                acc[k] = {**a, "calls": rs.lm_calls - calls0, "seconds": seconds}
    ex, mg = acc["exact"], acc[f"order {args.order}"]
    speed = ex["seconds"] / mg["seconds"]
    dwer = 100 * (mg["errors"] - ex["errors"]) / ref_words
    rows = [f"| {k} | {100 * a['errors'] / ref_words:.2f} | {a['states']:,} | {a['calls']:,} | "
            f"{a['seconds']:.1f} | {a['peak'] / 2**20:.1f} |" for k, a in acc.items()]
    body = "\n".join([
        f"## bench_lattice: order-{args.order} history merging vs exact histories, {args.device}",
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- {len(files)} lattices, {ref_words:,} reference words; LM {lm.config.name} from `{args.lm}`, n-gram "
        f"`{args.ngram}`; weights {weights_path if weights_path.exists() else 'defaults'}.",
        "",
        "| histories | WER % | expanded states | LM calls | seconds | peak LM state MiB |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Merging is {speed:.1f}x faster than exact (target 5x) at {dwer:+.2f} WER points (target within 0.2).",
    ])
    print(body)
    if not args.no_write:
        write_section(f"bench_lattice-{torch.device(args.device).type}", body, Path(args.doc))


def _timed_rescore(tree: Path, files: list[str], words: str, args, out: Path,
                   jobs: int = 1) -> tuple[float, int, bytes]:
    """(wall seconds of the whole command, expanded states it reports, best.txt)."""
    cmd = [sys.executable, "-m", "smallstate_lm.cli", "rescore", *files, "--words", words, "--ngram", args.ngram,
           "--max-ngram-order", str(args.order), "-o", str(out), "--quiet"]
    if args.nbest != 10 and tree == ROOT:  # the older revision runs as it did by default
        cmd += ["--nbest", str(args.nbest)]
    if jobs > 1:
        cmd += ["--jobs", str(jobs)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{tree}: rescore failed ({p.returncode}):\n{p.stderr[-2000:]}")
    states = int(re.search(r"([\d,]+) expanded states", p.stdout + p.stderr).group(1).replace(",", ""))
    return seconds, states, (out / "best.txt").read_bytes()


def against(args) -> None:
    """This tree's n-gram-only lattice rescoring against REV's, in one run."""
    rev = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    old_tree = Path(f"/tmp/bench-against-{rev}")
    if not old_tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
    for tree in (ROOT, old_tree):  # both with bytecode, as installed from a wheel (setup.sh compiles this tree)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "smallstate_lm")], check=True,
                       capture_output=True)
    files: list[str] = []
    for p in map(Path, args.lattices):
        files.extend(str(f.absolute()) for f in (sorted(p.glob("*.lat.fst"))[: args.limit] if p.is_dir() else [p]))
    words = str(Path(args.words).absolute()) if args.words else str(Path(files[0]).parent / "words.txt")
    args.ngram = str(Path(args.ngram).absolute())
    runs = {"this tree": (ROOT, 1), f"{rev} (before)": (old_tree, 1)}
    if args.jobs > 1:
        runs[f"this tree, --jobs {args.jobs}"] = (ROOT, args.jobs)
    best: dict[str, tuple[float, int, bytes]] = {}
    for r in range(args.repeats):
        for k, (name, (tree, jobs)) in enumerate(runs.items()):
            got = _timed_rescore(tree, files, words, args, Path(f"/tmp/bench-against-out-{r}-{k}"), jobs)
            if name not in best or got[0] < best[name][0]:
                best[name] = got
    torch_import = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); import torch; "
                                   "print(time.perf_counter() - t)"], capture_output=True, text=True).stdout
    (new_s, new_n, new_best), (old_s, old_n, old_best), *pool = best.values()
    same = all(b == old_best for _, _, b in best.values())
    pool_line = (f" with {args.jobs} worker processes (`--jobs {args.jobs}`, one core each): "
                 f"{pool[0][1] / pool[0][0] / (old_n / old_s):.1f}x." if pool else "")
    rows = [f"| {k} | {s:.2f} | {n:,} | {n / s:,.0f} |" for k, (s, n, _) in best.items()]
    body = "\n".join([
        f"## bench_lattice --against: n-gram-only rescoring, this tree vs {rev}",
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- {len(files)} lattices, n-gram `{args.ngram}`, order-{args.order} histories, `--nbest {args.nbest}` "
        f"(REV: its default, 10); "
        f"wall time of the whole `smallstate-lm rescore` process (start-up, reading, expansion, n-best, writing), "
        f"fastest of {args.repeats} alternating runs, both trees byte-compiled first. "
        f"Importing torch alone takes {float(torch_import):.2f} s here; "
        "an n-gram-only run of this tree no longer imports it.",
        "",
        "| code | seconds | expanded states | states per second |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Throughput {new_n / new_s / (old_n / old_s):.1f}x in one process (issue 41's target: 8x 5a54a35);{pool_line} "
        "best.txt "
        f"{'identical' if same else 'DIFFERENT'}; expanded states {new_n:,} vs {old_n:,}.",
    ])
    print(body)
    if not args.no_write:
        write_section("bench_lattice-against", body, Path(args.doc))


class _Clock:
    """Seconds spent inside wrapped callables, by name (nested ones are subtracted from their caller)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.stack: list[float] = []

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent = time.perf_counter() - t0
                inner = self.stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + spent - inner
                if self.stack:
                    self.stack[-1] += spent
        return timed


def breakdown(args) -> None:
    """One rescoring run of the lattices with the neural LM and the n-gram, its wall time split by phase."""
    from smallstate_lm.rescoring.formats.lattice_io import write_fst

    files: list[Path] = []
    for p in map(Path, args.lattices):
        files.extend(sorted(p.glob("*.lat.fst"))[: args.limit] if p.is_dir() else [p])
    words = Path(args.words) if args.words else files[0].parent / "words.txt"
    weights_path = Path(args.weights) if args.weights else None
    w = Weights.load(weights_path) if weights_path else Weights(am_scale=1 / 9.5)
    symbols = SymbolTable.read(words)
    lm, ngram = load_model(args.lm, args.device), NgramLM(args.ngram)
    clock = _Clock()
    rescorer = LatticeRescorer(w, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=args.order), args.device)
    rescorer._lm_call = clock.wrap("LM forward (incl. gathering states)", rescorer._lm_call)
    rescorer.cache.ngram_steps = clock.wrap("n-gram (KenLM)", rescorer.cache.ngram_steps)
    t0 = time.perf_counter()
    lats = [clock.wrap("read", read_lattice)(f, symbols) for f in files]
    expand = clock.wrap("expansion bookkeeping", lambda: list(rescorer.expand_many(lats)))
    done = expand()
    kbest = clock.wrap("k-best (10 distinct)", lambda e: e.nbest(w, 10))
    write = clock.wrap("write rescored lattices", lambda e, d: write_fst(d / f"{e.name}.lat.fst", e.to_lattice(w)))
    out = Path("/tmp/bench-breakdown")
    out.mkdir(exist_ok=True)
    for _, e in done:
        kbest(e)
        write(e, out)
    total = time.perf_counter() - t0
    rows = [f"| {k} | {v:.2f} | {100 * v / total:.0f}% |" for k, v in clock.seconds.items()]
    states = sum(e.stats.expanded_states for _, e in done)
    body = "\n".join([
        f"## bench_lattice --breakdown: where a rescoring run's time goes, {args.device}",
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- {len(files)} lattices, {states:,} expanded states, {rescorer.lm_calls} LM calls; LM `{args.lm}` "
        f"({lm.config.name}), n-gram `{args.ngram}`, order-{args.order} histories; one run, in-process timers.",
        "",
        "| phase | seconds | share |",
        "|---|---|---|",
        *rows,
        f"| total | {total:.2f} | 100% |",
        "",
        f"LM forward share {100 * clock.seconds['LM forward (incl. gathering states)'] / total:.0f}% (target 60%).",
    ])
    print(body)
    if not args.no_write:
        write_section(f"bench_lattice-breakdown-{torch.device(args.device).type}", body, Path(args.doc))


if __name__ == "__main__":
    main()
