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

    python benchmarks/bench_service.py [--lm models/bible-small] [--ngram runs/demo/lm4.bin] [--nbest FILE ...]
        [--concurrency 1 8 32] [--seconds 6] [--device cpu] [--no-write]
    python benchmarks/bench_service.py --abuse [--requests 2000] [--concurrency 32] [--heavy-share 0.05]
        [--stalls 10] [--disconnects 50]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
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
    def __init__(self, args, batching: bool, log: Path, settings: tuple[str, ...] = ()):
        self.port = free_port()
        cmd = [sys.executable, "-m", "smallstate_lm.cli", "serve", "--port", str(self.port), "--device", args.device,
               "--batching" if batching else "--no-batching", "--set", "log_level=warning",
               "--set", f"max_wait_ms={args.max_wait_ms}", "--set", "max_queue=1024"]
        for setting in settings:
            cmd += ["--set", setting]
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


# ---------------------------------------------------------------------------------------------
# --abuse: a fixed mix of small and near-limit requests, stalled uploads and clients that hang up

# Limits low enough that a near-limit request costs the CPU worker about a second, not a minute; timeouts short
# enough that the stalled uploads end within the run.
ABUSE_SETTINGS = ("max_trie_nodes=5000", "max_lattice_cost=50000", "header_timeout_s=5", "body_timeout_s=5")


def setting(settings: list[str], name: str) -> int:
    return int(next(s.split("=", 1)[1] for s in reversed(settings) if s.startswith(name + "=")))


def nbest_packs(paths: list[str], limit: int, n: int) -> list[bytes]:
    """`n` requests of whole dev n-best lists, each packed to 80-100% of `limit` trie nodes (counted on
    words, which bounds the LM's count: OOVs only merge prefixes)."""
    utts = [u for p in paths for u in read_nbest(p)]
    reqs, k = [], 0
    while len(reqs) < n:
        body, nodes = [], 0
        while nodes < 0.8 * limit:
            u = utts[k % len(utts)]
            k += 1
            size = len({tuple(h.words[:i]) for h in u.hyps for i in range(1, len(h.words) + 1)}) + len(u.hyps)
            if nodes + size > limit:
                continue
            nodes += size
            body.append({"id": f"{u.utt}-{k}", "hypotheses": [{"words": h.words, "am_score": h.am,
                                                               "graph_score": h.graph} for h in u.hyps]})
        reqs.append(post_bytes(json.dumps({"utterances": body}).encode()))
    return reqs


def lattice_packs(limit: int, max_per_state: int, n: int) -> list[bytes]:
    """`n` requests of real dev lattices (OpenFST text, words as labels), each packed to 80-100% of
    `limit` estimated LM steps."""
    from smallstate_lm.rescoring.lattice import SymbolTable
    from smallstate_lm.rescoring.lattice_io import lattice_to_text, read_fst
    from smallstate_lm.service.inputs import lattice_cost

    symbols = SymbolTable.read(DEV / "words.txt")
    lats = []
    for path in sorted(DEV.glob("festival_*/fst/*.lat.fst"))[:80]:
        lat = read_fst(path, symbols).prepare()
        cost = lattice_cost(lat, max_per_state)
        if cost <= limit:
            lines = [ln.split("\t") for ln in lattice_to_text(lat).splitlines()]
            text = "\n".join("\t".join(p[:2] + [symbols.word(int(p[2]))] * 2 + p[4:]) if len(p) == 5 else "\t".join(p)
                             for p in lines)
            lats.append((cost, {"id": path.stem, "lattice": {"format": "openfst-text", "data": text + "\n"}}))
    reqs, k = [], 0
    while len(reqs) < n:
        body, total = [], 0
        while total < 0.8 * limit:
            cost, utt = lats[k % len(lats)]
            k += 1
            if total + cost <= limit:
                total += cost
                body.append(utt)
        reqs.append(post_bytes(json.dumps({"utterances": body}).encode()))
    return reqs


