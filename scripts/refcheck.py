"""A fixed reference run of the rescoring commands, and the comparison of two such runs: what a change that
should not alter behaviour (a move of modules, a faster algorithm) is checked against.

    python scripts/refcheck.py run runs/ref-before --ngram runs/lm4.bin --lattices runs/devlat --nbest-dir D
    python scripts/refcheck.py compare runs/ref-before runs/ref-after

`run` executes every case of `cases` with the code of --tree through the CLI (`smallstate-lm rescore`, `tune`)
into OUT/<case>/.
`compare` walks both trees: files of n-gram-only cases must be byte-identical; numbers in files of neural cases
may differ by --tol (default 1e-5); confidences (fields named *conf*, a CTM's last column) by --conf-tol
(default 1e-6) in every case, the rest of such a file staying byte-identical. Lattice `.fst` files are compared
as bytes in n-gram cases and skipped in neural ones (their float32 weights are covered by best/nbest scores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cases(a) -> dict[str, tuple[bool, list[str]]]:
    """name -> (uses the neural LM, CLI arguments); OUT/<name> is appended as -o where the command takes it."""
    lat = Path(a.lattices).resolve()
    a.ngram, a.lm = str(Path(a.ngram).resolve()), str(Path(a.lm).resolve())
    kal = sorted(map(str, lat.glob("kal-*.lat.fst")))
    slt = sorted(map(str, lat.glob("slt-*.lat.fst")))
    words = str(lat / "words.txt")
    refs = str(lat / "ref.txt")
    data = ROOT / "tests" / "data"
    ng = ["--ngram", a.ngram]
    c = {
        "lat-ngram-kal": (False, ["rescore", *kal, "--words", words, *ng, "--refs", refs]),
        "lat-ngram-slt": (False, ["rescore", *slt, "--words", words, *ng, "--refs", refs]),
        "lat-ngram-kal-mbr": (False, ["rescore", *kal[:60], "--words", words, *ng, "--decode", "mbr",
                                      "--refs", refs]),
        "lat-ngram-exact": (False, ["rescore", *slt[:20], "--words", words, *ng, "--exact"]),
        "lat-ngram-slf": (False, ["rescore", *sorted(map(str, (ROOT / "lattices").glob("*.slf.gz"))),
                                  "--words", str(ROOT / "lattices" / "words.txt"), *ng]),
        "lat-ngram-k2": (False, ["rescore", str(ROOT / "lattices" / "k2" / "kal-dev.pt"),
                                 "--words", str(ROOT / "lattices" / "words.txt"), *ng]),
        "kaldi-ark": (False, ["rescore", f"ark:{data / 'kaldi' / 'lattice.ark'}",
                              "--words", str(data / "kaldi" / "words.txt"), *ng]),
        "kaldi-compact-text": (False, ["rescore", f"ark,t:{data / 'kaldi' / 'compact_text.ark'}",
                                       "--words", str(data / "kaldi" / "words.txt"), *ng, "--archive-text"]),
        "tune-lat-ngram": (False, ["tune", *kal[:40], "--words", words, *ng, "--refs", refs,
                                   "--decode", "viterbi,mbr"]),
        "lat-neural-kal": (True, ["rescore", *kal[:12], "--words", words, "--lm", a.lm, *ng,
                                  "--refs", refs, "--device", "cpu"]),
    }
    if a.nbest_dir:
        nb = Path(a.nbest_dir).resolve()
        c["nbest-ngram"] = (False, ["rescore", str(nb / "nbest.tsv"), *ng, "--refs", str(nb / "ref.txt")])
        c["nbest-neural"] = (True, ["rescore", str(nb / "nbest.tsv"), "--lm", a.lm, *ng,
                                    "--refs", str(nb / "ref.txt"), "--device", "cpu"])
    return c


def run(a) -> None:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = {}
    for name, (neural, argv) in cases(a).items():
        dest = out / name
        argv = argv + (["-o", str(dest / "weights.json")] if argv[0] == "tune" else ["-o", str(dest)])
        dest.mkdir(parents=True, exist_ok=True)
        tree = Path(a.tree).resolve()
        p = subprocess.run([sys.executable, "-m", "smallstate_lm", *argv, "--quiet"], cwd=tree,
                           env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
        meta[name] = {"neural": neural}
        print(f"{name}: ok", flush=True)
    (out / "cases.json").write_text(json.dumps(meta, indent=1))


WORST_CONF = [0.0]  # the largest confidence difference seen by `compare`
NUM = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|-?inf|nan")


def _close(x: str, y: str, tol: float) -> bool:
    """Two texts equal once every number in them is compared within `tol` (relative to max(1, |value|))."""
    tx, ty = NUM.split(x), NUM.split(y)
    if tx != ty:
        return False
    for u, v in zip(NUM.findall(x), NUM.findall(y)):
        fu, fv = float(u), float(v)
        if fu != fv and not (math.isfinite(fu) and abs(fu - fv) <= tol * max(1.0, abs(fu))):
            return False
    return True


def _conf_free(obj):
    """A JSON value with every confidence field taken out (returned apart, for the looser comparison)."""
    confs = []

    def walk(v):
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if "conf" in k:
                    confs.append(x)
                else:
                    out[k] = walk(x)
            return out
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return walk(obj), confs


def _flat(v) -> list[float]:
    if isinstance(v, list):
        return [y for x in v for y in _flat(x)]
    return [] if v is None else [float(v)]


def _compare_file(pa: Path, pb: Path, neural: bool, tol: float, ctol: float) -> str | None:
    a, b = pa.read_bytes(), pb.read_bytes()
    if a == b:
        return None
    if pa.suffix == ".fst" and neural:
        return None
    if pa.suffix in (".jsonl", ".json"):
        la, lb = a.decode().splitlines(), b.decode().splitlines()
        if pa.suffix == ".json":  # one document
            la, lb = [json.dumps(json.loads(a))], [json.dumps(json.loads(b))]
        if len(la) != len(lb):
            return "line counts differ"
        worst = 0.0
        for i, (x, y) in enumerate(zip(la, lb)):
            (xa, ca), (ya, cb) = _conf_free(json.loads(x)), _conf_free(json.loads(y))
            if (json.dumps(xa) != json.dumps(ya)) and not (neural and _close(json.dumps(xa), json.dumps(ya), tol)):
                return f"line {i + 1}: scores or words differ"
            fa, fb = _flat(ca), _flat(cb)
            if len(fa) != len(fb):
                return f"line {i + 1}: confidence counts differ"
            worst = max([worst, *(abs(p - q) for p, q in zip(fa, fb))])
        WORST_CONF[0] = max(WORST_CONF[0], worst)
        return None if worst <= ctol else f"confidences differ by {worst:.3g}"
    if pa.suffix == ".ctm":
        la, lb = a.decode().splitlines(), b.decode().splitlines()
        if len(la) != len(lb):
            return "line counts differ"
        for i, (x, y) in enumerate(zip(la, lb)):
            xs, ys = x.rsplit(" ", 1), y.rsplit(" ", 1)
            if xs[0] != ys[0] and not (neural and _close(xs[0], ys[0], tol)):
                return f"line {i + 1}: differs before the confidence"
            WORST_CONF[0] = max(WORST_CONF[0], abs(float(xs[1]) - float(ys[1])))
            if abs(float(xs[1]) - float(ys[1])) > ctol:
                return f"line {i + 1}: confidence differs by {abs(float(xs[1]) - float(ys[1])):.3g}"
        return None
    if neural:
        try:
            if _close(a.decode(), b.decode(), tol):
                return None
        except UnicodeDecodeError:
            pass
    return "bytes differ"


def compare(a) -> None:
    ra, rb = Path(a.a), Path(a.b)
    meta = json.loads((ra / "cases.json").read_text())
    bad = 0
    for name, m in meta.items():
        fa = {p.relative_to(ra / name) for p in (ra / name).rglob("*") if p.is_file()}
        fb = {p.relative_to(rb / name) for p in (rb / name).rglob("*") if p.is_file()}
        problems = [f"only in {ra}: {p}" for p in sorted(fa - fb)] + [f"only in {rb}: {p}" for p in sorted(fb - fa)]
        for rel in sorted(fa & fb):
            why = _compare_file(ra / name / rel, rb / name / rel, m["neural"], a.tol, a.conf_tol)
            if why:
                problems.append(f"{rel}: {why}")
        print(f"{name}: {len(fa & fb)} files, " + ("same" if not problems else f"{len(problems)} DIFFERENT"))
        for p in problems[:10]:
            print("   ", p)
        bad += bool(problems)
    print(f"largest difference of a confidence: {WORST_CONF[0]:.3g}")
    if bad:
        raise SystemExit(f"{bad} case(s) differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--ngram", required=True, help="KenLM binary (the full-text 4-gram)")
    r.add_argument("--lm", default=str(ROOT / "models" / "bible-small"))
    r.add_argument("--lattices", required=True, help="dir of kal-*/slt-*.lat.fst with words.txt and ref.txt")
    r.add_argument("--tree", default=str(ROOT), help="the source tree whose code runs (e.g. a `git worktree` of "
                   "the revision before a change) [default: this one]")
    r.add_argument("--nbest-dir", help="dir with nbest.tsv and ref.txt (one voice of the dev n-best lists)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--tol", type=float, default=1e-5)
    c.add_argument("--conf-tol", type=float, default=1e-6)
    a = ap.parse_args()
    run(a) if a.cmd == "run" else compare(a)


if __name__ == "__main__":
    main()
