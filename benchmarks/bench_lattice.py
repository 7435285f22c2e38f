"""Lattice rescoring: history merging (order n) against exact histories, in one run.

Both rescore the same lattices with the same LMs and weights; reported: WER, expanded
states, LM calls, seconds (per mode, best of --repeats alternating runs; lattices
are expanded `batch_lattices` at a time, sharing LM calls), peak LM state memory (all lattices in flight together).

    python benchmarks/bench_lattice.py --lm models/bible-small --ngram runs/demo/lm4.bin \\
        [--lattices DIR_OR_FILES ...] [--words words.txt] [--refs ref.txt] [--weights weights.json] [--order 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import command, machine, write_section  # noqa: E402

from smallstate_lm.checkpoint import load_model  # noqa: E402
from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.lattice_expand import ExpandConfig, LatticeRescorer  # noqa: E402
from smallstate_lm.rescoring.lattice_files import read_lattice  # noqa: E402
from smallstate_lm.rescoring.nbest_io import read_text  # noqa: E402
from smallstate_lm.rescoring.wer import align_counts  # noqa: E402
from smallstate_lm.scoring import Weights  # noqa: E402


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
    args = ap.parse_args()
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
        write_section(f"bench_lattice-{torch.device(args.device).type}", body)


if __name__ == "__main__":
    main()