async def run_fixed(port: int, reqs: list[tuple[str, bytes]], concurrency: int) -> list[tuple[str, float, int]]:
    """Every request once, `concurrency` at a time, each user on a keep-alive connection (a new one after
    an error answer): (kind, seconds, status) per request; status 0 for one that got no answer."""
    queue = collections.deque(reqs)
    out: list[tuple[str, float, int]] = []

    async def user() -> None:
        reader = writer = None
        while queue:
            kind, data = queue.popleft()
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(data)
                await writer.drain()
                status, _ = await read_response(reader)
            except (OSError, asyncio.IncompleteReadError, ValueError, RuntimeError):
                status = 0
            out.append((kind, time.perf_counter() - t0, status))
            if status != 200 and writer is not None:
                writer.close()
                writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*[user() for _ in range(concurrency)])
    return out


async def hang_up(port: int, data: bytes, start: float, after: float) -> None:
    """A client that sends a request and closes the connection `after` seconds later."""
    await asyncio.sleep(start)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(after)
    writer.close()


async def stall(port: int, head: bool, start: float, wait: float) -> float | None:
    """Half a request head (or a head and half its body), then nothing: the seconds until the server
    answered or closed, None if it did neither within `wait`."""
    await asyncio.sleep(start)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /rescore HTTP/1.1\r\nHost: bench\r\nContent-Ty" if head else
                 b"POST /rescore HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"utterances\": [")
    await writer.drain()
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(reader.read(65536), wait)
        return time.perf_counter() - t0
    except asyncio.TimeoutError:
        return None
    finally:
        writer.close()


async def mixed_run(port: int, reqs: list[tuple[str, bytes]], heavy: list[bytes], args) -> tuple[list, list]:
    """The mixed requests, with the hang-ups and the stalls spread over the first ten seconds."""
    rng = random.Random(1)
    extra = [hang_up(port, heavy[i % len(heavy)], rng.uniform(0, 10), rng.uniform(0.05, 0.5))
             for i in range(args.disconnects)]
    stalls = [stall(port, i % 2 == 0, rng.uniform(0, 10), 60) for i in range(args.stalls)]
    results = await asyncio.gather(run_fixed(port, reqs, max(args.concurrency)), *stalls, *extra)
    return results[0], list(results[1:1 + len(stalls)])


