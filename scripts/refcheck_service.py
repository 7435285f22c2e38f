"""The service's answers against another tree's, byte for byte: both servers (this tree and TREE, e.g. a `git
worktree` of the revision before a change) load the same models on the CPU in fp32, get the same requests one at
a time (so each is a batch of its own on both), and every answer must be the same bytes apart from `usage` (its
timings and batch sizes are the server's, not the answer's).

The neural LM's numbers depend on how a request is cut into scorer calls, which the cost model sizes from timings
taken at start-up (two servers of one tree differ where those differ): compare with `--set slice_ms=60000`, or
with the n-gram alone (no `--lm`).

Requests: every utterance of the dev n-best lists (both voices; one utterance per request, every hypothesis) and
every bundled lattice (`lattices/*.fst` as OpenFST text with the decoder's symbol table), plus one request of
sentences to /score.

    python scripts/refcheck_service.py --tree /tmp/fe1b136 --lm models/bible-small --ngram runs/lm4.bin
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEV = ROOT.parent / "shared" / "data" / "dev"
USAGE = re.compile(rb',"usage":\{[^{}]*\}')


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", required=True, type=Path, help="the other source tree")
    ap.add_argument("--this", type=Path, default=ROOT, help="the tree checked (default: this one)")
    ap.add_argument("--lm", default=None)
    ap.add_argument("--ngram", required=True)
    ap.add_argument("--limit", type=int, default=0, help="n-best utterances per voice (0: all)")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                    help="a server setting for both (e.g. slice_ms=60000: each list and lattice level scored whole, "
                    "so that no grain sized by the timed cost model changes the batches)")
    return ap.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "smallstate_lm.cli", "serve", "--port", str(port), "--device", "cpu",
           "--precision", "fp32", "--threads", "1", "--set", "log_level=warning",
           "--ngram", str(Path(args.ngram).resolve())] + (["--lm", str(Path(args.lm).resolve())] if args.lm else [])
    for s in args.settings:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server of {tree} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server of {tree} was not ready in time")


def requests(limit: int) -> list[tuple[str, str, bytes]]:
    sys.path.insert(0, str(ROOT))
    from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable
    from smallstate_lm.rescoring.nbest.lists import read_nbest

    out = []
    for voice in sorted(DEV.glob("festival_*")):
        utts = read_nbest(voice / "nbest.tsv")
        for u in utts[:limit] if limit else utts:
            body = {"utterances": [{"id": u.utt, "hypotheses": [
                {"words": h.words, "am_score": h.am, "graph_score": h.graph} for h in u.hyps]}],
                "return_token_logprobs": True}
            out.append(("nbest " + u.utt, "/rescore", json.dumps(body).encode()))
    symbols = SymbolTable.read(ROOT / "lattices" / "words.txt")
    words = _words(ROOT / "lattices")
    for path in sorted((ROOT / "lattices").glob("*.fst")):
        lat = read_fst(path, symbols)
        body = {"utterances": [{"id": path.stem, "lattice": {"format": "openfst-text", "data": lattice_to_text(lat),
                                                             "words": words}}],
                "nbest": 5}
        out.append(("lattice " + path.stem, "/rescore", json.dumps(body).encode()))
    out.append(("score", "/score", json.dumps({"sentences": ["and god said let there be light", "the lord"],
                                               "return_token_logprobs": True}).encode()))
    return out


def _words(d: Path) -> dict[str, int]:
    return {w: int(i) for w, i in (line.split() for line in (d / "words.txt").read_text().splitlines() if line)}


def main() -> None:
    args = parse_args()
    reqs = requests(args.limit)
    servers = [start(args.this.resolve(), args), start(args.tree.resolve(), args)]
    differ, t0 = [], time.perf_counter()
    try:
        with httpx.Client(timeout=300) as client:
            for name, route, body in reqs:
                got = [client.post(url + route, content=body, headers={"content-type": "application/json"})
                       for _, url in servers]
                a, b = (USAGE.sub(b"", r.content) for r in got)
                if got[0].status_code != 200 or got[1].status_code != 200 or a != b:
                    differ.append(name)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait()
    print(f"{len(reqs)} requests ({sum(n.startswith('nbest') for n, _, _ in reqs)} n-best lists, "
          f"{sum(n.startswith('lattice') for n, _, _ in reqs)} lattices, 1 /score) in "
          f"{time.perf_counter() - t0:.0f} s: {len(reqs) - len(differ)} byte-identical, {len(differ)} differ")
    for name in differ[:20]:
        print("  differs:", name)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
