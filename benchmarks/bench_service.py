"""The rescoring service under load: throughput and p50/p99 latency of POST /rescore at
several concurrencies, dynamic batching on vs off, for two request shapes:

- dev: one utterance's 50-best list per request (the dev n-best lists);
- small: one utterance, its 5 best hypotheses: per-request overhead dominates.

Two servers run side by side on loopback (batching on / off, the same model and
settings otherwise); the configurations alternate between them so that machine noise
hits both. The client is a minimal asyncio HTTP/1.1 client with one keep-alive
connection per concurrent user, in this process.

    python benchmarks/bench_service.py [--lm models/bible-small] [--ngram runs/demo/lm4.bin] [--nbest FILE ...]
        [--concurrency 1 8 32] [--seconds 6] [--device cpu] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import command, machine, write_section  # noqa: E402

from smallstate_lm.rescoring.nbest_io import read_nbest  # noqa: E402

DEV = ROOT.parent / "shared" / "data" / "dev"


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args, batching: bool, log: Path):
        self.port = free_port()
        cmd = [sys.executable, "-m", "smallstate_lm.cli", "serve", "--port", str(self.port), "--device", args.device,
               "--batching" if batching else "--no-batching", "--set", "log_level=warning",
               "--set", f"max_wait_ms={args.max_wait_ms}", "--set", "max_queue=1024"]
        if args.lm:
            cmd += ["--lm", args.lm]
        if args.ngram:
            cmd += ["--ngram", args.ngram]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()}")
            try:
                status, _ = asyncio.run(http_get(self.port, "/readyz"))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------------------------------------
# A minimal HTTP/1.1 client: the load generator must cost far less than the server


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = next(int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.lower() == b"content-length")
    return status, await reader.readexactly(length)


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    try:
        return await read_response(reader)
    finally:
        writer.close()


def post_bytes(body: bytes) -> bytes:
    return (b"POST /rescore HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(body)) + body


async def user(port: int, requests: list[bytes], offset: int, t_begin: float, t_end: float, out: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = offset
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            writer.write(requests[i % len(requests)])
            await writer.drain()
            status, _ = await read_response(reader)
            t1 = time.perf_counter()
            if t0 >= t_begin:  # requests started during the warm-up are not counted
                out.append((t1, t1 - t0, status))
            i += 7  # users walk the list at different phases
    finally:
        writer.close()


async def load(port: int, requests: list[bytes], concurrency: int, warmup: float, seconds: float) -> dict:
    t_begin = time.perf_counter() + warmup
    t_end = t_begin + seconds
    out: list = []
    await asyncio.gather(*[user(port, requests, k * len(requests) // concurrency, t_begin, t_end, out)
                           for k in range(concurrency)])
    bad = [s for _, _, s in out if s != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed (statuses {sorted(set(bad))})")
    lat = sorted(x for _, x, _ in out)
    span = max(t for t, _, _ in out) - t_begin
    return {"requests": len(lat), "rps": len(lat) / span, "p50": 1000 * lat[len(lat) // 2],
            "p99": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], "mean": 1000 * statistics.fmean(lat)}


def batch_counts(port: int) -> tuple[float, float]:
    """(batches, requests in them) from the server's metrics."""
    _, text = asyncio.run(http_get(port, "/metrics"))
    vals = {}
    for line in text.decode().splitlines():
        if line.startswith("smallstate_batch_requests_"):
            k, v = line.split(" ")
            vals[k] = float(v)
    return vals.get("smallstate_batch_requests_count", 0.0), vals.get("smallstate_batch_requests_sum", 0.0)


# ---------------------------------------------------------------------------------------------


def build_requests(paths: list[str], n_hyps: int | None, limit: int) -> tuple[list[bytes], float]:
    """One request per utterance: its first `n_hyps` hypotheses (all when None)."""
    utts = [u for p in paths for u in read_nbest(p)][:limit]
    reqs, hyps = [], 0
    for u in utts:
        hs = u.hyps[:n_hyps] if n_hyps else u.hyps
        hyps += len(hs)
        body = {"utterances": [{"id": u.utt, "hypotheses": [{"words": h.words, "am_score": h.am,
                                                             "graph_score": h.graph} for h in hs]}]}
        reqs.append(post_bytes(json.dumps(body).encode()))
    return reqs, hyps / len(utts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", default=str(ROOT / "models" / "bible-small"))
    ap.add_argument("--ngram", default=str(ROOT / "runs" / "demo" / "lm4.bin"))
    ap.add_argument("--nbest", nargs="+", default=[str(p) for p in sorted(DEV.glob("festival_*/nbest.tsv"))])
    ap.add_argument("--utts", type=int, default=200, help="distinct requests per shape")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per configuration")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each measurement")
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per server (default: 1 on CPU, where the client and two servers share the "
                    "cores and spinning intra-op threads cost more than they give on small batches)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.threads is None and not args.device.startswith("cuda"):
        args.threads = 1
    for p in [args.lm, args.ngram, *args.nbest]:
        if p and not Path(p).exists():
            sys.exit(f"bench_service: {p} not found (run `smallstate-lm demo` for runs/demo, or pass --lm/--ngram)")

    shapes = {"dev 50-best": build_requests(args.nbest, None, args.utts),
              "small 5-best": build_requests(args.nbest, 5, args.utts)}
    logs = ROOT / "runs" / "bench_service"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {True: ServerProcess(args, True, logs / "batching-on.log"),
               False: ServerProcess(args, False, logs / "batching-off.log")}
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
    body = "\n".join([
        f"## bench_service: POST /rescore under load, dynamic batching on vs off, {dev}",
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
    print(body)
    if not args.no_write:
        write_section(f"bench_service-{'cuda' if dev.startswith('cuda') else 'cpu'}", body)


if __name__ == "__main__":
    main()