def server_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(port: int, name: str, **labels) -> float:
    _, text = asyncio.run(http_get(port, "/metrics"))
    total = 0.0
    for line in text.decode().splitlines():
        key, _, value = line.rpartition(" ")
        if key.partition("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_abuse(args: argparse.Namespace) -> None:
    settings = [*ABUSE_SETTINGS, *args.settings]
    n_heavy = round(args.requests * args.heavy_share)
    small = [("small", r) for r in build_requests(args.nbest, 5, args.utts)[0]]
    heavy = [r for pair in zip(nbest_packs(args.nbest, setting(settings, "max_trie_nodes"), (n_heavy + 1) // 2),
                               lattice_packs(setting(settings, "max_lattice_cost"), 64, (n_heavy + 1) // 2))
             for r in pair][:n_heavy]
    mixed = [small[i % len(small)] for i in range(args.requests - n_heavy)] + [("heavy", r) for r in heavy]
    random.Random(0).shuffle(mixed)
    alone = [small[i % len(small)] for i in range(args.requests - n_heavy)]
    logs = ROOT / "runs" / "bench_service"
    logs.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args, True, logs / "abuse.log", tuple(settings))
    try:
        server.wait_ready()
        c = max(args.concurrency)
        asyncio.run(run_fixed(server.port, small[:200], 8))  # warm-up
        rss0 = server_rss_mib(server.proc.pid)
        t0 = time.perf_counter()
        base = asyncio.run(run_fixed(server.port, alone, c))
        t1 = time.perf_counter()
        out, stalls = asyncio.run(mixed_run(server.port, mixed, heavy, args))
        t2 = time.perf_counter()
        time.sleep(3)  # the hang-ups' work is stopped, large requests' memory given back
        rss1 = server_rss_mib(server.proc.pid)
        counts = {k: metric(server.port, f"smallstate_{k}_total") for k in ("requests_cancelled", "work_cancelled",
                                                                           "header_timeouts")}
        counts["408"] = metric(server.port, "smallstate_requests_total", status="408")
    finally:
        server.stop()
    body = abuse_report(args, settings, base, out, stalls, counts, (rss0, rss1), (t1 - t0, t2 - t1))
    print(body)
    if not args.no_write:
        write_section(f"bench_service-abuse-{'cuda' if args.device.startswith('cuda') else 'cpu'}", body)


def abuse_report(args, settings, base, out, stalls, counts, rss, seconds) -> str:
    statuses = collections.Counter((kind, status) for kind, _, status in out)
    errors_5xx = sum(n for (_, status), n in statuses.items() if status >= 500)
    lost = sum(n for (_, status), n in statuses.items() if status == 0)
    p99_alone = percentile([t for _, t, s in base if s == 200], 0.99)
    p99_mixed = percentile([t for k, t, s in out if k == "small" and s == 200], 0.99)
    heavy_ms = [t for k, t, s in out if k == "heavy" and s == 200]
    timed_out = [t for t in stalls if t is not None]
    table = ", ".join(f"{kind} {status}: {n}" for (kind, status), n in sorted(statuses.items()))
    return "\n".join([
        f"## bench_service --abuse: mixed load, stalled uploads and hang-ups, {args.device}",
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- Models: {Path(args.lm).name} ({args.lm}), n-gram {args.ngram}; server settings: "
        f"{', '.join(settings)} (the rest default), {args.threads or os.cpu_count()} torch thread(s).",
        f"- Load: {len(out)} requests at concurrency {max(args.concurrency)}, {args.heavy_share:.0%} near-limit "
        "(hypothesis lists of dev utterances near max_trie_nodes, alternating with packs of real dev lattices near "
        f"max_lattice_cost), the rest one utterance's 5-best list; meanwhile {args.stalls} stalled uploads (half a "
        f"head, or a head and half a body) and {args.disconnects} clients that send a near-limit request and hang up "
        "after 0.05-0.5 s. Baseline: the same small requests alone, first.",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| 5xx answers | {errors_5xx} | 0 |",
        f"| lost requests (no answer) | {lost} | 0 |",
        f"| answers | {table} | all 200 |",
        f"| small requests' p99, alone / with the heavy ones | {p99_alone:.0f} ms / {p99_mixed:.0f} ms "
        f"({p99_mixed / p99_alone:.2f}x) | within 3x |",
        f"| heavy requests' p50 / p99 | {percentile(heavy_ms, 0.5):.0f} ms / {percentile(heavy_ms, 0.99):.0f} ms | |",
        f"| stalled uploads answered 408 or closed | {len(timed_out)} of {len(stalls)}, after at most "
        f"{max(timed_out, default=float('nan')):.1f} s (server: {counts['408']:.0f} 408s, "
        f"{counts['header_timeouts']:.0f} head timeouts) | all, within the timeouts |",
        f"| hang-ups whose work was stopped | {counts['requests_cancelled']:.0f} requests cancelled, "
        f"{counts['work_cancelled']:.0f} jobs dropped or stopped | {args.disconnects} |",
        f"| server RSS before / after | {rss[0]:.0f} MiB / {rss[1]:.0f} MiB ({rss[1] / rss[0]:.2f}x) | within 1.2x |",
        f"| wall time, alone / mixed | {seconds[0]:.1f} s / {seconds[1]:.1f} s | |",
        "",
        f"The heavy requests' latency is queueing: near the end of the run most of the {max(args.concurrency)} "
        f"clients wait on one, and they are served oldest first, about "
        f"{(seconds[1] - seconds[0]) / max(1, len(heavy_ms)):.2f} s of worker time each here; the limits are set so "
        "that the last one still finishes within request_timeout_s (30 s).",
    ])


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
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--abuse", action="store_true", help="the abuse run instead of batching on vs off")
    ap.add_argument("--requests", type=int, default=2000, help="--abuse: requests in the mixed run")
    ap.add_argument("--heavy-share", type=float, default=0.05, help="--abuse: share of near-limit requests")
    ap.add_argument("--stalls", type=int, default=10, help="--abuse: stalled uploads (half heads, half bodies)")
    ap.add_argument("--disconnects", type=int, default=50, help="--abuse: clients that hang up half-way")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                    help="--abuse: server settings besides ABUSE_SETTINGS (repeatable)")
    args = ap.parse_args()
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
    body = batching_report(args, shapes, results)
    print(body)
    if not args.no_write:
        write_section(f"bench_service-{'cuda' if args.device.startswith('cuda') else 'cpu'}", body)


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


if __name__ == "__main__":
    main()
