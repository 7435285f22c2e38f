"""The rescoring service under load: throughput and p50/p99 latency of POST /rescore at
several concurrencies, dynamic batching on vs off, for two request shapes:

- dev: one utterance's 50-best list per request (the dev n-best lists);
- small: one utterance, its 5 best hypotheses: per-request overhead dominates.

Two servers run side by side on loopback (batching on / off, the same model and
settings otherwise); the configurations alternate between them so that machine noise
hits both. The client is a minimal asyncio HTTP/1.1 client with one keep-alive
connection per concurrent user, in this process.

With --abuse, one server takes a fixed number of mixed requests instead (small 5-best
lists and a share of near-limit heavy ones: hypothesis lists near max_trie_nodes, packs
of real dev lattices near max_lattice_cost), while stalled uploads and clients that hang
up half-way hit it too; it reports 5xx answers, lost requests, the small requests' p99
with and without the heavy ones, and the server's RSS before and after.

A few extra clients send "wedge" shapes meanwhile, each --wedges times at random moments of
the mix: deep n-best lists (200, 700 and 1000 hypotheses of 100 words drawn from 14 frequent
words), a fan lattice (64 x 2000 arcs), a sausage lattice (40 slots of 14 words), JSON nested
thousands deep (/rescore and /score), and the 1000-hypothesis list and the sausage with
`X-Request-Timeout: 2` or from a client that hangs up after 1 s. Every 504 and hang-up is
followed at once by a 3-word request, whose latency shows whether the worker is free again.
At the end, with wedges in flight, the server gets SIGTERM and its time to exit is measured.
Rules, with a PASS/FAIL line each: no 5xx but 503 (and 504 to a request that asked for a
2 s deadline); refused heavy and wedge requests answered within 100 ms; the request after a
504 or hang-up within 2 x slice_ms; the small requests' p99 within 3x of alone; RSS after
within 1.2x of before; exit 0 within drain_seconds + graceful_timeout_s.

    python benchmarks/bench_service.py [--lm models/bible-small] [--ngram runs/demo/lm4.bin] [--nbest FILE ...]
        [--concurrency 1 8 32] [--seconds 6] [--device cpu] [--no-write]
    python benchmarks/bench_service.py --abuse [--requests 2000] [--concurrency 32] [--heavy-share 0.05]
        [--stalls 10] [--disconnects 50] [--wedges 3 | --no-wedges] [--wedge-clients 4]
        [--doc docs/benchmarks.md] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DOC, command, machine, write_section  # noqa: E402
from service_abuse import run_abuse  # noqa: E402
from service_client import DEV, ServerProcess, batch_counts, build_requests, load, service_section  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", default=str(ROOT / "models" / "bible-small"))
    ap.add_argument("--ngram", default=str(ROOT / "runs" / "demo" / "lm4.bin"))
    ap.add_argument("--nbest", nargs="+", default=[str(p) for p in sorted(DEV.glob("festival_*/nbest.tsv"))])
    ap.add_argument("--utts", type=int, default=200, help="distinct requests per shape")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="(--abuse: the largest)")
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per configuration")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each measurement")
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per server (default: 1 on CPU, where the client and two servers share the "
                    "cores and spinning intra-op threads cost more than they give on small batches)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32", help="the servers' --precision (fp32, bf16, fp16); other than "
                    "fp32 the section is bench_service-DEVICE-PRECISION")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--abuse", action="store_true", help="the abuse run instead of batching on vs off")
    ap.add_argument("--requests", type=int, default=2000, help="--abuse: requests in the mixed run")
    ap.add_argument("--heavy-share", type=float, default=0.05, help="--abuse: share of near-limit requests")
    ap.add_argument("--stalls", type=int, default=10, help="--abuse: stalled uploads (half heads, half bodies)")
    ap.add_argument("--disconnects", type=int, default=50, help="--abuse: clients that hang up half-way")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                    help="--abuse: server settings besides ABUSE_SETTINGS (repeatable)")
    ap.add_argument("--dev", default=None, metavar="DIR", help="--abuse: the dev data whose lattices make the lattice "
                    "packs (DIR/festival_*/fst/*.lat.fst, DIR/words.txt); default: the directory above --nbest's lists")
    ap.add_argument("--wedges", type=int, default=3, help="--abuse: times each wedge shape is sent during the mix")
    ap.add_argument("--no-wedges", dest="wedges", action="store_const", const=0, help="--abuse: no wedges")
    ap.add_argument("--wedge-clients", type=int, default=4, help="--abuse: clients that send the wedges")
    ap.add_argument("--doc", default=str(DOC), help="the markdown file whose section the run (re)writes")
    ap.add_argument("--json", default=None, metavar="FILE", help="--abuse: also write the numbers to FILE")
    args = ap.parse_args()
    if args.wedges < 0 or args.wedge_clients < 1:
        ap.error("--wedges must be >= 0 and --wedge-clients >= 1")
    if args.threads is None and not args.device.startswith("cuda"):
        args.threads = 1
    for p in [args.lm, args.ngram, *args.nbest]:
        if p and not Path(p).exists():
            sys.exit(f"bench_service: {p} not found (run `smallstate-lm demo` for runs/demo, or pass --lm/--ngram)")
    return args


def main() -> None:
    args = parse_args()
    if args.abuse:
        run_abuse(args)
    else:
        run_batching(args)


def run_batching(args: argparse.Namespace) -> None:
    shapes = {"dev 50-best": build_requests(args.nbest, None, args.utts),
              "small 5-best": build_requests(args.nbest, 5, args.utts)}
    logs = ROOT / "runs" / "bench_service"
    logs.mkdir(parents=True, exist_ok=True)
    precision = (f"precision={args.precision}",)
    servers = {True: ServerProcess(args, True, logs / "batching-on.log", precision),
               False: ServerProcess(args, False, logs / "batching-off.log", precision)}
    results: dict[tuple[str, int, bool], dict] = {}
    try:
        for s in servers.values():
            s.wait_ready()
        for shape, (reqs, _) in shapes.items():
            for c in args.concurrency:
                order = (True, False) if c % 2 else (False, True)  # alternate which goes first
                for batching in order:
                    port = servers[batching].port
                    b0 = batch_counts(port)
                    r = asyncio.run(load(port, reqs, c, args.warmup, args.seconds))
                    b1 = batch_counts(port)
                    r["batch"] = (b1[1] - b0[1]) / max(1.0, b1[0] - b0[0])  # mean requests per batch
                    results[(shape, c, batching)] = r
                    print(f"{shape:13s} c={c:3d} batching={'on ' if batching else 'off'} {r['rps']:8.1f} req/s  "
                          f"p50 {r['p50']:7.1f} ms  p99 {r['p99']:7.1f} ms  batch {r['batch']:.1f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    body = batching_report(args, shapes, results)
    print(body)
    if not args.no_write:
        write_section(service_section("bench_service", args), body, Path(args.doc))


def batching_report(args: argparse.Namespace, shapes: dict, results: dict) -> str:
    dev = args.device
    rows = []
    for shape, (_, hyps) in shapes.items():
        for c in args.concurrency:
            on, off = results[(shape, c, True)], results[(shape, c, False)]
            for batching, r in ((True, on), (False, off)):
                rows.append(f"| {shape} | {c} | {'on' if batching else 'off'} | {r['rps']:,.1f} | "
                            f"{r['rps'] * hyps:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['batch']:.1f} |"
                            + (f" {on['rps'] / off['rps']:.2f}x |" if batching else " |"))
    cmax = max(args.concurrency)
    small = results[("small 5-best", cmax, True)]["rps"] / results[("small 5-best", cmax, False)]["rps"]
    big = results[("dev 50-best", cmax, True)]["rps"] / results[("dev 50-best", cmax, False)]["rps"]
    target = 3.0 if dev.startswith("cuda") else 1.5
    return "\n".join([
        f"## bench_service: POST /rescore under load, dynamic batching on vs off, {dev}"
        + ("" if args.precision == "fp32" else f", precision {args.precision}"),
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- Models: {Path(args.lm).name if args.lm else '-'} ({args.lm}), n-gram {args.ngram}; server: uvicorn, "
        f"{args.threads or os.cpu_count()} torch thread(s) each, max_wait_ms={args.max_wait_ms}, client and servers "
        f"on loopback, one keep-alive connection per concurrent user.",
        f"- Requests: {', '.join(f'{k}: {len(v[0])} distinct, {v[1]:.1f} hypotheses each' for k, v in shapes.items())}"
        f" (from {', '.join(Path(p).parent.name for p in args.nbest)}); {args.seconds:g} s measured per row after "
        f"{args.warmup:g} s warm-up; the two servers run side by side and alternate.",
        "",
        "| request | concurrency | batching | requests/s | hypotheses/s | p50 ms | p99 ms | requests/batch | on/off |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"At concurrency {cmax}, dynamic batching gives {small:.2f}x the throughput for small requests "
        f"(target {target:g}x on {'a GPU' if target == 3.0 else 'CPU'}) and {big:.2f}x for the dev 50-best lists.",
    ])


if __name__ == "__main__":
    main()
