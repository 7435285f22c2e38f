"""Word confidences against the expansion they follow, in one process: what the default lattice run spends
on the best paths' confidences (each lattice aligned to its best path, the batch's lattices in the same passes,
`decode_lattices`) beside expanding the lattices with the n-gram (`expand_many`), and the same confidences one
lattice at a time (`decode_lattice`, as the service and a consensus decode make them). Lattices are read before
any clock starts; each phase is the fastest of --repeats runs, each expansion by a new rescorer (an empty
n-gram answer cache, as a run starts with). NCE per voice (lattice names `kal-*`, `slt-*`)
against ref.txt beside the lattices.

    python benchmarks/bench_confidences.py --ngram runs/lm4.bin --lattices runs/devlat
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DOC, command, machine, write_section  # noqa: E402

from smallstate_lm.ngram import NgramLM  # noqa: E402
from smallstate_lm.rescoring.decode.confidence_eval import label_transcripts, nce  # noqa: E402
from smallstate_lm.rescoring.decode.transcript import decode_lattice, decode_lattices  # noqa: E402
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer  # noqa: E402
from smallstate_lm.rescoring.formats.lattice_io import read_lattice  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_text  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402


def fastest(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ngram", required=True, help="KenLM binary (the full-text 4-gram)")
    ap.add_argument("--lattices", required=True, help="a directory of *.lat.fst with words.txt and ref.txt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--doc", default=str(DOC))
    args = ap.parse_args()
    lat_dir = Path(args.lattices)
    symbols = SymbolTable.read(lat_dir / "words.txt")
    lats = [read_lattice(p, symbols) for p in sorted(lat_dir.glob("*.lat.fst"))]
    w = Weights()  # `rescore`'s weights when none are given
    ngram = NgramLM(args.ngram)

    def expand():  # a new rescorer each time: its n-gram answer cache starts empty, as in a run
        rescorer = LatticeRescorer(w, ngram=ngram, config=ExpandConfig())
        return [x for _, x in sorted(rescorer.expand_many(lats), key=lambda item: item[0])]

    t_expand, done = fastest(expand, args.repeats)
    t_nbest, hyps = fastest(lambda: [x.nbest(w, 10) for x in done], args.repeats)
    paths = [h[0].words for h in hyps]
    t_batch, batch = fastest(lambda: decode_lattices(done, w, paths), args.repeats)
    t_one, alone = fastest(lambda: [decode_lattice(x, w, p) for x, p in zip(done, paths)], args.repeats)
    worst = max((abs(a - b) for d, e in zip(batch, alone) for a, b in zip(d.confidences, e.confidences)),
                default=0.0)
    refs = read_text(lat_dir / "ref.txt")
    nces = []
    for voice in sorted({x.name.split("-")[0] for x in done}):
        hyp = {x.name: (d.words, d.confidences) for x, d in zip(done, batch) if x.name.startswith(voice + "-")}
        nces.append(f"{voice} {nce(*label_transcripts(refs, hyp)):.4f}")
    rows = [("expansion with the n-gram (`expand_many`)", t_expand),
            ("the 10 best word sequences (`nbest`)", t_nbest),
            ("confidences, the batch's lattices together (`decode_lattices`, the run's)", t_batch),
            ("confidences, one lattice at a time (`decode_lattice`)", t_one)]
    body = "\n".join([
        "## bench_confidences: the best paths' word confidences beside the expansion, cpu",
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- {len(lats)} lattices, n-gram `{args.ngram}`, default weights and expansion (order-4 histories), "
        f"fastest of {args.repeats} runs of each phase, in-process timers, lattices read before.",
        "",
        "| phase | seconds | share of the expansion |",
        "|---|---|---|",
        *[f"| {name} | {s:.3f} | {100 * s / t_expand:.0f}% |" for name, s in rows],
        "",
        f"Confidences in the run cost {100 * t_batch / t_expand:.0f}% of the expansion (target 30%); one lattice at "
        f"a time {t_one / t_batch:.1f}x as long. Largest difference between the two: {worst:.2g}. "
        f"NCE of the run's confidences: {', '.join(nces)}.",
    ])
    print(body)
    if not args.no_write:
        write_section("bench_confidences-cpu", body, Path(args.doc))


if __name__ == "__main__":
    main()
